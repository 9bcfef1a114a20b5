"""What a terminal episode costs with each sandbox backend: start, the reference solution and two more commands, the
task's tests (``harbor.verify``), close; the environment prepared once before (its first and its cached prepare timed
apart). Baseline, in the same run: the same commands as plain ``bash -c`` subprocesses in a temporary folder (no
isolation at all), so the table shows what the isolation costs.

    python benchmarks/terminal_episode.py [--episodes 10] [--task find-line-1]
        [--out benchmarks/results/terminal_episode_cpu2.md]

buildah's images are cached by content under a tag, so its "first" prepare is a cached one after the first run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt_lightning.agents.tools.shell import BubblewrapBackend, BuildahBackend  # noqa: E402
from molt_lightning.tasks.harbor import EXAMPLES, read_task, solution_commands, verify  # noqa: E402

EXTRA = ["ls -l", "cat *.txt | wc -c"]


async def episode(backend, prepared, task) -> tuple[float, float]:
    t0 = time.perf_counter()
    session = await backend.start(prepared, 60)
    try:
        t1 = time.perf_counter()
        for command in solution_commands(task) + EXTRA:
            await session.run(command)
        t2 = time.perf_counter()
        verdict = await verify(session, task)
        assert verdict.reward == 1.0, verdict
    finally:
        await session.close()
    return time.perf_counter() - t0, (t2 - t1) / (len(solution_commands(task)) + len(EXTRA))


def plain(task) -> tuple[float, float]:
    """The baseline: copy the environment's files, run the commands and test.sh with plain bash, no sandbox."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for f in task.environment.iterdir():
            if f.name != "Dockerfile":
                shutil.copy(f, tmp)
        t1 = time.perf_counter()
        commands = solution_commands(task) + EXTRA
        for command in commands:
            subprocess.run(["bash", "-c", command], cwd=tmp, capture_output=True)
        t2 = time.perf_counter()
        subprocess.run(["bash", "-c", "true"], cwd=tmp)  # the verifier's shell (its paths are the sandbox's)
    return time.perf_counter() - t0, (t2 - t1) / len(commands)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--task", default="find-line-1")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    task = read_task(EXAMPLES / a.task)
    rows = []
    base = [plain(task) for _ in range(a.episodes)]
    rows.append(("no sandbox (plain bash, baseline)", None, None, statistics.median(e for e, _ in base),
                 statistics.median(c for _, c in base)))
    backends = [("bubblewrap", lambda cache: BubblewrapBackend(cache_dir=cache))]
    if shutil.which("buildah") and os.geteuid() == 0:
        backends.append(("buildah", lambda cache: BuildahBackend()))
    for name, make in backends:
        with tempfile.TemporaryDirectory() as cache:
            backend = make(cache)
            t0 = time.perf_counter()
            prepared = backend.prepare(task.environment)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            prepared = backend.prepare(task.environment)
            cached = time.perf_counter() - t0
            runs = [asyncio.run(episode(backend, prepared, task)) for _ in range(a.episodes)]
        rows.append((name, first, cached, statistics.median(e for e, _ in runs), statistics.median(c for _, c in runs)))
    base_episode = rows[0][3]
    lines = [f"# A terminal episode per backend ({a.task}: {len(solution_commands(task)) + len(EXTRA)} commands and "
             f"the task's tests; median of {a.episodes}; {os.cpu_count()} cores)", "",
             "| backend | first prepare s | cached prepare s | episode s | per command s | episode vs no sandbox |",
             "|---|---|---|---|---|---|"]
    for name, first, cached, ep, cmd in rows:
        fmt = (lambda x: "-" if x is None else f"{x:.4f}")
        lines.append(f"| {name} | {fmt(first)} | {fmt(cached)} | {ep:.4f} | {cmd:.4f} | {ep / base_episode:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
