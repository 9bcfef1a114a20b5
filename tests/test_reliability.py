"""Reliability, through ``molt fit`` in subprocesses as a user runs it: SIGKILL at random points and resume from the
last checkpoint without losing or repeating a prompt (and, synchronous and seeded, with the metrics of a run never
killed); SIGTERM while the trainer waits for rollouts; the failure breaker; an empty task stream.

``MOLT_KILLS`` sets the number of kills (3 in CI; more on demand), ``MOLT_KILL_SEED`` where they land."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt_lightning.callbacks import audit

ROOT = Path(__file__).resolve().parents[1]
KILLS = int(os.environ.get("MOLT_KILLS", "3"))
# a stopped run's deadline: far below the hour its sleepy agents take, far above what a stop takes on 2 loaded cores
STOPS_WITHIN_S = 120
STEPS, G, P = 3 * KILLS + 3, 4, 2  # a process advances at most 3 checkpointed steps before its kill (kill_points)

RECIPE = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  log_every_n_steps: 1
  enable_progress_bar: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {dir}, name: logs}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {dir}/ckpt, every_n_train_steps: 1, save_last: true}}
    - class_path: molt_lightning.callbacks.SampleAudit
      init_args: {{path: {dir}/audit.jsonl}}
    - class_path: kill_points.Marks
model:
  engine: {{class_path: molt_lightning.engines.TorchEngine, init_args: {{seed: 0}}}}
  agent: molt_lightning.tasks.arithmetic.calculator_agent
  tasks: molt_lightning.tasks.arithmetic.tasks
  rollout: {{group_size: {G}, prompts_per_step: {P}, max_lag: 0}}
  optim: {{lr: 3.0e-4}}
  torch_threads: 1
{extra}
"""


def recipe(folder: Path, steps: int = STEPS, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(RECIPE.format(steps=steps, dir=folder, G=G, P=P, extra=extra))
    return path


def start(config: Path, *args: str, hold: bool = False) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{ROOT / 'tests' / 'helpers'}:{ROOT}", "MOLT_MARKS": str(config.parent / "marks"),
           "MOLT_HOLD": "1" if hold else "0"}
    # molt_with_ctrl_c: molt, with Ctrl-C handled even when this suite runs in a background job (which ignores SIGINT)
    return subprocess.Popen([sys.executable, "-m", "molt_with_ctrl_c", "fit", "--config", str(config), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_mark(proc: subprocess.Popen, folder: Path, name: str, timeout: float = 240) -> None:
    """Return once ``proc`` wrote the marker ``name`` (``kill_points.Marks``); fail if it exits or takes too long."""
    mark, deadline = folder / "marks" / name, time.time() + timeout
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    assert mark.exists(), f"{name} was not marked within {timeout} s"


def waiting_for_rollouts(proc: subprocess.Popen, folder: Path, timeout: float = 240) -> None:
    """Return once ``proc`` trained 2 steps, wrote their checkpoints and its third step asks for a batch (the agents
    of that batch sleep: see slow_agents), so a signal reaches the trainer while it waits for rollouts."""
    wait_for_mark(proc, folder, "batch-2", timeout)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    finish(start(recipe(folder)))
    return audit.replay(audit.read(str(folder / "audit.jsonl")))


def test_sigkill_and_resume_loses_and_repeats_nothing(tmp_path, uninterrupted):
    rng = random.Random(int(os.environ.get("MOLT_KILL_SEED", "0")))
    config, log = recipe(tmp_path), tmp_path / "audit.jsonl"
    for _ in range(KILLS):
        proc = start(config, "--ckpt_path", "last", hold=True)
        wait_for_mark(proc, tmp_path, f"held-{proc.pid}")  # two new steps trained, the first checkpointed
        (tmp_path / "marks" / f"release-{proc.pid}").touch()
        time.sleep(rng.uniform(0.0, 0.15))  # the kill lands somewhere in the next steps (at the latest at the fence)
        assert proc.poll() is None, proc.communicate()[0][-3000:]  # held at the fence at the latest: never done
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finish(start(config, "--ckpt_path", "last"))
    records = audit.read(str(log))
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == KILLS + 1 and starts[0]["step"] == 0  # every process that started is on record
    assert all(r["step"] > 0 for r in starts[1:])  # every resume continued from a checkpoint
    kept = audit.replay(records)
    assert [r["step"] for r in kept] == list(range(1, STEPS + 1))  # every step once, in order, after replay
    samples = [s for r in kept for s in r["samples"]]
    assert sorted(samples) == list(range(STEPS * P))  # every prompt trained exactly once: none lost, none twice
    redone = sum(r["event"] == "train" for r in records) - len(kept)
    # what was trained twice is exactly what the kills cut after the last checkpoint (every step checkpoints)
    assert redone <= len(starts) - 1
    # synchronous, seeded per request: the resumed run is the run that was never killed
    assert [r["samples"] for r in kept] == [r["samples"] for r in uninterrupted]
    for got, want in zip(kept, uninterrupted):
        for key in ("reward", "loss/total", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


def test_sigterm_while_waiting_for_rollouts_stops_cleanly_and_resumes(tmp_path):
    # every agent sleeps after the first 2 steps' prompts: the trainer is left waiting for rollouts
    config = recipe(tmp_path, steps=4, extra="  agent: slow_agents.sleepy_after_4_prompts")
    proc = start(config)
    waiting_for_rollouts(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=STOPS_WITHIN_S)  # its agents sleep for an hour: it did not wait for them
    assert proc.returncode == 143 and "molt: stopped while waiting for rollouts" in out, out[-2000:]
    assert "--ckpt_path last" in out and "Traceback" not in out
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    # resumed with patient agents, it finishes the 4 steps
    config = recipe(tmp_path, steps=4)
    finish(start(config, "--ckpt_path", "last"))
    kept = audit.replay(audit.read(str(tmp_path / "audit.jsonl")))
    assert [r["step"] for r in kept] == [1, 2, 3, 4]


def test_ctrl_c_while_waiting_for_rollouts_stops_the_run(tmp_path):
    config = recipe(tmp_path, steps=4, extra="  agent: slow_agents.sleepy_after_4_prompts")
    proc = start(config)
    waiting_for_rollouts(proc, tmp_path)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=STOPS_WITHIN_S)  # its agents sleep for an hour: it did not wait for them
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    assert proc.returncode not in (0, None, -9), (proc.returncode, out[-3000:])
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in out, out[-2000:]


@pytest.mark.slow
def test_sigterm_with_the_vllm_engine_leaves_no_process_behind(tmp_path):
    psutil = pytest.importorskip("psutil")
    extra = ("  agent: slow_agents.sleepy_after_4_prompts\n"
             "  engine: {class_path: molt_lightning.engines.VLLMEngine, init_args: {dtype: float32, seed: 0}}")
    proc = start(recipe(tmp_path, steps=4, extra=extra))
    waiting_for_rollouts(proc, tmp_path, timeout=400)
    family = psutil.Process(proc.pid).children(recursive=True)
    assert family  # vLLM's engine core runs in a child process
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=STOPS_WITHIN_S)
    assert proc.returncode == 143 and "stopped while waiting for rollouts" in out, out[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def test_failure_breaker_stops_a_run_whose_agents_all_fail(tmp_path):
    config = recipe(tmp_path, steps=3)
    proc = start(config, "--model.rollout.max_context", "8")  # every calculator agent overflows its context
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "Traceback" not in out
    assert "molt: 64 of the last 64 agent runs failed (more than 50%)" in out, out[-3000:]
    assert "ContextOverflow: segment of N tokens + max_tokens N exceeds max_context N" in out
    assert out.count("failed and will not be trained on") <= 10  # rate-limited, not a wall of lines


def test_empty_task_stream_is_a_clear_error(tmp_path):
    config = recipe(tmp_path, steps=2, extra="  tasks: slow_agents.no_tasks")
    proc = start(config)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0 and "yielded no samples" in out, out[-3000:]
