"""``molt export``: a checkpoint of one process, of a LoRA run (adapter and merged) and of the tiny mixture-of-experts
policy becomes a Hugging Face folder that ``transformers`` loads, whose logprobs on a batch equal the trainer's within
1e-5; ``molt eval`` evaluates a checkpoint; ``molt serve --policy OUT`` serves an export and its greedy outputs equal
transformers'. FSDP2's sharded checkpoint (and ``molt eval`` on its export, through the CLI) is exported in
``test_distributed.py::test_fsdp2_resumes_from_its_distributed_checkpoint`` (its run is reused), the expert-parallel
one in ``test_expert_parallel.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from molt_lightning import AsyncRLModule, Rollout
from molt_lightning.engines import TorchEngine
from molt_lightning.commands.export import export
from molt_lightning.tasks import arithmetic
from logprob_probe import batch, trainer_logprobs

ROOT = Path(__file__).resolve().parents[1]


def logprobs(lm, tokenizer) -> torch.Tensor:
    """Per-token logprobs of the next token on the probe's batch (padding zeroed), at temperature 1."""
    input_ids, mask = batch(tokenizer)
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
    out = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return out * mask[:, 1:]


def trainer_side(module, tokenizer) -> torch.Tensor:
    return trainer_logprobs(module.cpu().policy, tokenizer)


def train(tmp_path, policy, steps=2, **kw) -> tuple[AsyncRLModule, Path]:
    module = AsyncRLModule(agent=arithmetic.calculator_agent, tasks=arithmetic.tasks, policy=policy,
                           engine=TorchEngine(seed=0), rollout=Rollout(group_size=4, prompts_per_step=2, max_lag=0),
                           **kw)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module)
    return module, tmp_path / "ckpt" / "last.ckpt"


def test_one_process_round_trip(tmp_path, policy_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module, ckpt = train(tmp_path, policy_path)
    out = export(str(ckpt), str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "molt_export.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    again = AutoTokenizer.from_pretrained(out)
    assert again.chat_template == tokenizer.chat_template and again.eos_token == tokenizer.eos_token
    mine = trainer_side(module, tokenizer)
    assert (logprobs(loaded, again) - mine).abs().max() < 1e-5
    base = AutoModelForCausalLM.from_pretrained(policy_path)
    assert (logprobs(base, tokenizer) - mine).abs().max() > 1e-4  # the export holds the trained weights, not the base
    meta = json.loads((out / "molt_export.json").read_text())
    assert meta["policy_version"] == 2 and meta["kind"] == "full weights"


def test_lora_exports_an_adapter_or_merged_weights(tmp_path, policy_path, tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from molt_lightning.policies.lora import LoraSpec

    module, ckpt = train(tmp_path, policy_path, lora=LoraSpec(r=4, alpha=8), optim={"lr": 1e-2})
    mine = trainer_side(module, tokenizer)
    adapter = export(str(ckpt), str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    assert "model.safetensors" not in os.listdir(adapter)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy_path), adapter)
    assert (logprobs(peft, tokenizer) - mine).abs().max() < 1e-5
    merged = export(str(ckpt), str(tmp_path / "merged"), merge=True)
    assert "adapter_config.json" not in os.listdir(merged)
    # merged: W + s B A rounded once to float32 against the unmerged forward's W x + s B (A x): rounding apart, up to
    # 1.1e-5 seen on a logprob of -13 (a wrong merge at lr 1e-2 is off by orders of magnitude more)
    assert (logprobs(AutoModelForCausalLM.from_pretrained(merged), tokenizer) - mine).abs().max() < 1e-4


def test_mixture_of_experts_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_lightning.models.tiny import moe_policy

    module, ckpt = train(tmp_path, moe_policy())
    tok = AutoTokenizer.from_pretrained(moe_policy())
    out = export(str(ckpt), str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert (logprobs(loaded, tok) - trainer_side(module, tok)).abs().max() < 1e-5


def test_a_checkpoint_of_another_policy_is_refused(tmp_path, policy_path):
    from molt_lightning.models.tiny import moe_policy

    _, ckpt = train(tmp_path, policy_path, steps=1)
    saved = torch.load(ckpt, weights_only=False)
    saved["hyper_parameters"]["policy"] = moe_policy()
    torch.save(saved, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="does not match its policy folder"):
        export(str(tmp_path / "other.ckpt"), str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="no checkpoint at"):
        export(str(tmp_path / "nothing.ckpt"), str(tmp_path / "hf"))


EVAL_RECIPE = """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: molt_lightning.callbacks.Evaluate
      init_args: {tasks: molt_lightning.tasks.arithmetic.tasks, k: 2, seed: 7, max_prompts: 6}
model:
  agent: molt_lightning.tasks.arithmetic.calculator_agent
  tasks: molt_lightning.tasks.arithmetic.tasks
  engine: {class_path: molt_lightning.engines.TorchEngine, init_args: {seed: 0}}
"""


@pytest.mark.slow
def test_molt_serve_serves_an_export_with_transformers_greedy_outputs(tmp_path, policy_path, tokenizer):
    import httpx
    from transformers import AutoModelForCausalLM

    from molt_lightning.engines.vllm.server import LocalServer

    _, ckpt = train(tmp_path, policy_path)
    out = export(str(ckpt), str(tmp_path / "hf"))
    server = LocalServer(str(out), cpu_threads="0")
    try:
        server.wait_ready(600)
        prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
                   ["input_ids"] for q in ("What is 12*34?", "What is 700+25?")]
        hf = AutoModelForCausalLM.from_pretrained(out)
        for ids in prompts:
            reply = httpx.post(f"{server.url}/v1/completions", json={
                "model": str(out), "prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
                timeout=120).json()
            got = reply["choices"][0]["token_ids"]
            want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
            assert got == want[: len(got)] and got, (got, want)
    finally:
        server.stop()


@pytest.mark.slow
def test_molt_eval_on_a_checkpoint_and_what_it_refuses(tmp_path, policy_path, capsys):
    """``molt eval --ckpt`` exports the checkpoint (merged) and runs the recipe's evaluation on it, in this process;
    a recipe without ``Evaluate`` and a LoRA adapter folder are refused with the fix."""
    from molt_lightning.commands.cli import main

    _, ckpt = train(tmp_path, policy_path, steps=1)
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(EVAL_RECIPE)
    main(["eval", "--config", str(recipe), "--ckpt", str(ckpt), "--out", str(tmp_path / "e.json")])
    assert "heldout: 6 prompts x 2 runs" in capsys.readouterr().out
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["k"] == 2 and len(result["per_prompt"]["heldout"]) == 6
    with pytest.raises(SystemExit, match="is a LoRA adapter folder: export with --merge"):
        (tmp_path / "adapter").mkdir()
        (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
        main(["eval", "--config", str(recipe), "--model.policy", str(tmp_path / "adapter")])
    recipe.write_text(EVAL_RECIPE.split("  callbacks:")[0] + "model:" + EVAL_RECIPE.split("model:")[1])
    with pytest.raises(SystemExit, match="has no molt_lightning.callbacks.Evaluate"):
        main(["eval", "--config", str(recipe)])


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exported_files_get_the_usual_mode(tmp_path, policy_path, mask, mode):
    """save_pretrained leaves model.safetensors 0600 (a temporary file renamed); an export's files get what the
    umask gives any new file: 0644 under 022, 0640 under 027."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.commands.export import save_folder

    old = os.umask(mask)
    try:
        out = save_folder(AutoModelForCausalLM.from_pretrained(policy_path), policy_path, str(tmp_path / "out"))
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(mode)}, modes
