"""Two SGD steps (lr 1, no clipping) of the real training step on a fixed batch, under a given strategy; rank 0 saves
the gathered weights. The distributed test compares DDP and FSDP2 with one process: the gradients must be equal.

    python tests/helpers/sgd_step.py STRATEGY DEVICES OUT.pt
"""

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_step import POLICIES, StepBench  # noqa: E402

from molt_lightning.algorithms import Algorithm  # noqa: E402
from molt_lightning.config import Batching, Optim  # noqa: E402
from molt_lightning.trainer.weights import buckets  # noqa: E402


class SGDStep(StepBench):
    def configure_optimizers(self):
        return torch.optim.SGD(self.trainable_parameters(), lr=1.0)  # scale-sensitive, unlike Adam

    def on_train_end(self):
        full = {k: v for b in buckets(self.policy.lm, 2**30) for k, v in b.items()}
        if self.global_rank == 0:
            torch.save(full, sys.argv[3])


if __name__ == "__main__":
    module = SGDStep(16, 48, "chunked", policy=POLICIES["tiny"], torch_threads=1,
                     batching=Batching(micro_batch_tokens=200), optim=Optim(grad_clip=0),
                     algo=Algorithm(aggregation="seq_mean_token_mean"))
    trainer = L.Trainer(accelerator="cpu", devices=int(sys.argv[2]), strategy=sys.argv[1], max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
