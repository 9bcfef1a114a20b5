"""Where a step's time goes on the default recipe, two ways: the trainer's wall time, and everyone's CPU time.

1. Wall time, from a plain run (no profiler): every step's ``perf/step_time_s`` is split by ``RolloutMonitor`` into
   waiting for rollouts (generation, as the trainer sees it), the gradient step, weight sync, and everything else on
   the trainer's path (collation, Lightning's loop, logging, callbacks, checkpoints): mean seconds per step over the
   window and shares of the wall time.
2. CPU time, from a second run with a callback that starts ``py-spy record --subprocesses`` on itself at step
   ``--start`` and stops it ``--steps`` steps later (start-up and shutdown left out). Every sample is one thread found
   running and goes to one phase by its stack: generation inside the engine (vLLM's processes; their busy-wait
   between steps apart), vLLM's client side in the trainer process, the gradient step, weight sync, and everything
   else (agent and chat-template code, the rollout loop and asyncio, collation, Lightning and logging). That rollout
   work runs beside the gradient step, so it costs wall time only where it takes the trainer's core. py-spy's
   sampling slows this run down; its shares are of its own wall time.

    python benchmarks/overhead_profile.py [--start 20] [--steps 40] [--rate 100] [-- EXTRA molt fit FLAGS]

Written by hand: py-spy records, but nothing maintained classifies its stacks into these phases.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
# A sample's category: the stack is read from the leaf up and the first frame that contains a key of the first list
# names it (so an inner frame wins: tokenizer code called by the chat template is chat-template time, vLLM code called
# by the agent is vLLM's), else the same with the second list (the loops everything runs in).
TRAINER_KEYS = [
    ("weight sync", ("WeightFlow.push", "VLLMEngine._write", "update_weights")),
    ("generation: vLLM client side", ("vllm/",)),
    ("else: agent + chat template", ("ChatTemplate.", "AgentClient.", "calculator_agent", "tasks/", "endpoint.py")),
    ("else: collation", ("collate", "batching.py", "_BatchStream")),
]
LOOP_KEYS = [
    ("else: rollout loop + asyncio", ("rollout.py", "engines/", "asyncio/", "concurrent/futures", "threading.py")),
    ("else: Lightning + logging", ("lightning/", "callbacks/", "torch/utils/data")),
]
ENGINE_KEYS = [
    ("weight sync", ("vllm_worker.py",)),
    ("engine spin-wait", ("SpinCondition.wait", "acquire_read", "sched_yield")),
]
# threads blocked in these (the leaf frame) are waiting, not working, even when py-spy finds them on a CPU
IDLE_LEAVES = ("select", "_worker", "wait", "get", "poll", "sleep", "recv", "acquire")


class PySpyWindow(L.Callback):
    """Profiles this process and its children with py-spy from step ``start`` to step ``start + steps``."""

    def __init__(self, out: str, start: int = 20, steps: int = 40, rate: int = 100):
        self.out, self.start, self.steps, self.rate = out, start, steps, rate
        self.proc, self.t0 = None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start and self.proc is None:
            py_spy = Path(sys.executable).with_name("py-spy")
            self.proc = subprocess.Popen([str(py_spy), "record", "--pid", str(os.getpid()), "--subprocesses",
                                          "--format", "raw", "--rate", str(self.rate), "--nonblocking",
                                          "-o", f"{self.out}/stacks.txt"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
            self.t0 = time.perf_counter()
        elif trainer.global_step == self.start + self.steps and self.t0 is not None:
            wall = time.perf_counter() - self.t0
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)
            Path(f"{self.out}/window.txt").write_text(f"{wall} {self.steps} {self.rate} {os.getpid()}\n")
            self.t0 = None


def read_stacks(path: Path):
    """(pid of the leaf process, frames) per line of py-spy's raw output, with its sample count."""
    buf = ""
    for line in path.read_text(errors="replace").splitlines():
        buf += line
        m = re.match(r"(.*) (\d+)$", buf)
        if not m:
            continue
        buf = ""
        parts = m[1].split(";")
        pids = [int(re.match(r"process (\d+)", p)[1]) for p in parts if p.startswith("process ")]
        yield pids[-1], [p for p in parts if not p.startswith("process ")], int(m[2])


def classify(frames: list[str], engine: bool) -> str:
    names = [f.split(" (")[0] for f in frames]
    if names and names[-1].rpartition(".")[2] in IDLE_LEAVES:
        return "idle (blocked, not counted)"
    if not engine and any("training_step" in n for n in names) \
            and not any(k in f for f in frames for k in ("collate", "next_batch", "WeightFlow.push")):
        return "gradient step"  # forward, backward and the optimizer, Lightning's wrappers included
    for rules in ([ENGINE_KEYS] if engine else [TRAINER_KEYS, LOOP_KEYS]):
        for frame in reversed(frames):
            for name, keys in rules:
                if any(k in frame for k in keys):
                    return name
    return "generation (engine)" if engine else "else: other"


def table(folder: Path) -> str:
    wall, steps, rate, trainer_pid = folder.joinpath("window.txt").read_text().split()
    wall, steps, rate, trainer_pid = float(wall), int(steps), int(rate), int(trainer_pid)
    cpu = collections.Counter()
    for pid, frames, n in read_stacks(folder / "stacks.txt"):
        cpu[classify(frames, engine=pid != trainer_pid)] += n / rate / steps
    step = wall / steps
    rows = [f"CPU time under py-spy, {steps} steps at {step:.3f} s/step (2 cores: at most {2 * step:.3f} CPU s/step)",
            "", "| phase (all processes) | CPU s/step | % of wall |", "|---|---|---|"]
    for name in sorted(cpu, key=lambda n: (n.startswith("else"), n)):
        rows.append(f"| {name} | {cpu[name]:.4f} | {100 * cpu[name] / step:.1f}% |")
    other = sum(v for k, v in cpu.items() if k.startswith("else"))
    rows.append(f"| **everything else** | **{other:.4f}** | **{100 * other / step:.1f}%** |")
    return "\n".join(rows)


WALL = {"waiting for rollouts (generation)": "perf/trainer_idle_s", "gradient step": "perf/train_compute_s",
        "weight sync": "perf/weight_sync_s", "**everything else**": "perf/overhead_s"}


def wall_table(run: Path, start: int, steps: int) -> str:
    import pandas as pd

    [csv] = run.glob("default/version_*/metrics.csv")
    df = pd.read_csv(csv).groupby("step").first().loc[start:start + steps - 1]
    step = df["perf/step_time_s"].mean()
    rows = [f"wall time, steps {start}-{start + steps - 1} of a plain run: {step:.3f} s/step (mean), "
            f"{df['perf/step_time_s'].median():.3f} median", "", "| phase (trainer's path) | s/step | % of wall |",
            "|---|---|---|"]
    for name, col in WALL.items():
        rows.append(f"| {name} | {df[col].mean():.4f} | {100 * df[col].mean() / step:.1f}% |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="recipes/default.yaml")
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--out", default=None, help="folder for the run and the raw stacks (default: a new temp folder)")
    ap.add_argument("extra", nargs="*", help="more `molt fit` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="molt-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "0", "PYTHONPATH": f"{ROOT / 'benchmarks'}:{ROOT}"}
    cmd = [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", args.config,
           "--trainer.max_steps", str(args.start + args.steps + 2), "--trainer.enable_progress_bar", "false"]
    spy = ["--trainer.callbacks+", "overhead_profile.PySpyWindow", "--trainer.callbacks.out", str(out),
           "--trainer.callbacks.start", str(args.start), "--trainer.callbacks.steps", str(args.steps),
           "--trainer.callbacks.rate", str(args.rate)]
    for name, more in (("plain", []), ("profiled", spy)):
        with open(out / f"{name}.log", "w") as log:
            subprocess.run([*cmd, "--trainer.logger.init_args.save_dir", str(out / name), *more, *args.extra],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(wall_table(out / "plain", args.start, args.steps))
    print()
    print(table(out))
    print(f"\nraw stacks: {out / 'stacks.txt'}")


if __name__ == "__main__":
    main()
