"""Console-log and JSONL readers on lines written the way each stack's own logging code writes them (the real
objects: torch tensors, numpy scalars, Python's logging formatter, pprint), and a clear error for a line of theirs
that does not parse."""

from __future__ import annotations

import json
import logging
import pprint

import numpy as np
import pytest
import torch

from molt_lightning.bench import consoles, importers, runner
from molt_lightning.bench.protocol import Protocol
from molt_lightning.bench.runs import RunSetError, load_runset


def verl_console_line(step: int, metrics: dict) -> str:
    """verl/utils/logger/aggregate_logger.py ``concat_dict_to_str`` (since 2025-07): numbers only, pprint.pformat."""
    out = [f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in metrics.items() if isinstance(v, (int, float))]
    return " - ".join(out)


def test_verl_console_new_and_old_formats_with_ray_prefix(tmp_path, smoke_protocol):
    path = tmp_path / "verl.log"
    lines = ["(TaskRunner pid=4711) INFO some vLLM banner", "Training Progress:  10%|#         | 1/10"]
    for k in range(1, 5):
        lines.append("(TaskRunner pid=4711) " + verl_console_line(k, {
            "critic/score/mean": np.float64(0.1 * k), "timing_s/step": 2.0 + k, "perf/throughput": np.float32(50.0),
            "training/global_step": k, "actor/note": "not a number"}))
    lines.append("step:5 - critic/score/mean:0.500 - timing_s/step:7.000 - training/rollout_probs_diff_mean:0.003")
    path.write_text("\n".join(lines) + "\n")
    assert importers.guess_format(path) == "verl-console"
    rs = load_runset(runner.import_runs([path], Protocol(smoke_protocol), "verl", tmp_path / "out"))
    f = rs.frames[0]
    assert f["step"].tolist() == [1, 2, 3, 4, 5]
    assert f["reward"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert f["step_time_s"].tolist() == pytest.approx([3, 4, 5, 6, 7])
    assert f["training/rollout_probs_diff_mean"].dropna().tolist() == [0.003]
    assert "actor/note" not in f
    bad = tmp_path / "bad.log"
    bad.write_text(lines[2] + "\nstep:2 - critic/score/mean:np.float64(0.2 - timing_s/step:3.0\n")
    with pytest.raises(RunSetError, match=r"bad.log:2: a verl step line that does not parse"):
        importers.read(bad, "verl-console")


def test_verl_file_logger_jsonl_rows(tmp_path, smoke_protocol):
    path = tmp_path / "exp.jsonl"  # verl/utils/tracking.py FileLogger: {"step": N, "data": {...}} per line
    rows = [{"step": 0, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.3}}]
    rows += [{"step": k, "data": {"critic/score/mean": 0.1 * k, "timing_s/step": 1.0, "perf/throughput": 9.0,
                                  "actor/grad_norm": float("nan") if k == 2 else 1.0}} for k in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN as the bare token NaN
    f = load_runset(runner.import_runs([path], Protocol(smoke_protocol), "verl", tmp_path / "out")).frames[0]
    assert f["step"].tolist() == [0, 1, 2, 3]
    assert f["reward"].tolist()[1:] == pytest.approx([0.1, 0.2, 0.3])
    assert f["samples"].tolist() == [0, 8, 16, 24]  # step 0 (validation before training) stands for no samples
    assert np.isnan(f["actor/grad_norm"].iloc[2])


def test_slime_console_lines_from_its_logger(tmp_path, smoke_protocol):
    path = tmp_path / "slime.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(filename)s:%(lineno)d - %(message)s"))
    log = logging.getLogger("slime-test")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    for rid in range(3):
        log.info(f"rollout {rid}: {dict({'rollout/raw_reward': torch.tensor([0.2 + 0.1 * rid]), 'rollout/step': rid, 'rollout/response_lengths': np.float64(100.0)})}")  # noqa: E501
        log.info(f"perf {rid}: {dict({'perf/rollout_time': 3.5, 'perf/tokens_per_gpu_per_sec': np.float64(1000.0 + rid)})}")  # noqa: E501
        log.info(f"step {rid}: {dict({'train/loss': torch.tensor(0.5), 'train/step': rid, 'train/grad_norm': float('nan')})}")  # noqa: E501
        log.info(f"perf {rid}: {dict({'perf/step_time': 10.0 + rid, 'perf/actor_train_tok_per_s': 77.0})}")
        log.info(f"critic-step {rid}: {dict({'train/critic_loss': 1.0})}")  # not read
    handler.close()
    log.removeHandler(handler)
    assert importers.guess_format(path) == "slime-console"
    f = load_runset(runner.import_runs([path], Protocol(smoke_protocol), "slime", tmp_path / "out")).frames[0]
    assert f["step"].tolist() == [1, 2, 3]  # rollout/step from 0
    assert f["reward"].tolist() == pytest.approx([0.2, 0.3, 0.4], abs=1e-4)  # tensor([0.2000]) prints 4 digits
    assert f["step_time_s"].tolist() == [10, 11, 12]  # the train side's perf line, merged into its rollout's row
    assert f["tokens_per_s_per_device"].tolist() == [1000, 1001, 1002]  # the rollout side's
    assert "train/critic_loss" not in f
    assert consoles.scalar("tensor(0.25, device='cuda:0')") == 0.25
    assert consoles.scalar("np.float64(-1e-3)") == -1e-3
    assert np.isnan(consoles.scalar("tensor(nan)"))
    assert consoles.scalar("'text'") is None and consoles.scalar("[1.0, 2.0]") is None
    with pytest.raises(ValueError, match="cannot read"):
        consoles.scalar("__import__('os').system('true')")  # read from the syntax tree, never evaluated
    bad = tmp_path / "bad.log"
    bad.write_text("noise\n[t] x.py:1 - rollout 0: {'rollout/raw_reward': open('x')}\n")
    with pytest.raises(RunSetError, match=r"bad.log:2: a slime `rollout 0:` line whose dict does not parse"):
        importers.read(bad, "slime-console")


def test_areal_table_row_that_does_not_parse(tmp_path):
    path = tmp_path / "areal.log"
    path.write_text("\x1b[92m20251126-16:28:33.430 StatsLogger INFO: Epoch 1/1 Step 1/2 Train step 1/2 done.\x1b[0m\n"
                    "│ ppo_actor/task_reward/avg │ 5.0000e-01 │ rollout/reward │ 5.0000e-01 │\n"
                    "20251126-16:28:40.430 StatsLogger INFO: Epoch 1/1 Step 2/2 Train step 2/2 done.\n"
                    "│ ppo_actor/task_reward/avg │ oops │\n")
    with pytest.raises(RunSetError, match=r"areal.log:4: StatsLogger value 'oops'"):
        importers.read(path)


def test_unknown_console_log_is_a_clear_error(tmp_path):
    path = tmp_path / "mystery.log"
    path.write_text("hello\nworld\n")
    with pytest.raises(RunSetError, match="cannot tell the format of .*mystery.log: pass --format one of"):
        importers.read(path)
