"""Gym-style environments (``molt_lightning.agents.env``): trained end to end as the agent ``envs.EnvAgent``,
observations as context never trained on, summed rewards, ``close`` after every episode (a raising one too),
``max_turns`` truncation, ``CalculatorEnv`` token for token the same as ``calculator_agent``, the recipe through the
CLI, and the bad inputs."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.engines import TorchEngine
from molt_lightning.agents.env import EnvAgent, Environment, Step
from molt_lightning.rollout import request_seed
from molt_lightning.tasks import arithmetic
from molt_lightning.tasks.arithmetic_env import MAX_TOKENS, MAX_TURNS, CalculatorEnv
from molt_lightning.trajectory import Kind, Status, Trajectory, Truncation

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import trained_runs  # noqa: E402
from modules import make_module  # noqa: E402
from scripted import ScriptedEngine  # noqa: E402
from test_bad_inputs import answer  # noqa: E402  (``molt fit`` must stop with a short error)

ROOT = Path(__file__).resolve().parents[1]
EPISODES: dict[int, dict] = {}  # what every ScoredEnv saw, by episode id (envs run on the engine's loop thread)
_ids = itertools.count()


class ScoredEnv(Environment):
    """Episodes of ``1 + id % 3`` replies (whatever they say): 0.25 per non-final step, 1.0 for the last one, the
    observation ``turn k of episode e`` in between. With ``fail_every`` n, the step of every n-th episode raises."""

    def __init__(self, fail_every: int = 0):
        self.id, self.fail_every = next(_ids), fail_every
        self.record = EPISODES[self.id] = {"rewards": [], "observations": [], "closed": 0, "raised": False}

    async def reset(self, sample):
        self.length = 1 + self.id % 3
        return sample["question"]

    async def step(self, action):
        rec = self.record
        if self.fail_every and self.id % self.fail_every == 0:
            rec["raised"] = True
            raise RuntimeError("step broke")
        done = len(rec["rewards"]) + 1 >= self.length
        rec["rewards"].append(1.0 if done else 0.25)
        if not done:
            rec["observations"].append(f"turn {len(rec['rewards'])} of episode {self.id}")
        return Step(None if done else rec["observations"][-1], rec["rewards"][-1], done, {"episode": self.id})

    async def close(self):
        self.record["closed"] += 1


class Batches(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(outputs["record"].batch.to("cpu"))


def fit(module, tmp_path, steps, callbacks=()):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


def record_generations(engine, monkeypatch):
    records = {}  # context + generated ids -> the engine's outputs for it
    original = engine.generate

    async def generate(prompt_ids, sampling, images=None):
        out = await original(prompt_ids, sampling, images)
        records.setdefault(tuple(prompt_ids) + tuple(out.token_ids), []).append((len(prompt_ids), out))
        return out

    monkeypatch.setattr(engine, "generate", generate)
    return records


def test_environment_trains_end_to_end(tmp_path, monkeypatch, tokenizer, caplog):
    EPISODES.clear()
    engine, batches = TorchEngine(seed=0), Batches()
    generations = record_generations(engine, monkeypatch)
    agent = EnvAgent(ScoredEnv, {"fail_every": 5}, max_turns=2, max_tokens=16)
    module = make_module(agent=agent, engine=engine, group_size=4, prompts_per_step=3, max_lag=1, lr=3e-4,
                         max_failure_rate=1.0)
    with caplog.at_level(logging.WARNING, logger="molt_lightning.rollout"):
        fit(module, tmp_path, steps=3, callbacks=[batches])

    # close() ran exactly once for every episode, the ones whose step raised and the ones cancelled at the end too
    assert EPISODES and all(rec["closed"] == 1 for rec in EPISODES.values())
    raised = {ep for ep, rec in EPISODES.items() if rec["raised"]}
    assert raised and 1 <= module.source.counts.failed <= len(raised)  # failed runs are counted
    assert "agent raised RuntimeError: step broke" in caplog.text

    kinds = set()
    for b in batches.seen:
        for row in range(b.input_ids.shape[0]):
            traj = b.trajectories[int(b.traj_ids[row])]
            ep = traj.info["episode"]
            rec = EPISODES[ep]
            assert ep not in raised
            # summed step rewards
            assert traj.reward == pytest.approx(sum(rec["rewards"])) == float(b.outcomes.rewards[b.traj_ids[row]])
            assert traj.info["turns"] == len(rec["rewards"])
            truncated = rec["rewards"][-1] != 1.0  # still going after env_max_turns=2 replies
            assert traj.info["env_truncated"] is truncated
            if truncated:
                assert traj.status == Status.TRUNCATED and len(rec["rewards"]) == 2
            kinds.add((len(rec["rewards"]), truncated))

            ids, mask = b.input_ids[row].tolist(), b.loss_mask[row].tolist()
            context = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
            trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
            sent = rec["observations"][: len(rec["rewards"]) - 1]  # a truncated episode's last one is never sent
            assert context.count("<|im_start|>user\n") == 1 + len(sent)
            for obs in sent:  # the env's observations: user messages, context only
                assert f"<|im_start|>user\n{obs}<|im_end|>" in context and obs not in trained
            assert "<|im_start|>" not in trained
            runs = trained_runs(mask)
            assert len(runs) == traj.info["turns"]
            for s, e in runs:  # every trained run is one engine generation: its context, ids, logprobs, versions
                assert any(n == s and out.token_ids == ids[s:e] and out.versions == b.versions[row, s:e].tolist()
                           and torch.allclose(b.engine_logprobs[row, s:e], torch.tensor(out.logprobs))
                           for n, out in generations[tuple(ids[:e])])
    assert kinds == {(1, False), (2, False), (2, True)}, kinds  # one, two turns done, and cut at max_turns


class NotAStep(Environment):
    async def reset(self, sample):
        return [{"role": "user", "content": sample["question"]}]  # opening messages instead of a text

    async def step(self, action):
        return {"done": True}  # not a Step


class NoObservation(Environment):
    closed = 0

    async def reset(self, sample):
        return sample["question"]

    async def step(self, action):
        return Step(None)  # not done, yet nothing to say

    async def close(self):
        NoObservation.closed += 1


def play(agent, engine, template, sample, seed=None) -> tuple[Trajectory, object]:
    traj = Trajectory(sample_id=0, group_id=0)
    client = AgentClient(engine, traj, template, temperature=1.0, max_context=256, seed=seed)
    return traj, asyncio.run(agent(client, sample))


def test_bad_steps_fail_the_run_with_the_reason_and_still_close(tokenizer):
    t = ChatTemplate(tokenizer)
    engine = ScriptedEngine(itertools.repeat(t.encode("ANSWER 1") + [t.eos_id]))
    sample = {"question": "What is 1+1?", "answer": 2}
    with pytest.raises(TypeError, match="NotAStep.step returned dict, not a Step"):
        play(EnvAgent(NotAStep), engine, t, sample)
    with pytest.raises(ValueError, match=r"got None: return one from NoObservation.step \(or end the episode with"):
        play(EnvAgent(NoObservation), engine, t, sample)
    assert NoObservation.closed == 1


def test_calculator_env_at_max_turns_is_the_agent_plus_a_truncation_mark(tokenizer):
    """Three ``CALC`` replies: both stop with reward 0 after the same tokens; the environment marks it truncated."""
    t = ChatTemplate(tokenizer)
    sample = arithmetic.make_problem(random.Random(0))
    calc = t.encode("CALC 2*3") + [t.eos_id]
    agent_traj, agent_reward = play(arithmetic.calculator_agent, ScriptedEngine(itertools.repeat(calc)), t, sample)
    calculator_env = EnvAgent(CalculatorEnv, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS)
    env_traj, result = play(calculator_env, ScriptedEngine(itertools.repeat(calc)), t, sample)
    assert env_traj.segments == agent_traj.segments and len(env_traj.segments[0]) == 2 * MAX_TURNS
    assert agent_reward == result.reward == 0.0
    assert result.info == {"turns": MAX_TURNS, "env_truncated": True}
    assert (agent_traj.status, env_traj.status) == (Status.OK, Status.TRUNCATED)
    assert env_traj.reason == f"the environment was not done after max_turns={MAX_TURNS}"
    assert (agent_traj.truncation, env_traj.truncation) == (None, Truncation.MAX_TURNS)


def test_an_episode_gives_its_step_rewards_and_observations_per_turn(tokenizer):
    """``EnvAgent``'s result carries a reward and a state key per turn (engine call), and each policy span its turn:
    what the turn-level estimators read. Episode ids 2 mod 3 take three replies (ScoredEnv)."""
    EPISODES.clear()
    t = ChatTemplate(tokenizer)
    engine = ScriptedEngine(itertools.repeat(t.encode("ANSWER 1") + [t.eos_id]))
    while next(_ids) % 3 != 1:  # the next ScoredEnv made gets an id of 2 mod 3: a three-reply episode
        pass
    traj, result = play(EnvAgent(ScoredEnv, max_turns=5), engine, t, {"question": "q?"})
    (record,) = EPISODES.values()
    assert result.turn_rewards == record["rewards"] == [0.25, 0.25, 1.0] and result.reward == 1.5
    keys = [json.loads(k) for k in result.turn_keys]
    assert keys == [[{"role": "user", "content": "q?"}]] + [[{"role": "user", "content": o}]
                                                            for o in record["observations"]]
    assert traj.turns == 3 and [s.turn for s in traj.policy_spans()] == [0, 1, 2]


@pytest.mark.slow
def test_calculator_env_makes_the_same_tokens_as_calculator_agent(policy_path, tokenizer):
    """The same seeded requests to the torch engine, one run at a time: identical trajectories and rewards."""
    engine, template = TorchEngine(seed=0), ChatTemplate(tokenizer)
    engine.launch(policy_path)
    agents = {"agent": arithmetic.calculator_agent,
              "env": EnvAgent(CalculatorEnv, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS)}
    runs = {name: [] for name in agents}
    try:
        for sample_id, sample in zip(range(12), arithmetic.tasks(0)):
            for member in range(4):
                for name, agent in agents.items():
                    traj = Trajectory(sample_id=sample_id, group_id=0)
                    client = AgentClient(engine, traj, template, temperature=1.0, max_context=256,
                                         seed=request_seed(0, sample_id, member))
                    result = engine.call(agent(client, sample))
                    runs[name].append((traj, getattr(result, "reward", result)))
    finally:
        engine.release()
    tool_turns = 0
    for (a, a_reward), (e, e_reward) in zip(runs["agent"], runs["env"]):
        assert e.segments == a.segments  # kinds, token ids, logprobs, versions
        assert e_reward == a_reward
        tool_turns += sum(s.kind == Kind.ENV for s in a.segments[0])
    assert tool_turns > 0, "no run called the calculator: the comparison covered no tool turn"
    assert {r for _, r in runs["agent"]} == {0.0, 1.0}


@pytest.mark.slow
def test_the_recipe_runs_through_the_cli(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/calculator_env.yaml",
         "--trainer.max_steps", "2", "--model.rollout.group_size", "4", "--model.rollout.prompts_per_step", "4",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "calculator_env").iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1] and df["reward"].notna().all()
    config = (run_dir / "config.yaml").read_text()
    assert "environment: molt_lightning.tasks.arithmetic_env.CalculatorEnv" in config and "TorchEngine" in config


# ----- bad inputs, answered before anything starts (the style of tests/test_bad_inputs.py) -----
FAST = """\
trainer: {{accelerator: cpu, max_steps: 1, logger: false, enable_checkpointing: false, enable_progress_bar: false,
          default_root_dir: {root}}}
model:
  engine: molt_lightning.engines.TorchEngine
  tasks: molt_lightning.tasks.arithmetic.tasks
  rollout: {{group_size: 2, prompts_per_step: 2}}
  policy: {policy}
"""


@pytest.fixture
def recipe(tmp_path, policy_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["molt"])  # else LightningCLI warns that it got both argv and args
    path = tmp_path / "recipe.yaml"
    path.write_text(FAST.format(root=tmp_path, policy=policy_path))
    return str(path)


def env_agent_arg(environment: str, **init_args) -> list[str]:
    import json

    spec = {"class_path": "molt_lightning.agents.env.EnvAgent", "init_args": {"environment": environment, **init_args}}
    return ["--model.agent", json.dumps(spec)]


@pytest.mark.parametrize("args, problem", [
    (env_agent_arg("molt_lightning.engines.TorchEngine"),
     "model.agent.init_args.environment molt_lightning.engines.torch_engine.TorchEngine is not an Environment: give "
     "the dotted path of a class that subclasses molt_lightning.agents.env.Environment"),
    (env_agent_arg("molt_lightning.agents.env.Environment"),
     "model.agent.init_args.environment molt_lightning.agents.env.Environment is abstract: implement reset, step"),
    (env_agent_arg("molt_lightning.tasks.arithmetic_env.NoSuchEnv"),
     "fix: model.agent takes the dotted path of an `async def agent(client, sample) -> reward`"),
    (env_agent_arg("molt_lightning.tasks.arithmetic_env.CalculatorEnv", env_kwargs={"size": 3}),
     "CalculatorEnv cannot be made with env_kwargs {'size': 3}"),
    (env_agent_arg("molt_lightning.tasks.arithmetic_env.CalculatorEnv", max_turns=0),
     "EnvAgent max_turns and max_tokens must be >= 1, got 0 and 64"),
])
def test_a_bad_environment_is_answered_before_anything_starts(recipe, capsys, args, problem):
    err = answer(capsys, "--config", recipe, *args)
    assert problem in err, err


def test_a_bad_environment_in_python():
    with pytest.raises(ValueError, match="is not an Environment"):
        EnvAgent(arithmetic.calculator_agent)
    with pytest.raises(ValueError, match="cannot be made with env_kwargs"):
        EnvAgent(CalculatorEnv, {"size": 3})
