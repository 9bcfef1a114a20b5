"""The molt stack: one seed of ``AsyncRLModule`` under ``lightning.Trainer``, as a protocol describes it.

Seeding: ``lightning.seed_everything(seed)``, the task stream ``tasks(seed)`` and the engine's sampler seed. The run
logs with Lightning's ``CSVLogger`` into ``workdir`` (kept as the seed's raw log) and the bench reads that file back
through the same Lightning-CSV importer users use for their own molt runs, so ``run`` and ``import`` cannot drift.

Options: ``engine`` = ``torch`` (default; ``TorchEngine``) or ``vllm`` (``VLLMEngine``, ~30 s start per seed on this
CPU, with the recipes' core split: vLLM bound to the last core, the trainer on one thread unless ``torch_threads``).
The engine is a stack option, not a protocol field: it changes systems numbers, not the algorithm, and the manifest
records it; so do ``admit_ahead`` and ``switch_interval_ms`` (``AsyncRLModule``'s, the recipe's system settings).
``model.precision`` (optional, ``32-true`` or ``bf16-mixed``) is Lightning's trainer precision. ``model.lora``
(optional, ``{r, alpha, dropout, target_modules}``: ``policies.lora.LoraSpec``'s fields) trains a LoRA adapter instead
of every weight, as a recipe's ``model.lora`` does; without it the run is full fine-tuning.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import warnings
from pathlib import Path

from .support import check_supported, unsupported

SUPPORTED = {
    "optimizer.name": ("adamw",), "optimizer.schedule": ("constant",), "optimizer.betas": ([0.9, 0.999],),
    "sampling.top_p": (1.0, 1),
}
# protocol algorithm keys that are not ``Algorithm`` fields but the module's: PPO epochs and optimizer steps per epoch
LOOP_KEYS = ("updates_per_batch", "mini_batches")
# what the shipped agent programs fix (turns, tokens per reply): a protocol naming one must state the same values
AGENT_FIXED = {
    "molt_lightning.tasks.arithmetic.calculator_agent": {"task.max_turns": 3, "sampling.max_tokens_per_turn": 16},
    "molt_lightning.tasks.arithmetic.single_turn_agent": {"task.max_turns": 1, "sampling.max_tokens_per_turn": 16},
    "molt_lightning.tasks.addition.agent": {"task.max_turns": 1, "sampling.max_tokens_per_turn": 24},
}
PRECISIONS = ("32-true", "bf16-mixed")  # model.precision: Lightning's Trainer precision (default 32-true)


def check(protocol) -> None:
    from ...algorithms import Algorithm

    check_supported("molt", protocol, SUPPORTED)
    fields = {f.name for f in dataclasses.fields(Algorithm)}
    for key, value in protocol.data["algorithm"].items():
        if key in fields:
            continue  # passed to Algorithm as it is
        if key not in LOOP_KEYS:
            raise unsupported("molt", f"algorithm.{key}", value, sorted(fields | set(LOOP_KEYS)))
        if not isinstance(value, int) or value < 1:
            raise unsupported("molt", f"algorithm.{key}", value, "integers >= 1")
    for dotted_field, value in AGENT_FIXED.get(protocol.get("task.agent"), {}).items():
        if protocol.get(dotted_field) != value:
            raise unsupported("molt", dotted_field, protocol.get(dotted_field), [value])
    if str(protocol.data["model"].get("precision", "32-true")) not in PRECISIONS:
        raise unsupported("molt", "model.precision", protocol.data["model"]["precision"], list(PRECISIONS))
    lora_spec(protocol)


def lora_spec(protocol):
    """The protocol's ``model.lora`` as a ``LoraSpec`` (None: full fine-tuning); a field it lacks is refused."""
    from ...policies.lora import LoraSpec

    spec = protocol.data["model"].get("lora")
    if spec is None:
        return None
    fields = {f.name for f in dataclasses.fields(LoraSpec)}
    if not isinstance(spec, dict) or set(spec) - fields:
        raise unsupported("molt", "model.lora", spec, f"a mapping of {sorted(fields)}")
    return LoraSpec(**spec)


def describe(options: dict) -> dict:
    return {"engine": options.get("engine", "torch"), "trainer": "lightning.Trainer + AsyncRLModule"}


def dotted(path: str):
    """The object at a dotted path (not ``registry.resolve``: its errors would list an empty registry)."""
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import {path!r} named by the protocol: {e}") from e


def make_engine(name: str, seed: int):
    from ...engines import TorchEngine, VLLMEngine

    if name == "torch":
        return TorchEngine(seed=seed)
    if name == "vllm":  # the recipes' core split: vLLM on the last core, the trainer (1 thread) on the rest
        return VLLMEngine(seed=seed, cpu_threads=str((os.cpu_count() or 2) - 1))
    raise ValueError(f"--engine {name!r}: use torch or vllm")


def run_seed(protocol, seed: int, workdir: Path, options: dict):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from ...algorithms import Algorithm
    from ...config import Batching, Optim, Rollout
    from ...module import AsyncRLModule
    from .. import importers, runs

    p = protocol.data
    algo_fields = {f.name for f in dataclasses.fields(Algorithm)}
    algo = Algorithm(**{k: v for k, v in p["algorithm"].items() if k in algo_fields})
    L.seed_everything(seed, workers=True, verbose=False)
    rollout = Rollout(
        group_size=int(p["batch"]["samples_per_prompt"]), prompts_per_step=int(p["batch"]["prompts_per_step"]),
        max_lag=int(p["max_lag"]), temperature=float(p["sampling"]["temperature"]),
        top_p=float(p["sampling"].get("top_p", 1.0)), task_seed=seed,
        admit_ahead=options.get("admit_ahead", True), switch_interval_ms=options.get("switch_interval_ms"))
    optim = Optim(lr=float(p["optimizer"]["lr"]), weight_decay=float(p["optimizer"]["weight_decay"]),
                  grad_clip=float(p["optimizer"]["grad_clip"]))
    module = AsyncRLModule(
        dotted(p["task"]["agent"]), dotted(p["task"]["tasks"]), policy=p["model"]["policy"],
        engine=make_engine(options.get("engine", "torch"), seed), rollout=rollout, algo=algo, optim=optim,
        batching=Batching(**{k: int(p["algorithm"][k]) for k in LOOP_KEYS if k in p["algorithm"]}),
        dtype=p["model"].get("dtype", "float32"), lora=lora_spec(protocol),
        torch_threads=options.get("torch_threads") or (1 if options.get("engine") == "vllm" else None),
    )
    logger = CSVLogger(str(workdir), name="lightning_logs")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "no validation"/"few workers" advice is noise here
        trainer = L.Trainer(
            # a protocol's steps are rollout batches; Lightning's max_steps counts optimizer steps
            max_steps=int(p["steps"]) * module.batching.updates_per_batch * module.batching.mini_batches,
            logger=logger, log_every_n_steps=1,
            enable_checkpointing=False, accelerator="cpu", devices=1, enable_progress_bar=False,
            enable_model_summary=False, precision=p["model"].get("precision", "32-true"),
        )
        trainer.fit(module)
    ((_, raw),) = importers.read_lightning_csv(Path(logger.log_dir) / "metrics.csv")
    spec = importers.STACK_COLUMNS["molt"]
    return runs.normalise(raw, spec["columns"], protocol.samples_per_step, spec["step_base"],
                          devices=trainer.num_devices, per_device=spec["per_device"])
