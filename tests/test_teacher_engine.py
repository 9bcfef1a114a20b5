"""On-policy distillation with the teacher on an engine (``model.teacher: engines.Auxiliary``): the rollout side
scores every usable trajectory's policy tokens (``rollout.teacher.score_with``), the numbers travel with the batch
(``Span.teacher`` -> ``Batch.teacher_logprobs``), and the trainer's distillation advantage is the one an in-trainer
teacher gives, on the same tokens, within float32 rounding. A teacher that fails or hangs fails its samples (counted),
never the run."""

from __future__ import annotations

import asyncio

import pytest
import torch
from invariant import Batches
from test_algorithms_loop import fit, make

from molt_lightning.algorithms import Algorithm
from molt_lightning.engines import Auxiliary, TorchEngine
from molt_lightning.rollout.source import RolloutFailures
from molt_lightning.rollout.teacher import score_with
from molt_lightning.trajectory import ConsistencyError, Kind, Span, Trajectory, collate


class Positions:
    """A stand-in teacher whose logprob of token i is -i (so each span's slice shows where it came from)."""

    def __init__(self):
        self.requests = []

    async def score(self, token_ids, start, temperature=1.0):
        self.requests.append((list(token_ids), start, temperature))
        return [-float(i) for i in range(start, len(token_ids))]


def two_segments() -> Trajectory:
    traj = Trajectory(sample_id=0, group_id=0, reward=1.0)
    traj.segments = [
        [Span.context(Kind.PROMPT, [1, 2, 3]), Span.policy([4, 5], [-0.1, -0.2], [0, 0]),
         Span.context(Kind.ENV, [6]), Span.policy([7, 8, 9], [-0.1] * 3, [0, 0, 0])],
        [Span.context(Kind.PROMPT, [1, 2]), Span.policy([10], [-0.3], [0])],
    ]
    return traj


def test_score_with_gives_each_policy_span_its_tokens_scores_one_request_per_segment():
    traj, teacher = two_segments(), Positions()
    asyncio.run(score_with(teacher, traj, temperature=0.7))
    assert [s.teacher for s in traj.policy_spans()] == [[-3.0, -4.0], [-6.0, -7.0, -8.0], [-2.0]]
    assert sorted(teacher.requests) == [([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 0.7), ([1, 2, 10], 2, 0.7)]


def test_collate_stacks_the_teachers_logprobs_on_the_policy_tokens_and_refuses_a_partial_record():
    traj = two_segments()
    assert collate([traj], pad_id=0).teacher_logprobs is None  # no teacher: nothing in the batch
    asyncio.run(score_with(Positions(), traj, temperature=1.0))
    batch = collate([traj], pad_id=0)
    want = torch.zeros_like(batch.engine_logprobs)
    want[0, [3, 4, 6, 7, 8]] = torch.tensor([-3.0, -4.0, -6.0, -7.0, -8.0])
    want[1, 2] = -2.0
    assert torch.equal(batch.teacher_logprobs, want)
    traj.segments[1][1].teacher = None
    with pytest.raises(ConsistencyError, match="teacher's logprob and others none"):
        collate([traj], pad_id=0)
    traj.segments[1][1].teacher = [-1.0, -2.0]  # two numbers for one token
    with pytest.raises(ConsistencyError, match="full engine record"):
        collate([traj], pad_id=0)


@pytest.mark.slow
def test_a_teacher_on_an_engine_gives_the_in_trainer_teachers_logprobs(tmp_path):
    """The shipped tiny teacher on a torch engine of its own: every trained batch carries its logprobs, equal to what
    the trainer's frozen teacher computes on the same rows (the in-trainer path) within float32 rounding; the
    trainer holds no teacher; the teacher's requests, tokens and latency are logged."""
    from molt_lightning.models.tiny import teacher_policy
    from molt_lightning.trainer.policy import frozen_policy

    from molt_lightning.config import Batching

    aux = Auxiliary(teacher_policy(), TorchEngine(seed=0), name="teacher")
    batches = Batches()
    module = make(Algorithm(advantage="none", distill_coef=1.0), teacher=aux, lr=1e-3)
    df = fit(module, tmp_path, steps=3, callbacks=[batches])
    assert module.teacher is None and aux.folder is None  # nothing in the trainer; stopped with the run
    trainer_teacher = frozen_policy(teacher_policy(), torch.float32, Batching())
    worst = 0.0
    for _, b in batches.seen:
        mask = b.loss_mask[:, 1:]
        want = trainer_teacher.outputs(b.input_ids, b.attention_mask, b.loss_mask, 1.0).logprobs
        worst = max(worst, float((b.teacher_logprobs[:, 1:] - want)[mask].abs().max()))
        assert (b.teacher_logprobs[:, 1:][~mask] == 0).all()
    assert len(batches.seen) == 3 and worst < 1e-5, worst
    assert df["distill/reverse_kl"].notna().sum() == 3
    assert df["teacher/requests"].sum() >= 3 * 8 and df["teacher/failures"].sum() == 0
    asked = df["teacher/requests"] > 0  # a step whose batch was ready before it began asked nothing new
    assert df["teacher/tokens"].sum() > 0 and df["teacher/latency_s"][asked].gt(0).all()


@pytest.mark.slow
def test_distillation_from_the_policy_itself_on_an_engine_starts_at_zero_reverse_kl(tmp_path, policy_path):
    """As the in-trainer test of the same name: teacher = the initial policy, here on an engine of its own."""
    aux = Auxiliary(policy_path, TorchEngine(seed=0), name="teacher")
    module = make(Algorithm(advantage="none", distill_coef=1.0, loss="pg"), teacher=aux, max_lag=0, lr=1e-2)
    kl = fit(module, tmp_path, steps=3)["distill/reverse_kl"].dropna().tolist()
    assert abs(kl[0]) < 1e-3 and abs(kl[-1]) > 10 * abs(kl[0])


class Broken(TorchEngine):
    async def _score(self, token_ids, start, temperature):
        raise RuntimeError("the teacher's server said 503")


class Stuck(TorchEngine):
    async def _score(self, token_ids, start, temperature):
        await asyncio.Event().wait()  # never answers


@pytest.mark.slow
@pytest.mark.parametrize("engine, reason", [(Broken, "RuntimeError: the teacher's server said"),
                                            (Stuck, "did not answer within")])
def test_a_teacher_that_fails_or_hangs_fails_its_samples_counted(tmp_path, policy_path, engine, reason):
    """Every sample the teacher cannot score fails (never trained on, counted); the failure breaker then stops the
    run naming the reason instead of training on nothing."""
    aux = Auxiliary(policy_path, engine(seed=0), name="teacher", timeout_s=0.5)
    module = make(Algorithm(advantage="none", distill_coef=1.0), teacher=aux)
    with pytest.raises(RolloutFailures, match="the teacher could not score it") as info:
        fit(module, tmp_path, steps=2)
    assert reason in str(info.value)
    counts = module.source.counts
    assert counts.failed >= module.source.failure_window and counts.trained == 0
    assert aux.folder is None  # stopped with the run


def test_an_auxiliary_refuses_bad_limits_and_names_a_model_that_is_no_folder():
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        Auxiliary("x", TorchEngine(), max_in_flight=0)
    aux = Auxiliary("molt_lightning.no.such.builder", TorchEngine())
    with pytest.raises(ValueError, match="does not import"):
        aux.start()


@pytest.mark.slow
def test_the_distillation_recipe_runs_two_steps_with_its_teacher_on_an_engine(tmp_path):
    """``recipes/distill.yaml`` + ``recipes/distill_teacher_engine.yaml`` through ``molt fit``: the teacher's metrics
    are logged, none of its requests failed, and the distillation term is there."""
    from test_cli import fit_recipe

    _, _, config, df = fit_recipe("distill", tmp_path, "--config", "recipes/distill_teacher_engine.yaml")
    assert "molt_lightning.engines.Auxiliary" in config
    assert df["teacher/requests"].sum() >= 2 * 8 and df["teacher/failures"].sum() == 0
    assert df["teacher/timeouts"].sum() == 0 and df["distill/reverse_kl"].notna().sum() == 2


def test_a_teacher_engine_that_cannot_score_at_the_rollout_temperature_is_refused_before_the_run():
    """vLLM's prompt logprobs ignore the temperature: a vLLM teacher at 0.7 is refused when the module is made (not
    after a window of failed samples), naming the fix; an engine that cannot score at all is named too."""
    from molt_lightning.engines import EnginePool, RemoteVLLMEngine, RolloutEngine

    for engine in (RemoteVLLMEngine(url="http://127.0.0.1:9"), EnginePool(urls=["http://127.0.0.1:9"])):
        with pytest.raises(ValueError, match="scores at temperature 1.0 only.*Serve the teacher with TorchEngine"):
            make(Algorithm(advantage="none", distill_coef=1.0), teacher=Auxiliary("x", engine), temperature=0.7)
        make(Algorithm(advantage="none", distill_coef=1.0), teacher=Auxiliary("x", engine), temperature=1.0)

    class Unscoring(TorchEngine):
        _score = RolloutEngine._score

    with pytest.raises(NotImplementedError, match="Unscoring cannot score tokens"):
        make(Algorithm(advantage="none", distill_coef=1.0), teacher=Auxiliary("x", Unscoring()))


@pytest.mark.slow
def test_an_in_process_vllm_teacher_beside_the_in_process_vllm_policy(vllm_engine):
    """Two vLLM engines in one process (the policy's, the session's; the teacher's, an Auxiliary): the teacher scores
    what the policy sampled as an HF forward of the teacher does, and stops without touching the policy's engine."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.engines import Sampling, VLLMEngine
    from molt_lightning.models.tiny import teacher_policy

    aux = Auxiliary(teacher_policy(), VLLMEngine(seed=1), name="teacher")
    hf = AutoModelForCausalLM.from_pretrained(teacher_policy(), dtype=torch.float32).eval()
    try:
        aux.start()
        worst = 0.0
        for prompt in ([1, 2, 3], [5, 8, 13, 21]):
            out = vllm_engine.call(vllm_engine.generate(prompt, Sampling(max_tokens=12, seed=7)))
            ids = prompt + out.token_ids
            got = torch.tensor(vllm_engine.call(aux.score(ids, len(prompt))))
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float(), -1)
            want = logp.gather(-1, torch.tensor(ids[len(prompt):])[:, None]).squeeze(-1)
            worst = max(worst, float((got - want).abs().max()))
        assert worst < 1e-4, worst
        assert aux.take_metrics()["teacher/requests"] == 2
    finally:
        aux.stop()
    assert vllm_engine.call(vllm_engine.generate([1, 2, 3], Sampling(max_tokens=2))).token_ids  # still serving
