"""``molt export CKPT OUT``: a Lightning checkpoint of ``molt fit`` as a Hugging Face folder other tools load.

``export(ckpt, out)`` reads a checkpoint of any strategy: a file (one process, DDP) or the folder of shards FSDP2 and
expert parallelism write (``torch.distributed.checkpoint``, converted in one process with its ``dcp_to_torch_save``:
every parameter whole, the experts included). The policy's weights are the ``policy.lm.*`` entries of the module's
state (the value head and a KL reference are left out); they are loaded into the model the run started from (its
``model.policy`` folder, in the checkpoint's hyperparameters) with every key accounted for, and written with
``save_pretrained`` (safetensors), beside the policy's tokenizer with its chat template, its processor (a
vision-language policy), its generation config, and ``molt_export.json`` (the checkpoint, step, policy version).

A LoRA run exports peft's adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``; the base is the
run's policy folder), or with ``merge=True`` (``--merge``) the base with the adapter merged in (``merge_and_unload``,
in float64 and then rounded once: a float32 merge differs from the adapter's forward by more than 1e-5 in logprob)
as a plain model folder. ``dtype`` casts the exported weights (default: as trained).

The result loads with ``transformers`` (``AutoModelForCausalLM.from_pretrained(OUT)``), serves with ``molt serve
--policy OUT`` or vLLM, and is a ``model.policy`` for another ``molt fit`` or ``molt eval``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

PREFIX = "policy.lm."


def read_checkpoint(ckpt: str) -> dict:
    """The checkpoint as one dict (a sharded checkpoint folder converted in this process)."""
    path = Path(ckpt)
    if not path.exists():
        raise ValueError(f"molt export: no checkpoint at {ckpt}")
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "whole.pt")
            checkpoint = torch.load(Path(tmp) / "whole.pt", map_location="cpu", weights_only=False)
        meta = path / "meta.pt"  # Lightning keeps everything but the sharded states there (rank 0 writes it)
        if meta.exists():
            checkpoint = {**torch.load(meta, map_location="cpu", weights_only=False), **checkpoint}
        return checkpoint
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def export(ckpt: str, out: str, merge: bool = False, dtype: str | None = None) -> Path:
    """Write the policy of ``ckpt`` to the folder ``out`` (see the module docstring); returns ``out``."""
    from ..policies import lora as lora_
    from ..policies import load_lm
    from ..trainer.policy import policy_folder

    t0 = time.perf_counter()
    checkpoint = read_checkpoint(ckpt)
    hparams = checkpoint.get("hyper_parameters") or {}
    if "policy" not in hparams or "state_dict" not in checkpoint:
        raise ValueError(f"molt export: {ckpt} is not a checkpoint of molt fit (no policy in its hyperparameters)")
    base = policy_folder(hparams["policy"])
    weights = {k[len(PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    train_dtype = getattr(torch, hparams.get("dtype", "float32"))
    lm = load_lm(base, train_dtype)
    spec = hparams.get("lora")
    if spec is not None:
        lm = lora_.apply(lm, spec if isinstance(spec, lora_.LoraSpec) else lora_.LoraSpec(**spec))
    load_exactly(lm, weights, ckpt)
    if spec is not None and merge:  # W + B A summed in float64, rounded once to the trained dtype
        lm = lm.to(torch.float64).merge_and_unload().to(train_dtype)
    if dtype is not None:
        lm = lm.to(getattr(torch, dtype))
    out_path = save_folder(lm, base, out)
    (out_path / "molt_export.json").write_text(json.dumps({
        "checkpoint": os.path.abspath(ckpt), "base_policy": base, "global_step": checkpoint.get("global_step"),
        "policy_version": checkpoint.get("molt", {}).get("policy_version"),
        "kind": "lora adapter" if spec is not None and not merge else "full weights",
        "seconds": round(time.perf_counter() - t0, 2),
    }, indent=2) + "\n")
    return out_path


def save_folder(lm: torch.nn.Module, base: str, out: str) -> Path:
    """Write ``lm`` (``save_pretrained``: safetensors, config, generation config) to the folder ``out``, beside the
    tokenizer (with its chat template) and the processor (a vision-language policy) of the policy folder ``base``."""
    from transformers import AutoTokenizer

    from ..policies.vision import load_processor

    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_ino for p in out_path.rglob("*") if p.is_file()}
    lm.save_pretrained(out_path)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_path)
    processor = load_processor(base)
    if processor is not None:
        processor.save_pretrained(out_path)
    # save_pretrained writes the weights through a temporary file renamed into place, which keeps mkstemp's 0600: give
    # every file written here (new, or replaced: a new inode) the mode any new file gets, 0644 under umask 022
    mode = 0o666 & ~umask()
    for p in out_path.rglob("*"):
        if p.is_file() and before.get(p) != p.stat().st_ino:
            p.chmod(mode)
    return out_path


def umask() -> int:
    """The process's umask, read without changing it (/proc/self/status; elsewhere set and restored at once)."""
    try:
        return int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
                   .split()[1], 8)
    except (OSError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def load_exactly(lm: torch.nn.Module, weights: dict[str, torch.Tensor], ckpt: str) -> None:
    """Load ``weights`` into ``lm``; every parameter must come from the checkpoint (tied aliases aside) and every
    checkpoint entry must land."""
    result = lm.load_state_dict(weights, strict=False)
    aliases = set(lm.state_dict()) - {n for n, _ in lm.named_parameters()}  # tied weights and buffers
    missing = [k for k in result.missing_keys if k not in aliases]
    if missing or result.unexpected_keys:
        raise ValueError(f"molt export: {ckpt} does not match its policy folder: missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]} (was the checkpoint written by a run of another policy?)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="molt export", description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a checkpoint of molt fit (a .ckpt file, or the folder FSDP2 writes)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base (a full model folder)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: as trained)")
    args = p.parse_args(argv)
    try:
        out = export(args.ckpt, args.out, merge=args.merge, dtype=args.dtype)
    except ValueError as e:
        p.exit(2, f"{e}\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"molt export: wrote {out} ({size / 2**20:.1f} MiB)")
