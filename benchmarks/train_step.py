"""One training step of the real ``AsyncRLModule`` on a fixed synthetic rollout batch: seconds per step and peak RSS.

The batch: ``--rows`` sequences of ``--tokens`` tokens, the first quarter (or ``--prompt-tokens``) prompt and the rest
policy tokens, in groups of 8; with ``--shared-prompts`` a group's rows share their prompt (a GRPO batch), which
``model.share_prefix`` (``prefix``) runs once: ``--no-share-prefix`` is the baseline it is measured against. No engine
and no rollouts: ``train_dataloader`` yields the same batch every step and weight pushes are skipped, so only the
trainer's step is measured, under Lightning and the chosen strategy (``--strategy ddp|fsdp2 --devices 2`` launches the
ranks, as ``molt fit`` does). ``--mode full`` replaces the chunked head by the plain route (full (N, T, V) logits,
then log-softmax), the baseline the chunked one is measured against. Prints one JSON line (rank 0) with the median
s/step after the first step and the peak RSS of every rank.

    python benchmarks/train_step.py --policy smollm2 --mode chunked --micro-batch-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from molt_lightning import AsyncRLModule, Batching, Optim
from molt_lightning.trainer.policy import logprobs_and_entropy
from molt_lightning.tasks import arithmetic
from molt_lightning.trajectory import Kind, Span, Trajectory, collate

POLICIES = {"tiny": "molt_lightning.models.tiny.arithmetic_policy",
            "smollm2": "molt_lightning.models.smollm2.smollm2_policy"}


def synthetic_batch(rows: int, tokens: int, vocab: int, seed: int = 0, prompt_tokens: int | None = None,
                    shared_prompts: bool = False):
    g = torch.Generator().manual_seed(seed)
    trajs, p = [], prompt_tokens or tokens // 4
    for i in range(rows):
        ids = torch.randint(5, vocab, (tokens,), generator=g).tolist()
        if shared_prompts:  # a group's 8 rows share their prompt, as a GRPO batch's samples do
            ids[:p] = torch.randint(5, vocab, (p,), generator=torch.Generator().manual_seed(seed + 1 + i // 8)).tolist()
        trajs.append(Trajectory(sample_id=i // 8, group_id=i // 8, reward=float(i % 3 == 0), segments=[[
            Span.context(Kind.PROMPT, ids[:p]), Span.policy(ids[p:], [-1.0] * (tokens - p), [0] * (tokens - p))]]))
    return collate(trajs, pad_id=0, max_version=0)


class StepBench(AsyncRLModule):
    """``AsyncRLModule`` on a synthetic batch; ``kw`` are its arguments (records: ``batching=Batching(...)``)."""

    def __init__(self, rows: int, tokens: int, mode: str, prompt_tokens: int | None = None,
                 shared_prompts: bool = False, **kw):
        super().__init__(arithmetic.calculator_agent, arithmetic.tasks, **kw)  # no rollouts: never called
        self.rows, self.tokens, self.mode, self.times = rows, tokens, mode, []
        self.prompt_tokens, self.shared_prompts = prompt_tokens, shared_prompts

    def configure_model(self):
        super().configure_model()
        if self.mode == "full":  # the plain route: whole logits, then log-softmax (what the chunked head replaces)
            lm = self.policy.lm

            def full(input_ids, attention_mask, loss_mask, temperature, entropy_grad=False, **_):
                logits = lm(input_ids=input_ids, attention_mask=attention_mask.long()).logits  # (N, T, V)
                lp, ent = logprobs_and_entropy(logits, input_ids, temperature, entropy_grad)
                mask = loss_mask[:, 1:]
                return torch.where(mask, lp, 0.0), torch.where(mask, ent, 0.0), None, lp.new_zeros(()), {}

            self.policy.forward = full

    def train_dataloader(self):
        batch = synthetic_batch(self.rows, self.tokens, self.policy.lm.config.vocab_size,
                                prompt_tokens=self.prompt_tokens, shared_prompts=self.shared_prompts)

        def forever():
            while True:
                yield batch

        return DataLoader(_Iter(forever), batch_size=None, collate_fn=lambda x: x)

    def on_train_start(self):
        pass

    def configure_callbacks(self):
        return []

    def training_step(self, dataloader_iter):
        t0 = time.perf_counter()
        out = super().training_step(dataloader_iter)
        self.times.append(time.perf_counter() - t0)
        return out


class _Iter(torch.utils.data.IterableDataset):
    def __init__(self, fn):
        self.fn = fn

    def __iter__(self):
        return self.fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="tiny", choices=sorted(POLICIES))
    ap.add_argument("--mode", default="chunked", choices=["full", "chunked"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens per row (default: a quarter)")
    ap.add_argument("--shared-prompts", action="store_true", help="a group's 8 rows share their prompt")
    ap.add_argument("--no-share-prefix", action="store_true", help="run every row's prompt (model.share_prefix off)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed (autocast)")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / devices)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.devices)
    batching = Batching(share_prefix=not a.no_share_prefix, micro_batch_tokens=a.micro_batch_tokens,
                        activation_checkpointing=a.activation_checkpointing)
    module = StepBench(a.rows, a.tokens, a.mode, a.prompt_tokens, a.shared_prompts, policy=POLICIES[a.policy],
                       batching=batching, torch_threads=threads, optim=Optim(lr=1e-6), dtype=a.dtype)
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=a.strategy, max_steps=a.steps, logger=False,
                        precision=a.precision,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    ranks = [rss] if trainer.world_size == 1 else None
    if trainer.world_size > 1:
        ranks = [None] * trainer.world_size
        torch.distributed.all_gather_object(ranks, rss)
    if trainer.global_rank == 0:
        print(json.dumps({"policy": a.policy, "mode": a.mode, "strategy": a.strategy, "devices": a.devices,
                          "rows": a.rows, "tokens": a.tokens, "micro_batch_tokens": a.micro_batch_tokens,
                          "prompt_tokens": a.prompt_tokens, "shared_prompts": a.shared_prompts,
                          "share_prefix": not a.no_share_prefix,
                          "activation_checkpointing": a.activation_checkpointing, "threads_per_rank": threads,
                          "dtype": a.dtype, "precision": a.precision,
                          "s_per_step": statistics.median(module.times[1:] or module.times),
                          "peak_rss_gib_per_rank": ranks}))


if __name__ == "__main__":
    main()
