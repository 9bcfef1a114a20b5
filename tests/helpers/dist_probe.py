"""A callback for the 2-process tests (imported by the CLI's ranks through PYTHONPATH): per rank and step it writes
which samples the rank trained on, how much of each parameter it holds, and, on rank 0, whether the engine's weights
equal the gathered policy weights (a LoRA policy: its adapter) of the version it serves; at the end, rank 0 saves the
trainer's logprobs on the export tests' batch (``logprob_probe``) and the fingerprint samples of the last weights it
synced (``final_weights.pt``: what every engine must serve at the end)."""

from __future__ import annotations

import json
import os

import lightning as L

from molt_lightning.trainer.weights import buckets


class Probe(L.Callback):
    def __init__(self, out: str):
        self.out = out

    def _write(self, trainer, record: dict) -> None:
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        shares = {n: (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) / p.numel()
                  for n, p in pl_module.policy.lm.named_parameters()}
        self._write(trainer, {"event": "shares", "shares": shares, "world": trainer.world_size})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the engine serves the version pushed at the end of the previous step: compare it with the gathered weights
        full = {k: v for b in buckets(pl_module.policy.lm, 2**20) for k, v in b.items()}  # what a sync sends
        if trainer.global_rank == 0 and hasattr(pl_module.engine, "model"):  # the torch engine's weights are readable
            pl_module.weights.settle()  # the push returned while the engine was loading: wait for it
            engine = dict(pl_module.engine.model.named_parameters())
            if pl_module.engine.adapter is not None:  # a LoRA policy: the engine's adapter, by peft's names
                from peft import get_peft_model_state_dict

                engine = get_peft_model_state_dict(pl_module.engine.model)
            diff = max(float((engine[k].detach() - v).abs().max()) for k, v in full.items())
            self._write(trainer, {"event": "sync", "version": pl_module.policy_version,
                                  "engine_version": pl_module.engine.version, "max_abs_diff": diff,
                                  "checksum": float(sum(v.double().sum() for v in full.values()))})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        b = outputs["record"].batch
        mine = sorted({b.trajectories[int(b.traj_ids[r])].sample_id for r in outputs["record"].rows})
        version_range = b.versions[b.loss_mask]
        self._write(trainer, {"event": "step", "version": pl_module.policy_version - 1, "samples": mine,
                              "all_samples": sorted({t.sample_id for t in b.trajectories}),
                              "token_versions": [int(version_range.min()), int(version_range.max())],
                              "global_step": trainer.global_step})

    def on_train_end(self, trainer, pl_module) -> None:
        import torch
        from logprob_probe import trainer_logprobs

        from molt_lightning.engines.fingerprint import samples

        full = {k: v for b in buckets(pl_module.policy.lm, 2**20) for k, v in b.items()}  # every rank: FSDP2 gathers
        if trainer.global_rank == 0:
            torch.save(samples(full), os.path.join(self.out, "final_weights.pt"))

        lps = trainer_logprobs(pl_module.policy, pl_module.tokenizer)  # every rank: FSDP2 gathers in the forward
        if trainer.global_rank == 0:
            torch.save(lps, os.path.join(self.out, "logprobs.pt"))
