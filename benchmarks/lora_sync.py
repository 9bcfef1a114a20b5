"""LoRA vs full-weight sync: bytes and seconds per push to each engine, for the same base model, in the same run.

For each policy (the tiny default, SmolLM2-135M) a trainer-side copy is built twice, plain and wrapped with a LoRA
adapter (``--rank``, all linear layers, B random so the adapter is non-trivial). Each push is what
``weights.WeightFlow.push`` does: ``weights.buckets`` (every parameter, or the adapter's tensors only) through
``stage_weights`` + ``commit_weights``. Full weights go to an engine launched plain (vLLM: safetensors files in
/dev/shm, ``reload_weights``, prefix-cache reset); the adapter goes to an engine launched with it (vLLM: a peft folder
in /dev/shm, ``add_lora`` under a new id, the previous adapter removed; torch: ``set_peft_model_state_dict``). The
median of ``--repeats`` pushes after one warm-up; ratios are full / LoRA from the same run. Prints a table.

    python benchmarks/lora_sync.py [--engines torch,vllm] [--policies tiny,smollm2] [--rank 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from molt_lightning.policies import lora
from molt_lightning.trainer.policy import policy_folder
from molt_lightning.trainer.weights import buckets

from train_step import POLICIES  # noqa: E402  (benchmarks/ is the script's folder)


def make_engine(name: str):
    from molt_lightning.engines import TorchEngine, VLLMEngine

    return TorchEngine() if name == "torch" else VLLMEngine(seed=0, cpu_threads="1")


def push_seconds(engine, lm, repeats: int) -> tuple[float, int]:
    """Median seconds of a push of ``lm``'s sync (as ``WeightFlow.push`` makes it) and its bytes."""
    version, times, sent = [0], [], 0
    for i in range(repeats + 1):  # the first is a warm-up
        version[0] += 1
        t0 = time.perf_counter()
        sent = 0
        for bucket in buckets(lm, 256 * 2**20):
            sent += sum(t.numel() * t.element_size() for t in bucket.values())
            engine.call(engine.stage_weights(bucket))
        engine.call(engine.commit_weights(version[0]))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="torch,vllm")
    ap.add_argument("--policies", default="tiny,smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the trainer's share in the recipes; vLLM runs on the other core
    rows = []
    for pol in a.policies.split(","):
        t0 = time.perf_counter()
        try:
            path = policy_folder(POLICIES[pol])
        except (ValueError, ImportError) as e:
            print(f"note: skipping {pol}: {e}")
            continue
        full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        adapted = lora.apply(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                             lora.LoraSpec(r=a.rank, alpha=2 * a.rank))
        with torch.no_grad():  # a non-trivial adapter: B = 0 would be just as many bytes, but say it
            for name, p in adapted.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.01)
        print(f"note: {pol} ready in {time.perf_counter() - t0:.1f} s")
        for name in a.engines.split(","):
            for kind, lm in (("full", full), ("lora", adapted)):
                engine = make_engine(name)
                engine.launch(path, lora.adapter_of(lm))
                try:
                    s, nbytes = push_seconds(engine, lm, a.repeats)
                finally:
                    engine.release()
                rows.append({"policy": pol, "engine": name, "sync": kind, "MB": nbytes / 1e6, "s": s})
    print(f"\nLoRA r={a.rank} on all linear layers; median of {a.repeats} pushes; ratios full / LoRA (same run)\n")
    print(f"| {'policy':8} | {'engine':6} | {'sync':4} | {'MB/push':>9} | {'s/push':>8} | {'bytes ratio':>11} | "
          f"{'time ratio':>10} |")
    print(f"|{'-' * 10}|{'-' * 8}|{'-' * 6}|{'-' * 11}|{'-' * 10}|{'-' * 13}|{'-' * 12}|")
    for r in rows:
        ref = next(f for f in rows if (f["policy"], f["engine"], f["sync"]) == (r["policy"], r["engine"], "full"))
        print(f"| {r['policy']:8} | {r['engine']:6} | {r['sync']:4} | {r['MB']:9.3f} | {r['s']:8.4f} | "
              f"{ref['MB'] / r['MB']:11.1f} | {ref['s'] / r['s']:10.2f} |")


if __name__ == "__main__":  # vLLM's engine core starts with spawn
    main()
