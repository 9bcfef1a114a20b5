"""``RolloutEngine.score``: a teacher served by an engine gives the logprobs of tokens another model sampled (on-policy
distillation). Each engine's scores equal a plain HF forward's, and the torch engine's equal the trainer's own frozen
teacher (``Policy.outputs``) at any temperature; vLLM ignores the temperature in prompt logprobs (pinned here), so
its engines take 1.0 only and refuse anything else with the fix."""

import asyncio

import pytest
import torch

from molt_lightning.config import Batching
from molt_lightning.engines import EnginePool, Sampling, TorchEngine
from molt_lightning.engines.base import RolloutEngine
from molt_lightning.engines.batched import Batched
from molt_lightning.trainer.policy import frozen_policy

PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 30], [2, 3, 4, 5, 6, 7, 8, 9]]
TORCH_ATOL = 1e-5  # the engine against the same HF forward, float32: measured 0 (the same operations)
# the trainer's teacher packs shared prompts under a 4D mask and runs the head in chunks: float32 rounds otherwise,
# measured up to 1.4e-5 on logprobs near -15 (4 samples a prompt; 3e-6 with share_prefix off)
TEACHER_ATOL = 5e-5
VLLM_ATOL = 1e-4  # vLLM's CPU kernels against HF's, float32: measured 8e-6


@pytest.fixture(scope="module")
def hf_model(policy_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()


def hf_scores(model, ids: list[int], start: int, temperature: float) -> torch.Tensor:
    """The reference: log_softmax of a plain HF forward's logits / temperature at each scored token."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1:-1].float() / temperature  # (T - start, V)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None]).squeeze(-1)


def sequences(engine, samples: int = 2) -> list[tuple[list[int], int]]:
    """(tokens, start): each prompt with ``samples`` completions sampled by the engine (a group shares its prompt)."""
    async def go():
        return await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=12, ignore_eos=True, seed=i))
                                      for p in PROMPTS for i in range(samples)))

    outs = engine.call(go())
    return [(p + out.token_ids, len(p)) for p, out in zip([p for p in PROMPTS for _ in range(samples)], outs)]


def score_all(engine, seqs, temperature: float) -> list[torch.Tensor]:
    async def go():
        return await asyncio.gather(*(engine.score(ids, start, temperature) for ids, start in seqs))

    return [torch.tensor(s) for s in engine.call(go())]


def max_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert [g.shape for g in got] == [r.shape for r in ref]
    return max((g - r.float()).abs().max().item() for g, r in zip(got, ref))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_engine_scores_as_hf_and_the_trainers_teacher(torch_engine, hf_model, policy_path, temperature):
    """Two teachers agree: the engine's scores equal an HF forward's and the trainer's frozen teacher's logprobs
    (right-padded batch, shared prompts packed, the head in chunks of 8) on the same tokens."""
    seqs = sequences(torch_engine, 4)
    got = score_all(torch_engine, seqs, temperature)
    assert max_diff(got, [hf_scores(hf_model, ids, s, temperature) for ids, s in seqs]) < TORCH_ATOL

    teacher = frozen_policy(policy_path, torch.float32, Batching(logit_chunk_tokens=8))
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)  # (N, T) right-padded
    attention, loss_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for row, (ids, start) in enumerate(seqs):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention[row, :len(ids)] = 1
        loss_mask[row, start:len(ids)] = 1
    with torch.no_grad():
        lps = teacher.outputs(input_ids, attention, loss_mask.bool(), temperature).logprobs  # (N, T-1)
    trainer = [lps[row, start - 1:len(ids) - 1] for row, (ids, start) in enumerate(seqs)]
    assert max_diff(got, trainer) < TEACHER_ATOL


def test_score_refuses_bad_input(torch_engine):
    for start, temperature, match in [(0, 1.0, "1 <= start"), (3, 1.0, "1 <= start"), (5, 1.0, "1 <= start"),
                                      (1, 0.0, "temperature > 0"), (1, -1.0, "temperature > 0")]:
        with pytest.raises(ValueError, match=match):
            torch_engine.call(torch_engine.score([1, 2, 3], start, temperature))
    assert len(torch_engine.call(torch_engine.score([1, 2, 3], 2))) == 1  # the last token only


def test_pool_scores_on_a_live_engine(policy_path, hf_model):
    """The pool sends a score to the live engine with the fewest requests in flight: two at once go to both engines,
    and with the first engine down, to the second."""
    pool = EnginePool(engines=[TorchEngine(seed=0), TorchEngine(seed=1)])
    pool.launch(policy_path)
    try:
        seqs = [([1, 5, 7, 9, 11, 4, 2], 5), ([1, 20, 30, 40], 1)]
        got = score_all(pool, seqs, 1.0)
        assert max_diff(got, [hf_scores(hf_model, ids, s, 1.0) for ids, s in seqs]) < TORCH_ATOL
        assert pool.routed == {0: 1, 1: 1}
        pool.engines[0].mark_down("a test")
        score_all(pool, seqs, 1.0)
        assert pool.routed == {0: 1, 1: 3}
    finally:
        pool.release()


def test_batched_answers_requests_that_arrive_together_in_one_call():
    """The drain both the torch engine's scoring and the vLLM engine's routing capture use: the requests queued while
    a call runs go in the next call, in order; an exception answer reaches its own caller only, a raised one every
    caller of that call; a caller that gave up is skipped and the others of its call still get their answers."""
    calls, gate = [], asyncio.Event()

    async def answer(requests):
        calls.append(list(requests))
        if len(calls) == 1:
            await gate.wait()  # the first call runs while the others queue
        if "boom" in requests:
            raise RuntimeError("the whole call failed")
        return [ValueError(f"bad {r}") if r == "bad" else r.upper() for r in requests]

    async def main():
        batched = Batched(answer)
        first = asyncio.ensure_future(batched("a"))
        await asyncio.sleep(0)  # the drain task starts and takes "a"
        rest = [asyncio.ensure_future(batched(r)) for r in ("b", "gone", "bad", "c")]
        await asyncio.sleep(0)
        rest[1].cancel()  # its caller gives up while its call is queued
        gate.set()  # (a drain that tripped over it would leave "bad" and "c" unanswered: the deadline below)
        results = await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 60)
        failed = await asyncio.gather(batched("x"), batched("boom"), return_exceptions=True)
        return results, failed

    (a, b, gone, bad, c), failed = asyncio.run(main())
    assert calls[:2] == [["a"], ["b", "gone", "bad", "c"]] and (a, b, c) == ("A", "B", "C")
    assert isinstance(bad, ValueError) and str(bad) == "bad bad" and isinstance(gone, asyncio.CancelledError)
    assert calls[2] == ["x", "boom"] and all(isinstance(e, RuntimeError) for e in failed)


def test_an_engine_without_scoring_names_those_with():
    class Unscored(TorchEngine):
        _score = RolloutEngine._score

    with pytest.raises(NotImplementedError, match="Unscored cannot score tokens.*TorchEngine, VLLMEngine"):
        asyncio.run(Unscored().score([1, 2, 3], 1))


@pytest.mark.slow
@pytest.mark.parametrize("served_engine", ["vllm", "remote", "pool"], indirect=True)
def test_vllm_engines_score_as_hf(served_engine, hf_model):
    """In process, on a ``molt serve`` server and through a pool of two: HF's logprobs at temperature 1.0; any other
    temperature is refused, naming the fix."""
    seqs = [(p + list(range(40, 52)), len(p)) for p in PROMPTS] + [([1, 5, 7, 9, 11], 1)]
    got = score_all(served_engine, seqs, 1.0)
    assert max_diff(got, [hf_scores(hf_model, ids, s, 1.0) for ids, s in seqs]) < VLLM_ATOL
    with pytest.raises(ValueError, match="temperature 1.0 only.*Serve the teacher with TorchEngine"):
        served_engine.call(served_engine.score(seqs[0][0], seqs[0][1], 0.7))


@pytest.mark.slow
def test_vllm_prompt_logprobs_ignore_the_temperature(vllm_engine, hf_model):
    """Why the vLLM engines refuse temperature != 1: vLLM 0.32 (``logprobs_mode="processed_logprobs"``) returns the
    same prompt logprobs for a request at temperature 0.7 as at 1.0, those of the raw logits. If this fails, vLLM
    applies the temperature now: ``phases._score_params`` can take it."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = PROMPTS[0] + list(range(40, 52))

    async def prompt_logprobs(temperature):
        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for final in vllm_engine.llm.generate({"type": "token", "prompt_token_ids": ids}, params,
                                                    request_id=f"test-scoring-{temperature}"):
            pass
        return torch.tensor([final.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    at_07 = vllm_engine.call(prompt_logprobs(0.7))
    assert (at_07 - hf_scores(hf_model, ids, 1, 1.0)).abs().max() < VLLM_ATOL
    assert (at_07 - hf_scores(hf_model, ids, 1, 0.7)).abs().max() > 1.0
