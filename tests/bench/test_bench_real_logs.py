"""molt-bench on the logs other stacks really wrote (../shared/real-logs/, copied byte for byte from their public
repositories; see that folder's README for provenance). Each expected number below was read out of the file by hand
(the line is named), not produced by the reader under test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from molt_lightning.bench import check, importers, runner, runs
from molt_lightning.bench.cli import main
from molt_lightning.bench.protocol import load_protocol
from molt_lightning.bench.runs import load_runset


def _real_logs() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    for candidate in (os.environ.get("MOLT_REAL_LOGS"), here.parent / "shared" / "real-logs",
                      "/work/shared/real-logs"):
        if candidate and Path(candidate, "README.md").exists():
            return Path(candidate)
    return None


LOGS = _real_logs()
pytestmark = pytest.mark.skipif(LOGS is None, reason="../shared/real-logs not found: set MOLT_REAL_LOGS to the folder")
NEMO_BROKEN = "nemo-rl/grpo-qwen2.5-7b-2n8g-megatron-sglang-noncolo-nccl.metrics.json"
NEMO_MOE = "nemo-rl/grpo-nanov3-30BA3B-2n8g-fsdp2.metrics.json"
NEMO_AUDIO = "nemo-rl/functional-audio_grpo_megatron.metrics.json"
AREAL = "areal/logs_1xA100_fastest_completed.txt"


def imported(tmp_path, files, stack, protocol="verl-gsm8k-qwen2.5-3b", name=None, **kw):
    out = tmp_path / (name or stack)
    runner.import_runs([LOGS / f for f in files], load_protocol(protocol, kw.pop("overrides", None)), stack, out,
                       **kw)
    return load_runset(out)


def test_nemo_rl_metrics_json_megatron_broken_run(tmp_path):
    assert importers.guess_format(LOGS / NEMO_BROKEN) == "nemo-rl-json"
    rs = imported(tmp_path, [NEMO_BROKEN], "nemo-rl", "nemo-rl-grpo-qwen2.5-7b-smoke")
    f = rs.frames[0]
    assert f["step"].tolist() == list(range(0, 31))  # the ray/ tags (their own counter, up to 1108) are left out
    assert f["timing/setup/total_setup_time_s"].iloc[0] == 159.33119201660156  # line 7398: setup, logged at step 0
    assert f["samples"].iloc[0] == 0 and f["wall_s"].iloc[0] == 0  # before the first optimizer step
    f = f.iloc[1:]
    # line 9134: "1": 0.59375, line 9135: "2": 0.0, line 9163: "30": 0.0
    assert f["reward"].iloc[[0, 1, 29]].tolist() == [0.59375, 0.0, 0.0]
    # lines 7886, 7887, 7915: total_step_time 48.32798767089844, 27.967069625854492, 39.630584716796875
    assert f["step_time_s"].iloc[[0, 1, 29]].tolist() == pytest.approx([48.32798767089844, 27.967069625854492,
                                                                        39.630584716796875])
    # lines 35, 36, 64: generation_tokens_per_sec_per_gpu (already per GPU)
    assert f["tokens_per_s_per_device"].iloc[[0, 1, 29]].tolist() == pytest.approx(
        [2027.591064453125, 4371.748046875, 4472.83642578125])
    assert f["train/token_mult_prob_error"].iloc[[0, 29]].tolist() == pytest.approx([25324.13671875,
                                                                                      15.759299278259277])
    findings = check.check_runset(rs, ["reward"])
    kinds = {(x.severity, x.check) for x in findings}
    assert ("error", "collapse") in kinds and ("error", "mismatch") in kinds
    collapse = next(x for x in findings if x.check == "collapse")
    assert collapse.steps[0] == 2 and "0.5938 at step 1" in collapse.message


def test_nemo_rl_moe_fsdp2_and_audio_megatron(tmp_path):
    moe = imported(tmp_path, [NEMO_MOE], "nemo-rl", "nemo-rl-grpo-nanov3-30b-a3b", name="moe").frames[0]
    moe = moe[moe["step"] >= 1]
    assert len(moe) == 10
    # line 2065 "1": 0.0 (train/reward); line 1594 "1": 72.78610229492188, line 1603 "10": 119.11610412597656
    assert moe["reward"].iloc[0] == 0.0
    assert moe["step_time_s"].iloc[[0, 9]].tolist() == pytest.approx([72.78610229492188, 119.11610412597656])
    assert moe["tokens_per_s_per_device"].iloc[[0, 9]].tolist() == pytest.approx([87.32830047607422,
                                                                                  265.8811340332031])  # lines 15, 24
    assert moe["validation/accuracy"].dropna().tolist() == [0.01171875]  # line 2197, only at step 10
    findings = check.check_runset(load_runset(tmp_path / "moe"), ["reward"])
    assert not check.errors(findings)  # not broken: a flat reward, one mismatch spike, a slow last step
    assert {x.check for x in findings} == {"flat reward", "mismatch", "step-time outliers"}
    spike = next(x for x in findings if x.check == "mismatch")
    assert spike.steps == [6] and "3.26" in spike.message

    ((_, raw),) = importers.read(LOGS / NEMO_AUDIO)  # no protocol of its own: normalised directly, 2 x 4 samples
    spec = importers.column_map("nemo-rl")
    audio = runs.normalise(raw, importers.resolve_columns(spec["columns"], raw), 8, spec["step_base"])
    audio = audio[audio["step"] >= 1]  # step 0: setup timings
    # lines 274-275 (train/reward) and 118-119 (total_step_time)
    assert audio["reward"].tolist() == pytest.approx([0.29374998807907104, 0.512499988079071])
    assert audio["step_time_s"].tolist() == pytest.approx([20.259756088256836, 17.398963928222656])
    assert check.check_seed(0, audio, ["reward"]) == []


def test_areal_console_tables_two_launches(tmp_path):
    assert importers.guess_format(LOGS / AREAL) == "areal-console"
    runs = importers.read(LOGS / AREAL)
    assert [len(f) for _, f in runs] == [10, 7]  # the file holds a completed launch and a relaunch cut at step 7
    rs = imported(tmp_path, [AREAL], "areal", "areal-gsm8k-fastest", seeds=[0, 1])
    first, second = rs.frames[0], rs.frames[1]
    assert first["step"].tolist() == list(range(1, 11))  # "Train step g/G" is global_step + 1: steps from 1
    # line 220 (step 1) and 275 (step 2): grpo_actor/task_reward/avg 5.0000e-01; line 715 (step 10) 5.0000e-01
    assert first["reward"].iloc[[0, 1, 9]].tolist() == [0.5, 0.5, 0.5]
    # line 222: grpo_actor/behave_imp_weight/avg 9.9846e-01 at step 1; line 4228: 9.9944e-01 at the relaunch's step 1
    assert first["grpo_actor/behave_imp_weight/avg"].iloc[0] == 0.99846
    assert second["grpo_actor/behave_imp_weight/avg"].iloc[0] == 0.99944
    # step time from StatsLogger's own clock: line 200 "16:28:33.430 ... Train step 1/10 done", line 255
    # "16:28:41.731 ... Train step 2/10 done": 8.301 s; the first step's start is not in the log
    assert first["step_time_s"].iloc[1] == pytest.approx(8.301, abs=1e-6)
    assert first["step_time_s"].isna().iloc[0]
    manifest = json.loads((tmp_path / "areal" / "manifest.json").read_text())
    assert manifest["seeds"]["0"]["columns_used"]["reward"] == "grpo_actor/task_reward/avg"  # the older name
    findings = check.check_runset(rs)
    assert [x.check for x in findings] == ["lengths"] and "seed 1 ends at step 7" in findings[0].message


@pytest.mark.slow
def test_verl_tensorboard_megatron_and_fsdp_on_one_protocol(tmp_path):
    mcore = imported(tmp_path, ["verl/q3b_mcore_base"], "verl", name="mcore", label="verl Megatron")
    fsdp = imported(tmp_path, ["verl/q3b_fsdp_base"], "verl", name="fsdp", label="verl FSDP")
    assert mcore.manifest["fingerprint"] == fsdp.manifest["fingerprint"]
    m = mcore.frames[0]
    assert m["step"].iloc[0] == 0 and m["samples"].iloc[0] == 0  # validation before training, at step 0
    assert m["step"].iloc[-1] == 105
    # values from the event records (tensorboard's event_file_loader, step: simple_value)
    assert m.set_index("step").loc[[1, 2, 105], "reward"].tolist() == pytest.approx(
        [0.564648449420929, 0.7044922113418579, 0.9634765386581421])
    assert m.set_index("step").loc[[1, 105], "step_time_s"].tolist() == pytest.approx([554.5037841796875,
                                                                                        727.754150390625])
    assert m.set_index("step").loc[1, "tokens_per_s_per_device"] == pytest.approx(451.92840576171875)
    assert fsdp.frames[0].set_index("step").loc[1, "step_time_s"] == pytest.approx(585.2732543945312)
    assert m["samples"].iloc[-1] == 105 * 1024 * 5
    assert check.check_runset(mcore) == [] and check.check_runset(fsdp) == []


@pytest.mark.slow
def test_verl_megatron_vs_fsdp_one_run_each_gives_curves_not_a_verdict(tmp_path, capsys):
    for name, src in (("mcore", "q3b_mcore_base"), ("fsdp", "q3b_fsdp_base")):
        assert main(["import", str(LOGS / "verl" / src), "--protocol", "verl-gsm8k-qwen2.5-3b", "--source-stack",
                     "verl", "--out", str(tmp_path / name)]) == 0
    assert main(["compare", str(tmp_path / "mcore"), str(tmp_path / "fsdp"), "--report", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert out.count("no verdict: 1 vs 1 seed(s)") == 3 and "needs 2 seeds per side at least" in out
    assert (tmp_path / "rep" / "curves_reward.png").stat().st_size > 10_000  # the curves are still drawn
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert all(m["no_verdict"] and "verdict" not in m for m in summary["metrics"])


def test_verl_ppo_repeats_five_vs_two_sequence_parallel(tmp_path, capsys):
    repeats = sorted((LOGS / "verl" / "dp_sp_repeats").glob("dp_2_gpu_*.csv"))
    sp = sorted((LOGS / "verl" / "dp_sp_repeats").glob("uly_sp2_*.csv"))
    assert len(repeats) == 5 and len(sp) == 2
    for name, files in (("dp", repeats), ("sp", sp)):
        assert main(["import", *map(str, files), "--protocol", "verl-gsm8k-ppo-qwen2.5-0.5b", "--source-stack",
                     "verl", "--out", str(tmp_path / name)]) == 0
    dp = load_runset(tmp_path / "dp")
    f = dp.frames[0]  # dp_2_gpu_20251110_100611_parsed.csv
    assert len(f) == 116
    # line 2 (step 1): perf/throughput 2796.793558, timing_s/step 9.474421, critic/rewards/mean 0.000000;
    # line 3 (step 2): critic/rewards/mean 0.015625; line 117 (step 116): 0.515625, timing_s/step 9.175151
    assert f["reward"].iloc[[0, 1, 115]].tolist() == [0.0, 0.015625, 0.515625]
    assert f["step_time_s"].iloc[[0, 115]].tolist() == [9.474421, 9.175151]
    assert f["tokens_per_s_per_device"].iloc[0] == 2796.793558
    assert dp.manifest["seeds"]["0"]["columns_used"]["reward"] == "critic/rewards/mean"  # no critic/score/mean
    assert main(["check", str(tmp_path / "dp"), str(tmp_path / "sp")]) == 0
    assert main(["compare", str(tmp_path / "sp"), str(tmp_path / "dp"), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "verdict: A better" in out.split("== step_time_s")[1].split("==")[0]  # 7.4 s vs 9.5 s per step
    assert "verdict: inconclusive" in out.split("== reward")[1].split("==")[0]


def test_compare_refuses_a_verdict_over_the_broken_run(tmp_path, capsys):
    for name, src in (("broken", NEMO_BROKEN), ("moe", NEMO_MOE)):
        assert main(["import", str(LOGS / src), str(LOGS / src), "--protocol", "verl-gsm8k-qwen2.5-3b",
                     "--source-stack", "nemo-rl", "--out", str(tmp_path / name)]) == 0  # the file twice: 2 "seeds"
    assert main(["check", str(tmp_path / "broken")]) == 1
    main(["compare", str(tmp_path / "broken"), str(tmp_path / "moe"), "--metric", "reward", "--no-report"])
    out = capsys.readouterr().out
    assert "no verdict: molt-bench check found errors in A seed 0 (collapse), A seed 0 (mismatch)" in out
    main(["compare", str(tmp_path / "broken"), str(tmp_path / "moe"), "--metric", "reward", "--no-report",
          "--accept-check"])
    assert "verdict: A better" in capsys.readouterr().out  # what a comparison without the check would have said
