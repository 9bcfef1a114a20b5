"""Shared helpers for the molt-bench tests: synthetic run sets written in the on-disk format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def write_runset(root: Path, name: str, finals: list[float], protocol: dict, stack: str = "synthetic",
                 steps: int = 20, step_time: float = 1.0, seed0: int = 0) -> Path:
    """A run set whose seed k has a reward curve rising linearly to ``finals[k]``; step time constant."""
    from molt_lightning.bench import runs
    from molt_lightning.bench.protocol import Protocol

    out = root / name
    p = Protocol(protocol)
    manifest = {"molt_bench": 1, "stack": stack, "protocol": protocol, "protocol_name": p.name,
                "fingerprint": p.fingerprint, "seeds": {}}
    for k, final in enumerate(finals):
        step = np.arange(1, steps + 1)
        frame = pd.DataFrame({"step": step, "samples": step * p.samples_per_step, "wall_s": step * step_time,
                              "reward": final * step / steps, "step_time_s": np.full(steps, step_time)})
        rel = runs.write_seed(out, seed0 + k, frame)
        manifest["seeds"][str(seed0 + k)] = {"status": "ok", "metrics": rel}
    runs.write_manifest(out, manifest)
    return out


@pytest.fixture
def make_runset():
    """``make_runset(root, name, finals, protocol, ...)``: see ``write_runset``."""
    return write_runset


@pytest.fixture
def smoke_protocol() -> dict:
    from molt_lightning.bench.protocol import load_protocol

    return load_protocol("arithmetic-smoke").data
