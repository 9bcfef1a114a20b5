"""The kill-and-resume harness: ``molt fit`` in subprocesses as a user runs it, SIGKILLed at random points and resumed
from the last checkpoint, then the audit (``SampleAudit``) accounted for. Used by tests/test_reliability.py (3 kills
per engine in CI) and benchmarks/kill_resume.py (20 kills, torch engine and vLLM).

A process is released to its kill only on events it marks (``kill_points.Marks``): it has trained two steps and
checkpointed the first when it is held; released, it is killed within 0.15 s (a random instant in its next steps) and
at the latest at its fence after four steps, so every kill leaves steps to resume. Every child process of a killed
run (vLLM's engine core) must be gone before the next start.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from molt_lightning.callbacks import audit

ROOT = Path(__file__).resolve().parents[2]
G, P = 4, 2  # group size, prompts per step
TORCH = "{class_path: molt_lightning.engines.TorchEngine, init_args: {seed: 0}}"
VLLM = "{class_path: molt_lightning.engines.VLLMEngine, init_args: {dtype: float32, seed: 0, cpu_threads: '1'}}"

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
  engine: {engine}
  agent: molt_lightning.tasks.arithmetic.calculator_agent
  tasks: molt_lightning.tasks.arithmetic.tasks
  rollout: {{group_size: {G}, prompts_per_step: {P}, max_lag: 0}}
  optim: {{lr: 3.0e-4}}
  torch_threads: 1
{extra}
"""


def steps_for(kills: int) -> int:
    return 3 * kills + 3  # a process advances at most 3 checkpointed steps before its kill (the fence)


def recipe(folder: Path, steps: int, extra: str = "", engine: str = TORCH) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(RECIPE.format(steps=steps, dir=folder, G=G, P=P, extra=extra, engine=engine))
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


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def kill_and_resume(folder: Path, kills: int, seed: int = 0, engine: str = TORCH, timeout: float = 240) -> dict:
    """``kills`` processes SIGKILLed at random instants, then one that finishes the run, then one more that resumes
    the finished run (nothing left to train). Returns the counts ``account`` makes of the audit, plus the orphans:
    child processes of a killed run still alive 60 s after its kill."""
    import psutil

    rng, steps = random.Random(seed), steps_for(kills)
    config, orphans = recipe(folder, steps, engine=engine), 0
    for _ in range(kills):
        proc = start(config, "--ckpt_path", "last", hold=True)
        wait_for_mark(proc, folder, f"held-{proc.pid}", timeout)  # two new steps trained, the first checkpointed
        family = psutil.Process(proc.pid).children(recursive=True)
        (folder / "marks" / f"release-{proc.pid}").touch()
        time.sleep(rng.uniform(0.0, 0.15))  # the kill lands at a random instant of the next steps (or at the fence)
        assert proc.poll() is None, proc.communicate()[0][-3000:]  # held at the fence at the latest: never done
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        orphans += len(psutil.wait_procs(family, timeout=60)[1])
    finish(start(config, "--ckpt_path", "last"), timeout + 60)
    finish(start(config, "--ckpt_path", "last"), timeout + 60)  # the run is complete: this one trains nothing
    return {**account(audit.read(str(folder / "audit.jsonl")), steps), "kills": kills, "orphans": orphans}


def account(records: list[dict], steps: int) -> dict:
    """What the audit says happened: processes launched and started, steps trained twice, prompts lost or repeated
    after replay, torn lines; ``kept`` is the replayed train records."""
    kept = audit.replay(records)
    samples = [s for r in kept for s in r["samples"]]
    return {"launches": sum(r["event"] == "launch" for r in records),
            "starts": [r["step"] for r in records if r["event"] == "start"],
            "complete_starts": sum(bool(r.get("complete")) for r in records if r["event"] == "start"),
            "ends": [r["step"] for r in records if r["event"] == "end"],
            "steps_in_order": [r["step"] for r in kept] == list(range(1, steps + 1)),
            "retrained": sum(r["event"] == "train" for r in records) - len(kept),
            "lost": len(set(range(steps * P)) - set(samples)), "repeated": len(samples) - len(set(samples)),
            "torn": sum(r["event"] == "torn" for r in records), "kept": kept}
