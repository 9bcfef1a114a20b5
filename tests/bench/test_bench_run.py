"""Real runs on this machine (TorchEngine, the 3-step smoke protocol): manifests, resume, failures, reports, TRL
through rollout_func (the stock TRL stack: ``test_bench_trl_stock.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from molt_lightning.bench import compare, report, runner
from molt_lightning.bench.protocol import ProtocolError, load_protocol
from molt_lightning.bench.runs import load_runset

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_runs")
    p = load_protocol("arithmetic-smoke")
    runner.run(p, "molt", 2, root / "async", log=lambda *_: None)
    runner.run(p, "molt-sync", 2, root / "sync", log=lambda *_: None)
    return root


@pytest.mark.slow
def test_run_writes_metrics_and_a_manifest(real_runs):
    rs = load_runset(real_runs / "async")
    m = rs.manifest
    assert rs.seeds == [0, 1]
    assert m["stack"] == "molt" and m["fingerprint"] == load_protocol("arithmetic-smoke").fingerprint
    assert set(m["environment"]["packages"]) >= {"torch", "lightning", "scipy"}
    assert {"revision", "dirty"} <= set(m["environment"]["git"])
    assert m["environment"]["machine"]["cpus"] >= 1
    for info in m["seeds"].values():
        assert info["status"] == "ok" and info["wall_time_s"] > 0 and info["steps"] == 3
        assert (real_runs / "async" / info["raw"] / "lightning_logs").is_dir()  # the stack's own log is kept
    f = rs.frames[0]
    assert f["step"].tolist() == [1, 2, 3]
    assert f[["reward", "step_time_s", "tokens_per_s_per_device", "samples", "wall_s"]].notna().all().all()
    assert f["wall_s"].iloc[-1] == pytest.approx(f["step_time_s"].sum())
    assert f["samples"].iloc[-1] == pytest.approx(f["batch/samples"].sum())
    assert (f["reward"].between(0, 1)).all()


@pytest.mark.slow
def test_sync_stack_records_max_lag_zero_and_compare_needs_allow(real_runs):
    sync = load_runset(real_runs / "sync")
    assert sync.protocol["max_lag"] == 0 and sync.manifest["stack_changes"] == {"max_lag": 0}
    assert (sync.frames[0]["lag"] == 0).all()  # it really ran on-policy
    with pytest.raises(ProtocolError, match="--allow-diff max_lag"):
        compare.compare_runsets(real_runs / "async", real_runs / "sync")
    a, b, allowed, results = compare.compare_runsets(real_runs / "async", real_runs / "sync", allow=["max_lag"])
    assert [r.spec.name for r in results] == ["reward", "step_time_s", "tokens_per_s_per_device"]
    for r in results:
        assert r.result.verdict  # one line per metric
        assert list(r.values_a) == [0, 1]
    paths = report.write(real_runs / "report", a, b, allowed, results)
    html = paths["html"].read_text()
    assert "data:image/png;base64," in html and "verdict" in html
    md = paths["markdown"].read_text()
    for name in ("reward", "step_time_s", "tokens_per_s_per_device"):
        for kind in ("curves", "seeds"):
            png = real_runs / "report" / f"{kind}_{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.name in md


def test_rerun_resumes_and_other_runs_are_refused(real_runs):
    before = json.loads((real_runs / "async" / "manifest.json").read_text())["seeds"]
    said = []
    runner.run(load_protocol("arithmetic-smoke"), "molt", 2, real_runs / "async", log=said.append)
    after = json.loads((real_runs / "async" / "manifest.json").read_text())["seeds"]
    assert before == after and all("kept" in s for s in said)
    with pytest.raises(FileExistsError, match="holds stack molt-sync"):
        runner.run(load_protocol("arithmetic-smoke"), "molt", 1, real_runs / "sync")


def test_unsupported_protocol_values_are_refused_before_running(tmp_path):
    with pytest.raises(ValueError, match="cannot run sampling.top_p=0.9"):
        runner.run(load_protocol("arithmetic-smoke", ["sampling.top_p=0.9"]), "molt", 1, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="unknown stack 'megatron'"):
        runner.run(load_protocol("arithmetic-smoke"), "megatron", 1, tmp_path / "y")


def test_a_failing_seed_is_recorded_and_reported(tmp_path):
    p = load_protocol("arithmetic-smoke", ["task.agent=molt_lightning.tasks.arithmetic.no_such_agent"])
    with pytest.raises(RuntimeError, match=r"seeds \[0\] failed"):
        runner.run(p, "molt", 1, tmp_path / "bad", log=lambda *_: None)
    info = json.loads((tmp_path / "bad" / "manifest.json").read_text())["seeds"]["0"]
    assert info["status"] == "failed" and "no_such_agent" in info["error"]


@pytest.mark.slow
def test_trl_rollout_func_stack_runs_the_same_protocol(tmp_path):
    pytest.importorskip("trl")
    out = runner.run(load_protocol("arithmetic-smoke"), "trl-rollout-func", 2, tmp_path / "trl", log=lambda *_: None)
    rs = load_runset(out)
    assert rs.protocol["max_lag"] == 0 and "GRPOTrainer" in rs.manifest["stack_config"]["trainer"]
    f = rs.frames[1]
    assert f["step"].tolist() == [1, 2, 3]
    assert f[["reward", "step_time_s", "tokens_per_s_per_device"]].notna().all().all()
    raw = pd.read_json(out / "seed_1" / "raw" / "trl_log.jsonl", lines=True)
    assert raw["reward"].tolist() == pytest.approx(f["reward"].tolist())  # TRL's own logged reward, mapped
    assert (raw["completions/mean_length"] > 0).all()


def test_cli_help_is_instant_and_imports_no_torch():
    code = ("import sys; from molt_lightning.bench.cli import build_parser; "
            "build_parser().parse_args(['compare', 'a', 'b']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_molt_stack_runs_ppo_epochs_and_mini_batches(tmp_path, smoke_protocol):
    """``algorithm.updates_per_batch`` and ``mini_batches`` are real for the molt stack: 2 x 2 optimizer steps per
    batch, and the protocol's ``steps`` still count batches (policy versions)."""
    from molt_lightning.bench.protocol import Protocol

    data = {**smoke_protocol, "algorithm": {**smoke_protocol["algorithm"], "updates_per_batch": 2, "mini_batches": 2}}
    runner.run(Protocol(data), "molt", 1, tmp_path / "ppo", log=lambda *_: None)
    f = load_runset(tmp_path / "ppo").frames[0]
    assert f["step"].tolist() == [1, 2, 3] and (f["batch/optimizer_steps"] == 4).all()
    bad = {**data, "algorithm": {**data["algorithm"], "updates_per_batch": 0}}
    with pytest.raises(ValueError, match="updates_per_batch"):
        runner.run(Protocol(bad), "molt", 1, tmp_path / "bad", log=lambda *_: None)
