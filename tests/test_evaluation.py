"""Held-out evaluation (``molt_lightning.rollout.heldout``, ``callbacks.Evaluate``): pass@k against hand-computed values
and brute-force enumeration, maj@k, the interval against scipy, and evaluation beside training: the trainer keeps
stepping while a round runs (``max_lag`` 0 and 1), every round names the versions it measured, the start and end
rounds measure exactly one version, the best round's weights are kept, and held-out prompts that were trained on are
dropped."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import lightning as L
import pytest
import torch

from molt_lightning import AsyncRLModule, Rollout
from molt_lightning.callbacks import Evaluate
from molt_lightning.callbacks.plot import series
from molt_lightning.engines import TorchEngine
from molt_lightning.rollout.heldout import Outcome, interval, majority_correct, pass_at_k, summarize
from molt_lightning.tasks import arithmetic


# ----- the estimators -----
@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 1 - 3 / 6), (4, 2, 2, 1 - 1 / 6), (5, 0, 3, 0.0), (4, 3, 2, 1.0),
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)), (1, 1, 1, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_brute_force_enumeration():
    """The share of all k-subsets of n runs (c correct) that hold a correct run."""
    for n in range(1, 9):
        for c in range(n + 1):
            runs = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(runs[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@pytest.mark.parametrize("answers, correct, expected", [
    (["12", "12", "13", None], [True, True, False, False], True),
    (["13", "12", "12", "13"], [False, True, True, False], False),  # a tie: the first seen answer wins
    (["7", None, None, None], [True, False, False, False], True),  # no answer never wins a vote
    ([None, None], [False, False], False),
    (["5", "6", "6"], [True, False, False], False),
])
def test_majority_vote(answers, correct, expected):
    assert majority_correct(answers, correct) is expected


def test_interval_matches_scipy():
    from scipy import stats

    x = [0.0, 0.25, 1.0, 0.5, 0.75, 1.0, 0.0]
    mean, lo, hi = interval(x)
    want = stats.t.interval(0.95, len(x) - 1, loc=sum(x) / len(x), scale=stats.sem(x))
    assert (lo, hi) == pytest.approx(want, abs=1e-12) and mean == pytest.approx(sum(x) / len(x))
    assert interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)


def test_intervals_of_shares_stay_in_0_1():
    """38 of 40 prompts solved (pass@4 0.95): the t interval runs to 1.02; the reported one is scipy's, cut at 1.
    An avg@k over rewards outside [0, 1] keeps the plain t interval."""
    from scipy import stats

    outcomes = [Outcome("s", i, float(i < 38), i < 38) for i in range(40) for _ in range(4)]
    m = summarize(outcomes, 4)["s"]
    x = [1.0] * 38 + [0.0] * 2
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=0.95, scale=stats.sem(x))
    assert hi > 1 and (m["pass@4_lo"], m["pass@4_hi"]) == pytest.approx((lo, 1.0), abs=1e-12)
    assert (m["avg@4_lo"], m["avg@4_hi"]) == pytest.approx((lo, 1.0), abs=1e-12)
    assert 0 <= m["pass@1_lo"] <= m["pass@1_hi"] <= 1
    scaled = summarize([Outcome("s", o.prompt, 2 * o.reward, o.correct) for o in outcomes], 4)["s"]
    assert scaled["avg@4_hi"] == pytest.approx(2 * hi, abs=1e-12) and scaled["pass@4_hi"] == 1.0


def test_summarize_by_source():
    runs = [("a", 0, 1.0, "4"), ("a", 0, 0.0, "5"), ("a", 0, 1.0, "4"), ("a", 1, 0.0, "9"), ("a", 1, 0.0, "8"),
            ("a", 1, 0.0, None), ("b", 0, 0.5, None), ("b", 0, 1.0, None), ("b", 0, 0.0, None)]
    outcomes = [Outcome(s, p, r, r >= 1.0, a, versions=(2, 3 + p)) for s, p, r, a in runs]
    outcomes[5].failed = "TimeoutError: slow"
    m = summarize(outcomes, k=3)
    assert m["a"]["avg@3"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["a"]["pass@1"] == pytest.approx((2 / 3 + 0) / 2) and m["a"]["pass@3"] == 0.5
    assert m["a"]["maj@3"] == 0.5 and m["a"]["failed"] == 1 and m["a"]["prompts"] == 2
    assert (m["a"]["version_min"], m["a"]["version_max"]) == (2, 4)
    assert m["b"]["avg@3"] == pytest.approx(0.5) and m["b"]["pass@1"] == pytest.approx(1 / 3)
    assert "maj@3" not in m["b"]  # no answers reported: no vote


# ----- evaluation beside training -----
class WaitsForTheTrainer:
    """An evaluation agent that answers only once the engine serves two more policy versions than when the run began
    (or the last one): it proves the trainer steps and pushes while a round is in flight (a trainer waiting for the
    round would never get there: the deadline fails the run, and the test)."""

    def __init__(self, last: int):
        self.last, self.waited = last, []

    async def __call__(self, client, sample):
        start = client.engine.version
        deadline = asyncio.get_running_loop().time() + 120
        while client.engine.version < min(start + 2, self.last):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the trainer did not step while the evaluation ran")
            await asyncio.sleep(0.01)
        self.waited.append((start, client.engine.version))
        return await arithmetic.calculator_agent(client, sample)


def fit(tmp_path, policy_path, evaluate: Evaluate, max_lag: int, steps: int, tasks=arithmetic.tasks, **rollout):
    module = AsyncRLModule(agent=arithmetic.calculator_agent, tasks=tasks, policy=policy_path,
                           engine=TorchEngine(seed=0), rollout=Rollout(max_lag=max_lag, **{
                               "group_size": 4, "prompts_per_step": 4, **rollout}))
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    trainer = L.Trainer(max_steps=steps, logger=logger, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[evaluate], log_every_n_steps=1)
    trainer.fit(module)
    rounds = [json.loads(x) for x in open(f"{logger.log_dir}/eval.jsonl")]
    return module, trainer, rounds, logger.log_dir


@pytest.mark.parametrize("max_lag", [0, 1])
@pytest.mark.slow
def test_rounds_run_beside_training_and_name_their_versions(tmp_path, policy_path, max_lag):
    agent = WaitsForTheTrainer(last=10)
    evaluate = Evaluate(arithmetic.tasks, k=2, seed=99, max_prompts=3, every_n_steps=3, at_start=False,
                        at_end=False, agent=agent)
    module, _, rounds, _ = fit(tmp_path, policy_path, evaluate, max_lag, steps=10)
    versions = [r["version"] for r in rounds]
    assert versions[0] == 3 and 6 <= versions[1] < 10 and len(rounds) <= 3  # one at a time, none doubled
    assert [(s, v) for s, v in agent.waited if s == 3] and all(v >= min(s + 2, 10) for s, v in agent.waited)
    for r in rounds:
        m = r["metrics"]["heldout"]
        assert m["prompts"] == 3 and m["failed"] == 0
        # tagged as served: from the version the round started at (plus the two it waited for) to the last
        assert min(r["version"] + 2, 10) <= m["version_min"] <= m["version_max"] <= module.policy_version, (
            rounds, agent.waited)


@pytest.mark.slow
def test_start_and_end_rounds_measure_one_version_each(tmp_path, policy_path):
    evaluate = Evaluate(arithmetic.tasks, k=2, seed=99, max_prompts=4)
    module, trainer, rounds, log_dir = fit(tmp_path, policy_path, evaluate, max_lag=1, steps=4)
    first, last = rounds[0], rounds[-1]
    assert len(rounds) == 2 and first["version"] == 0 and last["version"] == module.policy_version == 4
    assert first["metrics"]["heldout"]["version_min"] == first["metrics"]["heldout"]["version_max"] == 0
    assert last["metrics"]["heldout"]["version_min"] == last["metrics"]["heldout"]["version_max"] == 4
    assert len(first["per_prompt"]["heldout"]) == 4
    import pandas as pd

    df = pd.read_csv(f"{log_dir}/metrics.csv")
    assert series(df.columns) == ["eval/heldout/avg@2"]  # what the reward plot draws beside the reward
    assert df.dropna(subset=["eval/heldout/avg@2"])["step"].tolist() == [0, 4]
    assert (tmp_path / "run" / "version_0" / "reward.png").exists()


@pytest.mark.slow
def test_the_best_rounds_weights_are_kept(tmp_path, policy_path):
    evaluate = Evaluate(arithmetic.tasks, k=2, seed=99, max_prompts=8, every_n_steps=1, at_start=False,
                        at_end=False, keep_best="eval/heldout/avg@2", temperature=1.0)
    module, trainer, rounds, log_dir = fit(tmp_path, policy_path, evaluate, max_lag=1, steps=6)
    scores = [(r["metrics"]["heldout"]["avg@2"], r["version"]) for r in rounds]
    best_score = max(s for s, _ in scores)
    best_version = next(v for s, v in scores if s == best_score)  # ties: the first round keeps it
    files = sorted(p.name for p in (tmp_path / "run" / "version_0" / "checkpoints").iterdir())
    assert "best.ckpt" in files
    assert not [f for f in files if f.startswith("eval-candidate") and
                int(f.removeprefix("eval-candidate-v").removesuffix(".ckpt")) in [v for _, v in scores]]
    saved = torch.load(tmp_path / "run" / "version_0" / "checkpoints" / "best.ckpt", weights_only=False)
    assert saved["molt"]["policy_version"] == best_version


@pytest.mark.parametrize("overlap", ["drop_from_training", "drop_from_eval"])
def test_a_prompt_in_both_sets_is_never_trained_on(tmp_path, policy_path, overlap):
    from molt_lightning.data import Source, Tasks
    from molt_lightning.data.sources import prompt_key

    rows = [{"question": f"What is {i}*{i + 10}?", "answer": i * (i + 10)} for i in range(10, 30)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[9:] + rows[9:10]))  # 3 shared
    train = Tasks([Source(path=str(tmp_path / "train.jsonl"), prompt="question")])
    evaluate = Evaluate(Tasks([Source(path=str(tmp_path / "test.jsonl"), prompt="question")]), k=1, at_end=False,
                        overlap=overlap)
    assert len(evaluate.samples) == 11  # the repeated prompt counts once
    module, _, rounds, _ = fit(tmp_path, policy_path, evaluate, max_lag=1, steps=1, tasks=train, prompts_per_step=2)
    held_out = {prompt_key(s) for s in evaluate.samples}
    assert not held_out & train.keys()  # whichever side gave them up, no held-out prompt is trained on
    if overlap == "drop_from_training":
        assert evaluate.excluded_from_training == 3 and len(train) == 9
        assert rounds[0]["metrics"]["test"]["prompts"] == 11
    else:
        assert evaluate.dropped_seen == 3 and len(train) == 12
        assert rounds[0]["metrics"]["test"]["prompts"] == 8


def test_evaluate_settings_are_checked():
    with pytest.raises(ValueError, match="identical runs per prompt"):
        Evaluate(arithmetic.tasks, k=4, temperature=0, max_prompts=2)
    with pytest.raises(ValueError, match="keep_best keeps the best of the periodic rounds"):
        Evaluate(arithmetic.tasks, max_prompts=2, keep_best="eval/heldout/avg@4")
    with pytest.raises(ValueError, match="k, concurrency and max_prompts must be >= 1"):
        Evaluate(arithmetic.tasks, k=0, max_prompts=2)
