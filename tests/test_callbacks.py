"""Callbacks around the loop: decoded rollout samples, the reward plot, weight-sync cadence."""

import json

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.callbacks import RolloutSamples, StepProgressBar, WeightSync
from molt_lightning.engines import TorchEngine
from modules import make_module


def test_rollout_samples_and_sync_every_k(tmp_path):
    pushes = []

    class CountingSync(WeightSync):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.weights.settle()  # a push returns before the engine has loaded the weights
            before = pl_module.engine.version
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            pl_module.weights.settle()
            pushes.append((trainer.global_step, before, pl_module.engine.version))

    module = make_module(engine=TorchEngine(), group_size=2, prompts_per_step=2, max_lag=2)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        callbacks=[RolloutSamples(every_n_steps=2, per_step=1), CountingSync(every_n_steps=2)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    # versions reach the engine only every second step
    assert pushes == [(1, 0, 0), (2, 0, 2), (3, 2, 2), (4, 2, 4)]
    lines = [json.loads(x) for x in open(f"{trainer.logger.log_dir}/rollouts.jsonl")]
    assert [x["step"] for x in lines] == [0, 2]
    kinds = [s["kind"] for s in lines[0]["spans"]]
    assert kinds[0] == "prompt" and "policy" in kinds
    assert "What is" in lines[0]["spans"][0]["text"]
    assert all(s["versions"] for s in lines[0]["spans"] if s["kind"] == "policy")


def test_sync_cadence_that_would_stall_is_refused(tmp_path):
    module = make_module(engine=TorchEngine(), group_size=2, prompts_per_step=2, max_lag=0)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[WeightSync(every_n_steps=2)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="every_n_steps <= max_lag \\+ 1"):
        trainer.fit(module)


def test_a_sync_that_never_pushes_fails_loudly_instead_of_hanging(tmp_path):
    class SilentSync(WeightSync):  # a user's replacement that forgot to push after the optimizer step
        def on_train_batch_end(self, *args):
            pass

    module = make_module(engine=TorchEngine(), group_size=2, prompts_per_step=2, max_lag=1)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, callbacks=[SilentSync()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="engine serves policy version 0 but the trainer is at 2"):
        trainer.fit(module)
    assert trainer.global_step == 2  # versions 0 and 1 may still train on version-0 samples (max_lag=1)


def test_progress_bar_shows_step_reward_and_lag(tmp_path):
    bar = StepProgressBar()
    module = make_module(engine=TorchEngine(), group_size=2, prompts_per_step=2, max_lag=1)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), callbacks=[bar],
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module)
    assert trainer.progress_bar_callback is bar and bar._get_train_description(trainer.current_epoch) == "Step"
    shown = bar.get_metrics(trainer, module)
    assert {"reward", "lag"} <= set(shown) and "v_num" not in shown
    # one line at 80 columns, at step 1000 of 1000 after an hour, with the widest reward and lag
    import io

    from rich.console import Console
    from rich.progress import Progress, TextColumn

    console = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    metrics = " ".join(f"{k}: {v:{bar.theme.metrics_format}}" for k, v in {"reward": -0.123456, "lag": 2.0}.items())
    progress = Progress(*bar.configure_columns(trainer), TextColumn(metrics), console=console)
    task = progress.add_task("Step", total=1000, completed=1000)
    progress.tasks[0].start_time, progress.tasks[0].finished_time = 0.0, 3599.0
    console.print(progress.make_tasks_table([progress.tasks[task]]))
    [line] = console.file.getvalue().rstrip("\n").splitlines()
    assert line.endswith("reward: -0.123 lag: 2") and len(line) <= 80, line


@pytest.mark.slow
def test_step_time_split_puts_slow_callbacks_in_overhead(tmp_path):
    """perf/step_time_s = trainer idle + gradient step + weight sync + overhead, and a slow callback lands in the
    overhead, not in the gradient step."""
    import time

    import pandas as pd

    class Slow(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 2:
                time.sleep(0.3)

    module = make_module(engine=TorchEngine(), group_size=2, prompts_per_step=2, max_lag=1)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        callbacks=[Slow()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    df = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv").groupby("step").first()
    parts = df[["perf/trainer_idle_s", "perf/train_compute_s", "perf/weight_sync_s", "perf/overhead_s"]].sum(axis=1)
    assert (parts - df["perf/step_time_s"]).abs().max() < 1e-6 and (df["perf/train_compute_s"] > 0).all()
    # the sleep of step s (1-based global_step after it) ends step s's wall time: odd global steps, i.e. rows 0, 2, 4
    slow, fast = df["perf/overhead_s"].iloc[[2, 4]], df["perf/overhead_s"].iloc[[1, 3, 5]]
    assert (slow >= 0.3).all() and (fast < 0.3).all() and (df["perf/train_compute_s"] < 0.3).all()


def test_run_summary_names_duplicate_completions_when_they_are_many():
    from types import SimpleNamespace

    from molt_lightning.callbacks.runlog import DUPLICATES_NOTED, RunSummary

    summary, trainer = RunSummary(first=2, last=2), SimpleNamespace(callback_metrics={}, logger=None)
    summary.step_times, summary.rewards = [1.0] * 4, [0.5] * 4
    summary.duplicates = [0.5, 0.6, 0.1, 0.2]  # steps 0-1: 55%, the last two: 15%
    text = summary.text(trainer)
    assert "duplicates: 55% of a group's completions repeated another one in steps 0-1 (15% in steps 2-3)" in text
    assert "warm start" in text and "seeds" in text  # both causes: a policy sure of itself, engines of one stream
    summary.duplicates = [DUPLICATES_NOTED - 0.01] * 2 + [0.9, 0.9]  # a policy that converged repeats itself
    assert "duplicates" not in summary.text(trainer)


def test_run_summary_windows_never_overlap_on_a_short_run():
    """A 10-step run said "steps 0-4 -> steps 0-9" (the last 10 held the first 5): each window is now at most half
    the run, and a one-step run gets one number."""
    from types import SimpleNamespace

    from molt_lightning.callbacks.runlog import RunSummary

    summary, trainer = RunSummary(), SimpleNamespace(callback_metrics={}, logger=None)
    for rewards, said in (([0.0] * 5 + [1.0] * 5, "mean reward 0.00 (steps 0-4) -> 1.00 (steps 5-9)"),
                          ([0.0, 0.5, 1.0], "mean reward 0.00 (steps 0-0) -> 0.75 (steps 1-2)"),
                          ([0.0] * 5 + [1.0] * 15, "mean reward 0.00 (steps 0-4) -> 1.00 (steps 10-19)"),
                          ([0.25], "reward 0.25 (step 0)")):
        summary.step_times, summary.rewards = [1.0] * len(rewards), rewards
        assert said in summary.text(trainer), summary.text(trainer)
    summary.duplicates = [0.9]  # too short to compare: not named
    assert "duplicates" not in summary.text(trainer)


def test_run_summary_names_only_the_files_that_are_in_the_run_folder(tmp_path):
    """It listed reward.png (and config.yaml) whether or not they were written, e.g. with log_every_n_steps left at
    50 on a short run (no metrics, no plot)."""
    from types import SimpleNamespace

    from molt_lightning.callbacks.runlog import RunSummary

    summary = RunSummary()
    summary.step_times, summary.rewards = [1.0] * 2, [0.5] * 2
    trainer = SimpleNamespace(callback_metrics={}, logger=SimpleNamespace(log_dir=str(tmp_path)))
    assert f"run folder: {tmp_path}\n" in summary.text(trainer) + "\n"
    (tmp_path / "metrics.csv").write_text("step\n")
    (tmp_path / "config.yaml").write_text("")
    assert summary.text(trainer).endswith(f"run folder: {tmp_path} (metrics.csv, config.yaml)")
