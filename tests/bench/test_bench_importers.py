"""Importers read files written by the formats' own writers (Lightning's CSVLogger, TensorBoard's event writer,
torch's SummaryWriter, json, csv) and map each source stack's names onto the protocol's."""

from __future__ import annotations

import csv
import json

import numpy as np
import pandas as pd
import pytest

from molt_lightning.bench import importers, runner
from molt_lightning.bench.protocol import Protocol
from molt_lightning.bench.runs import RunSetError, load_runset

REWARD = [0.1, 0.3, 0.2, 0.5, 0.4]
STEP_T = [2.0, 1.0, 1.5, 1.0, 0.5]


def imported(tmp_path, protocol, sources, stack, **kw):
    out = runner.import_runs(sources, Protocol(protocol), stack, tmp_path / f"imp_{stack}", **kw)
    return load_runset(out)


def test_lightning_csv_from_csvlogger(tmp_path, smoke_protocol):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="lightning_logs")
    for k, (r, t) in enumerate(zip(REWARD, STEP_T)):
        logger.log_metrics({"reward": r, "perf/step_time_s": t, "perf/gen_tokens_per_s": 100.0 * k,
                            "batch/samples": 8.0 - (k == 2)}, step=k)  # step 2 lost a failed sample
        logger.log_metrics({"lag": 1.0}, step=k)  # a second row for the same step, as separate log calls make
    logger.save()
    rs = imported(tmp_path, smoke_protocol, [tmp_path / "lightning_logs"], "molt", devices=2)
    f = rs.frames[0]
    assert f["step"].tolist() == [1, 2, 3, 4, 5]  # Lightning's 0-based step -> 1-based
    assert f["reward"].tolist() == pytest.approx(REWARD)
    assert f["wall_s"].tolist() == pytest.approx(np.cumsum(STEP_T).tolist())
    assert f["samples"].tolist() == [8, 16, 23, 31, 39]
    assert f["tokens_per_s_per_device"].tolist() == pytest.approx([0, 50, 100, 150, 200])  # per device of 2
    assert f["lag"].tolist() == [1.0] * 5  # unmapped columns come along under their own names


def test_tensorboard_event_writer_as_slime(tmp_path, smoke_protocol):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path / "tb"))
    for k, (r, t) in enumerate(zip(REWARD, STEP_T)):
        for tag, v in (("rollout/raw_reward", r), ("perf/step_time", t), ("perf/tokens_per_gpu_per_sec", 10.0 + k)):
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=v)])
            writer.add_event(event_pb2.Event(wall_time=1e9 + k, step=k, summary=summary))
    writer.close()
    rs = imported(tmp_path, smoke_protocol, [tmp_path / "tb"], "slime")
    f = rs.frames[0]
    assert f["step"].tolist() == [1, 2, 3, 4, 5]
    assert f["reward"].tolist() == pytest.approx(REWARD)
    assert f["step_time_s"].tolist() == pytest.approx(STEP_T)
    assert f["tokens_per_s_per_device"].tolist() == pytest.approx([10, 11, 12, 13, 14])  # already per GPU
    assert f["samples"].tolist() == [8, 16, 24, 32, 40]  # from the protocol: 2 prompts x 4 samples


def test_torch_summarywriter_as_nemo_rl_and_format_guess(tmp_path, smoke_protocol):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "nemo"))
    for k, (r, t) in enumerate(zip(REWARD, STEP_T), start=1):  # NeMo-RL logs from step 1
        w.add_scalar("train/reward", r, k)
        w.add_scalar("timing/train/total_step_time", t, k)
        w.add_scalar("performance/generation_tokens_per_sec_per_gpu", 5.0 * k, k)
    w.close()
    assert importers.guess_format(tmp_path / "nemo") == "tensorboard"
    f = imported(tmp_path, smoke_protocol, [tmp_path / "nemo"], "nemo-rl").frames[0]
    assert f["step"].tolist() == [1, 2, 3, 4, 5]
    assert f["reward"].tolist() == pytest.approx(REWARD)
    assert f["wall_s"].iloc[-1] == pytest.approx(sum(STEP_T))


def test_jsonl_nested_as_verl(tmp_path, smoke_protocol):
    path = tmp_path / "verl.jsonl"
    with open(path, "w") as fh:
        for k, (r, t) in enumerate(zip(REWARD, STEP_T), start=1):
            fh.write(json.dumps({"step": k, "critic": {"score": {"mean": r}}, "timing_s/step": t,
                                 "perf/throughput": 3.0}) + "\n")
            fh.write("\n")
    f = imported(tmp_path, smoke_protocol, [path], "verl").frames[0]
    assert f["reward"].tolist() == pytest.approx(REWARD)
    assert f["step_time_s"].tolist() == pytest.approx(STEP_T)


def test_wandb_history_export_as_trl(tmp_path, smoke_protocol):
    path = tmp_path / "history.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["_step", "_runtime", "_timestamp", "train/global_step", "train/reward", "train/step_time"])
        for k, (r, t) in enumerate(zip(REWARD, STEP_T)):
            w.writerow([k, 10 * k, 1.7e9 + 10 * k, k + 1, r, t])
    assert importers.guess_format(path) == "wandb-csv"
    f = imported(tmp_path, smoke_protocol, [path], "trl-wandb").frames[0]
    assert f["step"].tolist() == [1, 2, 3, 4, 5]  # from train/global_step (1-based), not W&B's _step
    assert f["reward"].tolist() == pytest.approx(REWARD)


def test_wandb_panel_export_splits_runs_and_drops_min_max(tmp_path, smoke_protocol):
    path = tmp_path / "panel.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Step", "seed-a - train/reward", "seed-a - train/reward__MIN", "seed-a - train/reward__MAX",
                    "seed-b - train/reward", "seed-b - train/reward__MIN", "seed-b - train/reward__MAX"])
        for k, r in enumerate(REWARD, start=1):
            w.writerow([k, r, r - 1, r + 1, r / 2, 0, 0])
    rs = imported(tmp_path, smoke_protocol, [path], "trl-wandb", maps=["step=step"], seeds=[3, 7])
    assert rs.seeds == [3, 7]
    assert rs.frames[3]["reward"].tolist() == pytest.approx(REWARD)
    assert rs.frames[7]["reward"].tolist() == pytest.approx([r / 2 for r in REWARD])
    assert "train/reward__MIN" not in rs.frames[3]


def test_custom_map_and_clear_errors(tmp_path, smoke_protocol):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"iteration": k, "score": r}) + "\n" for k, r in enumerate(REWARD)))
    f = imported(tmp_path, smoke_protocol, [path], "custom", maps=["reward=score"]).frames[0]
    assert f["reward"].tolist() == pytest.approx(REWARD) and f["step"].tolist() == [1, 2, 3, 4, 5]
    nostep = tmp_path / "nostep.jsonl"
    nostep.write_text(json.dumps({"score": 1.0}) + "\n")
    with pytest.raises(RunSetError, match="no step column"):
        importers.read(nostep)
    with pytest.raises(RunSetError, match="unknown source stack 'megatron'"):
        importers.column_map("megatron")
    with pytest.raises(RunSetError, match="NAME=COLUMN"):
        importers.column_map("slime", ["reward"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(RunSetError, match="bad.jsonl:1: not JSON"):
        importers.read(bad)
    with pytest.raises(RunSetError, match="2 seeds given"):
        runner.import_runs([path], type("P", (), {})(), "custom", tmp_path / "x", maps=["reward=score"], seeds=[0, 1])


def test_a_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(RunSetError, match="missing.csv: no such file or folder"):
        importers.read(tmp_path / "missing.csv")  # not a FileNotFoundError from the format guess


def test_imported_runs_compare_through_the_cli(tmp_path, smoke_protocol, capsys):
    """Two imported stacks, one from TensorBoard and one from JSONL, compared end to end with a report."""
    from torch.utils.tensorboard import SummaryWriter

    from molt_lightning.bench.cli import main

    rng = np.random.default_rng(0)
    for seed in range(4):
        w = SummaryWriter(str(tmp_path / f"tb{seed}"))
        with open(tmp_path / f"j{seed}.jsonl", "w") as fh:
            for k in range(6):
                w.add_scalar("rollout/raw_reward", 0.5 + 0.01 * rng.normal(), k)
                w.add_scalar("perf/step_time", 1.0, k)
                fh.write(json.dumps({"step": k + 1, "critic/score/mean": 0.2 + 0.01 * rng.normal(),
                                     "timing_s/step": 1.0}) + "\n")
        w.close()
    proto = tmp_path / "p.yaml"
    import yaml

    proto.write_text(yaml.safe_dump(smoke_protocol))
    assert main(["import", *[str(tmp_path / f"tb{s}") for s in range(4)], "--protocol", str(proto),
                 "--source-stack", "slime", "--out", str(tmp_path / "slime"), "--label", "slime (Megatron)"]) == 0
    assert main(["import", *[str(tmp_path / f"j{s}.jsonl") for s in range(4)], "--protocol", str(proto),
                 "--source-stack", "verl", "--out", str(tmp_path / "verl")]) == 0
    assert main(["compare", str(tmp_path / "slime"), str(tmp_path / "verl"), "--metric", "reward",
                 "--report", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "verdict: A better" in out
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["metrics"][0]["verdict_kind"] == "A better"
    manifest = json.loads((tmp_path / "slime" / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "import" and manifest["source"]["source_stack"] == "slime"
    assert pd.read_csv(tmp_path / "slime" / "seed_0" / "metrics.csv")["step"].tolist() == [1, 2, 3, 4, 5, 6]
