"""``molt-bench check RUNSET``: what is wrong with a run set, found before any verdict is computed over it.

``compare`` runs the same checks on both sides first and gives no verdict over a run with an error (unless told to
leave that seed out, or to go ahead). Each finding names the seed, the steps and the numbers. Severities:

- **error**: the run is broken in a way a per-seed summary would silently average in.
  - *collapse*: the reward stays at one value for the last ``w`` steps or more (``w`` = max(3, steps/10)) after
    mostly other values before, lower than it had been; or its rolling mean (window ``w``) falls back to within a
    quarter of its gain over the start, the gain being at least 4 standard errors of a window's mean.
  - *non-finite*: an infinite value of a compared metric, or NaN in a compared metric inside the steps where it is
    logged every step (a hole there is a NaN the stack wrote, or a lost row).
  - *mismatch*: a train-vs-engine mismatch metric (``MISMATCH``) outside its sane range on at least 20% of steps.
- **warning**: look before trusting the numbers.
  - the same for columns that are not compared (infinite values, holes) and for mismatch spikes on fewer steps;
  - steps missing inside the run, a first step above 1 (is ``step_base`` right?), or steps logged twice with
    different values (recorded by ``import``: a resume from a checkpoint, or two launches in one file);
  - step-time outliers: above 1.5x the median and 6 robust SDs (1.4826 x MAD) above it (validation, checkpoints),
    among the steps after the first (the first holds the warm-up: engine start, compilation, the first sync);
  - a reward with one value at three quarters of the steps or more (a run that does not learn, a reward that
    never fires);
  - seeds of very different lengths (the shortest below 80% of the longest): ``compare`` cuts every run there.

Written by hand (no library checks RL training logs); the thresholds are the constants below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .runs import RunSet

# column -> (low, high, what it is). Sane means "engine and trainer agree about as well as healthy runs show".
MISMATCH = {
    "train/token_mult_prob_error": (0.9, 1.1, "NeMo-RL: mean over tokens of exp|logprob_engine - logprob_trainer|, 1 "
                                    "when they agree; NeMo-RL's test suites require its median (earlier its mean) "
                                    "below 1.1"),
    "training/rollout_probs_diff_mean": (0.0, 0.01, "verl: mean |p_engine - p_trainer| over response tokens; verl's "
                                         "FAQ calls above 0.01 a precision problem"),
    "rollout_corr/rollout_is_mean": (0.5, 2.0, "verl: mean engine-to-trainer importance weight, 1 when they agree; "
                                     "verl's docs warn outside [0.5, 2]"),
    "train/train_rollout_logprob_abs_diff": (0.0, 0.1, "slime: mean |logprob_trainer - logprob_engine|; slime's CI "
                                             "fails above 0.1"),
    "mismatch/kl": (0.0, 0.05, "molt: k3 estimate of KL(engine || trainer) on the sampled tokens, 0 when they agree"),
    "ppo_actor/behave_imp_weight/avg": (0.8, 1.25, "AReaL: mean behaviour importance weight pi_trainer / pi_engine, "
                                        "1 when they agree (range ours: AReaL documents none)"),
    "grpo_actor/behave_imp_weight/avg": (0.8, 1.25, "AReaL (older names): the same weight"),
}
ERROR_SHARE = 0.2  # mismatch out of range on this share of steps or more: an error
FLAT_SHARE = 0.75  # one reward value at this share of steps or more: a warning
LENGTH_SHARE = 0.8
OUTLIER_RATIO, OUTLIER_SDS = 1.5, 6.0
STEPS_SHOWN = 8


@dataclass
class Finding:
    severity: str  # error | warning
    check: str
    seed: int | None
    message: str
    steps: list[int] = field(default_factory=list)

    def line(self) -> str:
        where = f"seed {self.seed}" if self.seed is not None else "run set"
        return f"  {self.severity.upper():7s} {where}: {self.check}: {self.message}"


def check_runset(rs: RunSet, metrics: list[str] | None = None) -> list[Finding]:
    """Every finding for the run set; ``metrics`` are the compared ones (default: the protocol's)."""
    metrics = list(metrics or rs.protocol.get("metrics", {}))
    findings: list[Finding] = []
    for seed, frame in sorted(rs.frames.items()):
        info = rs.manifest.get("seeds", {}).get(str(seed), {})
        findings += check_seed(seed, frame, metrics, info.get("repeated_steps") or [])
    lengths = {seed: int(f["step"].max()) for seed, f in rs.frames.items() if len(f)}
    if len(lengths) > 1 and min(lengths.values()) < LENGTH_SHARE * max(lengths.values()):
        longest = max(lengths.values())
        short = {s: n for s, n in lengths.items() if n < LENGTH_SHARE * longest}
        findings.append(Finding("warning", "lengths", None, "seeds of very different lengths: " + ", ".join(
            f"seed {s} ends at step {n}" for s, n in sorted(short.items())) + f", the longest at {longest}; "
            "compare cuts every run at the shortest (leave short seeds out with --exclude)"))
    return findings


def check_seed(seed: int, frame: pd.DataFrame, metrics: list[str], repeated: list[int] = ()) -> list[Finding]:
    out: list[Finding] = []
    f = frame[frame["step"] >= 1].sort_values("step").reset_index(drop=True)
    steps = f["step"].astype(int).to_numpy()
    if "reward" in f:
        out += _reward(seed, f[["step", "reward"]].dropna())
    for col in f.columns:
        if col in ("step", "samples", "wall_s") or not pd.api.types.is_numeric_dtype(f[col]):
            continue
        out += _finite(seed, f, col, "error" if col in metrics or col in MISMATCH else "warning")
    for col, (low, high, what) in MISMATCH.items():
        if col in f:
            out += _mismatch(seed, f[["step", col]].dropna(), col, low, high, what)
    if "step_time_s" in f:
        out += _outliers(seed, f[["step", "step_time_s"]].dropna())
    out += _steps(seed, steps, repeated)
    return out


def _at(steps) -> str:
    return ("step " if len(steps) == 1 else "steps ") + _show(steps)


def _show(steps) -> str:
    steps = [int(s) for s in steps]
    return ", ".join(map(str, steps[:STEPS_SHOWN])) + (f", ... ({len(steps)} steps)" if len(steps) > STEPS_SHOWN
                                                      else "")


def _reward(seed: int, d: pd.DataFrame) -> list[Finding]:
    y, x = d["reward"].to_numpy(float), d["step"].to_numpy(int)
    n = y.size
    w = max(3, n // 10)
    if n < 2 * w or not np.isfinite(y).all():  # too short to tell; non-finite values are _finite's
        return []
    same = np.isclose(y, y[-1], rtol=0, atol=1e-9 * max(1.0, abs(y[-1])))
    tail = n - (np.flatnonzero(~same)[-1] + 1) if (~same).any() else n
    out = []
    before = y[: n - tail]
    if w <= tail < n and before.max() > y[-1] and (~same[: n - tail]).mean() > 0.5:
        top = int(np.argmax(before))
        out.append(Finding("error", "collapse", seed, f"reward stays at {y[-1]:.4g} from step {x[n - tail]} to the "
                           f"end ({tail} steps), after {before.max():.4g} at step {x[top]}", x[n - tail:].tolist()))
    else:
        roll = np.convolve(y, np.ones(w) / w, mode="valid")  # roll[i] = mean of y[i:i+w]
        start, peak, end = roll[0], roll.max(), roll[-1]
        noise = np.std(np.diff(y), ddof=1) / math.sqrt(2) if n > 2 else 0.0
        gain = peak - start
        if gain > 0 and gain > 4 * noise / math.sqrt(w) and end <= start + 0.25 * gain:
            at = int(np.argmax(roll))
            out.append(Finding("error", "collapse", seed, f"reward's {w}-step mean fell from {peak:.4g} (steps "
                               f"{x[at]}-{x[at + w - 1]}) to {end:.4g} at the end, back to its start ({start:.4g})",
                               x[at + w - 1:].tolist()))
    values, counts = np.unique(np.round(y, 12), return_counts=True)
    if not out and counts.max() >= FLAT_SHARE * n:
        v = values[np.argmax(counts)]
        out.append(Finding("warning", "flat reward", seed, f"reward is {v:.4g} at {counts.max()} of {n} steps: a run "
                           "that does not learn, or a reward that never fires"))
    return out


def _finite(seed: int, f: pd.DataFrame, col: str, severity: str) -> list[Finding]:
    v = f[col].to_numpy(float)
    out = []
    inf = np.isinf(v)
    if inf.any():
        out.append(Finding(severity, "non-finite", seed, f"{col} is infinite at {_at(f['step'][inf])}",
                           f["step"][inf].tolist()))
    logged = np.flatnonzero(~np.isnan(v))
    if logged.size >= 5:
        inside = np.isnan(v[logged[0]: logged[-1] + 1])
        if inside.any() and inside.mean() <= 0.1:  # a column logged every step, with holes
            holes = f["step"].to_numpy()[logged[0]: logged[-1] + 1][inside]
            out.append(Finding(severity, "non-finite", seed, f"{col} is NaN (or missing) at {_at(holes)}, "
                               "inside the steps where it is logged every step", holes.tolist()))
    return out


def _mismatch(seed: int, d: pd.DataFrame, col: str, low: float, high: float, what: str) -> list[Finding]:
    v = d[col].to_numpy(float)
    bad = (v < low - 1e-6) | (v > high)  # the tolerance: a k3 estimate of 0 can round to -1e-9
    if not bad.any():
        return []
    severity = "error" if bad.mean() >= ERROR_SHARE else "warning"
    worst = v[bad][np.argmax(np.abs(v[bad] - (low + high) / 2))]
    return [Finding(severity, "mismatch", seed, f"{col} outside its sane range [{low:g}, {high:g}] at {bad.sum()} of "
                    f"{v.size} steps ({_show(d['step'][bad])}; median {np.median(v):.4g}, worst {worst:.4g}). {what}",
                    d["step"][bad].astype(int).tolist())]


def _outliers(seed: int, d: pd.DataFrame) -> list[Finding]:
    # The run's first logged step is never an outlier, nor in the median: it holds the warm-up every run pays once
    # (engine start and compilation, the first weight sync, allocator growth), so it was flagged in every molt run;
    # `mean` summaries leave it out by their protocol's `warmup` instead.
    d = d.sort_values("step").iloc[1:]
    v = d["step_time_s"].to_numpy(float)
    if v.size < 5:
        return []
    med = float(np.median(v))
    sd = 1.4826 * float(np.median(np.abs(v - med)))
    hit = (v > OUTLIER_RATIO * med) & (v > med + OUTLIER_SDS * sd)
    if not hit.any():
        return []
    return [Finding("warning", "step-time outliers", seed, f"step time at {_at(d['step'][hit])} is up to "
                    f"{v[hit].max() / med:.2f}x the median {med:.4g} s (validation, checkpoints?); `mean` "
                    "summaries include them", d["step"][hit].astype(int).tolist())]


def _steps(seed: int, steps: np.ndarray, repeated: list[int]) -> list[Finding]:
    out = []
    if steps.size > 1:
        diffs = np.diff(steps)
        stride = int(pd.Series(diffs).mode().iloc[0])
        gaps = np.flatnonzero(diffs > stride)
        if gaps.size:
            ranges = [f"{steps[i] + stride}-{steps[i + 1] - stride}" if steps[i + 1] - steps[i] > 2 * stride
                      else f"{steps[i] + stride}" for i in gaps[:STEPS_SHOWN]]
            out.append(Finding("warning", "missing steps", seed, f"no row for steps {', '.join(ranges)}"
                               + (f" (logged every {stride} steps)" if stride > 1 else "")))
    if steps.size and steps[0] > 1 and (steps.size < 2 or steps[0] > np.diff(steps).min()):
        out.append(Finding("warning", "missing steps", seed, f"the first step is {steps[0]}: the run's beginning is "
                           "missing, or the source counts from another base (--map step_base=N)"))
    if repeated:
        out.append(Finding("warning", "repeated steps", seed, f"source steps {_show(repeated)} were logged more than "
                           "once with different values (a resume from a checkpoint, or two launches in one file); "
                           "the last value logged was kept", list(repeated)))
    return out


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def text(rs: RunSet, findings: list[Finding]) -> str:
    n_err, n_warn = len(errors(findings)), len(findings) - len(errors(findings))
    head = f"{rs.path} ({rs.label}; seeds {rs.seeds}): {n_err} error(s), {n_warn} warning(s)"
    return "\n".join([head] + [f.line() for f in findings])
