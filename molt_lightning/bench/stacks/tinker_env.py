"""A single-turn molt-bench protocol's task as a tinker-cookbook RL environment (``tinker_cookbook.rl.types``).

The ``tinker-cookbook`` stack (``stacks/tinker_cookbook.py``) hands ``TaskStreamBuilder`` to the cookbook's
``rl.train.main`` unchanged. What it builds, in the cookbook's own vocabulary:

- ``TaskStreamBuilder`` (an ``RLDatasetBuilder``, a ``chz`` class of plain fields): the protocol's task stream
  ``tasks(seed)`` drawn in order, ``batch_size`` samples per step for ``steps`` steps: the prompts molt draws for the
  same seed, in the same order.
- ``TaskStream`` (``RLDataset``): batch ``i`` is samples ``i*B .. (i+1)*B - 1``, one group builder each.
- ``SampleGroupBuilder`` (``EnvGroupBuilder``, a frozen dataclass of strings and the sample: picklable, as the
  cookbook requires for distributed rollouts): ``group_size`` copies of one ``SampleEnv``.
- ``SampleEnv`` (``Env``): the prompt is the sample's question as the one user message (no few-shot prefix, no
  system prompt: what molt's ``single_turn_agent`` sends), rendered by the cookbook's renderer; the reward is the
  protocol's ``task.reward`` (a TRL-style ``reward(prompts, completions, **columns) -> [float]``, e.g.
  ``tasks.arithmetic.tool_call_reward``, which is ``tool_call_score``) of the reply, and nothing else.

Deliberately not ``rl.problem_env.ProblemEnv``: its reward adds ``format_coef * (format - 1)`` (-0.1 for a reply that
did not end with the stop sequence) and scores the renderer's parsed message. Here the reply is decoded as molt's
``ChatTemplate.decode_reply`` does (the end-of-turn token dropped when it ends the reply, special tokens kept), so
the reward is exactly the protocol's score of the same text molt would score.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer


def dotted(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def score(reward: str, reply: str, sample: dict[str, Any]) -> float:
    """The protocol's ``task.reward`` of one reply, called as TRL calls it (a conversational completion and the
    sample's fields as one-element columns)."""
    columns = {k: [v] for k, v in sample.items() if k not in ("prompts", "completions")}
    prompt = [{"role": "user", "content": sample["question"]}]
    return float(dotted(reward)(prompts=[prompt], completions=[[{"role": "assistant", "content": reply}]],
                                **columns)[0])


class SampleEnv(Env):
    """One episode: the sample's question, one reply, the protocol's score."""

    def __init__(self, renderer: renderers.Renderer, sample: dict[str, Any], reward: str):
        self.renderer, self.sample, self.reward = renderer, sample, reward

    async def initial_observation(self):
        messages = [{"role": "user", "content": self.sample["question"]}]
        return self.renderer.build_generation_prompt(messages), self.renderer.get_stop_sequences()

    def reply_text(self, action: list[int]) -> str:
        """molt's ``decode_reply``: the reply without its end-of-turn token, special tokens kept."""
        stops = {s for s in self.renderer.get_stop_sequences() if isinstance(s, int)}
        ids = list(action)[:-1] if action and action[-1] in stops else list(action)
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=False)

    async def step(self, action, *, extra=None) -> StepResult:
        reward = score(self.reward, self.reply_text(action), self.sample)
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences(), metrics={"score": reward})


@dataclass(frozen=True)
class SampleGroupBuilder(EnvGroupBuilder):
    """``group_size`` episodes of one sample (GRPO's group); only strings and the sample: picklable."""

    sample: dict
    reward: str
    model_name: str
    renderer_name: str
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        return [SampleEnv(renderer, self.sample, self.reward) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["task"]


class TaskStream(RLDataset):
    def __init__(self, builders: list[SampleGroupBuilder], batch_size: int):
        self.builders, self.batch_size = builders, batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.builders[index * self.batch_size:(index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.builders) // self.batch_size


@chz.chz
class TaskStreamBuilder(RLDatasetBuilder):
    """The protocol's seeded task stream as the cookbook's dataset: ``steps`` batches of ``batch_size`` samples."""

    tasks: str  # dotted path of ``tasks(seed) -> Iterator[sample]`` (the protocol's task.tasks)
    reward: str  # dotted path of the protocol's task.reward
    seed: int
    batch_size: int  # prompts per step (groups per batch)
    group_size: int  # samples per prompt
    steps: int
    model_name: str
    renderer_name: str

    async def __call__(self) -> tuple[TaskStream, None]:
        samples = list(islice(dotted(self.tasks)(self.seed), self.batch_size * self.steps))
        builders = [SampleGroupBuilder(s, self.reward, self.model_name, self.renderer_name, self.group_size)
                    for s in samples]
        return TaskStream(builders, self.batch_size), None
