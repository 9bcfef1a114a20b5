"""``molt-bench check`` on constructed runs: each rule fires on the defect it names and stays quiet on healthy,
noisy runs; ``compare`` gives no verdict over a flagged seed unless it is left out or accepted."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from molt_lightning.bench import check, compare, runner, runs
from molt_lightning.bench.cli import main
from molt_lightning.bench.protocol import Protocol
from molt_lightning.bench.runs import load_runset


def frame(reward, step_time=None, **extra) -> pd.DataFrame:
    n = len(reward)
    step = np.arange(1, n + 1)
    st = np.ones(n) if step_time is None else np.asarray(step_time, float)
    return pd.DataFrame({"step": step, "samples": step * 8, "wall_s": np.cumsum(st), "reward": reward,
                         "step_time_s": st, **extra})


def kinds(findings):
    return [(f.severity, f.check) for f in findings]


@pytest.mark.slow
def test_healthy_noisy_runs_are_not_flagged():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(20, 120))
        curve = 0.2 + 0.6 * (1 - np.exp(-np.arange(n) / rng.uniform(5, 40)))  # rising, then a plateau
        y = np.clip(curve + rng.normal(0, rng.uniform(0.01, 0.1), n), 0, 1)
        st = 10 + rng.normal(0, 0.3, n)
        assert check.check_seed(0, frame(y, st), ["reward"]) == []


def test_collapse_two_ways():
    rng = np.random.default_rng(1)
    n = 60
    rise_fall = np.r_[np.linspace(0.2, 0.9, 30), np.full(30, 0.15)] + rng.normal(0, 0.03, n)
    (f,) = check.check_seed(3, frame(rise_fall), ["reward"])
    assert (f.severity, f.check, f.seed) == ("error", "collapse", 3) and "fell from" in f.message
    stuck = np.r_[np.linspace(0.1, 0.6, 20) + rng.normal(0, 0.02, 20), np.zeros(40)]
    (f,) = check.check_seed(0, frame(stuck), ["reward"])
    assert f.check == "collapse" and f.steps[0] == 21 and "stays at 0 from step 21" in f.message
    saturated = np.r_[np.linspace(0.1, 0.9, 20), np.ones(40)]  # stuck at its best: not a collapse
    assert check.check_seed(0, frame(saturated), ["reward"]) == []
    never = np.zeros(40)
    assert kinds(check.check_seed(0, frame(never), ["reward"])) == [("warning", "flat reward")]


def test_non_finite_missing_steps_and_outliers():
    y = np.linspace(0.1, 0.5, 30)
    y[12] = np.nan
    st = np.ones(30)
    st[[9, 19]] = 5.0  # validation every 10 steps
    grad = np.ones(30)
    grad[4] = np.inf
    f = frame(y, st, grad_norm=grad).drop(index=[25, 26])  # two rows lost
    found = check.check_seed(0, f, ["reward"])
    assert ("error", "non-finite") in kinds(found)  # NaN in a compared metric
    assert any(x.check == "non-finite" and x.severity == "warning" and "grad_norm is infinite at step 5" in x.message
               for x in found)  # inf in another column
    assert any(x.check == "missing steps" and "26-27" in x.message for x in found)
    outliers = next(x for x in found if x.check == "step-time outliers")
    assert outliers.steps == [10, 20] and "5.00x" in outliers.message
    late = frame(y).assign(step=lambda d: d["step"] + 9)
    assert any("the first step is 10" in x.message for x in check.check_seed(0, late, ["reward"]))


def test_the_first_step_is_warm_up_not_an_outlier():
    """A molt run's step 1 holds the engine warm-up and the first sync (here 8x the others): no warning for it; a
    slow step later still is one."""
    y = np.linspace(0.1, 0.5, 30)
    st = np.r_[8.0, np.full(29, 1.0)] + np.tile([0.0, 0.01, 0.02], 10)  # a little spread for the MAD
    assert "step-time outliers" not in {x.check for x in check.check_seed(0, frame(y, st), ["reward"])}
    st[14] = 8.0
    (outliers,) = [x for x in check.check_seed(0, frame(y, st), ["reward"]) if x.check == "step-time outliers"]
    assert outliers.steps == [15]


def test_mismatch_ranges():
    n = 30
    spikes = np.full(n, 1.02)
    spikes[7] = 3.0
    (f,) = check.check_seed(0, frame(np.linspace(0.1, 0.5, n), **{"train/token_mult_prob_error": spikes}), [])
    assert (f.severity, f.check, f.steps) == ("warning", "mismatch", [8])
    broken = np.full(n, 15.0)
    (f,) = check.check_seed(0, frame(np.linspace(0.1, 0.5, n), **{"mismatch/kl": broken}), [])
    assert f.severity == "error" and f"at {n} of {n} steps" in f.message


def test_repeated_steps_recorded_at_import_and_lengths(tmp_path, smoke_protocol):
    a = tmp_path / "a.jsonl"  # a run resumed from its step-3 checkpoint after step 5: steps 4-5 logged twice
    rows = [(k, 0.1 * k) for k in range(1, 6)] + [(k, 0.1 * k + 0.01) for k in range(4, 11)]
    a.write_text("".join(json.dumps({"step": k, "reward": r, "perf/step_time_s": 1.0}) + "\n" for k, r in rows))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"step": k, "reward": 0.1 * k}) + "\n" for k in range(1, 5))
                 + "".join(json.dumps({"step": k, "lag": 1}) + "\n" for k in range(1, 5)))  # separate calls: fine
    out = runner.import_runs([a, b], Protocol(smoke_protocol), "custom", tmp_path / "rs",
                             maps=["reward=reward", "step_base=1"])
    manifest = json.loads((out / runs.MANIFEST).read_text())
    assert manifest["seeds"]["0"]["repeated_steps"] == [4, 5] and manifest["seeds"]["1"]["repeated_steps"] == []
    rs = load_runset(out)
    assert rs.frames[0]["reward"].iloc[3] == pytest.approx(0.41)  # the resumed run's value is kept
    found = check.check_runset(rs, ["reward"])
    assert ("warning", "repeated steps") in kinds(found)
    lengths = next(x for x in found if x.check == "lengths")
    assert "seed 1 ends at step 4" in lengths.message


@pytest.mark.slow
def test_compare_no_verdict_until_flagged_seed_is_left_out(tmp_path, make_runset, smoke_protocol, capsys):
    healthy = make_runset(tmp_path, "h", [0.5, 0.52, 0.48, 0.51], smoke_protocol)
    other = make_runset(tmp_path, "o", [0.8, 0.82, 0.79, 0.81], smoke_protocol)
    f = pd.read_csv(other / "seed_2" / "metrics.csv")
    f.loc[10:, "reward"] = 0.0  # seed 2 collapses at step 11
    f.to_csv(other / "seed_2" / "metrics.csv", index=False)
    _, b, _, (r,) = compare.compare_runsets(healthy, other, ["reward"])
    assert r.result is None and "B seed 2 (collapse)" in r.no_verdict and "--exclude" in r.no_verdict
    assert b.findings and b.findings[0].check == "collapse"
    _, b, _, (r,) = compare.compare_runsets(healthy, other, ["reward"], exclude=["B:2"])
    assert r.result.verdict_kind == "B better" and b.excluded == [2] and 2 not in r.values_b
    _, _, _, (r,) = compare.compare_runsets(healthy, other, ["reward"], accept_check=True)
    assert r.result is not None and 2 in r.values_b
    with pytest.raises(runs.RunSetError, match="has no seed \\[9\\]"):
        compare.compare_runsets(healthy, other, ["reward"], exclude=["B:9"])
    assert main(["compare", str(healthy), str(other), "--metric", "reward", "--exclude", "B:2",
                 "--report", str(tmp_path / "rep")]) == 0
    assert "(left out: [2])" in capsys.readouterr().out
    assert "## molt-bench check" in (tmp_path / "rep" / "report.md").read_text()


def test_one_seed_against_several_says_what_it_would_take(tmp_path, make_runset, smoke_protocol):
    one = make_runset(tmp_path, "one", [0.6], smoke_protocol)
    many = make_runset(tmp_path, "many", [0.5, 0.52, 0.48, 0.51, 0.49], smoke_protocol)
    _, _, _, (r,) = compare.compare_runsets(one, many, ["reward"])
    assert r.result is None and r.no_verdict.startswith("no verdict: 1 vs 5 seed(s)")
    sd = np.std(list(r.values_b.values()), ddof=1)
    assert f"With the seed SD the other side shows ({sd:.3g})" in r.no_verdict
    _, _, _, (r,) = compare.compare_runsets(one, one, ["reward"])
    assert "n: k = 3: 3.1, 5: 2.0, 10: 1.3, 20: 0.9" in r.no_verdict
