"""Two environments written the way ``verifiers`` (v0.4, ``verifiers.v1``) users write them, for the python-tool policy.

- ``ArithmeticTaskset``: single turn. The arithmetic questions of ``tasks.arithmetic`` as an in-memory
  ``datasets.Dataset``; the task's rewards: ``exact_answer`` (weight 1: the reply is exactly the result, as
  ``python_tool.reward``) and ``integer_reply`` (weight 0: logged, not rewarded); the metric ``reply_chars``.
- ``PythonToolTaskset``: multi-turn with a tool. The same questions and rewards plus a ``python`` tool: a shared
  ``vf.Toolset`` (an MCP server verifiers starts once per run, ``python -m molt_lightning.tasks.verifiers_envs``)
  that runs the code in ``python_tool.sandbox()`` and returns what it prints; the metric ``tool_calls``.

Run them with ``molt_lightning.agents.adapters.VerifiersAgent("molt_lightning.tasks.verifiers_envs:ArithmeticTaskset")``
(and ``VerifiersTasks`` for the tasks): ``recipes/verifiers_single_turn.yaml``, ``recipes/verifiers_tool.yaml``.
This module imports ``verifiers``: it is a verifiers environment.
"""

from __future__ import annotations

import random
import re
import tempfile

import verifiers.v1 as vf

from .arithmetic import make_problem

__all__ = ["ArithmeticTaskset", "PythonToolTaskset", "PythonToolset"]


class ArithmeticData(vf.TaskData):
    expression: str
    answer: int


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward
    async def exact_answer(self, trace: vf.Trace) -> float:
        """1.0 when the final reply is exactly the result (an integer, nothing else)."""
        m = re.fullmatch(r"\s*(-?\d+)\s*\.?\s*", trace.last_reply)
        return float(m is not None and int(m.group(1)) == self.data.answer)

    @vf.reward(weight=0.0)
    async def integer_reply(self, trace: vf.Trace) -> float:
        """1.0 when the final reply is an integer, right or not (weight 0: a logged signal)."""
        return float(re.fullmatch(r"\s*-?\d+\s*", trace.last_reply) is not None)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    seed: int = 0


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self):
        from datasets import Dataset

        rng = random.Random(self.config.seed)
        dataset = Dataset.from_list([make_problem(rng) for _ in range(self.config.num_tasks)])
        for row in dataset:
            data = ArithmeticData(prompt=row["question"], expression=row["expression"], answer=row["answer"])
            yield ArithmeticTask(data, self.config.task)


class PythonToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called "python", as the policy learned

    @vf.tool
    async def python(self, code: str) -> str:
        """Run Python code in a sandbox; returns what it prints."""
        from .python_tool import sandbox, tool_text

        # verifiers' subprocess runtime points TMPDIR into its own folder; the sandbox's private folders live in /tmp
        tempfile.tempdir = "/tmp"
        return tool_text(await sandbox().run(code))


class ToolTask(ArithmeticTask):
    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class PythonToolConfig(ArithmeticConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class PythonToolTaskset(vf.Taskset[ToolTask, PythonToolConfig]):
    def load(self):
        for task in ArithmeticTaskset(self.config).load():
            yield ToolTask(task.data, self.config.task)

    @classmethod
    def toolsets(cls, config: PythonToolConfig) -> list[vf.Toolset]:
        return [PythonToolset(config.tools)]


if __name__ == "__main__":  # the tool server verifiers starts
    PythonToolset.run()
