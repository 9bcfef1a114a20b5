"""Fixtures of the micro-benchmarks: the tiny default policy, its chat template, and a realistic rollout batch.

The batch is what one step of the default recipe trains on: 8 prompts of the calculator task x 8 agent runs
(``group_size``), each run built span by span exactly as ``AgentClient.chat_turn`` records it (the first prompt, then
for every later turn the template's closing text plus the delta as an environment span, the replies as policy spans
with engine logprobs and versions). About half the runs take the tool route (two policy turns), the rest answer at
once. Everything is seeded, and torch runs on one thread so the timings of a shared 2-core machine stay comparable.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from molt_lightning.tasks.arithmetic import calculator, make_problem, reward  # noqa: E402
from molt_lightning.trajectory import Kind, Span, Trajectory  # noqa: E402

GROUPS, GROUP_SIZE = 8, 8  # the default recipe's prompts_per_step x group_size: 64 trajectories


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def policy_path() -> str:
    from molt_lightning.models.tiny import arithmetic_policy

    return arithmetic_policy()


@pytest.fixture(scope="session")
def tokenizer(policy_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_path)


@pytest.fixture(scope="session")
def template(tokenizer):
    from molt_lightning.agents.chat import ChatTemplate

    return ChatTemplate(tokenizer)


@pytest.fixture(scope="session")
def lm(policy_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)


def calculator_dialogue(rng: random.Random, problem: dict, p_tool: float = 0.5) -> list[dict]:
    """One run of the calculator agent: the tool route (CALC, tool reply, ANSWER) or a direct guess."""
    user = {"role": "user", "content": problem["question"]}
    if rng.random() < p_tool:
        return [user, {"role": "assistant", "content": f"CALC {problem['expression']}"},
                {"role": "tool", "content": calculator(problem["expression"])},
                {"role": "assistant", "content": f"ANSWER {problem['answer']}"}]
    return [user, {"role": "assistant", "content": f"ANSWER {rng.randint(-99, 99999)}"}]


def record(template, dialogue: list[dict], rng: random.Random, sample_id: int, group_id: int,
           version: int = 3) -> Trajectory:
    """The trajectory ``AgentClient.chat_turn`` records for ``dialogue``: context spans, then each reply as the
    engine's tokens (content + end of turn) with a logprob in [-3, 0) and a version in [version - 1, version]."""
    traj = Trajectory(sample_id=sample_id, group_id=group_id)
    seen, last = None, []
    for i, msg in enumerate(dialogue):
        if msg["role"] != "assistant":
            continue
        if seen is None:
            traj.segments[-1].append(Span.context(Kind.PROMPT, template.prompt_ids(dialogue[:i])))
        else:
            delta = template.close_turn_ids(last) + template.delta_ids(seen, dialogue[len(seen):i])
            traj.segments[-1].append(Span.context(Kind.ENV, delta))
        last = template.encode(msg["content"]) + [template.eos_id]
        traj.segments[-1].append(Span.policy(last, [-3 * rng.random() for _ in last],
                                             [version - rng.randint(0, 1) for _ in last]))
        seen = dialogue[: i + 1]
    return traj


@pytest.fixture(scope="session")
def trajectories(template) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for g in range(GROUPS):
        problem = make_problem(rng)
        for _ in range(GROUP_SIZE):
            dialogue = calculator_dialogue(rng, problem)
            traj = record(template, dialogue, rng, sample_id=g, group_id=g)
            traj.reward = reward(dialogue[-1]["content"], problem)
            out.append(traj)
    return out
