"""``molt tasks check FOLDER...``: is a Harbor task set ready to train on?

It reads the tasks as ``HarborTasks`` does (``tasks.harbor.scan``: harbor 0.26's loader rules and the task.toml fields
refused here) and lists every broken task at once, each problem with its fix. Then each task that reads runs twice in
the sandbox (``--backend``; ``--jobs`` episodes at once): its reference solution as Harbor's oracle runs it
(``tasks.harbor_run.run_solution``: ``solution/solve.sh`` uploaded to ``/solution`` and run as a script from the work
folder) and an empty episode (no command), each scored by the task's own tests (``harbor_run.verify``). The table: the
task, its work folder, both rewards, and its seconds (preparing the environment and both episodes). What went wrong
(a solution below its full reward, an empty episode above 0, a verifier without a reward) is said under the table,
with the ends of the outputs.

Exit status 1 when a task is broken or its solution does not score its full reward (1; a task without
``solution/solve.sh`` included), else 0; an empty episode that scores is pointed out (tests that pass with nothing done
teach nothing) but does not fail the check. Without a broken task's fix, ``HarborTasks(skip_broken=True)`` trains on
the others.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

EPILOG = ("exit status: 1 when a task is broken or its reference solution scores below its full reward (1; no "
          "solution/solve.sh counts), else 0; an empty episode that scores above 0 is pointed out, not failed; 2: a "
          "usage error or no sandbox")


@dataclass
class Row:
    task: str
    workdir: str = "-"
    solution: str = "-"
    empty: str = "-"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    solved: bool = False


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="molt tasks", description="Harbor task sets (molt_lightning/tasks/harbor.py)")
    sub = p.add_subparsers(dest="command", required=True, metavar="check")
    c = sub.add_parser("check", prog="molt tasks check", epilog=EPILOG,
                       help="list a task set's broken tasks with their fixes; score each reference solution and an "
                            "empty episode with the task's tests",
                       description="Lists every broken task with its fix, then runs each task's solution/solve.sh "
                                   "as Harbor's oracle does and an empty episode, each scored by the task's tests, "
                                   "and prints task, work folder, solution reward, empty reward, seconds.")
    c.add_argument("folders", nargs="+", metavar="FOLDER", help="a task folder or a folder of task folders")
    c.add_argument("--backend", choices=("bubblewrap", "buildah"), default="bubblewrap",
                   help="the sandbox (default bubblewrap; buildah builds each Dockerfile, needs root)")
    c.add_argument("--jobs", type=int, default=4, metavar="N", help="episodes at once (default 4)")
    c.add_argument("--pattern", default=None, metavar="GLOB", help="only tasks whose name or folder name matches")
    c.add_argument("--base-image", action="append", default=[], metavar="NAME=LOCAL",
                   help="buildah: build FROM NAME on the local image LOCAL (repeatable; nothing is pulled)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    images = dict(a.split("=", 1) for a in args.base_image if "=" in a)
    if args.jobs < 1 or len(images) != len(args.base_image):
        p.error("--jobs must be >= 1 and each --base-image NAME=LOCAL")
    sys.exit(check(args.folders, args.backend, args.jobs, args.pattern, images))


def check(folders: list[str], backend: str = "bubblewrap", jobs: int = 4, pattern: str | None = None,
          base_images: dict[str, str] | None = None, out=None) -> int:
    """Print the check of the tasks under ``folders`` (see the module docstring) to ``out``; the exit status."""
    from ..agents.tools.shell import BubblewrapBackend, BuildahBackend
    from ..tasks.harbor import scan

    out, start = out or sys.stdout, time.monotonic()
    found, problems = scan(*folders, pattern=pattern)
    broken = {folder: ps for folder, ps in problems.items() if folder is not None}
    for problem in problems.get(None, []):
        print(problem, file=out)
    if broken:
        print(f"{len(broken)} broken {_plural(len(broken), 'task')} (fix each; HarborTasks(skip_broken=True) trains "
              "on the rest):", file=out)
        for folder, ps in broken.items():
            print(f"  {folder}", file=out)
            print("".join(f"    - {p.removeprefix(f'Harbor task {folder}: ')}\n" for p in ps), end="", file=out)
        print(file=out)
    if not found:
        return 1
    try:
        sandbox = BuildahBackend(base_images=base_images) if backend == "buildah" else BubblewrapBackend()
    except RuntimeError as e:
        print(f"molt tasks check: {e}", file=out)
        return 2
    print(f"{len(found)} {_plural(len(found), 'task')} read; each run with its solution and empty ({backend}, "
          f"{jobs} at once):\n", file=out)
    rows = asyncio.run(_check_all(sandbox, found, jobs))
    print(_table(rows), file=out)
    notes = [f"  {row.task}: {note}" for row in rows for note in row.notes]
    print("\n".join(["", *notes]) if notes else "", file=out)
    failed = sum(not row.solved for row in rows)
    print(f"{len(rows) - failed} of {len(rows)} solutions score their full reward; {len(broken)} broken; "
          f"{time.monotonic() - start:.1f} s", file=out)
    return 1 if failed or broken else 0


async def _check_all(backend, found: list, jobs: int) -> list[Row]:
    slots = asyncio.Semaphore(jobs)
    return list(await asyncio.gather(*(_check_task(backend, task, slots) for task in found)))


async def _check_task(backend, task, slots: asyncio.Semaphore) -> Row:
    from ..tasks.harbor_run import prepare

    row = Row(task.name)
    async with slots:
        t0 = time.monotonic()
        try:
            prepared = await asyncio.to_thread(prepare, backend, task)
        except Exception as e:  # noqa: BLE001 - said in the task's row: the check goes on with the others
            row.solution = row.empty = "error"
            row.notes.append(f"its environment: {type(e).__name__}: {e}")
            return row
        finally:
            row.seconds += time.monotonic() - t0
    solution, empty = await asyncio.gather(_episode(backend, prepared, task, True, slots),
                                           _episode(backend, prepared, task, False, slots))
    for name, (reward, cell, workdir, seconds, note) in (("solution", solution), ("empty episode", empty)):
        row.workdir, row.seconds = workdir or row.workdir, row.seconds + seconds
        row.notes += [f"{name}: {note}"] if note else []
    row.solution, row.empty, row.solved = solution[1], empty[1], solution[0] is not None and solution[0] >= 1.0
    if empty[0]:
        row.notes.append(f"the empty episode scores {empty[0]:g}: the tests pass with nothing done")
    return row


async def _episode(backend, prepared, task, solve: bool, slots: asyncio.Semaphore):
    """One episode: (reward or None, its cell, the work folder, seconds, what to say of it or None)."""
    from ..tasks.harbor_run import EPISODE_S, VerifierFailed, run_solution, verify

    if solve and task.solution is None:
        return None, "none", None, 0.0, "no solution/solve.sh: write the reference solution there"
    async with slots:
        t0, workdir, ran = time.monotonic(), None, None
        try:
            session = await backend.start(prepared, (task.agent_timeout_s or EPISODE_S) + task.verifier_timeout_s + 30)
            try:
                workdir = session.workdir
                ran = await run_solution(session, task) if solve else None
                verdict = await verify(session, task)
            finally:
                await session.close()
        except VerifierFailed as e:
            return None, f"failed ({e.kind})", workdir, time.monotonic() - t0, e.message + _said(ran, "; ")
        except Exception as e:  # noqa: BLE001 - said in the task's row: the check goes on with the others
            return None, "error", workdir, time.monotonic() - t0, f"{type(e).__name__}: {e}"
    seconds, note = time.monotonic() - t0, None
    if solve and verdict.reward < 1.0:
        note = f"scores {verdict.reward:g}{_said(ran, '; ')}; test.sh {_printed(verdict.output)}"
    return verdict.reward, f"{verdict.reward:g}", workdir, seconds, note


def _said(ran, sep: str) -> str:
    """How solve.sh ended and what it printed ("" when it did not run)."""
    if ran is None:
        return ""
    return f"{sep}solve.sh {'timed out' if ran.timed_out else f'exit {ran.exit_code}'}, {_printed(ran.output)}"


def _printed(text: str, chars: int = 300) -> str:
    text = " | ".join(line for line in text.strip().splitlines() if line.strip())  # one line
    return f"printed {text[-chars:]!r}" if text else "printed nothing"


def _table(rows: list[Row]) -> str:
    cells = [("task", "work folder", "solution", "empty", "seconds")]
    cells += [(r.task, r.workdir, r.solution, r.empty, f"{r.seconds:.2f}") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) if i == 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     .rstrip() for row in cells)


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


if __name__ == "__main__":
    main()
