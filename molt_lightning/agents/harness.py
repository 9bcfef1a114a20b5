"""``Harness``: an agent that is a separate program (a CLI agent, a script, a container), run once per agent run.

``model.agent: {class_path: molt_lightning.agents.harness.Harness, init_args: {command: [python, my_agent.py,
"{question}"], timeout_s: 120}}``. Each run starts ``command`` as a child process in its own process group, the
``{field}`` templates of its arguments filled from the sample (a command ``python`` is the trainer's own
interpreter), with this run's session in its environment:

- ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (chat completions) and ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``
  (messages) point at the run's endpoint with this trajectory's own key, so a harness built on either stock client
  needs no change; ``MOLT_MODEL`` is the model name to ask for (``policy``);
- ``MOLT_SAMPLE``: the sample as JSON; ``MOLT_RESULT``: a file path the harness may write its result to.

Reward: with ``score`` unset, the harness reports it: ``{"reward": r, "info": {...}}`` (or a bare number) in the
``MOLT_RESULT`` file, or else as the last line of its standard output. With ``score`` set (a verifier spec of
``molt_lightning.data.graders``: ``exact``, ``last_number``, ``regex:P``, ``math``, a dotted path), the harness's
standard output is its final answer and the verifier grades it against the sample's ``answer``.

Every way a harness can go wrong fails the agent run (counted as ``agent/harness/<kind>`` and as a failed sample,
never trained on) and the run goes on: it ran past ``timeout_s`` (``timeout``: its whole process group is killed;
also when the rollout's own ``agent_timeout_s`` cancels it first), exited non-zero (``crashed``, with the tail of its
standard error), reported no reward that parses (``no_reward``) or never called the endpoint (``no_requests``: there
is nothing to train on).

The endpoint listens on 127.0.0.1; a harness in another network namespace or machine needs ``model.rollout.
endpoint_host`` set to an address it can reach and ``model.rollout.endpoint_token`` (a secret every session key then
carries). Process handling is asyncio's subprocess support; the session protocol is ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from .answer import graded
from .client import AgentResult

_SESSION_VARS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                 "ANTHROPIC_AUTH_TOKEN", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID")


class HarnessFailed(RuntimeError):
    """The harness hung, crashed, reported no reward or never called the endpoint."""


class Harness:
    def __init__(self, command: list[str] | str, timeout_s: float = 120.0, score: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, keep_output: int = 2000):
        """``command``: argv (or one shell-like string, split with shlex) with ``{field}`` templates from the sample;
        ``timeout_s``: the deadline of one run; ``score``: grade the output with this verifier instead of reading a
        reported reward; ``env``: extra environment variables; ``keep_output``: characters of the output tails kept
        in the trajectory's info."""
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"Harness: command must be a non-empty argv list of strings, got {command!r}")
        if not timeout_s > 0:
            raise ValueError(f"Harness: timeout_s must be > 0, got {timeout_s}")
        self.argv, self.timeout_s, self.score = argv, timeout_s, score
        self.env, self.cwd, self.keep = dict(env or {}), cwd, keep_output

    def command(self, sample: dict) -> list[str]:
        head = [sys.executable] if self.argv[0] in ("python", "python3") else []  # the trainer's own interpreter
        try:
            return head + [arg.format_map(sample) for arg in self.argv[len(head):]]
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"Harness: the command {self.argv} names {e} but the sample has only the fields "
                             f"{sorted(sample)} (escape a literal brace as {{{{ or }}}})") from None

    async def __call__(self, client, sample: dict) -> AgentResult:
        if client.endpoint is None:
            raise ValueError("Harness needs the run's endpoint, which needs a policy with a chat template")
        argv = self.command(sample)
        with tempfile.TemporaryDirectory(prefix="molt-harness-") as tmp:
            result_file = Path(tmp) / "result.json"
            env = {k: v for k, v in os.environ.items() if k not in _SESSION_VARS}
            env.update(self.env)
            env.update(OPENAI_BASE_URL=client.base_url, OPENAI_API_KEY=client.api_key, MOLT_MODEL="policy",
                       ANTHROPIC_BASE_URL=client.anthropic_base_url, ANTHROPIC_API_KEY=client.api_key,
                       MOLT_SAMPLE=json.dumps(sample, default=str), MOLT_RESULT=str(result_file))
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)  # its own process group: killed as one
            try:
                stdout, stderr = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except asyncio.TimeoutError:
                raise self._failed(client, "timeout", f"the harness ran past its deadline of {self.timeout_s} s and "
                                                      "was killed with its process group") from None
            finally:
                if proc.returncode is None:  # deadline, or the rollout cancelled this run
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await asyncio.shield(proc.wait())
            out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
            info: dict[str, Any] = {"harness_exit": proc.returncode, "harness_stdout": out[-self.keep:],
                                    "harness_stderr": err[-self.keep:]}
            client.trajectory.info.update(info)
            if proc.returncode != 0:
                raise self._failed(client, "crashed", f"the harness exited with {proc.returncode}: "
                                                      f"{err.strip()[-500:] or '(no stderr)'}")
            if client.trajectory.num_policy_tokens == 0:
                raise self._failed(client, "no_requests", "the harness never called the endpoint (OPENAI_BASE_URL "
                                                          "/ ANTHROPIC_BASE_URL): nothing to train on")
            if self.score is not None:
                verdict = await graded(client, self.score, out.strip(), sample)
                return AgentResult(verdict.score, {**info, "answer": verdict.answer})
            last_line = next((line for line in reversed(out.splitlines()) if line.strip()), "")
            report = result_file.read_text() if result_file.exists() else last_line
            reward, extra = _parse_report(report)
            if reward is None:
                raise self._failed(client, "no_reward", f"the harness reported no reward: {report.strip()[-200:]!r}; "
                                                        "print a number or {\"reward\": r} as its last line, or "
                                                        "write it to $MOLT_RESULT")
            return AgentResult(reward, {**info, **extra})

    @staticmethod
    def _failed(client, kind: str, why: str) -> HarnessFailed:
        client.count(f"harness/{kind}")
        return HarnessFailed(why)


def _parse_report(text: str) -> tuple[float | None, dict]:
    try:
        value = json.loads(text)
    except ValueError:
        return None, {}
    info = {}
    if isinstance(value, dict):
        info = value.get("info") if isinstance(value.get("info"), dict) else {}
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, {}
    return float(value), info
