"""What the weight fingerprints cost (``engines.fingerprint``): per sync, on the trainer's side and the engine's,
against the sync itself and a training step.

For each policy (the tiny default; SmolLM2-135M-Instruct when its GGUF package is installed, else a line saying why
not) and engine (``TorchEngine``; ``VLLMEngine`` in-process, one core), medians of ``--repeats``:
- trainer: ``fingerprint.samples`` over every bucket a sync sends (``WeightFlow.push`` does this as it stages);
- engine: the engine's ``fingerprints`` of every sent tensor (vLLM: one RPC, the worker reading every linear layer
  through its kernel) plus the comparison (``fingerprint.verify``);
- sync: ``WeightFlow.push`` + ``settle`` with the check off, and with it on;
- step: one training step of the real ``AsyncRLModule`` on a synthetic batch shaped like the policy's recipe
  (``benchmarks/train_step.py``'s ``StepBench``: forward, backward, AdamW; no generation, so the real step is longer).
``cost/step`` is (trainer + engine) / step: the fingerprints' share of a step when nothing overlaps them (the
trainer's part always adds to the step; the engine's adds to the load, which overlaps the next step unless
``max_lag`` is 0).

    python benchmarks/fingerprint_cost.py [--policies tiny,smollm2] [--engines torch,vllm] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
from types import SimpleNamespace

import torch

from molt_lightning.engines.fingerprint import samples, verify
from molt_lightning.trainer.weights import WeightFlow, buckets

from train_step import POLICIES, StepBench  # noqa: E402  (benchmarks/ is the script's folder)
from weight_sync import median_s  # noqa: E402

TRAINER = SimpleNamespace(global_rank=0, strategy=None)  # what WeightFlow.push reads of a one-process trainer
BATCH = {"tiny": (64, 64), "smollm2": (32, 128)}  # rows x tokens: the default recipe's 8 x 8, smollm2_addition's 4 x 8


def step_s(policy: str, repeats: int) -> float:
    import lightning as L

    from molt_lightning import Optim

    rows, tokens = BATCH[policy]
    module = StepBench(rows, tokens, "chunked", policy=POLICIES[policy], optim=Optim(lr=1e-6),
                       torch_threads=os.cpu_count())
    trainer = L.Trainer(accelerator="cpu", max_steps=repeats + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return statistics.median(module.times[1:])


def measure(policy: str, path: str, engine_name: str, repeats: int, bucket_bytes: int) -> dict:
    from molt_lightning.engines import TorchEngine, VLLMEngine
    from molt_lightning.policies import load_lm

    lm = load_lm(path, torch.float32)
    engine = TorchEngine() if engine_name == "torch" else VLLMEngine(seed=0, cpu_threads="1")
    engine.launch(path)
    try:
        trainer_s = median_s(lambda: [samples(b) for b in buckets(lm, bucket_bytes)], repeats)
        expected = {k: v for b in buckets(lm, bucket_bytes) for k, v in samples(b).items()}
        shapes = {k: s.shape for k, s in expected.items()}
        engine_s = median_s(lambda: verify(expected, engine.call(engine.fingerprints(shapes)), "bench", 0), repeats)
        version, sync = iter(range(1, 10**6)), {}
        for verify_on in (False, True):
            flow = WeightFlow(engine, verify=verify_on)

            def push():
                flow.push(lm, next(version), TRAINER, bucket_bytes)
                flow.settle()

            sync[verify_on] = median_s(push, repeats)
            assert flow.verified == verify_on
    finally:
        engine.release()
    mb = sum(p.numel() * p.element_size() for p in lm.parameters()) / 1e6
    return {"policy": policy, "engine": engine_name, "mb": mb, "tensors": len(expected), "trainer_ms": trainer_s * 1e3,
            "engine_ms": engine_s * 1e3, "sync_off_s": sync[False], "sync_on_s": sync[True]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="tiny,smollm2")
    p.add_argument("--engines", default="torch,vllm")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=256)
    args = p.parse_args()
    from molt_lightning.trainer.policy import policy_folder

    rows, missing = [], []
    for policy in args.policies.split(","):
        try:
            path = policy_folder(POLICIES[policy])
        except Exception as e:  # noqa: BLE001 (SmolLM2 needs a package this machine may not have)
            missing.append(f"{policy}: not available offline ({e})")
            continue
        step = step_s(policy, args.repeats)
        for engine in args.engines.split(","):
            rows.append({**measure(policy, path, engine, args.repeats, args.bucket_mb * 2**20), "step_s": step})
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine); "
          f"medians of {args.repeats}")
    print("| policy | engine | MB, tensors | trainer ms | engine ms | sync s (check off) | sync s (on) | step s "
          "| fingerprints / sync | fingerprints / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fp_s = (r["trainer_ms"] + r["engine_ms"]) / 1e3
        print(f"| {r['policy']} | {r['engine']} | {r['mb']:.1f}, {r['tensors']} | {r['trainer_ms']:.2f} | "
              f"{r['engine_ms']:.2f} | {r['sync_off_s']:.4f} | {r['sync_on_s']:.4f} | {r['step_s']:.3f} | "
              f"{fp_s / r['sync_off_s']:.1%} | {fp_s / r['step_s']:.2%} |")
    for line in missing:
        print(line)


if __name__ == "__main__":
    main()
