"""The asynchronous loop end to end: consistency invariant, staleness bound, on-policy exactness, metrics, resume,
failures. Fast variants use the torch engine; the ``slow`` ones repeat the key checks on the shared vLLM engine."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.engines import TorchEngine
from molt_lightning.module import AsyncRLModule
from molt_lightning.config import Rollout
from molt_lightning.tasks.arithmetic import calculator_agent, tasks

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import Batches, check_trained_tokens, record_generations  # noqa: E402
from modules import make_module  # noqa: E402

NAMED_METRICS = [  # what issue #2 asks every step to log
    "reward", "reward/std", "lag", "lag/max", "is/ratio_mean", "is/ratio_min", "is/ratio_max", "mismatch/kl",
    "loss/clip_frac", "samples/failed", "samples/dropped_stale_groups", "samples/failed_total",
    "perf/gen_tokens_per_s", "perf/trainer_idle_s", "perf/engine_idle_frac", "perf/weight_sync_s", "reward/all_samples",
]


def fit(module, tmp_path, steps, callbacks=(), ckpt_path=None, name="run"):
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=CSVLogger(tmp_path, name=name), log_every_n_steps=1,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")


def make(engine, **kw):
    return make_module(**{**dict(engine=engine, group_size=4, prompts_per_step=4, max_lag=1, lr=3e-4, task_seed=0),
                          **kw})


@pytest.fixture(params=["torch", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request):
    if request.param == "torch":
        yield TorchEngine(seed=0)
        return
    from safetensors.torch import load_file

    engine, policy = request.getfixturevalue("vllm_engine"), request.getfixturevalue("policy_path")
    yield engine
    engine.call(engine.update_weights(load_file(f"{policy}/model.safetensors"), 0))  # the session's engine: the policy


@pytest.mark.slow
def test_trained_tokens_are_exactly_the_engines(engine, tmp_path, monkeypatch, tokenizer):
    records = record_generations(engine, monkeypatch)
    batches = Batches()
    fit(make(engine, max_lag=1), tmp_path, steps=4, callbacks=[batches])
    tool_turns = check_trained_tokens(records, batches, tokenizer)
    assert tool_turns > 0, "the run had no multi-turn (tool) trajectory to check"


@pytest.mark.slow
def test_max_lag_zero_is_exactly_on_policy(engine, tmp_path):
    batches = Batches()
    _, df = fit(make(engine, max_lag=0), tmp_path, steps=4, callbacks=[batches])
    assert (df["lag/max"] == 0).all()
    assert ((df["is/ratio_min"] - 1).abs() < 1e-3).all() and ((df["is/ratio_max"] - 1).abs() < 1e-3).all()
    for version, b in batches.seen:
        assert set(b.versions[b.loss_mask].tolist()) == {version}


@pytest.mark.slow
def test_several_updates_per_batch_keep_the_lag_bound_and_exact_sync(tmp_path):
    """PPO epochs x mini-batches: 4 optimizer steps per batch, one weight push per batch; the version counts pushes,
    admission and the lag bound work in versions, and the PPO clip is active (the ratio leaves 1 after the first)."""
    pushed = []

    class Pushes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.weights.settle()  # the last push's load may still run (it overlaps the next step)
            pushed.append((pl_module.policy_version, pl_module.engine.version, trainer.global_step))

    batches = Batches()
    module = make(TorchEngine(seed=0), max_lag=1, updates_per_batch=2, mini_batches=2, micro_batch_tokens=200, lr=1e-2)
    _, df = fit(module, tmp_path, steps=12, callbacks=[batches, Pushes()])
    assert [(v, g) for v, _, g in pushed] == [(0, 0), (1, 4), (2, 8)]  # versions count batches, steps optimizer steps
    assert all(v == e for v, e, _ in pushed), pushed  # each push carried the trainer's version
    for version, b in batches.seen:
        assert 0 <= version - b.versions[b.loss_mask].min() <= 1
    assert df["loss/clip_frac"].dropna().max() > 0


@pytest.mark.slow
def test_end_to_end_changes_parameters_and_logs_every_metric(engine, tmp_path, policy_path):
    from transformers import AutoModelForCausalLM

    module = make(engine)
    _, df = fit(module, tmp_path, steps=3)
    before = AutoModelForCausalLM.from_pretrained(policy_path).state_dict()
    after = module.policy.lm.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    missing = [m for m in NAMED_METRICS if m not in df or df[m].isna().all()]
    assert not missing, f"metrics not logged: {missing}"
    # a step in which no request completed counts none; over the run, every trained token was counted when its
    # request completed (the engine counts the tokens of every completed request, trained or not)
    steps = df.dropna(subset=["perf/gen_tokens_per_s"])
    assert (steps["perf/gen_tokens_per_s"] >= 0).all()
    counted = (steps["perf/gen_tokens_per_s"] * steps["perf/step_time_s"]).sum()  # rate x time: float round-off
    assert counted >= df["batch/policy_tokens"].dropna().sum() * (1 - 1e-6) > 0  # (seen: 406.99999 for 407 tokens)
    assert len(df["step"].dropna().unique()) == 3
    assert (tmp_path / "run" / "version_0" / "reward.png").exists()


@pytest.mark.slow
def test_resume_continues_at_saved_step_and_version(engine, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    first = make(engine, max_lag=1)
    fit(first, tmp_path, steps=3, callbacks=[ckpt])
    if not isinstance(engine, TorchEngine):  # the shared vLLM engine: leave it serving other weights and version 0
        engine.call(engine.update_weights({k: v * 0.5 for k, v in first.policy.lm.state_dict().items()
                                           if k != "lm_head.weight"}, 0))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3 and saved["molt"]["policy_version"] == 3
    assert saved["molt"]["rollout"]["consumed"] == 3 and saved["molt"]["rollout"]["next_prompt"] > 0

    class AtStart(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if hasattr(self, "step"):
                return
            self.step, self.engine_version = trainer.global_step, pl_module.engine.version
            self.weights_equal = all(torch.equal(v, first.policy.lm.state_dict()[k])
                                     for k, v in pl_module.policy.lm.state_dict().items())
            self.next_prompt = pl_module.source.state_dict()["next_prompt"]

    at_start, batches = AtStart(), Batches()
    second = make(TorchEngine(seed=0) if isinstance(engine, TorchEngine) else engine, max_lag=1)
    trainer, df = fit(second, tmp_path, steps=5, callbacks=[at_start, batches],
                      ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), name="resumed")
    assert at_start.step == 3 and at_start.engine_version == 3 and at_start.weights_equal
    assert at_start.next_prompt == saved["molt"]["rollout"]["next_prompt"]
    assert trainer.global_step == 5 and [v for v, _ in batches.seen] == [3, 4]
    for _, b in batches.seen:  # the resumed engine only ever served versions >= 3
        assert b.versions[b.loss_mask].min() >= 3
    # no prompt trained twice across the two runs
    resumed_ids = {t.sample_id for _, b in batches.seen for t in b.trajectories}
    done_before = set(range(saved["molt"]["rollout"]["next_prompt"])) | set(saved["molt"]["rollout"]["done_beyond"])
    assert resumed_ids and not resumed_ids & done_before
    # resuming a run that trained its max_steps already trains nothing and starts no engine (vLLM: 40 s saved)
    idle = TorchEngine(seed=0)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(make(idle), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 3 and idle.loop is None and not trainer.lightning_module._started


async def flaky_agent(client, sample):
    """Member 0 of each group raises, member 1 returns NaN, member 2 overruns its time; whole groups fail
    for answers divisible by 5."""
    index = client.trajectory.member
    if sample["answer"] % 5 == 0:
        raise ValueError("the whole group fails")
    if index == 2:
        await asyncio.sleep(30)
    reward = await calculator_agent(client, sample)
    if index == 0:
        raise RuntimeError("tool crashed")
    return math.nan if index == 1 else reward


@pytest.mark.slow
def test_failed_agents_and_nan_rewards_are_counted_and_never_trained(tmp_path, caplog):
    batches = Batches()
    module = make(TorchEngine(seed=0), agent=flaky_agent, agent_timeout_s=2.0, max_failure_rate=1.0)  # 75% fail
    with caplog.at_level(logging.WARNING, logger="molt_lightning.rollout"):
        _, df = fit(module, tmp_path, steps=3, callbacks=[batches])
    counts = module.source.counts
    # three failing members in each of the 3 x 4 trained groups, all counted by the time the last step logged
    assert 3 * 3 * 4 <= df["samples/failed_total"].max() <= counts.failed
    whole = counts.dropped_empty_groups * 4  # failures of that kind, each counted
    logged = sum("whole group fails" in r.message for r in caplog.records)
    assert whole >= 4 and logged == min(whole, 5) + sum(10 ** k > 5 for k in range(1, 6) if 10 ** k <= whole)
    messages = "\n".join(r.message for r in caplog.records)
    assert "failed and will not be trained on (1 so far of this kind): agent raised RuntimeError: tool crashed" \
        in messages
    assert "non-finite reward nan" in messages and "timed out after 2.0s" in messages
    for _, b in batches.seen:
        assert all(t.member == 3 for t in b.trajectories)  # only the healthy member ever trains
        assert all(math.isfinite(t.reward) for t in b.trajectories)


@pytest.mark.slow
def test_hook_order_weight_sync_before_rollouts_start(tmp_path):
    from molt_lightning.callbacks import WeightSync

    events = []

    class Sync(WeightSync):
        def on_train_start(self, trainer, pl_module):
            events.append(("sync", pl_module.engine.version, pl_module.source._producer is None))
            super().on_train_start(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            pl_module.weights.settle()  # the push returns while the engine loads; wait to read its version
            events.append(("pushed", pl_module.engine.version))

    class Module(AsyncRLModule):
        def on_train_start(self):
            events.append(("begin", self.engine.version))
            super().on_train_start()

        def training_step(self, dataloader_iter):
            events.append(("step", self.global_step, self.engine.version))
            return super().training_step(dataloader_iter)

    module = Module(calculator_agent, tasks, engine=TorchEngine(), rollout=Rollout(group_size=2, prompts_per_step=2,
                                                                                  max_lag=0))
    fit(module, tmp_path, steps=2, callbacks=[Sync()])
    assert events == [("sync", 0, True), ("begin", 0), ("step", 0, 0), ("pushed", 1), ("step", 1, 1), ("pushed", 2)]
