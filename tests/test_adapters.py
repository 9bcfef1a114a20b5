"""Environments of other libraries run unchanged (``molt_lightning.agents.adapters``): a verifiers single-turn taskset,
a verifiers taskset with an MCP tool and an OpenEnv MCP environment each train on the tiny python-tool policy with the
torch engine, every trained token the engine's; their own scorers give the rewards (checked against hand-computed
values on scripted replies); an environment whose reward function or step raises is a counted failed sample and
training goes on; OpenEnv's HTTP server on 127.0.0.1; a recipe through the CLI."""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1")
pytest.importorskip("openenv.core")

from molt_lightning import Rollout  # noqa: E402
from molt_lightning.agents.adapters import OpenEnvAgent, VerifiersAgent, VerifiersTasks, seeds  # noqa: E402
from molt_lightning.agents.adapters.verifiers_env import load_env_config  # noqa: E402
from molt_lightning.agents.chat import ChatTemplate  # noqa: E402
from molt_lightning.engines import TorchEngine  # noqa: E402
from molt_lightning.tasks import openenv_envs, verifiers_envs  # noqa: E402
from molt_lightning.tasks.arithmetic import make_problem  # noqa: E402
from molt_lightning.trajectory import Status, Truncation  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from invariant import check_trained_tokens, fit_recorded  # noqa: E402
from scripted import run_at_endpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SINGLE = "molt_lightning.tasks.verifiers_envs:ArithmeticTaskset"
TOOL = "molt_lightning.tasks.verifiers_envs:PythonToolTaskset"
OPENENV = "molt_lightning.tasks.openenv_envs:ArithmeticEnv"
ANSWER = "molt_lightning.tasks.openenv_envs:AnswerAction"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="the python tool's sandbox needs bubblewrap: apt-get install bubblewrap")


@pytest.fixture(scope="module")
def tool_policy():
    from molt_lightning.models.tiny import python_tool_policy

    return python_tool_policy()


@pytest.fixture(scope="module")
def template(tool_policy):
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(tool_policy))


def call(template, agent, sample, replies):
    """Run ``agent`` once against an endpoint in front of a scripted engine; returns (result or error, client)."""
    return run_at_endpoint(template, replies, lambda client: agent(client, sample), catch=True)


def tool_call(code: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'


def train(agent, tasks, monkeypatch, group_size=8, prompts_per_step=2, steps=2, max_failure_rate=0.5):
    rollout = Rollout(group_size=group_size, prompts_per_step=prompts_per_step, max_lag=1, task_seed=1,
                      max_failure_rate=max_failure_rate)
    module, _, records, batches = fit_recorded(agent, tasks, monkeypatch, engine=TorchEngine(seed=0), steps=steps,
                                               rollout=rollout)
    return module, records, batches


def trained(batches):
    return [t for _, b in batches.seen for t in b.trajectories]


# ----- the environments' own scorers, on scripted replies -----
@pytest.mark.slow
def test_verifiers_rewards_on_scripted_replies(template):
    tasks = VerifiersTasks(SINGLE, {"num_tasks": 10}, split="eval", eval_size=3)
    sample = list(tasks())[1]
    assert len(tasks) == 3 and sample["prompt"] == sample["task"]["prompt"]
    expr, answer = sample["task"]["expression"], sample["task"]["answer"]
    single = VerifiersAgent(SINGLE, {"num_tasks": 10}, {"agent": {"max_turns": 1}}, max_tokens=48)
    for reply, exact, integer in [(str(answer), 1.0, 1.0), (f"{answer}.", 1.0, 0.0), (str(answer + 1), 0.0, 1.0),
                                  (f"it is {answer}", 0.0, 0.0)]:
        result, client = call(template, single, sample, [reply])
        assert result.reward == exact  # integer_reply has weight 0
        assert result.info["reward/exact_answer"] == exact and result.info["reward/integer_reply"] == integer
        assert result.info["metric/reply_chars"] == len(reply) and result.info["turns"] == 1
        assert client.trajectory.status == Status.OK and "endpoint_errors" not in client.trajectory.info

    tool = VerifiersAgent(TOOL, {"num_tasks": 10}, {"agent": {"max_turns": 3}}, max_tokens=48)
    result, client = call(template, tool, sample, [tool_call(f"print({expr})"), str(answer)])
    assert result.reward == 1.0 and result.info["metric/tool_calls"] == 1.0 and result.info["turns"] == 2
    assert f"<|im_start|>tool\n{answer}<|im_end|>" in template.tokenizer.decode(client.tokens)  # the sandbox ran it
    # verifiers' max_turns ends the episode: scored, and the trajectory is truncated
    result, client = call(template, tool, sample, [tool_call("print(1)")] * 4)
    assert result.reward == 0.0 and result.info["turns"] == 3 and result.info["stop_condition"] == "max_turns"
    assert client.trajectory.status == Status.TRUNCATED and client.trajectory.truncation == Truncation.MAX_TURNS


def test_openenv_rewards_on_scripted_replies(template):
    sample = {"seed": 7}
    problem = make_problem(random.Random(7))
    agent = OpenEnvAgent(OPENENV, action=ANSWER, max_turns=3, max_tokens=48)
    replies = [tool_call(f"print({problem['expression']})"), str(problem["answer"])]
    result, client = call(template, agent, sample, replies)
    assert result.reward == 1.0 and result.info == {"turns": 2, "env_steps": 2, "env_truncated": False}
    text = template.tokenizer.decode(client.tokens)
    assert f"<|im_start|>user\n{problem['question']}<|im_end|>" in text and "tools: python" in text
    assert f"<|im_start|>tool\n{problem['answer']}<|im_end|>" in text
    result, client = call(template, agent, sample, [str(problem["answer"] + 1)])
    assert result.reward == 0.0 and result.info["env_steps"] == 1
    result, client = call(template, agent, sample, [tool_call("print(1)")] * 3)
    assert result.reward == 0.0 and result.info["env_truncated"] and client.trajectory.status == Status.TRUNCATED
    assert client.trajectory.truncation == Truncation.MAX_TURNS


def test_openenv_through_its_server_on_loopback(template):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(openenv_envs.app(), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert server.started
        agent = OpenEnvAgent(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", action=ANSWER, max_tokens=48)
        problem = make_problem(random.Random(3))
        result, client = call(template, agent, {"seed": 3}, [str(problem["answer"])])
        assert result.reward == 1.0 and result.info["env_steps"] == 1
        assert problem["question"] in template.tokenizer.decode(client.tokens)
    finally:
        server.should_exit = True
        thread.join(10)


def test_verifiers_config_choices(caplog):
    """Unset roles get the subprocess runtime and the in-process chat program; sampling other than max_tokens is
    dropped with a warning (the endpoint samples at the run's settings); what the user set stays."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig

    with caplog.at_level(logging.WARNING, logger="molt_lightning.agents.adapters"):
        config = load_env_config(SINGLE, {"num_tasks": 5}, {"agent": {"max_turns": 2, "sampling": {
            "temperature": 0.7, "top_p": 0.9, "max_tokens": 32}}})
    [(role, spec)] = agent_config_fields(config).items()
    assert role == "agent" and spec.max_turns == 2 and isinstance(spec.runtime, SubprocessConfig)
    assert spec.harness.id == "molt_chat_program" and spec.sampling.model_dump(exclude_none=True) == {"max_tokens": 32}
    assert "dropped sampling" in caplog.text and "temperature" in caplog.text and config.taskset.num_tasks == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="127.0.0.1"):
        OpenEnvAgent(base_url="http://10.0.0.1:8000")
    with pytest.raises(ValueError, match="not both"):
        OpenEnvAgent(OPENENV, base_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="eval_size"):
        VerifiersTasks(SINGLE, split="eval")
    with pytest.raises(ValueError, match="none left"):
        VerifiersTasks(SINGLE, {"num_tasks": 4}, eval_size=4)


# ----- training on the tiny python-tool policy -----
@pytest.mark.parametrize("kind", ["verifiers_single_turn", "verifiers_tool", "openenv"])
@pytest.mark.slow
def test_environment_trains_only_on_engine_tokens(kind, tool_policy, template, tmp_path, monkeypatch):
    if kind == "openenv":
        agent, tasks = OpenEnvAgent(OPENENV, action=ANSWER, max_turns=3, max_tokens=48), seeds
    else:
        env, turns = (SINGLE, 1) if kind == "verifiers_single_turn" else (TOOL, 3)
        agent = VerifiersAgent(env, env_config={"agent": {"max_turns": turns}}, max_tokens=48)
        tasks = VerifiersTasks(env)
    module, records, batches = train(agent, tasks, monkeypatch)
    tool_turns = check_trained_tokens(records, batches, template.tokenizer)
    trajectories = trained(batches)
    assert trajectories and all("endpoint_errors" not in t.info for t in trajectories)
    assert module.source.counts.failed == 0
    for t in trajectories:
        assert t.reward in (0.0, 1.0)
        if kind != "openenv":  # the rubric's per-function scores; the reward is exact_answer (weight 1)
            assert t.reward == t.info["reward/exact_answer"] and "reward/integer_reply" in t.info
        if kind == "verifiers_tool":
            ids = [i for segment in t.segments for span in segment for i in span.token_ids]
            assert t.info["metric/tool_calls"] == template.tokenizer.decode(ids).count("<|im_start|>tool")
    if kind == "verifiers_single_turn":
        assert tool_turns == 0
    else:
        assert tool_turns > 0, "no trained trajectory called the python tool"


class BrokenTask(verifiers_envs.ArithmeticTask):
    @vf.reward
    async def exact_answer(self, trace):
        if self.data.idx % 2:
            raise RuntimeError("rubric broke")
        return 0.0


class BrokenTaskset(vf.Taskset[BrokenTask, verifiers_envs.ArithmeticConfig]):
    def load(self):
        for task in verifiers_envs.ArithmeticTaskset(self.config).load():
            yield BrokenTask(task.data, self.config.task)


class BrokenEnv(openenv_envs.ArithmeticEnv):
    def _step_impl(self, action, timeout_s=None, **kwargs):
        if self._seed % 2:
            raise RuntimeError("step broke")
        return super()._step_impl(action, timeout_s, **kwargs)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._seed = seed
        return super().reset(seed, episode_id, **kwargs)


@pytest.mark.slow
def test_broken_environments_fail_samples_and_training_goes_on(tool_policy, template, tmp_path, monkeypatch, caplog):
    """A verifiers reward function that raises (odd tasks) and an OpenEnv step that raises (odd seeds): those samples
    fail with their reasons, are counted and not trained on; the others train."""
    vf_agent = VerifiersAgent(f"{__name__}:BrokenTaskset", env_config={"agent": {"max_turns": 1}}, max_tokens=48)
    oe_agent = OpenEnvAgent(f"{__name__}:BrokenEnv", action=ANSWER, max_turns=1, max_tokens=48)
    vf_tasks = VerifiersTasks(f"{__name__}:BrokenTaskset", shuffle=False)

    def tasks(seed=0):  # alternate: verifiers task idx 0, 1, 2, ... and reset seeds 0, 1, 2, ...
        for k, sample in enumerate(vf_tasks(seed)):
            yield sample
            yield {"seed": k}

    async def agent(client, sample):
        return await (vf_agent if "task" in sample else oe_agent)(client, sample)

    with caplog.at_level(logging.WARNING, logger="molt_lightning.rollout"):
        module, records, batches = train(agent, tasks, monkeypatch, group_size=2, prompts_per_step=4,
                                         max_failure_rate=0.8)
    check_trained_tokens(records, batches, template.tokenizer)
    assert "the verifiers episode failed" in caplog.text and "rubric broke" in caplog.text
    assert "step broke" in caplog.text
    assert module.source.counts.failed >= 4
    for t in trained(batches):  # only the sound half trained
        sample = t.sample
        assert (sample["task"]["idx"] % 2 == 0) if "task" in sample else (sample["seed"] % 2 == 0)


@pytest.mark.slow
def test_verifiers_recipe_runs_through_the_cli(tmp_path):
    import pandas as pd

    out = subprocess.run(
        [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/verifiers_tool.yaml",
         "--model.engine", "molt_lightning.engines.TorchEngine", "--trainer.max_steps", "2",
         "--model.rollout.prompts_per_step", "4", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "verifiers_tool").iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1]
    assert df["samples/failed"].dropna().sum() == 0
