"""Weight sync: seconds and GB/s of a push to each engine, against a plain memory copy of the same bytes (same run).

For each policy (the tiny default, SmolLM2-135M) and engine path, the median of ``--repeats`` pushes of the policy's
parameters through ``stage_weights`` + ``commit_weights`` (pause, load, tag with a prefix-cache reset, resume) in
buckets of ``--bucket-mb``, against the median of a ``copy_`` of the same tensors into preallocated ones (the memcpy
baseline, same run), and the time to pack the policy's matrices into oneDNN kernels in this process (what vLLM's CPU
engine computes with, so the floor of any load into it). Paths: ``torch`` (``TorchEngine`` in-process: a
``load_state_dict`` copy under the weights lock); ``vllm`` (``VLLMEngine`` as shipped: buckets copied into reused
shared-memory slabs, each bucket's kernels packed by the worker while the next is staged, swapped in at the commit,
``engines/vllm_load.py``); ``vllm-serial`` (the same without packing ahead, ``load_ahead=False``: every kernel is
packed in the commit, after the last bucket is staged); ``vllm-reload`` (the first path, kept as the baseline: a new
safetensors file per bucket in /dev/shm, loaded by vLLM's ``reload_weights``). vLLM runs on core 1, the trainer's
copy on one thread. Prints a table; ``--json`` appends the rows to a file.

    python benchmarks/weight_sync.py [--engines torch,vllm,vllm-serial,vllm-reload] [--policies tiny,smollm2]
                                     [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from molt_lightning.trainer.policy import policy_folder
from molt_lightning.trainer.weights import buckets

from train_step import POLICIES  # noqa: E402  (benchmarks/ is the script's folder)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def push_time(engine, lm, repeats: int, bucket_bytes: int, warmups: int = 1) -> float:
    """Median s/push of ``lm``'s weights to ``engine``, cut into buckets by the weight flow's ``buckets`` (a run's order
    and cut; stage each bucket, then commit), after ``warmups`` pushes."""
    version = iter(range(1, 10**6))

    def push():
        for bucket in buckets(lm, bucket_bytes):
            engine.call(engine.stage_weights(bucket))
        engine.call(engine.commit_weights(next(version)))

    for _ in range(warmups):
        push()
    return median_s(push, repeats)


def make_engine(name: str):


    from molt_lightning.engines import TorchEngine, VLLMEngine

    if name == "torch":
        return TorchEngine()
    if name == "vllm-reload":
        return VLLMEngine(seed=0, cpu_threads="1", direct_load=False)  # vLLM's reload_weights: the GPU's path
    return VLLMEngine(seed=0, cpu_threads="1", load_ahead=name == "vllm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="torch,vllm,vllm-serial,vllm-reload")
    ap.add_argument("--policies", default="tiny,smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the trainer's share in the recipes; vLLM runs on the other core
    rows = []
    for pol in a.policies.split(","):
        path = policy_folder(POLICIES[pol])
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        params = dict(lm.named_parameters())
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        dst = {k: torch.empty_like(p) for k, p in params.items()}
        memcpy = median_s(lambda: [dst[k].copy_(p.detach()) for k, p in params.items()], a.repeats)
        rows.append({"policy": pol, "engine": "memcpy (baseline)", "MB": nbytes / 1e6, "s": memcpy})
        if "vllm" in a.engines:  # the floor of any load into vLLM's CPU kernels: packing every matrix (oneDNN)
            from vllm import _custom_ops as ops

            mats = [p.detach() for p in params.values() if p.dim() == 2]  # the embedding too: the tied head's kernel
            held = []  # the previous round's kernels are freed only after the next is packed, as in a load

            def pack():
                held.append([ops.create_onednn_mm(w.t(), 32) for w in mats])
                if len(held) > 1:
                    held.pop(0)

            rows.append({"policy": pol, "engine": "oneDNN pack alone", "MB": nbytes / 1e6,
                         "s": median_s(pack, a.repeats)})
            held.clear()
        for name in a.engines.split(","):
            engine = make_engine(name)
            engine.launch(path)
            rows.append({"policy": pol, "engine": name, "MB": nbytes / 1e6,
                         "s": push_time(engine, lm, a.repeats, a.bucket_mb * 2**20)})
            engine.release()
        for r in rows:
            if r["policy"] == pol:
                r["GB/s"] = r["MB"] / 1e3 / r["s"]
                r["vs memcpy"] = memcpy / r["s"]
    print(f"{'policy':8} {'path':18} {'MB':>8} {'s/push':>8} {'GB/s':>7} {'vs memcpy':>9}")
    for r in rows:
        print(f"{r['policy']:8} {r['engine']:18} {r['MB']:8.1f} {r['s']:8.4f} {r['GB/s']:7.2f} {r['vs memcpy']:9.2f}")
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
