"""The loop on a CUDA device: seconds per step, generated tokens/s, peak memory and whether every sync verified.

Runs, printed as one table: the embedded default (``recipes/default.yaml``'s policy, agent, tasks, rollout, optimizer
and algorithm) for ``--steps`` steps on each engine of ``--engines`` (``torch``; ``vllm`` where vLLM is installed, the
in-process engine on the GPU: vLLM's own weight loading, ``engines/vllm/cpu.py`` unused), and the same loop with a
~110M-parameter Llama of random weights (same tokenizer, bf16) for ``--big-steps`` steps on the torch engine, to show
the per-step cost at a size where the GPU matters (its rewards are meaningless). ``scripts/gpu_check.sh`` runs it.
Usage: ``python benchmarks/gpu_step.py [--device cuda] [--engines torch,vllm]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def big_policy(src: str, out: str, dtype: str) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def recipe() -> dict:
    """The default recipe's rollout, optimizer and algorithm records."""
    import yaml

    from molt_lightning import Optim, Rollout
    from molt_lightning.algorithms import Algorithm

    model = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "recipes", "default.yaml")))["model"]
    return {"rollout": Rollout(**model["rollout"]), "optim": Optim(**model["optim"]),
            "algo": Algorithm(**model["algo"])}


def make_engine(name: str, device: str, dtype: str):
    from molt_lightning.engines import TorchEngine, VLLMEngine

    if name == "vllm":  # the trainer's dtype, a share of the GPU beside the trainer
        return VLLMEngine(dtype=dtype, seed=0, engine_kwargs={"gpu_memory_utilization": 0.3})
    return TorchEngine(device=device, dtype=dtype)


def run(policy: str, steps: int, device: str, dtype: str, engine: str = "torch") -> dict:
    import lightning as L
    import pandas as pd
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from molt_lightning import AsyncRLModule
    from molt_lightning.tasks import arithmetic

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    out = tempfile.mkdtemp()
    module = AsyncRLModule(arithmetic.calculator_agent, arithmetic.tasks, policy=policy,
                           engine=make_engine(engine, device, dtype), dtype=dtype, **recipe())
    t0 = time.perf_counter()
    L.Trainer(max_steps=steps, accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
              logger=CSVLogger(out), log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module)
    wall = time.perf_counter() - t0
    df = pd.read_csv(f"{out}/lightning_logs/version_0/metrics.csv").groupby("step").first()
    steady = df.iloc[min(3, len(df) - 1):]
    return {
        "engine": engine, "policy params (M)": sum(p.numel() for p in module.policy.parameters()) / 1e6,
        "dtype": dtype, "steps": steps, "wall s": round(wall, 1),
        "s/step (median)": round(float(steady["perf/step_time_s"].median()), 3),
        "gen tok/s": round(float(steady["perf/gen_tokens_per_s"].median()), 1),
        "trainer idle": round(float(steady["perf/trainer_idle_frac"].mean()), 3),
        "weight sync s": round(float(steady["perf/weight_sync_s"].median()), 4),
        "sync/verified (every step)": bool((df["sync/verified"] == 1).all()) if "sync/verified" in df else None,
        "peak GPU mem GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None,
        "reward first 5": round(float(df["reward"].iloc[:5].mean()), 3),
        "reward last 5": round(float(df["reward"].iloc[-5:].mean()), 3),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--engines", default="torch", help="comma-separated: torch, vllm")
    ap.add_argument("--big-steps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from molt_lightning.models.tiny import arithmetic_policy

    tiny = arithmetic_policy()
    rows = {f"tiny default, {name} engine": run(tiny, args.steps, args.device, "float32", name)
            for name in args.engines.split(",") if name}
    if args.big_steps:
        big = big_policy(tiny, tempfile.mkdtemp(), "bfloat16")
        rows["110M random, bf16, torch engine"] = run(big, args.big_steps, args.device, "bfloat16")
    info = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__}
    print(json.dumps(info))
    keys = ["engine", "steps", "s/step (median)", "gen tok/s", "peak GPU mem GiB", "sync/verified (every step)",
            "reward first 5", "reward last 5"]
    print("| run | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
