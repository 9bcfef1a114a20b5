"""Per-run summaries: one number per seed for the statistics, and curves for the plots.

The x axis is ``step`` (optimizer steps), ``samples`` (cumulative samples consumed) or ``wall`` (cumulative wall
seconds). Runs are cut at a *common horizon*: the smallest final x over every run on both sides, so with
``--by wall`` or ``--by samples`` both stacks are judged at the same budget (with ``--by step`` it is the shorter
run's last step).

Summaries (the protocol picks one per metric; ``compare --summary`` overrides):
- ``final``: the mean of the last ``last_k`` logged values up to the horizon (the reward a run ended at);
- ``mean``: the mean after the first ``warmup`` logged values (systems metrics: step time, tokens/s);
- ``auc``: area under the curve over x, divided by the x range it covers (a mean over the budget: higher-is-better
  stays higher-is-better, and the units stay the metric's).
Time to threshold (first x where the metric reaches ``threshold``) is reported descriptively, with the count of runs
that never reach it; it is not tested (censored values would need survival analysis).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats
from scipy.integrate import trapezoid

from .protocol import MetricSpec

AXIS = {"step": "step", "samples": "samples", "wall": "wall_s"}


def axis_column(by: str) -> str:
    if by not in AXIS:
        raise ValueError(f"--by {by!r}: use one of {sorted(AXIS)}")
    return AXIS[by]


def series(frame: pd.DataFrame, metric: str, by: str, where: str = "") -> pd.DataFrame:
    x = axis_column(by)
    if metric not in frame:
        known = [c for c in frame.columns if c not in AXIS.values()]
        raise ValueError(f"{where}: no column {metric!r}; this run logged {known[:25]}")
    d = frame[[x, metric]].dropna()
    if d.empty:
        hint = " (wall time needs a step-time column)" if by == "wall" else ""
        raise ValueError(f"{where}: {metric!r} has no values against {by}{hint}")
    return d.sort_values(x)


def horizon(frames: list[pd.DataFrame], metric: str, by: str) -> float:
    """The smallest final x over all runs: where every run still has data."""
    return float(min(series(f, metric, by)[axis_column(by)].max() for f in frames))


def summarise(frame: pd.DataFrame, spec: MetricSpec, by: str, upto: float, summary: str | None = None,
              where: str = "") -> float:
    summary = summary or spec.summary
    d = series(frame, spec.name, by, where)
    x = axis_column(by)
    d = d[d[x] <= upto * (1 + 1e-9)]
    y = d[spec.name].to_numpy(float)
    if summary == "final":
        return float(y[-spec.last_k:].mean()) if y.size else math.nan
    if summary == "mean":
        y = y[spec.warmup:] if y.size > spec.warmup else y
        return float(y.mean()) if y.size else math.nan
    if summary == "auc":
        xs = d[x].to_numpy(float)
        if xs.size < 2 or xs[-1] == xs[0]:
            return float(y.mean()) if y.size else math.nan
        return float(trapezoid(y, xs) / (xs[-1] - xs[0]))
    raise ValueError(f"summary {summary!r}: use final, mean or auc")


def time_to_threshold(frame: pd.DataFrame, spec: MetricSpec, by: str) -> float:
    """First x at which the metric reaches the threshold (>= for goal max, <= for min); NaN if never."""
    if spec.threshold is None:
        return math.nan
    d = series(frame, spec.name, by)
    hit = d[spec.name] >= spec.threshold if spec.goal == "max" else d[spec.name] <= spec.threshold
    return float(d[axis_column(by)][hit].iloc[0]) if hit.any() else math.nan


def curves(frames: list[pd.DataFrame], metric: str, by: str, upto: float, points: int = 120):
    """Each run interpolated on one grid over [first x, horizon]: (grid (P,), values (runs, P))."""
    x = axis_column(by)
    parts = [series(f, metric, by) for f in frames]
    start = max(float(p[x].min()) for p in parts)
    grid = np.linspace(start, upto, points) if upto > start else np.array([start])
    values = np.stack([np.interp(grid, p[x].to_numpy(float), p[metric].to_numpy(float)) for p in parts])
    return grid, values


def band(values: np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over runs and its t-based (1 - alpha) confidence band, per grid point."""
    mean = values.mean(0)
    n = values.shape[0]
    if n < 2:
        return mean, mean, mean
    half = stats.t.ppf(1 - alpha / 2, n - 1) * values.std(0, ddof=1) / math.sqrt(n)
    return mean, mean - half, mean + half
