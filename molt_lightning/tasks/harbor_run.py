"""A Harbor task (``tasks.harbor``) in a shell sandbox (``agents.tools.shell``): its environment as task.toml says,
its reference solution run as Harbor's oracle runs it, its tests as the verifier.

- ``prepare(backend, task)``: ``backend.prepare`` of ``environment/`` with what task.toml adds to it. Harbor applies
  these when the container runs; here they become the Dockerfile's last lines, so that every backend gives them alike
  and caches them by content: ``[environment] workdir`` a last ``WORKDIR`` (where the episode's commands, ``solve.sh``
  and ``test.sh`` run), ``[environment] env`` ``ENV`` lines (``${VAR}`` resolved on this host, as Harbor does), and
  ``docker_image`` without a Dockerfile ``FROM`` that image with ``environment/`` copied into the work folder (Harbor
  uploads it there). A task.toml that adds nothing prepares ``environment/`` itself, as before.
- ``run_solution(session, task)``: Harbor 0.26's ``OracleAgent``: ``solution/`` uploaded to ``/solution``,
  ``solve.sh`` made executable and run as a script (its shebang picks the interpreter; a ``for`` loop, a
  here-document, a ``cd`` act as written) from the work folder with ``DEBIAN_FRONTEND=noninteractive`` and
  ``[solution] env``, within ``[agent] timeout_sec`` (``EPISODE_S`` when the task sets none).
- ``verify(session, task)``: the tests, in the same sandbox once the agent is done. A verifier that gives no reward
  raises ``VerifierFailed`` (the run fails that sample; it never scores 0). Rewards as Harbor reads them:
  ``reward.json`` before ``reward.txt``, the exit code ignored when either exists; of ``reward.json``'s named numbers
  (Harbor keeps them apart) the ``reward``, else their mean. With neither file Harbor fails the trial; ``verify`` scores
  the exit code (0: 1.0, else 0.0) unless ``exit_code_reward=False``.

Not Harbor's: test.sh runs as ``bash /tests/test.sh`` (Harbor executes it, so a shebang of another interpreter
decides there), and its output is not kept in ``/logs/verifier/test-stdout.txt``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REWARD_TXT, REWARD_JSON = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"
EPISODE_S = 600.0  # an episode's limit when the task sets none (Harbor's [agent] timeout_sec has no default)
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")  # harbor.utils.env's: a whole value ${VAR} or ${VAR:-default}


class VerifierFailed(RuntimeError):
    """No reward: ``kind`` is ``timeout``, ``crash`` (killed, or the session could not run the tests) or
    ``bad_reward`` (a reward file that is empty, unparsable or not finite)."""

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message
        super().__init__(f"{kind}: {message}")


@dataclass
class Verdict:
    reward: float
    how: str  # "reward.txt", "reward.json" or "exit code"
    output: str
    exit_code: int | None
    seconds: float
    rewards: dict[str, float] = field(default_factory=dict)  # reward.json's named numbers


def resolve_env(table: dict[str, str]) -> dict[str, str]:
    """An ``env`` table of task.toml as Harbor resolves it where it runs: a value ``${VAR}`` (``${VAR:-default}``)
    is this host's ``VAR`` (else the default), any other value itself; ``ValueError`` names a variable not set."""
    out = {}
    for key, value in table.items():
        m = _TEMPLATE.fullmatch(value)
        if m and m[1] not in os.environ and m[2] is None:
            raise ValueError(f"{key} = {value!r}: {m[1]} is not set here")
        out[key] = os.environ.get(m[1], m[2]) if m else value
    return out


def _killed(code: int | None) -> str | None:
    """How an exit code says the process was killed (None: unknown, negative or 128+N: signal N), else None."""
    n = -1 if code is None else -code if code < 0 else code - 128 if 128 < code <= 192 else 0
    name = {s.value: s.name for s in signal.Signals}.get(n, f"signal {n}")
    return None if n == 0 else "killed" if n < 0 else f"killed by {name}"


def _reward(raw: bytes, how: str, where: str) -> tuple[float, dict[str, float]]:
    try:
        text = raw.decode()
        if not text.strip():
            raise ValueError("it is empty")
        data = json.loads(text) if how == "reward.json" else {"reward": float(text)}
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise VerifierFailed("bad_reward", f"{where}: {how} does not parse ({e}): {raw[:80]!r}") from None
    if not isinstance(data, dict) or not data:
        raise VerifierFailed("bad_reward", f"{where}: reward.json holds {raw[:80]!r}, not named numbers "
                             '({"reward": 1.0})')
    for key, value in data.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise VerifierFailed("bad_reward", f"{where}: {how} gives {key} = {value!r}, not a finite number")
    rewards = {k: float(v) for k, v in data.items()}
    return rewards.get("reward", sum(rewards.values()) / len(rewards)), rewards


async def verify(session, task, *, exit_code_reward: bool = True) -> Verdict:
    """Run ``task``'s tests in ``session`` (a shell session: ``run``, ``put``, ``read``, ``workdir``) once the agent
    is done: stale reward files removed, ``tests/`` uploaded to ``/tests``, ``bash /tests/test.sh`` run from the work
    folder with ``[verifier] env`` within ``[verifier] timeout_sec``, the reward read (see the module docstring).
    ``task``: a ``harbor.HarborTask`` (this module does not import harbor, which re-exports it). Raises
    ``VerifierFailed`` when no reward comes of it."""
    where = f"the verifier of Harbor task {task.name}"
    prep = await session.run(f"mkdir -p /logs/verifier && rm -f {REWARD_TXT} {REWARD_JSON}", timeout_s=30)
    if prep.timed_out or prep.exit_code != 0:  # (/tests is put's to make: the sandbox's root may be read-only)
        raise VerifierFailed("crash", f"{where}: could not prepare /logs/verifier (exit code "
                             f"{prep.exit_code}{', timed out' if prep.timed_out else ''}): {prep.output[-300:]}")
    await session.put(task.tests, "/tests")
    limit = task.verifier_timeout_s
    # "; exit $?": the shell outlives test.sh, so a signal that kills it shows as 128+N (no exec of the last command)
    env = _assign(resolve_env(task.verifier_env))
    result = await session.run(f"cd {shlex.quote(session.workdir)} 2>/dev/null; {env}bash /tests/test.sh; exit $?",
                               timeout_s=limit)
    if result.timed_out:
        raise VerifierFailed("timeout", f"{where}: tests/test.sh ran past [verifier] timeout_sec = {limit:g} s")
    if why := _killed(result.exit_code):
        raise VerifierFailed("crash", f"{where}: tests/test.sh was {why}: {result.output[-300:]}")
    for how, file in (("reward.json", REWARD_JSON), ("reward.txt", REWARD_TXT)):  # Harbor reads reward.json first
        if (raw := await session.read(file)) is not None:
            reward, rewards = _reward(raw, how, where)
            return Verdict(reward, how, result.output, result.exit_code, result.seconds, rewards)
    if not exit_code_reward:
        raise VerifierFailed("bad_reward", f"{where}: tests/test.sh wrote neither {REWARD_TXT} nor {REWARD_JSON}")
    return Verdict(float(result.exit_code == 0), "exit code", result.output, result.exit_code, result.seconds)


def _assign(env: dict[str, str]) -> str:
    """``NAME=value `` words that set ``env`` for the command they precede."""
    return "".join(f"{name}={shlex.quote(value)} " for name, value in env.items())


async def run_solution(session, task):
    """Run ``task``'s ``solution/solve.sh`` in ``session`` as Harbor's oracle does (see the module docstring); the
    session's ``ShellResult`` (its output, exit code, whether it ran past ``[agent] timeout_sec``)."""
    if task.solution is None:
        raise ValueError(f"Harbor task {task.name} has no solution/solve.sh: write the reference solution there")
    await session.put(task.solution, "/solution")
    env = {"DEBIAN_FRONTEND": "noninteractive", **resolve_env(task.solution_env)}
    return await session.run(f"chmod +x /solution/solve.sh && {_assign(env)}/solution/solve.sh",
                             timeout_s=task.agent_timeout_s or EPISODE_S)


def prepare(backend, task):
    """``backend.prepare`` of ``task``'s environment with task.toml's workdir, env and docker_image applied (see the
    module docstring): the ``Prepared`` that ``backend.start`` takes. Raises the backend's ``PrepareError``."""
    from ..agents.tools.shell import PrepareError  # (lazily: the sandbox's module imports the agents package)

    dockerfile, lines = task.environment / "Dockerfile", [f"WORKDIR {task.workdir}"] if task.workdir else []
    for name, value in resolve_env(task.env).items():
        if "$" in value or "\n" in value:
            raise PrepareError(f"Harbor task {task.path}: [environment] env {name}: a value holding $ or a line break "
                               "cannot be an ENV line of the Dockerfile: set it in the Dockerfile itself")
        lines.append(f"ENV {name}={shlex.quote(value)}")
    if dockerfile.is_file() and not lines:
        return backend.prepare(task.environment)
    with tempfile.TemporaryDirectory(prefix="molt-harbor-env-") as tmp:
        if dockerfile.is_file():
            shutil.copytree(task.environment, tmp, symlinks=True, dirs_exist_ok=True)
            text = dockerfile.read_text()
        else:  # [environment] docker_image: Harbor uploads environment/ into the work folder once the image runs
            text = f"FROM {task.docker_image}\n"
            if task.environment.is_dir() and any(task.environment.iterdir()):
                shutil.copytree(task.environment, Path(tmp) / "context", symlinks=True)
                lines.append("COPY context/ ./")
        (Path(tmp) / "Dockerfile").write_text("\n".join([text.rstrip(), *lines]) + "\n")
        try:
            return backend.prepare(Path(tmp))
        except PrepareError as e:
            said = str(e).strip().replace(str(Path(tmp).resolve()), tmp).replace(tmp, str(task.environment))
            raise PrepareError(f"{said} (the Dockerfile's last {len(lines)} lines come from task.toml: "
                               f"{'; '.join(lines)})") from None
