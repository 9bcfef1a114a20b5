"""The embedded default policy: a tiny Llama and a byte-level BPE tokenizer, made offline by this code (and its
mixture-of-experts sibling, ``moe_policy``: the same tokenizer and warm start on a tiny Qwen3-MoE). The tiny
vision-language policy (``models.tiny_vlm``) reuses the tokenizer training, padding and cache here.

``arithmetic_policy()`` returns a Hugging Face model folder (config, safetensors, tokenizer with a ChatML template)
that transformers and vLLM both load: a tokenizer trained on synthetic dialogues, a random-init ~0.6M-parameter Llama,
and a short supervised warm start on demonstrations of the calculator task (``tasks.arithmetic.demonstration``): first
on tool-heavy data until it reliably copies the expression into the call and the result into the answer, then on data
where the tool is used rarely (``p_final`` of the time), so the policy starts out mostly guessing. No hub access.

Shipped, and the script that makes it: the package carries one build of each spec below in ``models/prebuilt/``
(``python -m molt_lightning.models.tiny`` rebuilds them there, a few minutes each on a CPU), so a fresh
clone trains at once and every machine trains the same weights. A spec without a shipped build (an edited ``SPEC``, a
spec of your own) is built on first use and cached (``$MOLT_CACHE`` or ``~/.cache/molt-lightning``), with a log line
per phase. A build is seeded but not bit-identical across machines or thread counts (float reduction order);
``build`` checks the result instead (see there) and records it in ``molt_spec.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
SPEC = {  # everything that determines the folder's content; the cache key hashes it
    "builder": 4,
    "vocab_size": 320,
    "model": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 256},
    # Two phases: learn the tool route (copying) on tool-heavy data, then settle the tool-use rate near p_final.
    "sft": {"rounds": [1400, 600, 600], "target": 0.95, "final_steps": 200, "final_lr": 3e-4, "batch": 64,
            "lr": 3e-3, "p_tool": 0.7, "p_final": 0.15, "seed": 0},
}


# The python-tool policy: the same network and warm start, on dialogues with Hermes-style tool calls. One phase-1
# round: a build with three reached 0.923, 0.926, 0.927 after each (the later rounds cost 9 CPU-minutes for nothing).
PYTHON_TOOL_SPEC = {**SPEC, "task": "python_tool", "vocab_size": 400,
                    "model": {**SPEC["model"], "max_position_embeddings": 512},
                    "sft": {**SPEC["sft"], "rounds": [1400], "target": 0.9}}


# The mixture-of-experts policy: the same tokenizer, task and warm start on a Qwen3-MoE of the same width and depth,
# every layer sparse (8 experts of width 64, top-2, renormalized top-k weights: about as many parameters as the dense
# one), warm-started with transformers' load-balancing loss (without it the routers collapsed onto two experts per
# layer). One phase-1 round, like the python-tool spec: the build takes 3.5 CPU-minutes. ``arch`` is absent from the
# dense specs, so their hashes (and shipped folders) are what they were.
MOE_SPEC = {**SPEC, "arch": "qwen3_moe",
            "model": {**SPEC["model"], "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 64, "norm_topk_prob": True, "router_aux_loss_coef": 0.02},
            "sft": {**SPEC["sft"], "rounds": [1400], "target": 0.9}}
SPECS = {"arithmetic": SPEC, "python_tool": PYTHON_TOOL_SPEC, "moe": MOE_SPEC}  # the shipped builds, by name
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def _task(spec: dict):
    """The task module whose ``demonstration`` dialogues the policy is warm-started on."""
    import importlib

    # by name, imported on demand: a run of one task loads (and `molt fit`'s import closure holds) no other task's code
    modules = {"arithmetic": "arithmetic", "python_tool": "python_tool", "terminal": "terminal_agent"}
    return importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.tasks.{modules[spec.get('task', 'arithmetic')]}")


PREBUILT = Path(__file__).parent / "prebuilt"


def cache_root() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt-lightning"))


def spec_key(spec: dict) -> str:
    """A hash of everything that determines a build's content."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def folder_name(spec: dict) -> str:
    """The folder a spec builds into: its task and its ``spec_key``."""
    key = spec_key(spec)
    arch = f"-{spec['arch']}" if "arch" in spec else ""  # the dense specs predate ``arch``: their names stay
    return f"tiny-{spec.get('task', 'arithmetic')}{arch}-{key}".replace("_", "-")


def arithmetic_policy(spec: dict | None = None) -> str:
    """Path of the warm-started policy folder: the shipped build of ``spec``, else the cached one, built on first use
    (a few minutes on a CPU)."""
    spec = spec or SPEC
    name = folder_name(spec)
    if (PREBUILT / name / "model.safetensors").exists():
        return str(PREBUILT / name)
    return cached_folder(name, lambda out: build(out, spec))


def python_tool_policy() -> str:
    """The tiny policy of ``tasks.python_tool`` (tool calls through the OpenAI-compatible endpoint), cached."""
    return arithmetic_policy(PYTHON_TOOL_SPEC)


def moe_policy() -> str:
    """The tiny mixture-of-experts policy (``MOE_SPEC``) for the arithmetic task: shipped, else built and cached."""
    return arithmetic_policy(MOE_SPEC)


def base_policy(seed: int = 0, like: str = "arithmetic") -> str:
    """The shipped ``like`` policy's tokenizer and config (``SPECS``) with freshly initialized weights (``seed``),
    cached: what ``molt sft`` (``recipes/sft_tiny.yaml``) warm-starts from scratch."""
    warm = Path(arithmetic_policy(SPECS[like]))

    def make(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(warm)).float()
        model.generation_config = GenerationConfig.from_pretrained(warm)
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(warm).save_pretrained(out)
        (out / "molt_spec.json").write_text(json.dumps({"random_init_of": warm.name, "seed": seed}, indent=1))

    return cached_folder(f"{warm.name}-random-init-{seed}", make)


def qwen3_policy(seed: int = 0) -> str:
    """A tiny random-init Qwen3 with the default policy's tokenizer, width and depth (head_dim 32: vLLM's CPU
    attention refuses 16), cached: a new dense architecture as a policy is one function like this one and one recipe
    line (``recipes/research/qwen3.yaml``; docs/research.md)."""
    warm = Path(arithmetic_policy())

    def make(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(warm)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), head_dim=32, tie_word_embeddings=True,
                                             pad_token_id=tokenizer.pad_token_id, **SPEC["model"])).float()
        model.generation_config = GenerationConfig.from_pretrained(warm)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return cached_folder(f"tiny-qwen3-random-init-{seed}", make)


def terminal_base_policy() -> str:
    """``base_policy`` with the python-tool policy's tokenizer and its 512-token context (a shell episode with its
    outputs outgrows the arithmetic policy's 256): what ``recipes/sft_terminal.yaml`` warm-starts."""
    return base_policy(0, "python_tool")


def terminal_demonstrations() -> str:
    """25,600 solved instances of the example terminal tasks' families (``tasks.terminal_agent.demonstration``)."""
    return demonstrations(task="terminal")


def demonstrations(path: str | None = None, n: int = 25600, p_tool: float = 1.0, seed: int = 1,
                   task: str = "arithmetic") -> str:
    """Write ``n`` warm-start dialogues of ``task`` (``demonstration(rng, p_tool)``; the task's ``TOOLS`` in each
    row's ``tools`` where it has some) as JSONL rows ``{"messages": [...], "tools": [...]}`` to ``path`` (default: a
    cached file named by the arguments); returns the path. ``recipes/sft_tiny.yaml`` trains on it."""
    module = _task({"task": task})
    rng, tools = random.Random(seed), getattr(module, "TOOLS", None)
    if path is None:
        path = str(cache_root() / f"demonstrations-{task}-n{n}-p{p_tool}-s{seed}.jsonl".replace("_", "-"))
        if os.path.exists(path):
            return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        for _ in range(n):
            row = {"messages": module.demonstration(rng, p_tool)}
            f.write(json.dumps({**row, "tools": tools} if tools else row) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent writer or a crash never leaves half a file
    return path


def cached_folder(name: str, make) -> str:
    """The model folder ``name`` in the cache, made by ``make(folder)`` on first use (in a temporary folder, renamed
    into place atomically, so a crashed or concurrent build never leaves a half-written model behind)."""
    final = cache_root() / name
    if (final / "model.safetensors").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
    try:
        make(tmp)
        try:
            tmp.rename(final)  # atomic; a concurrent builder may have won the race
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def train_tokenizer(vocab_size: int, seed: int = 0, task=None):
    """A byte-level BPE with single-digit tokens, trained on synthetic task dialogues, with a ChatML template (the
    task's own, with its tool-call tokens and ``response_template``, where it has one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..agents.chat import message_text
    from ..tasks import arithmetic

    task = task or arithmetic
    rng = random.Random(seed)
    dialogues = [task.demonstration(rng, 0.5) for _ in range(3000)]  # p_tool (p_right for tasks.shapes) 0.5
    corpus = [message_text(m["content"]) for d in dialogues for m in d]
    corpus += [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
               for d in dialogues for m in d for c in m.get("tool_calls", [])]
    corpus += ["user", "assistant", "tool", "system", "\n"]
    if hasattr(task, "TOOLS"):
        corpus.append("tools: " + ", ".join(t["function"]["name"] for t in task.TOOLS))
    specials = SPECIALS + getattr(task, "SPECIAL_TOKENS", [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
        chat_template=getattr(task, "CHAT_TEMPLATE", CHATML), additional_special_tokens=specials[1:2] + specials[3:],
    )
    if hasattr(task, "RESPONSE_TEMPLATE"):
        tokenizer.response_template = task.RESPONSE_TEMPLATE
    return tokenizer


def tool_route_success(model, template, pad_id: int, n: int = 256, seed: int = 12345, task=None) -> float:
    """Mean probability (temperature 1) that the policy, having chosen the tool, completes the tool route: copies the
    expression into the call, then the result into the answer. The choice itself (the first generated token) is left
    out: it is what RL is meant to change."""
    import torch

    from ..trainer.sft import collate, render
    from ..tasks import arithmetic

    task = task or arithmetic
    rng = random.Random(seed)
    tools = getattr(task, "TOOLS", None)
    rows = [render(template, task.demonstration(rng, p_tool=1.0), tools) for _ in range(n)]
    ids, labels, attention = collate(rows, pad_id)  # (B, T) each
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # (B, T-1, V)
    targets, mask = labels[:, 1:], labels[:, 1:] != -100  # (B, T-1)
    first = mask.float().cumsum(-1) == 1  # (B, T-1): the first generated token of each dialogue
    mask = mask & ~first
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return float(torch.exp((logp * mask).sum(-1)).mean())


def cosine(i: int, n: int, peak: float) -> float:
    """The warm start's learning rate at step ``i`` of ``n``: linear warm-up over 10%, then cosine decay to 0."""
    from ..trainer.sft import warmup_cosine

    return peak * warmup_cosine(i, n, max(1, n // 10))


def build(out: Path, spec: dict) -> None:
    """Tokenizer, random init, then two supervised phases. Phase 1 (tool-heavy data) runs annealed rounds (warm-up,
    cosine decay) until the tool route is reliable (``tool_route_success >= target`` after a round): how much training
    that takes varies from build to build (float reduction order differs between machines and thread counts, and a
    small network learns to copy abruptly), and one fixed schedule gave policies that copied anywhere from most to all
    of the expressions right. Phase
    2 then lowers the tool-use rate to about ``p_final`` at a small, decaying learning rate."""
    import torch
    import transformers

    from ..agents.chat import ChatTemplate

    sft, task = spec["sft"], _task(spec)
    torch.manual_seed(sft["seed"])
    tokenizer = train_tokenizer(spec["vocab_size"], sft["seed"], task)
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[spec.get("arch", "llama")])
    config = config_cls(
        vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **spec["model"]
    )
    model = model_cls(config).float()
    template, pad = ChatTemplate(tokenizer), tokenizer.pad_token_id
    rng = random.Random(sft["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=sft["lr"], weight_decay=0.0)
    balance = {"output_router_logits": True} if "num_experts" in spec["model"] else {}  # MoE: + load-balancing loss

    def step(p_tool: float, lr: float) -> None:
        demonstration_step(model, opt, template, pad, task, rng, p_tool, lr, sft["batch"], **balance)

    model.train()
    rounds = []
    for r, n in enumerate(sft["rounds"]):  # annealed rounds until the tool route is reliable
        log.warning("building the tiny policy %s (no shipped build of this spec; cached once built): phase-1 "
                    "round %d, %d steps", folder_name(spec), r + 1, n)
        for i in range(n):
            step(sft["p_tool"], cosine(i, n, sft["lr"] / (1 + r)))
        model.eval()
        rounds.append(tool_route_success(model, template, pad, task=task))
        model.train()
        if rounds[-1] >= sft["target"]:
            break
    for i in range(sft["final_steps"]):
        step(sft["p_final"], sft["final_lr"] * (1 - i / sft["final_steps"]))
    model.eval()
    final = tool_route_success(model, template, pad, task=task)
    log.warning("built the tiny policy: tool-route success %.3f after phase-1 rounds %s", final,
                [round(x, 3) for x in rounds])
    if final < sft["target"]:
        log.warning("the warm start did not reach its target %.2f: RL will start from a weaker policy", sft["target"])
    spec = {**spec, "built": {"phase1_round_success": rounds, "tool_route_success": final}}
    model.generation_config.pad_token_id = pad
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "molt_spec.json").write_text(json.dumps(spec, indent=1))


def demonstration_step(model, opt, template, pad: int, task, rng: random.Random, p_tool: float, lr: float, batch: int,
                       **forward) -> None:
    """One supervised step of a warm start at ``lr``: ``batch`` of ``task``'s demonstrations (``p_tool``) rendered as
    their rollouts (``sft.render``), transformers' loss (``sft.sft_loss``'s value), the gradient clipped to norm 1."""
    import torch

    from ..trainer.sft import collate, render

    for group in opt.param_groups:
        group["lr"] = lr
    tools = getattr(task, "TOOLS", None)
    ids, labels, attention = collate([render(template, task.demonstration(rng, p_tool), tools)
                                      for _ in range(batch)], pad)
    model(input_ids=ids, attention_mask=attention, labels=labels, **forward).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


# The distillation teacher (recipes/distill.yaml): the shipped arithmetic policy fine-tuned further on dialogues that
# take the tool route 90% of the time, so it shares the student's tokenizer and network and uses the tool far more.
TEACHER_SPEC = {"from": "arithmetic", "p_tool": 0.9, "steps": 200, "lr": 3e-4, "batch": 64, "seed": 0}


def teacher_name() -> str:
    return f"tiny-arithmetic-teacher-{spec_key(TEACHER_SPEC)}"


def teacher_policy() -> str:
    """The tiny distillation teacher (``TEACHER_SPEC``): shipped, else built from the shipped student and cached."""
    name = teacher_name()
    if (PREBUILT / name / "model.safetensors").exists():
        return str(PREBUILT / name)
    return cached_folder(name, build_teacher)


def build_teacher(out: Path) -> None:
    """``TEACHER_SPEC["steps"]`` supervised steps from the student at a linearly decaying learning rate (``build``'s
    phase 2, at another tool-use rate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..agents.chat import ChatTemplate
    from ..tasks import arithmetic

    spec, student = TEACHER_SPEC, arithmetic_policy()
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student).float().train()
    template, pad, rng = ChatTemplate(tokenizer), tokenizer.pad_token_id, random.Random(spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    for i in range(spec["steps"]):
        demonstration_step(model, opt, template, pad, arithmetic, rng, spec["p_tool"],
                           spec["lr"] * (1 - i / spec["steps"]), spec["batch"])
    model.eval()
    built = {"tool_route_success": tool_route_success(model, template, pad)}
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "molt_spec.json").write_text(json.dumps({**spec, "student": Path(student).name, "built": built}, indent=1))


def ship(spec: dict, build_fn=None) -> Path:
    """Build ``spec`` (with ``build_fn``, default ``build``) into ``models/prebuilt/``, replacing its old build."""
    target = PREBUILT / folder_name(spec)
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        (build_fn or build)(Path(tmp), spec)
        shutil.copytree(tmp, target)
    return target


# rebuild shipped policies: python -m molt_lightning.models.tiny [arithmetic python_tool moe]
# (the teacher: rm -r the shipped one, then copy teacher_policy()'s cached build into prebuilt/)
if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for spec in (SPECS[name] for name in sys.argv[1:] or SPECS):
        print(ship(spec))
