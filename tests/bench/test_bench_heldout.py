"""``molt-bench heldout``: before/after tables from a run's eval.jsonl or two ``molt eval`` files, and the verdict on
per-prompt avg@k (checked against scipy's Welch test on the same numbers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from molt_lightning.bench.cli import main
from molt_lightning.bench.heldout import heldout
from molt_lightning.rollout.heldout import summarize, Outcome


def round_record(version: int, correct: np.ndarray) -> dict:
    """A round of ``Evaluate`` (k=4) whose prompt i had ``correct[i]`` of 4 runs right."""
    outcomes = [Outcome("chain_sum", i, float(r < c), bool(r < c), str(r < c)) for i, c in enumerate(correct)
                for r in range(4)]
    return {"step": version, "version": version, "k": 4, "metrics": summarize(outcomes, 4),
            "per_prompt": {"chain_sum": [c / 4 for c in correct.tolist()]}}


@pytest.mark.slow
def test_a_run_that_improved_is_called_better(tmp_path, capsys):
    rng = np.random.default_rng(0)
    before, after = rng.binomial(4, 0.2, 200), rng.binomial(4, 0.45, 200)
    (tmp_path / "eval.jsonl").write_text(json.dumps(round_record(0, before)) + "\n" + json.dumps(
        round_record(100, after)) + "\n")
    assert main(["heldout", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "before: version 0, after: version 100" in out
    assert f"| chain_sum | avg@4 | {before.mean() / 4:.3f}" in out and "A better" in out
    p = stats.ttest_ind(after / 4, before / 4, equal_var=False).pvalue
    assert f"Welch p={p:.2g}" in out


@pytest.mark.slow
def test_two_eval_files_and_a_null_difference(tmp_path):
    same = np.random.default_rng(1).binomial(4, 0.3, 300)
    for name in ("before", "after"):
        (tmp_path / f"{name}.json").write_text(json.dumps(round_record(0, same)))
    text = heldout([tmp_path / "before.json", tmp_path / "after.json"], margin=0.05)
    assert "comparable within +-0.05" in text


def test_two_eval_files_are_named_by_file_and_policy(tmp_path):
    """`molt eval --out` files hold a policy, no version: the header names each file and its policy."""
    correct = np.array([1, 2, 3, 4, 0, 2])
    for name, policy in (("before", "HuggingFaceTB/SmolLM2-135M"), ("after", "out/")):
        record = round_record(0, correct)
        del record["version"], record["step"]
        (tmp_path / f"{name}.json").write_text(json.dumps({**record, "policy": policy}))
    text = heldout([tmp_path / "before.json", tmp_path / "after.json"])
    assert text.splitlines()[0] == (f"before: {tmp_path / 'before.json'} (policy HuggingFaceTB/SmolLM2-135M), "
                                    f"after: {tmp_path / 'after.json'} (policy out/)")
    assert "?" not in text.splitlines()[0]


def test_what_it_needs_is_named(tmp_path):
    with pytest.raises(ValueError, match="holds no eval.jsonl"):
        heldout([tmp_path])
    (tmp_path / "eval.jsonl").write_text(json.dumps(round_record(0, np.ones(5, int))) + "\n")
    with pytest.raises(ValueError, match="holds 1 round"):
        heldout([tmp_path])
