"""A terminal agent for Harbor tasks (``tasks.harbor``): a shell sandbox per episode, the task's own tests as reward.

Each turn the policy writes one shell command (``RUN ls -l``) or ends (``DONE``, or anything that is not a command);
the command runs in the episode's sandbox (``agents.tools.shell``: a fresh copy of the task's environment, no
network, limits per command and per episode) and its output and exit code come back as a tool turn, never trained on.
When the agent is done, the task's ``tests/`` run in the same sandbox (``harbor_run.verify``) and their reward is the
sample's. A verifier that hangs, crashes or writes no number fails the sample (counted by the rollout source, never a
silent 0). Every command, its output and the verifier's output go to the sample's ``info`` (the run's sample log).

The environment is prepared once per task (``harbor_run.prepare``: task.toml's workdir and env applied; the backend
caches it by content); an episode costs a start, its commands and a close. ``TerminalAgent(backend=BuildahBackend())``
runs the same tasks in buildah containers built from their Dockerfiles.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from ..agents.client import AgentResult
from ..agents.tools.shell import BubblewrapBackend, ShellBackend
from .harbor import read_task
from .harbor_run import EPISODE_S, prepare, verify

PREFIX = "RUN "


class TerminalAgent:
    def __init__(self, backend: ShellBackend | None = None, max_turns: int = 4, max_tokens: int = 48,
                 output_chars: int = 300):
        """``max_turns``: commands per episode; ``max_tokens``: each reply's budget; ``output_chars``: the tail of a
        command's output the policy sees (the sample log keeps up to the backend's ``max_output``)."""
        if max_turns < 1 or max_tokens < 1 or output_chars < 0:
            raise ValueError(f"TerminalAgent: max_turns and max_tokens must be >= 1 and output_chars >= 0, got "
                             f"{max_turns}, {max_tokens}, {output_chars}")
        self.backend = backend or BubblewrapBackend()
        self.max_turns, self.max_tokens, self.output_chars = max_turns, max_tokens, output_chars
        self._prepared: dict[str, asyncio.Future] = {}  # task folder -> its prepared environment (once per task)

    async def _prepare(self, task):
        key = str(task.path)
        if key not in self._prepared:
            self._prepared[key] = asyncio.ensure_future(asyncio.to_thread(prepare, self.backend, task))
        try:
            return await asyncio.shield(self._prepared[key])
        except Exception:
            self._prepared.pop(key, None)  # a failed build is tried again by the next episode of the task
            raise

    async def __call__(self, client, sample: dict[str, Any]) -> AgentResult:
        task = read_task(sample["task_dir"])
        session = await self.backend.start(await self._prepare(task), task.agent_timeout_s or EPISODE_S)
        try:
            messages = [{"role": "user", "content": task.instruction}]
            for _ in range(self.max_turns):
                reply = await client.chat(messages, max_tokens=self.max_tokens)
                messages.append({"role": "assistant", "content": reply})
                if not reply.startswith(PREFIX):
                    break
                result = await session.run(reply[len(PREFIX):])
                messages.append({"role": "tool", "content": observation(result, self.output_chars)})
            typed = len(session.commands)
            # the verifier gets its own time, whatever the agent used of the episode's
            session.deadline = max(session.deadline, time.monotonic() + task.verifier_timeout_s + 5)
            verdict = await verify(session, task)
        finally:
            await session.close()
        return AgentResult(verdict.reward, {"task": task.name, "commands": session.commands[:typed], "verifier": {
            "how": verdict.how, "exit_code": verdict.exit_code, "seconds": verdict.seconds,
            "output": verdict.output[-2000:], "commands": [c["command"] for c in session.commands[typed:]]}})


def observation(result, chars: int) -> str:
    """What the policy reads after a command: the tail of its output and how it ended."""
    end = "timed out" if result.timed_out else f"exit {result.exit_code}"
    output = result.output[-chars:] if chars else ""
    return f"{output}\n[{end}]" if output else f"[{end}]"


def solution_dialogue(task) -> list[dict[str, str]]:
    """A task's reference solution (``solution/solve.sh``) as the dialogue the agent would have: the script one
    command (``harbor.solution_commands``; these solutions print nothing: ``[exit 0]``), then ``DONE``."""
    from .harbor import solution_commands

    return dialogue(task.instruction, solution_commands(task))


def dialogue(instruction: str, commands: list[str]) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": instruction}]
    for command in commands:
        messages += [{"role": "assistant", "content": PREFIX + command}, {"role": "tool", "content": "[exit 0]"}]
    return messages + [{"role": "assistant", "content": "DONE"}]


# The six families' wording and command, one table: tasks/terminal/make_tasks.py writes the example tasks from it and
# instance() draws new ones (a demonstration must never match a held-out task's instruction).
FAMILIES = {
    "write-file": ("Create a file named {file} that contains the text {text}.", "printf '{text}\\n' > {file}"),
    "find-line": ("Find the line of data.txt that contains the word {text} and write that line to answer.txt.",
                  "grep {text} data.txt > answer.txt"),
    "count-lines": ("Write the number of lines in {file} to a file named count.txt.", "wc -l < {file} > count.txt"),
    "fix-script": ("The script run.sh fails because a command name in it has a typo. Fix run.sh so that bash run.sh "
                   "{what}.", "sed -i 's/{typo}/{command}/' run.sh"),
    "rename-file": ("Rename the file {old} to {new}.", "mv {old} {new}"),
    "sort-file": ("Sort the lines of {file} alphabetically and write them to sorted.txt.", "sort {file} > sorted.txt"),
}


def fill(family: str, **names: str) -> tuple[str, str]:
    """A family's (instruction, command) with its names filled in."""
    instruction, command = FAMILIES[family]
    return instruction.format(**names), command.format(**names)


# Warm-start data: new instances of the example tasks' families, with names and words of random letters: a policy can
# only solve them by copying from the instruction, not by recalling a list of names (with a fixed list of 25 words the
# tiny policy typed names from the list instead; with words of 3-7 letters it garbled the 8-letter greeting.txt). The
# held-out tasks are other instances.
EXTENSIONS = (".txt", ".md", ".log")


def word(rng) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))


def instance(rng) -> tuple[str, str]:
    """One (instruction, command) of a random family, with random names and words."""
    name = lambda: word(rng) + rng.choice(EXTENSIONS)  # noqa: E731
    family, text = rng.choice(tuple(FAMILIES)), word(rng)
    if family == "fix-script":
        typo, command, what = rng.choice((("ehco", "echo", f"writes {text} to out.txt"),
                                          ("sotr", "sort", f"writes the sorted lines of {name()} to out.txt")))
        return fill(family, typo=typo, command=command, what=what)
    if family == "rename-file":
        return fill(family, old=name(), new=name())
    if family == "find-line":
        return fill(family, text=text)
    return fill(family, text=text, file=name())


@functools.cache
def heldout_instructions() -> frozenset[str]:
    from .harbor import EXAMPLES, HarborTasks

    return frozenset(s["instruction"] for s in HarborTasks(EXAMPLES, split="heldout").samples)


def demonstration(rng, p_tool: float = 1.0) -> list[dict[str, str]]:
    """A warm-start dialogue (``models.tiny.demonstrations(task="terminal")``): a random instance solved; an instance
    that is one of the held-out example tasks is drawn again. ``p_tool`` is unused (every instance needs the shell)."""
    while True:
        instruction, command = instance(rng)
        if instruction not in heldout_instructions():
            return dialogue(instruction, [command])
