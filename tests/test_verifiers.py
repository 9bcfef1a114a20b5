"""Verifiers as rewards (``molt_lightning.data.graders``): each built-in on hand-made replies, math-verify on what it
is for (boxed answers, fractions, LaTeX), reasoning-gym's own scorer, user functions by dotted path, and a verifier
that raises, hangs, dies or returns garbage: a ``VerifierFailed`` (a counted failed sample), never a crash, and the
pool serves the next reply after it."""

from __future__ import annotations

import asyncio
import time

import pytest

from molt_lightning.data import graders as verifiers
from molt_lightning.data.graders import VerifierFailed, extract, verify


def score(spec: str, reply: str, answer, **sample) -> verifiers.Verdict:
    return asyncio.run(verify(spec, reply, {"answer": answer, **sample}, timeout_s=60))


@pytest.fixture(scope="module", autouse=True)
def fresh_pool():
    yield
    verifiers.close()


@pytest.mark.parametrize("reply, answer", [
    ("\\boxed{42}", "42"), ("so the answer is \\boxed{\\frac{1}{2}} ok", "\\frac{1}{2}"),
    ("<answer> Paris </answer>", "Paris"), ("Work...\nAnswer: 17.\nThanks", "17."), ("  plain  ", "plain"),
])
def test_extract(reply, answer):
    assert extract(reply) == answer


@pytest.mark.parametrize("spec, reply, answer, expected, read", [
    ("exact", "Answer: Paris.", "paris", 1.0, "Paris."),
    ("exact", "Paris is big", "Paris", 0.0, "Paris is big"),
    ("last_number", "7 + 5 = 12", 12, 1.0, "12"),
    ("last_number", "12 or maybe 13", 12, 0.0, "13"),
    ("last_number", "it is 1,024 bytes", "1024", 1.0, "1024"),
    ("last_number", "-4.0 is it", "-4", 1.0, "-4.0"),
    ("last_number", "no digits", 3, 0.0, None),
    (r"regex:ANSWER\s+(-?\d+)", "ANSWER 12 then ANSWER 41104", 41104, 1.0, "41104"),
    (r"regex:ANSWER\s+(-?\d+)", "ANSWER twelve", 12, 0.0, None),
])
def test_inline_verifiers(spec, reply, answer, expected, read):
    verdict = score(spec, reply, answer)
    assert (verdict.score, verdict.answer) == (expected, read)


@pytest.mark.parametrize("reply, answer, expected", [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("We get \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("So x = \\boxed{3}", "4", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("I don't know", "4", 0.0),
])
@pytest.mark.slow
def test_math_verify(reply, answer, expected):
    pytest.importorskip("math_verify")
    assert score("math", reply, answer).score == expected


@pytest.mark.slow
def test_reasoning_gym_scorer():
    rg = pytest.importorskip("reasoning_gym")
    entry = rg.create_dataset("chain_sum", seed=1, size=1, min_terms=2, max_terms=2)[0]
    sample = {"question": entry["question"], "metadata": entry["metadata"]}
    assert score("reasoning_gym", f"Answer: {entry['answer']}", entry["answer"], **sample).score == 1.0
    wrong = score("reasoning_gym", "Answer: 123456", entry["answer"], **sample)
    assert wrong.score < 1.0 and wrong.answer == "123456"


def test_user_function_by_dotted_path():
    verdict = score("data_helpers.half_credit", " yes ", "x")
    assert (verdict.score, verdict.answer) == (0.5, "yes")


@pytest.mark.parametrize("fn, message", [
    ("data_helpers.raises", "raised KeyError"),
    ("data_helpers.dies", "raised ProcessExpired|died|Abnormal"),
    ("data_helpers.not_a_number", "non-finite score"),
])
def test_a_failing_verifier_is_a_verifier_failure(fn, message):
    with pytest.raises(VerifierFailed, match=message):
        score(fn, "reply", "x")
    assert score("data_helpers.half_credit", "next", "x").score == 0.5  # the pool still serves


@pytest.mark.slow
def test_a_hanging_verifier_is_killed_at_its_deadline():
    t0 = time.perf_counter()
    with pytest.raises(VerifierFailed, match="did not answer within 1.0 s"):
        asyncio.run(verify("data_helpers.hangs", "reply", {"answer": 1}, timeout_s=1.0))
    assert time.perf_counter() - t0 < 60  # it did not wait for the loop to end (it never would)
    assert score("data_helpers.half_credit", "after", "x").score == 0.5  # a fresh worker took its place


def test_bad_specs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pattern does not compile"):
        verifiers.resolve("regex:(")
    with pytest.raises(ValueError, match="not one of exact, last_number, math, reasoning_gym"):
        verifiers.resolve("no_such_module.fn")


@pytest.mark.slow
def test_a_verifier_failure_is_a_counted_failed_sample_and_the_run_goes_on(tmp_path, policy_path):
    """A data source whose verifier raises on some replies: those samples fail (counted), the rest train."""
    import json

    import lightning as L

    from molt_lightning import AsyncRLModule, Rollout
    from molt_lightning.agents import Answer
    from molt_lightning.data import Source, Tasks
    from molt_lightning.engines import TorchEngine

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": i + 1}) + "\n" for i in range(16)))
    tasks = Tasks([Source(path=str(path), prompt="question", verifier="data_helpers.raises_on_odd_rows")])
    module = AsyncRLModule(agent=Answer(max_tokens=8), tasks=tasks, policy=policy_path, engine=TorchEngine(seed=0),
                           rollout=Rollout(group_size=2, prompts_per_step=2, max_lag=0, max_failure_rate=1.0))
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # (Lightning's default one would write ./checkpoints)
    trainer.fit(module)
    counts = module.source.counts
    assert counts.failed > 0 and counts.agent["verifier_failed"] == counts.failed
    assert counts.trained > 0 and trainer.global_step == 3
