"""Processes an engine starts die with the process that started them, even when it is SIGKILLed.

vLLM's in-process engine runs its engine core and workers in child processes, and nothing in vLLM watches the parent:
a trainer killed with SIGKILL (the OOM killer, a preempted job, ``kill -9``) left ``VLLM::EngineCore``,
``VLLM::Worker`` and multiprocessing's resource tracker running, 2.5 GB of memory each time on this machine (on a
GPU, the device memory too), found by the kill-and-resume harness (tests/helpers/kill_harness.py).

``Reaper.watch(pids)`` hands the pids (with their start times, so a reused pid is never touched) to a small watcher
process that reads them from a pipe; when the pipe closes, i.e. when this process ends for any reason, the watcher
kills every one still alive, and its children. Written by hand: ``PR_SET_PDEATHSIG`` would have to be set inside the
children vLLM spawns, and no maintained library does this for processes it did not start.
"""

from __future__ import annotations

import subprocess
import sys

import psutil

WATCHER = r"""
import sys, time, psutil
watched = {}
for line in sys.stdin:
    pid, created = line.split()
    watched[int(pid)] = float(created)
procs = []
for pid, created in watched.items():
    try:
        p = psutil.Process(pid)
        if p.create_time() == created:
            procs += [p, *p.children(recursive=True)]
    except psutil.Error:
        pass
for p in procs:
    try:
        p.kill()
    except psutil.Error:
        pass
def running(p):  # a killed child of the trainer stays a zombie until the trainer reaps it: that counts as gone
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
deadline = time.monotonic() + 30
while any(map(running, procs)) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


class Reaper:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def children() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)}

    def watch(self, pids: set[int]) -> None:
        """Kill these processes (and theirs) when this process ends, however it ends."""
        lines = []
        for pid in pids:
            try:
                lines.append(f"{pid} {psutil.Process(pid).create_time()}\n")
            except psutil.Error:
                pass  # already gone
        if not lines:
            return
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", WATCHER], stdin=subprocess.PIPE, text=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proc.stdin.write("".join(lines))
        self.proc.stdin.flush()

    def close(self) -> None:
        """Let the watcher finish now (it kills what is still alive of the watched processes) and wait for it."""
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None
