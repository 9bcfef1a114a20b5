"""The stock ``trl`` stack: TRL's GRPOTrainer with its own generation on single-turn protocols, scored like molt."""

from __future__ import annotations

import asyncio
import copy

import pandas as pd
import pytest

from molt_lightning.bench import compare, runner
from molt_lightning.bench.protocol import Protocol, load_protocol
from molt_lightning.bench.runs import load_runset
from molt_lightning.bench.stacks import get_stack
from molt_lightning.tasks import addition, arithmetic

pytestmark = pytest.mark.timeout(300)
# tokens/s from the first step on: molt's is the tokens generated within a step's wall time, and running ahead
# (max_lag 1) a 3-step run may generate none in its last steps (a mean of 0 has no relative margin)
SMALL = ["steps=3", "batch.prompts_per_step=2", "batch.samples_per_prompt=4",
         "metrics.tokens_per_s_per_device.warmup=0"]
SAMPLE = {"question": "What is 37*58?", "expression": "37*58", "answer": 2146}


@pytest.mark.parametrize("reply, score", [
    ("CALC 37*58", 1.0), ("CALC 37 * 58", 1.0), ("CALC 37*58\n", 1.0),  # what calculator_agent would run right
    ("CALC 58*37", 0.0), ("CALC 37+58", 0.0), ("CALC 37*58 please", 0.0), (" CALC 37*58", 0.0),
    ("CALC37*58", 0.0), ("ANSWER 2146", 0.0), ("", 0.0),
])
def test_single_turn_agent_and_trl_reward_share_one_score(reply, score):
    assert arithmetic.tool_call_score(reply, SAMPLE) == score

    class Client:  # molt's side: the agent program asks one reply of 16 tokens
        async def chat(self, messages, *, max_tokens):
            assert messages == [{"role": "user", "content": SAMPLE["question"]}] and max_tokens == 16
            return reply

    assert asyncio.run(arithmetic.single_turn_agent(Client(), SAMPLE)) == score
    # TRL's side: conversational completions (or plain strings) and the dataset's columns as keyword lists
    convo = [[{"role": "assistant", "content": reply}]]
    assert arithmetic.tool_call_reward(prompts=[[]], completions=convo, expression=["37*58"], answer=[2146]) == [score]
    assert arithmetic.tool_call_reward(prompts=[""], completions=[reply], expression=["37*58"]) == [score]


def test_addition_reward_is_the_task_reward():
    replies = ["12", "The answer is 12.", "7 + 5 = 12", "13"]
    convo = [[{"role": "assistant", "content": r}] for r in replies]
    assert addition.addition_reward(prompts=[[]] * 4, completions=convo, answer=[12] * 4) == [1.0, 0.75, 0.5, 0.0]


def test_a_lora_protocol_is_refused_not_ignored():
    pytest.importorskip("trl")
    p = load_protocol("arithmetic-single-turn", ["model.lora={r: 8, alpha: 16}"])
    with pytest.raises(ValueError, match=r"stack trl cannot run model.lora=\{'r': 8, 'alpha': 16\}"):
        get_stack("trl").check(p.with_changes(get_stack("trl").changes))


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    pytest.importorskip("trl")
    from transformers import GenerationMixin

    from molt_lightning.agents.client import AgentClient
    from molt_lightning.engines import TorchEngine, VLLMEngine

    root = tmp_path_factory.mktemp("trl_stock")
    p = load_protocol("arithmetic-single-turn", SMALL)
    generate, calls = GenerationMixin.generate, []

    def counted(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return generate(self, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the stock trl stack must not construct molt's engines or agent client")

    with pytest.MonkeyPatch.context() as mp:  # completions come from TRL's own transformers generate, not molt's
        for cls in (TorchEngine, VLLMEngine, AgentClient):
            mp.setattr(cls, "__init__", refuse)
        mp.setattr(GenerationMixin, "generate", counted)
        runner.run(p, "trl", 2, root / "trl", log=lambda *_: None)
    runner.run(p, "molt", 2, root / "molt", log=lambda *_: None)
    return root, calls


@pytest.mark.slow
def test_stock_trl_generates_itself_and_logs_what_molt_logs(stock_runs):
    root, calls = stock_runs
    assert calls == [8] * 6  # one TRL generate per step (2 prompts x 4 samples), 3 steps x 2 seeds
    rs = load_runset(root / "trl")
    m = rs.manifest
    assert rs.seeds == [0, 1] and rs.protocol["max_lag"] == 0 and m["stack"] == "trl"
    assert "single-turn" in m["stack_config"]["turns"] and "SINGLE-TURN" in m["stack_notes"]
    assert "transformers generate" in m["stack_config"]["generation"]
    for seed in (0, 1):
        f = rs.frames[seed]
        assert f["step"].tolist() == [1, 2, 3] and f["reward"].between(0, 1).all()
        raw = pd.read_json(root / "trl" / f"seed_{seed}" / "raw" / "trl_log.jsonl", lines=True)
        assert raw["reward"].tolist() == pytest.approx(f["reward"].tolist())  # TRL's own logged reward
        assert raw["rewards/tool_call_reward/mean"].tolist() == pytest.approx(f["reward"].tolist())
        assert (raw["completions/mean_length"] > 0).all()
        tokens = raw["completions/mean_length"] * 8 / raw["bench/step_time_s"]
        assert f["tokens_per_s_per_device"].tolist() == pytest.approx(tokens.tolist())


def test_stock_trl_run_set_compares_with_molt_on_the_same_protocol(stock_runs):
    root, _ = stock_runs
    a, b, allowed, results = compare.compare_runsets(root / "trl", root / "molt", allow=["max_lag"])
    assert [d[0] for d in allowed] == ["max_lag"]  # trl runs synchronously; nothing else differs
    assert [r.spec.name for r in results] == ["reward", "step_time_s", "tokens_per_s_per_device"]
    assert all(r.result.verdict and list(r.values_a) == [0, 1] for r in results)


def _without_reward() -> Protocol:
    data = copy.deepcopy(load_protocol("arithmetic-single-turn").data)
    del data["task"]["reward"]
    return Protocol(data)


@pytest.mark.parametrize("protocol, message", [
    (_without_reward, "needs task.reward"),
    (lambda: load_protocol("arithmetic-single-turn", ["task.reward=molt_lightning.tasks.arithmetic.nope"]),
     "cannot import 'molt_lightning.tasks.arithmetic.nope'"),
    (lambda: load_protocol("arithmetic-tiny"), "single-turn variant"),
    (lambda: load_protocol("arithmetic-single-turn", ["optimizer.schedule=cosine"]), "optimizer.schedule"),
])
def test_bad_protocols_are_refused_before_running(tmp_path, protocol, message):
    pytest.importorskip("trl")
    with pytest.raises(ValueError, match=message):
        runner.run(protocol(), "trl", 1, tmp_path / "x", log=lambda *_: None)
    assert not (tmp_path / "x").exists()


def test_shipped_single_turn_protocols_pass_both_stacks_checks():
    pytest.importorskip("trl")
    for name in ("arithmetic-single-turn", "smollm2-addition"):
        p = load_protocol(name)
        get_stack("molt").check(p)
        get_stack("trl").check(p.with_changes(get_stack("trl").changes))
    with pytest.raises(ValueError, match="task.max_turns"):  # molt holds a protocol to what its agent does
        get_stack("molt").check(load_protocol("arithmetic-single-turn", ["task.max_turns=3"]))
    with pytest.raises(ValueError, match="model.precision"):
        get_stack("trl").check(load_protocol("smollm2-addition", ["model.precision=16-mixed", "max_lag=0"]))
