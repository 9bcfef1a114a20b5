"""docs/research.md's worked examples, each an overlay on the default recipe (``recipes/research/``) and one function or
callback file in the package: each runs 2 steps through ``molt fit`` (the torch engine, by the documented short form)
and shows its idea in the run's metrics. The pieces' own numbers are tested by hand in tests/test_selection.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def stacked(name: str, tmp_path: Path) -> pd.DataFrame:
    """``molt fit --config recipes/default.yaml --config recipes/research/NAME.yaml`` for 2 steps; its metrics."""
    done = subprocess.run(
        [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/default.yaml", "--config",
         f"recipes/research/{name}.yaml", "--model.engine", "TorchEngine", "--trainer.max_steps", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = (tmp_path / name).iterdir()  # the overlay names the run
    df = pd.read_csv(run / "metrics.csv")
    assert df["reward"].notna().sum() == 2
    return df


def test_each_research_example_is_one_short_overlay():
    for path in sorted((ROOT / "recipes" / "research").glob("*.yaml")):
        assert len(path.read_text().splitlines()) <= 10, path.name


@pytest.mark.slow
def test_forking_tokens_train_on_the_top_fifth_by_entropy(tmp_path):
    df = stacked("forking_tokens", tmp_path)
    assert df["select/kept_frac"].dropna().between(0.15, 0.25).all(), df["select/kept_frac"].tolist()


@pytest.mark.slow
def test_overlong_filtering_drops_only_samples_cut_at_max_tokens(tmp_path):
    df = stacked("overlong_filter", tmp_path).dropna(subset=["reward"])
    kept, dropped = df["select/kept_frac"], df["select/samples_dropped"]
    assert ((kept == 1.0) == (dropped == 0)).all(), df[["select/kept_frac", "select/samples_dropped"]]


@pytest.mark.slow
def test_update_kl_logs_how_far_each_step_moved(tmp_path):
    kl = stacked("update_kl", tmp_path)["update/kl"].dropna()
    assert len(kl) == 2 and (kl > 0).all() and (kl < 1).all(), kl.tolist()  # lr 3e-4 moves it, a little


@pytest.mark.slow
def test_a_tiny_qwen3_is_the_policy(tmp_path):
    from transformers import AutoConfig

    from molt_lightning.models.tiny import qwen3_policy

    stacked("qwen3", tmp_path)
    config = AutoConfig.from_pretrained(qwen3_policy())
    assert config.model_type == "qwen3" and config.head_dim == 32
