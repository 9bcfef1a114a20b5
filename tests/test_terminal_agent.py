"""The terminal agent on the example Harbor tasks, in real bubblewrap sandboxes: a policy that types the reference
solution earns the task's reward from its own tests, one that stops at once or types a wrong command earns 0, each
command and its output land in the sample's info, a verifier that hangs fails the sample; the recipe runs two steps
through ``molt fit``."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from molt_lightning.agents.tools.shell import BubblewrapBackend
from molt_lightning.tasks.harbor import EXAMPLES, VerifierFailed, harbor_tasks, sample_of, solution_commands
from molt_lightning.tasks.terminal_agent import TerminalAgent, observation, solution_dialogue

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


class Scripted:
    """A client whose replies are given (what the policy would type), recording what it was shown."""

    def __init__(self, replies: list[str]):
        self.replies, self.seen = list(replies), []

    async def chat(self, messages, max_tokens=None):
        self.seen.append([dict(m) for m in messages])
        return self.replies.pop(0) if self.replies else "DONE"


def run(agent, replies, task):
    client = Scripted(replies)
    return asyncio.run(agent(client, sample_of(task, "train"))), client


@pytest.fixture(scope="module")
def agent():
    return TerminalAgent(BubblewrapBackend(), max_turns=3)


@pytest.mark.slow  # 30 episodes: ~3 s
def test_the_reference_solution_earns_the_tests_reward_and_nothing_earns_nothing(agent):
    for task in harbor_tasks(EXAMPLES):
        solved, client = run(agent, [f"RUN {c}" for c in solution_commands(task)] + ["DONE"], task)
        assert solved.reward == 1.0, (task.name, solved.info)
        assert [c["command"] for c in solved.info["commands"]] == solution_commands(task)
        assert client.seen[1][-1]["role"] == "tool" and client.seen[1][-1]["content"].endswith("[exit 0]")
        nothing, _ = run(agent, ["DONE"], task)
        assert nothing.reward == 0.0 and nothing.info["commands"] == []


def test_a_wrong_command_earns_0_and_its_output_is_shown(agent):
    [task] = harbor_tasks(EXAMPLES / "count-lines-1")
    result, client = run(agent, ["RUN wc -l data.txt > count.txt", "RUN cat count.txt", "DONE"], task)
    assert result.reward == 0.0
    assert client.seen[2][-1]["content"] == "3 data.txt\n\n[exit 0]"  # what the policy read after `cat`
    assert result.info["verifier"]["how"] == "reward.txt"


def test_a_verifier_that_hangs_fails_the_sample(agent, tmp_path):
    task_dir = tmp_path / "hang"
    shutil.copytree(EXAMPLES / "write-file-1", task_dir)
    (task_dir / "task.toml").write_text((task_dir / "task.toml").read_text().replace("timeout_sec = 30.0",
                                                                                       "timeout_sec = 1.0"))
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 1000\n")
    [task] = harbor_tasks(task_dir)
    with pytest.raises(VerifierFailed, match="timeout"):
        run(agent, ["DONE"], task)


def test_the_verifier_runs_after_an_episode_that_used_all_its_time(agent, tmp_path):
    task_dir = tmp_path / "slow"
    shutil.copytree(EXAMPLES / "write-file-1", task_dir)
    (task_dir / "task.toml").write_text((task_dir / "task.toml").read_text().replace("[agent]\ntimeout_sec = 60.0",
                                                                                       "[agent]\ntimeout_sec = 1.0"))
    [task] = harbor_tasks(task_dir)
    assert task.agent_timeout_s == 1.0
    result, client = run(agent, [f"RUN {solution_commands(task)[0]}", "RUN sleep 30"], task)
    assert result.info["commands"][1]["timed_out"] and client.seen[2][-1]["content"] == "[timed out]"
    assert result.reward == 1.0 and result.info["verifier"]["how"] == "reward.txt"


def test_observations_and_demonstrations():
    from molt_lightning.agents.tools.shell import ShellResult

    assert observation(ShellResult("a\nb", 0, False, 0.1), 2) == "\nb\n[exit 0]"
    assert observation(ShellResult("", None, True, 30.0), 300) == "[timed out]"
    [task] = harbor_tasks(EXAMPLES / "find-line-1")
    assert solution_dialogue(task) == [
        {"role": "user", "content": task.instruction},
        {"role": "assistant", "content": "RUN grep apple data.txt > answer.txt"},
        {"role": "tool", "content": "[exit 0]"},
        {"role": "assistant", "content": "DONE"}]
    with pytest.raises(ValueError, match="max_turns and max_tokens must be >= 1"):
        TerminalAgent(max_turns=0)


def test_warm_start_instances_copy_their_names_from_the_instruction():
    """Each demonstration's command takes its file names and words from its instruction (random letters: a policy
    learns to copy them), the held-out tasks' instructions are never drawn, and every family appears."""
    import random
    import re

    from molt_lightning.tasks.terminal_agent import demonstration, heldout_instructions

    rng, firsts = random.Random(0), set()
    for _ in range(300):
        user, command, tool, done = demonstration(rng)
        assert command["content"].startswith("RUN ") and tool["content"] == "[exit 0]" and done["content"] == "DONE"
        assert user["content"] not in heldout_instructions()
        names = re.findall(r"[a-z]+\.(?:txt|md|log)|'([a-z]+)\\n'", command["content"])
        for name in [n for group in names for n in (group if isinstance(group, tuple) else (group,)) if n]:
            assert name in user["content"], (name, user["content"])
        firsts.add(command["content"].split()[1])
    assert firsts == {"printf", "grep", "wc", "sed", "mv", "sort"}


@pytest.mark.slow
def test_the_terminal_recipe_runs_two_steps(tmp_path):
    from test_cli import fit_recipe

    out, _, config, df = fit_recipe("terminal", tmp_path)
    assert "TerminalAgent" in config and "HarborTasks" in config
    assert df["samples/failed_total"].dropna().iloc[-1] == 0  # every episode sandboxed and verified


@pytest.mark.slow
def test_the_terminal_warm_start_recipe_trains_and_writes_a_policy_the_agent_can_use(tmp_path):
    """``molt sft --config recipes/sft_terminal.yaml`` for 2 steps writes a policy folder with the 512-token context
    the episodes need; its demonstrations render within it."""
    import json

    from test_cli import run
    from transformers import AutoConfig

    out = run("-m", "molt_lightning.commands.cli", "sft", "--config", "recipes/sft_terminal.yaml",
              "--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
              "--model.out", str(tmp_path / "policy"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert AutoConfig.from_pretrained(tmp_path / "policy").max_position_embeddings == 512
    from molt_lightning.models.tiny import terminal_demonstrations

    rows = [json.loads(line) for line, _ in zip(open(terminal_demonstrations()), range(100))]
    assert all(r["messages"][1]["content"].startswith("RUN ") for r in rows)
