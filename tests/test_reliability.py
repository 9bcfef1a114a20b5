"""Reliability, through ``molt fit`` in subprocesses as a user runs it (tests/helpers/kill_harness.py): SIGKILL at
random points and resume from the last checkpoint without losing or repeating a prompt, with the torch engine
(synchronous and seeded: with the metrics of a run never killed) and with vLLM (no child process left behind), every
process on the audit's record, a torn audit line reported; SIGTERM while the trainer waits for rollouts; the failure
breaker; an empty task stream.

``MOLT_KILLS`` / ``MOLT_KILLS_VLLM`` set the number of kills (3 and 1 in CI; benchmarks/kill_resume.py runs 20),
``MOLT_KILL_SEED`` where they land."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import kill_harness
from kill_harness import finish, kill_and_resume, start, wait_for_mark

from molt_lightning.callbacks import SampleAudit, audit

KILLS = int(os.environ.get("MOLT_KILLS", "3"))
KILLS_VLLM = int(os.environ.get("MOLT_KILLS_VLLM", "1"))  # each process starts vLLM (about 35 s on 2 cores)
# a stopped run's deadline: far below the hour its sleepy agents take, far above what a stop takes on 2 loaded cores
STOPS_WITHIN_S = 120
STEPS = kill_harness.steps_for(KILLS)


def recipe(folder: Path, steps: int = STEPS, extra: str = "", engine: str = kill_harness.TORCH) -> Path:
    return kill_harness.recipe(folder, steps, extra, engine)


def waiting_for_rollouts(proc: subprocess.Popen, folder: Path, timeout: float = 240) -> None:
    """Return once ``proc`` trained 2 steps, wrote their checkpoints and its third step asks for a batch (the agents
    of that batch sleep: see slow_agents), so a signal reaches the trainer while it waits for rollouts."""
    wait_for_mark(proc, folder, "batch-2", timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    finish(start(recipe(folder)))
    return audit.replay(audit.read(str(folder / "audit.jsonl")))


def check_kill_and_resume(got: dict, kills: int) -> None:
    """Every process is on record (each kill's, the one that finished, the one that found the run complete), every
    step trained once after replay, no prompt lost or repeated, nothing torn, no child process left behind."""
    steps = kill_harness.steps_for(kills)
    assert got["launches"] == kills + 2 and len(got["starts"]) == kills + 2, got["starts"]
    assert got["starts"][0] == 0 and all(s > 0 for s in got["starts"][1:])  # every resume continued from a checkpoint
    assert got["complete_starts"] == 1 and got["starts"][-1] == got["ends"][-1] == steps  # the last found it done
    assert got["ends"] == [steps, steps]  # the killed ones never ended
    assert got["steps_in_order"] and got["lost"] == 0 and got["repeated"] == 0, got
    assert got["retrained"] <= kills  # what was trained twice is what each kill cut after its last checkpoint
    assert got["torn"] == 0 and got["orphans"] == 0, got


@pytest.mark.slow
def test_sigkill_and_resume_loses_and_repeats_nothing(tmp_path, uninterrupted):
    got = kill_and_resume(tmp_path, KILLS, int(os.environ.get("MOLT_KILL_SEED", "0")))
    check_kill_and_resume(got, KILLS)
    # synchronous, seeded per request: the resumed run is the run that was never killed
    kept = got["kept"]
    assert [r["samples"] for r in kept] == [r["samples"] for r in uninterrupted]
    for got, want in zip(kept, uninterrupted):
        for key in ("reward", "loss/total", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


@pytest.mark.slow
def test_sigkill_and_resume_with_the_vllm_engine_loses_and_repeats_nothing(tmp_path):
    # asynchronous batching inside vLLM: the values differ from run to run, the prompts and their accounting do not
    check_kill_and_resume(kill_and_resume(tmp_path, KILLS_VLLM, engine=kill_harness.VLLM, timeout=400), KILLS_VLLM)


def test_a_torn_audit_line_is_reported_and_the_next_record_stands_alone(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text('{"event": "launch", "pid": 1}\n{"event": "train", "st')  # a kill cut the second line
    SampleAudit(str(path))._write(SimpleNamespace(global_rank=0), {"event": "launch", "pid": 2})
    records = audit.read(str(path))
    assert records == [{"event": "launch", "pid": 1}, {"event": "torn", "line": 2, "text": '{"event": "train", "st'},
                       {"event": "launch", "pid": 2}]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_failure_breaker_stops_a_run_whose_agents_all_fail(tmp_path):
    config = recipe(tmp_path, steps=3)
    proc = start(config, "--model.rollout.max_context", "8")  # every calculator agent overflows its context
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "Traceback" not in out
    assert "molt: 64 of the last 64 agent runs failed (more than 50%)" in out, out[-3000:]
    assert "ContextOverflow: segment of N tokens + max_tokens N exceeds max_context N" in out
    assert out.count("failed and will not be trained on") <= 10  # rate-limited, not a wall of lines


@pytest.mark.slow
def test_empty_task_stream_is_a_clear_error(tmp_path):
    config = recipe(tmp_path, steps=2, extra="  tasks: slow_agents.no_tasks")
    proc = start(config)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0 and "yielded no samples" in out, out[-3000:]


@pytest.mark.slow
def test_processes_an_engine_started_die_with_a_sigkilled_parent(tmp_path):
    psutil = pytest.importorskip("psutil")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from molt_lightning.engines.vllm.reaper import Reaper\n"
        "reaper = Reaper(); before = reaper.children()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        "reaper.watch(reaper.children() - before)\n"
        "print(child.pid, flush=True); time.sleep(3600)\n")], stdout=subprocess.PIPE, text=True, cwd=kill_harness.ROOT)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=60)
    assert gone and not alive


def write_forever(path: str, first: int) -> None:
    """A writer: records of up to 2 MB (large writes, so that a kill can land inside one), until it is killed."""
    sample_audit, trainer = SampleAudit(path), SimpleNamespace(global_rank=0)
    for step in range(first, first + 10**6):
        sample_audit._write(trainer, {"event": "train", "step": step, "pad": "x" * (step * 7919 % (2 << 20))})


@pytest.mark.slow
def test_audit_records_survive_sigkill_at_any_instant(tmp_path):
    """Writers SIGKILLed at random instants, each resumed after the last whole record: every record read back is
    whole or reported torn (at most one per kill), and the steps that stand run without a gap. (Each writer is a fork
    of this process: a fresh interpreter spent 13 s importing Lightning before its first record.)"""
    import multiprocessing
    import random

    path, rng, kills = tmp_path / "audit.jsonl", random.Random(0), 5
    for _ in range(kills):
        done = [r for r in audit.read(str(path)) if r["event"] == "train"] if path.exists() else []
        first = done[-1]["step"] + 1 if done else 0
        size = path.stat().st_size if path.exists() else 0
        proc = multiprocessing.get_context("fork").Process(target=write_forever, args=(str(path), first))
        proc.start()
        deadline = time.time() + 120
        while (not path.exists() or path.stat().st_size <= size) and time.time() < deadline:
            time.sleep(0.01)  # wait for the writer's first record (the event), then kill it at a random instant
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.join()
    records = audit.read(str(path))
    torn = [r for r in records if r["event"] == "torn"]
    steps = [r["step"] for r in records if r["event"] == "train"]
    assert len(torn) <= kills and len(steps) > kills
    assert steps == list(range(len(steps))), "a record was lost or repeated"
