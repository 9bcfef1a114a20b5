"""How the suite runs (a pytest plugin that tests/conftest.py loads): groups for two xdist workers, their order, the
fast tier's file skipping, and the time summary a run ends with.

``make test`` runs ``pytest -n 2`` (pytest-xdist). xdist's ``loadscope`` scheduler is used with ``group`` as the
scope; its own ``--dist loadgroup`` does nothing on pytest 9.2 (it renames ``item._nodeid``, which pytest no longer
reads). The groups are sent longest first, by ``tests/durations.json`` (seconds per test of a full run; a test not in it
counts 1 s): a 5-minute test that starts last is a 5-minute tail. ``MOLT_DURATIONS=write`` updates the file with the
seconds of the tests a run ran."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

SHARED = ("vllm_engine", "vllm_lora_engine", "vllm_moe_engine", "molt_servers")  # each a few GB while it lives
DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
_texts: dict[Path, str] = {}
_seconds: dict[str, float] = {}  # node id -> seconds of its set-up, call and tear-down


def text(path: Path) -> str:
    return _texts.setdefault(path, path.read_text(encoding="utf-8"))


def names(source: str, fixture: str) -> bool:
    """Whether test code names a fixture (a whole word: ``test_sigterm_with_the_vllm_engine`` does not)."""
    return re.search(rf"\b{fixture}\b", source) is not None


def group(path: Path, name: str) -> str | None:
    """A test's group: ``engines`` for every test of a file that names a shared engine or holds an in-process vLLM
    engine of its own for the module (``VLLMEngine(``, or a ``molt tinker`` server's ``engine="vllm"``), and the
    SmolLM2 tests: one worker runs them in file order, so that one vLLM engine spins at a time (its scheduler
    busy-waits) and the shared ones are stopped before the SmolLM2 recipe's 8 GB trainer starts, as in a serial run.
    The file, for the tests of any other file that take one of its fixtures wider than a test (made once) as an
    argument, or every test of a file with such a fixture used automatically (e.g. a module's worker pool: split
    across workers it would be made again for each test). Else None: the test goes to
    whichever worker is free."""
    source = text(path)
    wide = re.findall(r'@pytest\.fixture\(scope="(?:module|class|session)"[^)]*\)\s*\n(?:async )?def (\w+)', source)
    if any(names(source, shared) for shared in SHARED) or "smollm2" in f"{path.name}::{name}" \
            or wide and ("VLLMEngine(" in source or 'engine="vllm"' in source):
        return "engines"
    signature = re.search(rf"def {re.escape(name.partition('[')[0])}\((.*?)\)", source, re.S)
    takes = signature is None or any(names(signature.group(1), fixture) for fixture in wide) \
        or re.search(r'@pytest\.fixture\(scope="(?:module|class|session)"[^)]*autouse=True', source) is not None
    return str(path) if wide and takes else None


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # the test extra brings pytest-xdist; without it the suite runs in one process
    pass
else:
    def pytest_xdist_make_scheduler(config, log):
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

        class Groups(LoadScopeScheduling):
            ordered = False

            def _split_scope(self, nodeid: str) -> str:
                file, _, rest = nodeid.partition("::")
                return group(config.rootpath / file, rest.split("::")[-1]) or nodeid

            def _assign_work_unit(self, node) -> None:
                if not self.ordered:  # the work queue is complete now: longest group first
                    self.ordered = True
                    seconds = {scope: sum(known.get(n, 1.0) for n in ids) for scope, ids in self.workqueue.items()}
                    for scope in sorted(seconds, key=lambda s: -seconds[s]):
                        self.workqueue.move_to_end(scope)
                super()._assign_work_unit(node)

        return Groups(config, log)


def pytest_ignore_collect(collection_path, config):
    """``-m "not slow"`` (``make test-fast``) leaves out a file whose every test is slow (a module-level ``pytestmark``
    with ``pytest.mark.slow``) without importing it: importing every library the test files name takes 40 s."""
    if (config.option.markexpr or "").replace(" ", "") == "notslow" and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_"):
        return bool(re.search(r"^pytestmark = .*pytest\.mark\.slow", text(Path(collection_path)), re.M)) or None
    return None


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def core_gflops(n: int = 256, seconds: float = 0.5) -> float:
    """One core's float32 matmul rate, to read a run's times against (measured after the tests, on a quiet core)."""
    import time

    import torch

    threads, a = torch.get_num_threads(), torch.randn(n, n)
    torch.set_num_threads(1)
    try:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a
            done += 1
        return 2 * n**3 * done / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Where a run of several files spent its time, slowest file first (a slow file shows in CI's log)."""
    files: Counter[str] = Counter()
    for nodeid, seconds in _seconds.items():
        files[nodeid.split("::")[0]] += seconds
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # a worker's summary is seen by no one: the controller's counts
    if len(files) > 1 and not worker:
        terminalreporter.section("seconds per test file (set-up, call, tear-down), the 25 slowest")
        for name, seconds in files.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
        terminalreporter.write_line(f"{sum(files.values()):8.1f}  all {len(files)} files")
        terminalreporter.write_line(f"this machine: {core_gflops():.0f} GFLOP/s on one core (float32 matmul; draws of "
                                    "one machine kind differ ~3x, and the suite's time with them: docs/testing.md)")
    if os.environ.get("MOLT_DURATIONS") == "write" and not worker:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}  # make test runs pytest twice:
        known.update({k: round(v, 1) for k, v in _seconds.items()})  # each run updates the tests it ran
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
        terminalreporter.write_line(f"updated {len(_seconds)} tests' seconds in {DURATIONS}")
