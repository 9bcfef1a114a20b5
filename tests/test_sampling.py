"""Engines agree with the trainer on how they sample: at temperature 0.7 and top-p 0.9 every engine's logprobs are the
trainer's recomputation; a random stream per engine and per request, reproducible from the run's seed; every
end-of-turn id ends a turn the same way on every engine; a pool's servers sample streams of their own, so a group's
completions repeat each other no more on two servers than on one."""

import asyncio
import json
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.sessions import AgentSessions
from molt_lightning.engines import EnginePool, Sampling, TorchEngine
from molt_lightning.engines.base import derive_seed, nucleus
from molt_lightning.engines.vllm.server import server_command
from molt_lightning.rollout.agent_run import request_seed
from molt_lightning.tasks.arithmetic import make_problem
from molt_lightning.trajectory import Status, Trajectory, repeats

QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    t, rng = ChatTemplate(tokenizer), random.Random(2)
    return [t.prompt_ids([{"role": "user", "content": make_problem(rng)["question"]}]) for _ in range(8)]


async def _gather(engine, prompts, sampling):
    return await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])


def generate(engine, prompts, samplings):
    async def _all():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)])

    return [o.token_ids for o in engine.call(_all())]


# ----- the distribution sampled from: temperature and top-p -----
def test_the_nucleus_keeps_the_most_likely_tokens_holding_top_p_of_the_mass():
    z = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # ascending: 0.05, 0.15, 0.3, 0.5; their running sums
    # 0.05, 0.2, 0.5, 1.0: a token goes while its running sum is at most 1 - top_p
    assert torch.isinf(nucleus(z, 0.75)).tolist() == [False, False, True, True]
    assert torch.isinf(nucleus(z, 0.9)).tolist() == [False, False, False, True]
    assert torch.isinf(nucleus(z, 0.01)).tolist() == [False, True, True, True]  # the most likely token stays
    assert nucleus(z, 1.0) is z
    per_row = nucleus(torch.stack([z, z]), torch.tensor([[0.75], [1.0]]))
    assert torch.isinf(per_row).sum(-1).tolist() == [2, 0]


def test_the_nucleus_is_vllms():
    """vLLM's own top-p (its PyTorch sampler, which the CPU platform runs) drops the same tokens of random logits."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 300, generator=g) * 3  # (B, V)
    p = torch.rand(64, generator=g) * 0.9 + 0.05  # (B,)
    ours = nucleus(z, p[:, None])
    theirs = apply_top_k_top_p_pytorch(z.clone(), None, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)) and torch.isinf(ours).any()


def test_a_token_outside_the_trainers_nucleus_gets_the_floor_and_no_nan(policy_path):
    """An older policy sampled it; the current one's nucleus no longer holds it: its logprob is LOGPROB_FLOOR in
    every pass (no -inf - -inf ratio), and the backward pass stays finite."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.trainer.policy import LOGPROB_FLOOR, Policy

    policy = Policy(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32), top_p=0.05)
    ids = torch.tensor([[1, 5, 9, 13]])  # (1, 4)
    with torch.no_grad():  # the least likely next token after the prompt: outside a 5% nucleus
        ids[0, -1] = policy.lm(ids[:, :-1]).logits[0, -1].argmin()
    mask = torch.tensor([[False, True, True, True]])
    out = policy.outputs(ids, torch.ones_like(mask), mask, 1.0)
    assert out.logprobs[0, -1].item() == LOGPROB_FLOOR and torch.isfinite(out.entropy).all()
    out.logprobs.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


def check_top_p(engine, policy_path: str, prompts) -> None:
    """At temperature 0.7 and top-p 0.9, each sampled token's engine logprob is the trainer's recomputation (the
    tolerance of the engines' agreement tests)."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.trainer.policy import Policy

    engine.call(engine.update_weights(load_file(f"{policy_path}/model.safetensors"), engine.version))
    outs = engine.call(_gather(engine, prompts, Sampling(max_tokens=16, temperature=0.7, top_p=0.9)))
    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    policy, untruncated, truncated = Policy(lm, top_p=0.9).eval(), Policy(lm).eval(), 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids])  # (1, T)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        with torch.no_grad():
            lp, full = (p.outputs(ids, torch.ones_like(mask), mask, 0.7).logprobs[0, len(prompt) - 1:]  # (n,)
                        for p in (policy, untruncated))
        assert torch.allclose(lp, torch.tensor(out.logprobs), atol=1e-4), (lp, out.logprobs)
        truncated += int((lp - full).abs().max() > 1e-3)  # the nucleus renormalized these tokens' distribution
    assert truncated >= len(prompts) // 2  # top-p really cut tokens off, and the trainer cut the same ones


def test_the_torch_engine_samples_at_temperature_and_top_p_what_the_trainer_recomputes(torch_engine, policy_path,
                                                                                        prompts):
    check_top_p(torch_engine, policy_path, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("served_engine", ["vllm", "remote", "pool"], indirect=True)
def test_vllm_engines_sample_at_temperature_and_top_p_what_the_trainer_recomputes(served_engine, policy_path,
                                                                                   prompts):
    check_top_p(served_engine, policy_path, prompts)


# ----- a random stream per engine and per request -----
def test_torch_engine_runs_repeat_with_the_run_seed_and_differ_with_another(policy_path, prompts):
    def sample(run_seed: int, index: int = 0, seeded: bool = True) -> list[list[int]]:
        engine = TorchEngine()
        engine.seed_from(run_seed, index)  # what the module does with model.rollout.task_seed before launching
        engine.launch(policy_path)
        try:
            return generate(engine, prompts, [Sampling(max_tokens=12, seed=request_seed(run_seed, i, 0) if seeded
                                                       else None) for i in range(len(prompts))])
        finally:
            engine.release()

    assert sample(0) == sample(0)  # request by request: the same tokens
    assert sample(0) != sample(1)
    # requests without a seed draw from the engine's stream: engine i of a run has its own, and a rerun repeats it
    assert sample(0, 0, seeded=False) == sample(0, 0, seeded=False) != sample(0, 1, seeded=False)


def test_a_pool_gives_each_engine_its_own_seed_from_the_run_seed_and_servers_get_it_on_the_command_line():
    pool = EnginePool(engines=[TorchEngine(), TorchEngine(seed=5)], servers=2)
    pool.seed_from(7)
    seeds = [e.seed for e in pool.engines]
    assert seeds == [derive_seed(7, "engine", 0, bits=31), 5, derive_seed(7, "engine", 2, bits=31),
                     derive_seed(7, "engine", 3, bits=31)]  # an engine given a seed keeps it
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds)
    cmd = server_command("folder", "127.0.0.1", 8000, seed=seeds[2])
    assert cmd[cmd.index("--seed") + 1] == str(seeds[2])
    assert server_command("folder", "127.0.0.1", 8000, ["--seed", "3"], seed=9).count("--seed") == 1  # the user's


def test_a_pool_names_engines_that_share_a_seed_while_their_requests_carry_none(policy_path, caplog):
    a, b = TorchEngine(seed=3), TorchEngine(seed=3)
    for engine in a, b:
        engine.request_seeds = False  # as vLLM on the CPU, or servers started with one --seed
    pool = EnginePool(engines=[a, b])
    with caplog.at_level(logging.WARNING, logger="molt_lightning.engines.pool"):
        pool.launch(policy_path)
        pool.release()
    assert "sample from the same seed (3)" in caplog.text and "molt serve --seed" in caplog.text


@pytest.mark.slow
def test_vllm_on_the_cpu_says_once_that_requests_sample_from_the_engines_stream(vllm_engine, prompts, caplog):
    assert vllm_engine.request_seeds is False and vllm_engine.seed is not None  # asked of the worker at open
    vllm_engine._said_unseeded = False
    with caplog.at_level(logging.INFO, logger="molt_lightning.engines.vllm.phases"):
        generate(vllm_engine, prompts, [Sampling(max_tokens=4, seed=i) for i in range(len(prompts))])
        generate(vllm_engine, prompts, [Sampling(max_tokens=4, seed=i) for i in range(len(prompts))])
    said = [r for r in caplog.records if "takes no per-request seeds" in r.getMessage()]
    assert len(said) == 1  # once per engine
    assert "samples/duplicates" not in said[0].getMessage() and "seed" in said[0].getMessage()


@pytest.mark.slow
def test_servers_of_a_pool_sample_streams_of_their_own(molt_servers, policy_path, tokenizer):
    """The two session servers were started without a seed: each drew its own. A group of 16 runs of one prompt on
    the pool of both repeats itself no more than on one server (within noise), where two servers seeded alike
    answered 16 identical requests identically (half of a group were copies)."""
    pool = EnginePool(urls=[s.url for s in molt_servers])
    pool.launch(policy_path)
    try:
        assert [e.seed for e in pool.engines] == [s.seed for s in molt_servers]  # read back from each server
        assert molt_servers[0].seed != molt_servers[1].seed
        prompt, n = ChatTemplate(tokenizer).prompt_ids(QUESTION), 16

        def share(engine) -> float:
            async def group_of_runs():
                return await asyncio.gather(*[engine.generate(prompt, Sampling(max_tokens=24, route_key=str(i)))
                                              for i in range(n)])

            outs = pool.call(group_of_runs())
            group = [Trajectory(0, 0, segments=[[_policy(o.token_ids)]]) for o in outs]
            return repeats(group) / n

        routed = pool.routed.copy()
        on_pool, on_one = share(pool), share(pool.engines[0])
        assert all(pool.routed[i] - routed[i] >= n // 4 for i in (0, 1))  # the group really went to both servers
        assert on_pool <= on_one + 0.25, (on_pool, on_one)
    finally:
        pool.release()


def _policy(ids):
    from molt_lightning.trajectory import Span

    return Span.policy(ids, [0.0] * len(ids), [0] * len(ids))


# ----- every end-of-turn id -----
@pytest.fixture
def two_ends(policy_path, torch_engine, tmp_path):
    """The tiny policy with a second end-of-turn id in its generation config: the token the policy answers
    ``QUESTION`` with first (greedy), so that a turn ends on it at once. Returns the folder and that id."""
    from transformers import AutoTokenizer

    prompt = ChatTemplate(AutoTokenizer.from_pretrained(policy_path)).prompt_ids(QUESTION)
    [[second]] = generate(torch_engine, [prompt], [Sampling(max_tokens=1, temperature=0.0)])
    folder = tmp_path / "two-ends"
    shutil.copytree(policy_path, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    assert second != config["eos_token_id"], "the first token is the end of turn already: pick another question"
    config["eos_token_id"] = [config["eos_token_id"], second]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder), second


def chat_twice(engine, folder: str):
    """Two chat turns at temperature 0 through an agent client made as a run makes it; the trajectory."""
    from transformers import AutoTokenizer

    sessions = AgentSessions(engine, folder, AutoTokenizer.from_pretrained(folder), temperature=0.0,
                             max_context=256)
    traj = Trajectory(0, 0)

    async def agent():
        async with sessions.client(traj, seed=1, counter=None) as client:
            first, out = await client.chat_turn(QUESTION, max_tokens=8)
            ended = (out.finish_reason, traj.status)
            await client.chat_turn([*QUESTION, first, {"role": "user", "content": "Again?"}], max_tokens=8)
            return client, ended

    return traj, *engine.call(agent())


def check_two_ends(traj, client, ended, second: int) -> None:
    template, [segment] = client.template, traj.segments
    first = segment[1]  # prompt, the first reply, the closing and the next user turn, the second reply
    assert template.end_ids == {template.eos_id, second}
    assert first.token_ids == [second]  # the turn ended on the second id, which the engine returned as sampled
    assert template.decode_reply(first.token_ids) == "" and ended == ("stop", Status.OK)  # ended, not truncated
    # closed exactly as a turn that ended on the tokenizer's end-of-sequence id: no end token added, none lost
    closing = template.close_turn_ids([second])
    assert closing == template.close_turn_ids([template.eos_id]) == template.encode("\n")
    assert segment[2].token_ids[:len(closing)] == closing
    assert template.close_turn_ids([5]) == template.encode(template.turn_suffix)  # a truncated turn: the whole suffix


def test_a_turn_that_ends_on_the_generation_configs_second_id_ends_on_the_torch_engine(two_ends):
    folder, second = two_ends
    engine = TorchEngine(seed=0)
    engine.launch(folder)
    try:
        assert second in engine.eos_ids
        traj, client, ended = chat_twice(engine, folder)
    finally:
        engine.release()
    check_two_ends(traj, client, ended, second)


@pytest.mark.slow
def test_a_turn_that_ends_on_the_generation_configs_second_id_ends_on_vllm(two_ends, vllm_engine):
    folder, second = two_ends  # the session engine serves the same weights; the client sends it every end id
    traj, client, ended = chat_twice(vllm_engine, folder)
    check_two_ends(traj, client, ended, second)
    assert list(client._end_ids) == sorted(client.template.end_ids)  # what it sent as stop_token_ids
