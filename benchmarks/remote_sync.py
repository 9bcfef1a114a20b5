"""Remote engines: weight sync by channel, and generation throughput with 1 vs 2 local servers (one run, one table).

Weight sync, for the tiny default policy: the median of ``--repeats`` pushes (``stage_weights`` per bucket of
``--bucket-mb``, cut by the weight flow's ``buckets``, then ``commit_weights``) to ``VLLMEngine`` in-process (slabs in
/dev/shm, ``collective_rpc`` in-process), to a ``RemoteVLLMEngine`` over the shared-memory channel (slab paths posted
to ``/collective_rpc``) and over the HTTP body (base64 safetensors in the ``/collective_rpc`` JSON), each including
the pause, prefix-cache reset, version and resume calls; against a plain memory copy of the same bytes (``copy_``
into preallocated tensors). The in-process engine and the server whose sync is measured both run on core 1.

Throughput: ``--prompts`` prompts x ``--tokens`` new tokens (``ignore_eos``), all sent at once, through an
``EnginePool`` of 1 server and of 2 servers (bound to cores 1 and 0), tokens/s over the wall time.

``--policy smollm2`` measures the weight sync for SmolLM2-135M-Instruct (538 MB, one server; no throughput table).

    python benchmarks/remote_sync.py [--policy tiny|smollm2] [--repeats 10] [--prompts 64] [--tokens 64]
                                     [--bucket-mb 64] [--channels shm,http]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
import weight_sync  # benchmarks/ is the script's folder
from weight_sync import median_s


def push_time(engine, lm, repeats: int, bucket_bytes: int) -> float:
    """``weight_sync.push_time`` after two warm-up pushes (the steady state a run sees: the shm channel's slabs, two
    per bucket for the remote engine, exist and are mapped)."""
    return weight_sync.push_time(engine, lm, repeats, bucket_bytes, warmups=2)


def throughput(engine, prompts: int, tokens: int) -> float:
    from molt_lightning.engines import Sampling

    sampling = Sampling(max_tokens=tokens, temperature=1.0, ignore_eos=True)

    async def run():
        outs = await asyncio.gather(*[engine.generate([1, 5 + i % 50, 7, 9], sampling) for i in range(prompts)])
        return sum(len(o.token_ids) for o in outs)

    engine.call(run())  # warm-up
    t0 = time.perf_counter()
    n = engine.call(run())
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--policy", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--channels", default="shm,http")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from molt_lightning.engines import EnginePool, RemoteVLLMEngine, VLLMEngine
    from molt_lightning.models.smollm2 import smollm2_policy
    from molt_lightning.models.tiny import arithmetic_policy
    from molt_lightning.engines.vllm.server import LocalServer

    policy = arithmetic_policy() if args.policy == "tiny" else smollm2_policy()
    lm = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    state = {k: p.detach() for k, p in lm.named_parameters()}  # what a sync sends (a tied head once)
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    rows = []

    bucket_bytes = args.bucket_mb * 2**20
    servers = [LocalServer(policy, cpu_threads=str(1 - i)) for i in range(2 if args.policy == "tiny" else 1)]
    try:
        for s in servers:
            s.wait_ready(300)
        inproc = VLLMEngine(seed=0, cpu_threads="1")
        inproc.launch(policy)
        rows.append(("vllm in-process (/dev/shm)", push_time(inproc, lm, args.repeats, bucket_bytes)))
        inproc.release()
        remote = RemoteVLLMEngine(url=servers[0].url)
        remote.launch(policy)
        for channel in args.channels.split(","):
            remote.channel = channel
            rows.append((f"remote, {channel} channel", push_time(remote, lm, args.repeats, bucket_bytes)))
        remote.release()
        rates = []
        for n in (1, 2) if args.policy == "tiny" else ():
            pool = EnginePool(urls=[s.url for s in servers[:n]])
            pool.launch(policy)
            pool.call(pool.update_weights(state, 0))
            rates.append((n, throughput(pool, args.prompts, args.tokens)))
            pool.release()
    finally:
        for s in servers:
            s.stop()
    torch.set_num_threads(1)  # measured last, on one thread: the servers' busy cores made a threaded copy erratic
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    rows.insert(0, ("memcpy (baseline)", median_s(lambda: [dst[k].copy_(v) for k, v in state.items()],
                                                  10 * args.repeats)))
    import os

    base = rows[0][1]
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine)")
    print(f"weight sync, {args.policy} policy ({mb:.1f} MB), median of {args.repeats} pushes, "
          f"{args.bucket_mb} MB buckets")
    print(f"{'path':28s} {'s/push':>8s} {'GB/s':>8s} {'vs memcpy':>10s}")
    for name, s in rows:
        print(f"{name:28s} {s:8.4f} {mb / 1e3 / s:8.3f} {base / s:10.4f}")
    if not rates:
        return
    print(f"\ngeneration, {args.prompts} prompts x {args.tokens} tokens at once, EnginePool of local servers")
    print(f"{'servers':8s} {'tokens/s':>9s} {'vs 1':>6s}")
    for n, rate in rates:
        print(f"{n:<8d} {rate:9.0f} {rate / rates[0][1]:6.2f}")


if __name__ == "__main__":
    main()
