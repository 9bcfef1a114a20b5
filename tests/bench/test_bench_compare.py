"""Per-run summaries and the compare pipeline on synthetic run sets, against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from molt_lightning.bench import compare, summaries
from molt_lightning.bench.protocol import ProtocolError, metric_spec


def test_final_mean_and_auc_by_step(tmp_path, smoke_protocol, make_runset):
    a = make_runset(tmp_path, "a", [0.4, 0.6, 0.8], smoke_protocol)
    b = make_runset(tmp_path, "b", [0.5, 0.5, 0.6], smoke_protocol)
    _, _, _, (r,) = compare.compare_runsets(a, b, ["reward"])
    steps = np.arange(1, 21)
    for final, got in zip([0.4, 0.6, 0.8], r.values_a.values()):
        curve = final * steps / 20
        assert got == pytest.approx(curve[-2:].mean())  # smoke protocol: last_k = 2
    _, _, _, (auc,) = compare.compare_runsets(a, b, ["reward"], summary="auc")
    curve = 0.4 * steps / 20
    assert auc.values_a[0] == pytest.approx(np.trapezoid(curve, steps) / 19)
    _, _, _, (mean,) = compare.compare_runsets(a, b, ["reward"], summary="mean")
    assert mean.values_a[0] == pytest.approx(curve.mean())  # reward has no warm-up in the protocol
    spec = metric_spec("reward", {"summary": "mean", "warmup": 3})
    frame = compare.load_runset(a).frames[0]
    assert summaries.summarise(frame, spec, "step", 20) == pytest.approx(curve[3:].mean())


def test_wall_axis_cuts_both_sides_at_the_common_budget(tmp_path, smoke_protocol, make_runset):
    finals = [0.5, 0.52, 0.54, 0.56]
    fast = make_runset(tmp_path, "fast", finals, smoke_protocol, step_time=1.0)
    slow = make_runset(tmp_path, "slow", finals, smoke_protocol, step_time=2.0)
    _, _, _, (r,) = compare.compare_runsets(fast, slow, ["reward"], by="wall")
    assert r.horizon == pytest.approx(20.0)  # the fast runs end at 20 s; the slow ones are cut there (step 10)
    assert r.values_b[0] == pytest.approx(np.mean([0.5 * 9 / 20, 0.5 * 10 / 20]))
    assert r.values_a[0] == pytest.approx(np.mean([0.5 * 19 / 20, 0.5 * 20 / 20]))
    assert r.result.verdict_kind == "A better"  # same curve per step, twice the steps in the same wall time
    _, _, _, (by_step,) = compare.compare_runsets(fast, slow, ["reward"], by="step")
    assert by_step.result.verdict_kind == "comparable"  # identical per step


def test_time_to_threshold(tmp_path, smoke_protocol, make_runset):
    a = make_runset(tmp_path, "a", [0.6, 0.2], smoke_protocol)  # threshold 0.3 in the smoke protocol
    _, _, _, (r,) = compare.compare_runsets(a, a, ["reward"])
    assert r.threshold_a[0] == 10  # 0.6 * 10 / 20 = 0.3 first reached at step 10
    assert np.isnan(r.threshold_a[1])


def test_relative_margin_uses_side_b_mean(tmp_path, smoke_protocol, make_runset):
    a = make_runset(tmp_path, "a", [0.5, 0.6], smoke_protocol, step_time=1.0)
    b = make_runset(tmp_path, "b", [0.5, 0.6], smoke_protocol, step_time=4.0)
    _, _, _, (r,) = compare.compare_runsets(a, b, ["step_time_s"])  # protocol margin: 10%
    assert r.result.margin == pytest.approx(0.4)
    assert r.result.verdict == "A better (no variation between seeds)"  # goal min: A's steps take 1 s, B's 4 s
    _, _, _, (r,) = compare.compare_runsets(a, b, ["step_time_s"], margin="0.5")
    assert r.result.margin == 0.5


def test_metrics_outside_the_protocol_need_goal_and_margin(tmp_path, smoke_protocol, make_runset):
    a = make_runset(tmp_path, "a", [0.5, 0.6], smoke_protocol)
    with pytest.raises(ProtocolError, match="pass --goal max|min and --margin"):
        compare.compare_runsets(a, a, ["wall_s"])
    _, _, _, (r,) = compare.compare_runsets(a, a, ["wall_s"], goal="min", margin="1", summary="final")
    assert r.result.verdict_kind == "comparable"
    with pytest.raises(ValueError, match="no column 'entropy'"):
        compare.compare_runsets(a, a, ["entropy"], goal="max", margin="1")


def test_time_to_threshold_gets_a_verdict(tmp_path, smoke_protocol, make_runset):
    """summary ttt: each seed's first x at the threshold is its value; lower is better; the margin defaults to 20% of
    B's mean time; a seed that never gets there is named."""
    finals = [0.6, 0.62, 0.64, 0.66]  # reward = final * step / 20 reaches 0.3 at step ceil(6 / final)
    fast = make_runset(tmp_path, "fast", finals, smoke_protocol, step_time=1.0)
    slow = make_runset(tmp_path, "slow", finals, smoke_protocol, step_time=2.0)
    _, _, _, (r,) = compare.compare_runsets(fast, slow, ["reward"], by="wall", summary="ttt")
    steps = [int(np.ceil(0.3 * 20 / f - 1e-9)) for f in finals]
    assert list(r.values_a.values()) == pytest.approx([1.0 * s for s in steps])
    assert list(r.values_b.values()) == pytest.approx([2.0 * s for s in steps])
    assert r.spec.goal == "min" and r.result.margin == pytest.approx(0.2 * np.mean([2.0 * s for s in steps]))
    assert r.result.verdict_kind == "A better"
    assert "ttt (first wall at reward 0.3; lower is better)" in compare.text_report(*compare.compare_runsets(
        fast, slow, ["reward"], by="wall", summary="ttt"))
    _, _, _, (same,) = compare.compare_runsets(fast, fast, ["reward"], by="wall", summary="ttt", margin="1")
    assert same.result.verdict_kind == "comparable"
    never = make_runset(tmp_path, "never", [0.6, 0.2], smoke_protocol)
    with pytest.raises(ProtocolError, match=r"A seed 1 never reached reward 0.3"):
        compare.compare_runsets(never, fast, ["reward"], summary="ttt")
    _, _, _, (lower,) = compare.compare_runsets(never, fast, ["reward"], summary="ttt", threshold=0.1)
    assert lower.values_a[1] == 10  # 0.2 * step / 20 reaches 0.1 at step 10


def test_an_unreachable_seed_count_reads_more_than_10000(tmp_path, smoke_protocol, make_runset):
    """|difference| >= margin: no seed count shows equivalence; the power line says "more than 10000" as the
    verdict rule (README) does, not the cap itself."""
    a = make_runset(tmp_path, "a", [0.5, 0.7, 0.6], smoke_protocol)
    b = make_runset(tmp_path, "b", [0.45, 0.65, 0.55], smoke_protocol)
    text = compare.text_report(*compare.compare_runsets(a, b, ["reward"], margin="0.01"))
    power = next(line for line in text.splitlines() if "seeds per side for 80% power" in line)
    assert power.endswith("to show equivalence within +-0.01 more than 10000"), power
