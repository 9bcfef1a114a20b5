"""Harbor-format terminal tasks as a task source, their tests as the reward.

A Harbor task (harborframework.com/docs/tasks; fields and defaults as in the ``harbor`` package 0.26.0,
``harbor/models/task/config.py``, ``task.py``, ``verifier/verifier.py``) is a folder: ``instruction.md`` (the prompt;
leading canary lines, ``<!-- ...canary... -->`` or ``# ...canary...``, dropped as Harbor's ``strip_canary`` does),
``task.toml``, ``environment/Dockerfile`` with its build context (the agent's container; optional with
``[environment] docker_image``), ``tests/test.sh`` (the verifier: uploaded to ``/tests`` once the agent is done, it
writes ``/logs/verifier/reward.txt``, a number, or ``reward.json``, named numbers) and optionally ``solution/solve.sh``.
task.toml: ``schema_version`` (or ``version``; 1.0-1.4 known, another warns), ``[task] name`` (else the folder's),
``[metadata]`` (free; ``split = "train" | "heldout"`` is read here), ``[agent] timeout_sec`` (Harbor's default: none),
``[verifier] timeout_sec`` (600), ``[environment]`` ``cpus``, ``memory_mb`` (or ``memory = "4G"``), ``storage_mb``
(or ``storage``), ``network_mode`` (or the deprecated ``allow_internet``; default public), ``docker_image``.

``read_task`` reads a folder, ``harbor_tasks`` every task under some folders: one ``HarborTaskError`` with every
problem, each naming the folder, the problem and the fix. ``tasks(folders, split=...)`` is the run's ``tasks(seed)``.
``verify(session, task)`` runs the tests in a shell session; a verifier that gives no reward raises
``VerifierFailed`` (the run fails; it never scores 0). Rewards as Harbor reads them: ``reward.json`` before
``reward.txt``, the exit code ignored when either exists; of ``reward.json``'s named numbers (Harbor keeps them apart)
the ``reward``, else their mean. With neither file Harbor fails the trial; ``verify`` scores the exit code (0: 1.0,
else 0.0) unless ``exit_code_reward=False``.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import math
import random
import re
import shlex
import signal
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent / "terminal"  # the example tasks (``terminal/make_tasks.py``)
SCHEMA_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")
VERIFIER_TIMEOUT_S = 600.0  # Harbor's VerifierConfig.timeout_sec; its AgentConfig.timeout_sec defaults to None
SPLITS = ("train", "heldout")
REWARD_TXT, REWARD_JSON = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_NETWORK = ("public", "no-network", "allowlist")


class HarborTaskError(ValueError):
    """One or more bad Harbor tasks; ``problems`` lists each (the folder, the problem, the fix)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        many = f"{len(problems)} problems with Harbor tasks:\n" + "\n".join(f"- {p}" for p in problems)
        super().__init__(problems[0] if len(problems) == 1 else many)


class VerifierFailed(RuntimeError):
    """No reward: ``kind`` is ``timeout``, ``crash`` (killed, or the session could not run the tests) or
    ``bad_reward`` (a reward file that is empty, unparsable or not finite)."""

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message
        super().__init__(f"{kind}: {message}")


@dataclass(frozen=True)
class HarborTask:
    name: str
    path: Path
    instruction: str
    agent_timeout_s: float | None  # None: the task sets no limit (the agent's own applies)
    verifier_timeout_s: float
    environment: Path
    tests: Path
    solution: Path | None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = True
    docker_image: str | None = None
    metadata: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class Verdict:
    reward: float
    how: str  # "reward.txt", "reward.json" or "exit code"
    output: str
    exit_code: int | None
    seconds: float
    rewards: dict[str, float] = field(default_factory=dict)  # reward.json's named numbers


def strip_canary(text: str) -> str:
    lines = text.split("\n")
    i = next((i for i, line in enumerate(lines) if not _CANARY.match(line.strip())), len(lines))
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def read_task(path: str | Path) -> HarborTask:
    """The task in folder ``path``; ``HarborTaskError`` listing every problem found in it."""
    path, problems, config = Path(path), [], {}

    def bad(problem: str, fix: str) -> None:
        problems.append(f"Harbor task {path}: {problem}: {fix}")

    if not path.is_dir():
        raise HarborTaskError([f"Harbor task {path}: no such folder: give a task folder (task.toml, instruction.md, "
                               "environment/, tests/)"])
    if not (path / "task.toml").is_file():
        bad("no task.toml", "add one ([verifier] timeout_sec, [agent] timeout_sec; `harbor init` writes a template)")
    else:
        try:
            config = tomllib.loads((path / "task.toml").read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            bad(f"task.toml does not parse ({e})", "fix the TOML there")
    for key in (sections := ("task", "metadata", "agent", "verifier", "environment")):
        if not isinstance(config.get(key, {}), dict):
            bad(f"task.toml's {key} is {config.pop(key)!r}, not a table", f"write it as a [{key}] section")
    task, meta, agent, verifier, env = (config.get(k, {}) for k in sections)

    def number(section: dict, where: str, key: str, default, unit: str = "seconds", example: str = "30"):
        value = section.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            bad(f"[{where}] {key} = {value!r} is not a positive number of {unit}", f"set e.g. {key} = {example}")
            return default
        return float(value)

    def size(key: str) -> int | None:
        mb, given = number(env, "environment", f"{key}_mb", None, "MB", "2048"), env.get(key)
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([GMK])\s*", str(given).upper())
        if given is None or m is None:
            if given is not None:
                bad(f"[environment] {key} = {given!r} is no size", f'write e.g. {key}_mb = 2048 (or {key} = "2G")')
            return None if mb is None else int(mb)
        parsed = int(float(m.group(1)) * {"G": 1024, "M": 1, "K": 1 / 1024}[m.group(2)])
        if mb is not None and mb != parsed:
            bad(f"[environment] {key} = {given!r} and {key}_mb = {mb:g} disagree", f"keep only {key}_mb")
        return parsed

    version = config.get("schema_version", config.get("version"))
    if version is not None and str(version) not in SCHEMA_VERSIONS:
        warnings.warn(f"Harbor task {path}: task.toml schema_version {version!r} is not one this reader knows "
                      f"({', '.join(SCHEMA_VERSIONS)}); read as 1.4", stacklevel=2)
    name = task.get("name", path.name)
    if not isinstance(name, str) or not name.strip():
        bad(f"[task] name = {name!r} is no name", 'write e.g. name = "org/my-task", or leave it out (the folder name)')
        name = path.name
    network, internet, image = env.get("network_mode"), env.get("allow_internet"), env.get("docker_image")
    if network not in (None, *_NETWORK) or internet not in (None, True, False):
        bad(f"[environment] network_mode = {network!r}, allow_internet = {internet!r}",
            f"set network_mode to one of {', '.join(_NETWORK)} (allow_internet: true or false)")
    instruction = ""
    if not (path / "instruction.md").is_file():
        bad("no instruction.md", "write the agent's prompt in it")
    else:
        raw = (path / "instruction.md").read_text(errors="replace")
        instruction = strip_canary(raw).strip()
        if not instruction:
            bad("instruction.md is empty" + (" once its canary lines are dropped" if raw.strip() else ""),
                "write the agent's prompt in it")
    if not (path / "environment" / "Dockerfile").is_file() and not image:
        bad("no environment/Dockerfile", "add the agent container's Dockerfile (or set [environment] docker_image)")
    if not (path / "tests" / "test.sh").is_file():
        bad("no tests/test.sh", "add the verifier script; it writes the reward to /logs/verifier/reward.txt")
    result = HarborTask(
        name=name.strip(), path=path, instruction=instruction,
        agent_timeout_s=number(agent, "agent", "timeout_sec", None),
        verifier_timeout_s=number(verifier, "verifier", "timeout_sec", VERIFIER_TIMEOUT_S),
        environment=path / "environment", tests=path / "tests",
        solution=path / "solution" if (path / "solution" / "solve.sh").is_file() else None,
        cpus=number(env, "environment", "cpus", None, "CPUs", "1"), memory_mb=size("memory"),
        storage_mb=size("storage"), docker_image=image if isinstance(image, str) else None, metadata=dict(meta),
        allow_internet=network == "public" if network in _NETWORK else internet is not False)
    if problems:
        raise HarborTaskError(problems)
    return result


def _task_folders(folder: Path, seen: set[Path]) -> list[Path]:
    if folder.resolve() in seen:
        return []
    seen.add(folder.resolve())
    if (folder / "task.toml").is_file() or (folder / "instruction.md").is_file():
        return [folder]
    return [t for d in sorted(folder.iterdir()) if d.is_dir() and not d.name.startswith((".", "__"))
            for t in _task_folders(d, seen)]


def harbor_tasks(*folders: str | Path, pattern: str | None = None) -> list[HarborTask]:
    """Every task under ``folders`` (a folder with task.toml or instruction.md; a given folder may be one; hidden
    ones skipped), sorted by name; ``pattern`` (a glob) keeps those whose name or folder name matches (a task that
    cannot be read: its folder name). Every problem is raised together."""
    problems, found, seen, by_name = [], [], set(), {}
    for folder in map(Path, folders):
        if folder.is_dir():
            found += _task_folders(folder, seen)
        else:
            problems.append(f"Harbor tasks: {folder} is no folder: give a task folder or a folder of task folders")
    for folder in found:
        try:
            task = read_task(folder)
        except HarborTaskError as e:
            problems += e.problems if pattern is None or fnmatch.fnmatch(folder.name, pattern) else []
            continue
        if pattern is not None and not (fnmatch.fnmatch(task.name, pattern) or fnmatch.fnmatch(folder.name, pattern)):
            continue
        if task.name in by_name:
            problems.append(f"Harbor tasks {by_name[task.name].path} and {folder} are both named {task.name!r}: give "
                            "one of them another [task] name")
        by_name.setdefault(task.name, task)
    if not problems and not by_name:
        problems.append(f"no Harbor task under {', '.join(map(str, folders)) or '(no folder given)'}"
                        + (f" matching {pattern!r}" if pattern else "")
                        + ": give folders holding task folders (each with task.toml and instruction.md)")
    if problems:
        raise HarborTaskError(problems)
    return [by_name[n] for n in sorted(by_name)]


def split_of(task: HarborTask, heldout_fraction: float = 0.2) -> str:
    """``[metadata] split`` when given, else "heldout" for a stable ``heldout_fraction`` of names (a hash)."""
    if "split" in task.metadata:
        return task.metadata["split"]
    h = int.from_bytes(hashlib.sha256(task.name.encode()).digest()[:8], "big") / 2**64
    return "heldout" if h < heldout_fraction else "train"


def sample_of(task: HarborTask, split: str, source: str = "harbor") -> dict[str, Any]:
    """What an agent gets: the prompt (``messages``, ``instruction``), where the task is and its limits."""
    return {"messages": [{"role": "user", "content": task.instruction}], "instruction": task.instruction,
            "answer": None, "task": task.name, "task_dir": str(task.path), "environment": str(task.environment),
            "tests": str(task.tests), "split": split, "source": source, "agent_timeout_s": task.agent_timeout_s,
            "verifier_timeout_s": task.verifier_timeout_s, "cpus": task.cpus, "memory_mb": task.memory_mb,
            "allow_internet": task.allow_internet, "docker_image": task.docker_image,
            "metadata": copy.deepcopy(task.metadata)}


class HarborTasks:
    """The run's ``tasks(seed)`` over Harbor tasks: an epoch is every task of ``split`` (None: all, "train",
    "heldout": ``split_of``) once, shuffled by the seed. ``keys``/``exclude`` serve ``Evaluate``'s overlap rule, which
    compares prompts (``messages``): tasks with one instruction are one prompt there (a warning says so)."""

    def __init__(self, folders: str | Path | list = EXAMPLES, split: str | None = None, pattern: str | None = None,
                 heldout_fraction: float = 0.2, shuffle: bool = True, source: str = "harbor"):
        folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
        if split not in (None, *SPLITS):
            raise ValueError(f"Harbor tasks: split={split!r}: use None, 'train' or 'heldout'")
        every = harbor_tasks(*folders, pattern=pattern)
        wrong = [f"Harbor task {t.path}: [metadata] split = {t.metadata['split']!r}: use \"train\" or \"heldout\""
                 for t in every if t.metadata.get("split", "train") not in SPLITS]
        if wrong:
            raise HarborTaskError(wrong)
        self.tasks = [t for t in every if split is None or split_of(t, heldout_fraction) == split]
        if not self.tasks:
            raise HarborTaskError([f"no {split} task among the {len(every)} Harbor tasks under "
                                   f"{', '.join(map(str, folders))}: mark some [metadata] split = \"{split}\""])
        first: dict[str, str] = {}
        same = [(first[t.instruction], t.name) for t in self.tasks if first.setdefault(t.instruction, t.name) != t.name]
        if same:
            warnings.warn(f"{len(same)} Harbor tasks have the instruction of another ({same[0][1]} that of "
                          f"{same[0][0]}, ...): an evaluation counts them as one prompt", stacklevel=2)
        self.shuffle = shuffle
        self.samples = [sample_of(t, split_of(t, heldout_fraction), source) for t in self.tasks]

    def __len__(self) -> int:
        return len(self.samples)

    def __call__(self, seed: int = 0):
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(seed).shuffle(order)
        return (copy.deepcopy(self.samples[i]) for i in order)  # copies: agents may write into their sample

    def keys(self) -> set[str]:
        from ..data.sources import prompt_key  # (lazily: the data package imports the run's config)

        return {prompt_key(s) for s in self.samples}

    def exclude(self, keys: set[str]) -> int:
        from ..data.sources import prompt_key

        kept = [s for s in self.samples if prompt_key(s) not in keys]
        if not kept:
            raise ValueError("Harbor tasks: every training task is also a held-out prompt: evaluate on other tasks")
        removed, self.samples = len(self.samples) - len(kept), kept
        return removed


def tasks(folders: str | Path | list = EXAMPLES, split: str | None = None, **kwargs) -> HarborTasks:
    """The task stream the rollout source takes (``HarborTasks``); by default the example tasks."""
    return HarborTasks(folders, split, **kwargs)


def solution_commands(task: HarborTask) -> list[str]:
    """The reference solution's commands: ``solve.sh`` without its shebang, comments and blank lines."""
    lines = (task.solution / "solve.sh").read_text().splitlines() if task.solution else []
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


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


async def verify(session, task: HarborTask | dict, *, exit_code_reward: bool = True) -> Verdict:
    """Run ``task``'s tests in ``session`` (a shell session: ``run``, ``put``, ``read``, ``workdir``) once the agent
    is done: stale reward files removed, ``tests/`` uploaded to ``/tests``, ``bash /tests/test.sh`` run from the work
    folder within ``[verifier] timeout_sec``, the reward read (see the module docstring). ``task``: a ``HarborTask``
    or a sample of ``HarborTasks``. Raises ``VerifierFailed`` when no reward comes of it."""
    task = task if isinstance(task, HarborTask) else read_task(task["task_dir"])
    where = f"the verifier of Harbor task {task.name}"
    prep = await session.run(f"mkdir -p /logs/verifier && rm -f {REWARD_TXT} {REWARD_JSON}", timeout_s=30)
    if prep.timed_out or prep.exit_code != 0:  # (/tests is put's to make: the sandbox's root may be read-only)
        raise VerifierFailed("crash", f"{where}: could not prepare /logs/verifier (exit code "
                             f"{prep.exit_code}{', timed out' if prep.timed_out else ''}): {prep.output[-300:]}")
    await session.put(task.tests, "/tests")
    limit = task.verifier_timeout_s
    # "; exit $?": the shell outlives test.sh, so a signal that kills it shows as 128+N (no exec of the last command)
    result = await session.run(f"cd {shlex.quote(session.workdir)} 2>/dev/null; bash /tests/test.sh; exit $?",
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
