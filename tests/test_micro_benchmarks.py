"""The micro-benchmarks (``benchmarks/micro``) still run and their assertions hold: each benchmarked function once
(``--benchmark-disable``), in a pytest of its own, since ``testpaths`` keeps ``benchmarks/`` out of this suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_micro_benchmarks_run_and_check_their_outputs(policy_path):  # the fixture builds the tiny policy if needed
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/micro/test_micro.py", "--benchmark-disable", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"\b12 passed\b", out.stdout), out.stdout[-2000:]
