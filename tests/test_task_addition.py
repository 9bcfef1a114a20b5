"""The addition task's reward, problem stream and agent, without a model."""

import asyncio
import itertools

import pytest

from molt_lightning.tasks.addition import agent, reward, tasks


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("12", 1.0),
        (" 12.\n", 1.0),
        ("The answer is 12.", 0.75),
        ("12 is the answer.", 0.75),
        ("7 + 5 = 12", 0.5),
        ("7+5 = 12 as you mentioned.", 0.5),
        ("7 + 5 = 12\n\nThe answer is 12.", 0.5),
        ("13", 0.0),
        ("7 + 5 = 13", 0.0),
        ("12, or maybe 13", 0.0),  # the right number must come last
        ("7 + 5 = 12\n\nThis is 2 numbers", 0.0),
        ("twelve", 0.0),
        ("", 0.0),
        ("120", 0.0),
        ("1.2", 0.0),
    ],
)
def test_reward(reply, expected):
    assert reward(reply, 12) == expected


def test_reward_zero_answer():
    assert reward("0", 0) == 1.0
    assert reward("The answer is 0.", 0) == 0.75
    assert reward("0 + 0 = 0", 0) == 0.5


def test_tasks_seeded_endless_and_consistent():
    a, b = list(itertools.islice(tasks(3), 50)), list(itertools.islice(tasks(3), 50))
    assert a == b and a != list(itertools.islice(tasks(4), 50))
    for s in a:
        x, y = s["question"].removeprefix("What is ").split("?")[0].split("+")
        assert s["answer"] == int(x) + int(y) and 0 <= int(x) <= 9 and 0 <= int(y) <= 9
        assert s["question"].endswith("Reply with only the number.")


class _FakeClient:
    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def chat(self, messages, *, max_tokens):
        self.calls.append((messages, max_tokens))
        return self.reply


def test_agent_grades_one_chat_turn():
    sample = {"question": "What is 7+5? Reply with only the number.", "answer": 12}
    client = _FakeClient("7 + 5 = 12")
    assert asyncio.run(agent(client, sample)) == 0.5
    [(messages, max_tokens)] = client.calls
    assert messages == [{"role": "user", "content": sample["question"]}] and max_tokens <= 32
