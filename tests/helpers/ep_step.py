"""Two SGD steps (lr 1, no clipping) of the real training step of the tiny MoE on a fixed batch, under a given
strategy, then a weight push into a ``TorchEngine`` in small buckets; rank 0 saves what the test compares.

    python tests/helpers/ep_step.py STRATEGY DEVICES OUT.pt ROUTING   # ROUTING: free | replay

``replay`` trains through a fixed random routing record (every expert gets tokens, most of them another rank's under
expert parallelism). OUT.pt holds: ``start`` and ``final`` (the gathered full state before and after the two steps),
``engine`` (the torch engine's weights after the push), ``buckets``, and per rank ``losses``, ``grad_norms`` and
``local`` (the shape each rank holds of every expert tensor).
"""

import asyncio
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train_step import StepBench  # noqa: E402

from molt_lightning.trainer import parallel  # noqa: E402
from molt_lightning.algorithms import Algorithm  # noqa: E402
from molt_lightning.config import Batching, MoE, Optim  # noqa: E402
from molt_lightning.trainer.weights import buckets as sync_buckets  # noqa: E402
from molt_lightning.engines import TorchEngine  # noqa: E402
from molt_lightning.policies.moe import ROUTING_DTYPE  # noqa: E402

MOE = "molt_lightning.models.tiny.moe_policy"


def full_state(lm, bucket_bytes: int = 2**30) -> dict[str, torch.Tensor]:
    return {k: v.clone() for b in sync_buckets(lm, bucket_bytes) for k, v in b.items()}


NORMS: list[float] = []  # the gradient norm of every optimizer step (the loop's clip_grad_norm_ returns it)
_clip = torch.nn.utils.clip_grad_norm_


def _recording_clip(*args, **kwargs):
    norm = _clip(*args, **kwargs)
    NORMS.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))  # DTensor under FSDP2
    return norm


torch.nn.utils.clip_grad_norm_ = _recording_clip


class EPStep(StepBench):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.out, self.losses = {}, []

    def configure_optimizers(self):
        return torch.optim.SGD(self.trainable_parameters(), lr=1.0)  # scale-sensitive, unlike Adam

    def train_dataloader(self):
        loader = super().train_dataloader()
        if self.moe.routing == "replay":  # a fixed random record: k distinct experts per position and layer
            batch = next(iter(loader))
            cfg = self.policy.lm.config
            g = torch.Generator().manual_seed(1)
            n, t = batch.input_ids.shape
            scores = torch.rand(n, t, cfg.num_hidden_layers, cfg.num_experts, generator=g)
            batch.routing = scores.argsort(-1)[..., :cfg.num_experts_per_tok].to(ROUTING_DTYPE)  # (N, T, layers, k)
        return loader

    def on_train_start(self):
        self.out["start"] = full_state(self.policy.lm)
        from torch.distributed.tensor import DTensor

        local = {n: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
                 for n, p in self.policy.lm.named_parameters() if "experts" in n}
        self.out["local"] = parallel.all_gather(local, self.trainer)

    def micro_loss(self, *args, **kw):
        loss, metrics, tokens = super().micro_loss(*args, **kw)
        self.losses.append(float(loss.detach()))
        return loss, metrics, tokens

    def on_train_end(self):
        self.out["final"] = full_state(self.policy.lm)
        self.out["losses"] = parallel.all_gather(self.losses, self.trainer)
        self.out["grad_norms"] = parallel.all_gather(NORMS, self.trainer)
        # the push: every rank gathers each small bucket (experts and FSDP2 shards interleaved), rank 0 stages it
        engine, loop = None, asyncio.new_event_loop()
        if self.global_rank == 0:
            engine = TorchEngine()
            loop.run_until_complete(engine.open(self.policy_path))
        buckets = 0
        for bucket in sync_buckets(self.policy.lm, 64 * 2**10):
            buckets += 1
            if engine is not None:
                loop.run_until_complete(engine.stage_weights(bucket))
        if engine is not None:
            loop.run_until_complete(engine.commit_weights(1))
            self.out["engine"] = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
            self.out["buckets"] = buckets
            loop.run_until_complete(engine.close())
            torch.save(self.out, sys.argv[3])


if __name__ == "__main__":
    module = EPStep(16, 48, "chunked", policy=MOE, torch_threads=1, batching=Batching(micro_batch_tokens=200),
                    optim=Optim(grad_clip=0), algo=Algorithm(aggregation="seq_mean_token_mean"),
                    moe=MoE(routing=sys.argv[4], aux_coef=0.01))
    trainer = L.Trainer(accelerator="cpu", devices=int(sys.argv[2]), strategy=sys.argv[1], max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
