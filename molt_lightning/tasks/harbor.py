"""Harbor-format terminal tasks as a task source, their tests as the reward.

A Harbor task (harborframework.com/docs/tasks; fields and defaults as in the ``harbor`` package 0.26.0,
``harbor/models/task/config.py``, ``task.py``, ``verifier/verifier.py``, ``agents/oracle.py``) is a folder:
``instruction.md`` (the prompt; leading canary lines, ``<!-- ...canary... -->`` or ``# ...canary...``, dropped as
Harbor's ``strip_canary`` does), ``task.toml``, ``environment/Dockerfile`` with its build context (the agent's
container; optional with ``[environment] docker_image``), ``tests/test.sh`` (the verifier: uploaded to ``/tests`` once
the agent is done, it writes ``/logs/verifier/reward.txt``, a number, or ``reward.json``, named numbers) and
optionally ``solution/solve.sh``.

task.toml, field by field (``docs/agents.md`` has the table): read: ``schema_version`` (or ``version``; 1.0-1.4 known,
another warns), ``[task] name`` (an org/name, as Harbor requires; without ``[task]`` the folder's name), ``[metadata]``
(free; ``split = "train" | "heldout"`` is read here). Honoured (``harbor_run`` applies them): ``[agent] timeout_sec``
(Harbor's default: none), ``[verifier] timeout_sec`` (600), ``[environment] workdir``, ``env``, ``docker_image``,
``[verifier] env``, ``[solution] env``, ``network_mode = "no-network"`` (or ``allow_internet = false``; left out, the
sandbox has no network either, where Harbor's default is public). Requests, not limits: ``cpus`` (more than this
machine has is refused, as Docker does), ``memory_mb`` (or ``memory = "4G"``), ``storage_mb`` (or ``storage``): the
backend's own limits apply to each command. Refused, each with its fix (``_refused``): a network (``public``,
``allowlist``, ``allowed_hosts``, ``allow_internet = true``, in any section), ``[agent]``/``[verifier] user``,
``os`` other than linux, ``gpus``, ``gpu_types``, ``tpu``, ``mcp_servers``, ``healthcheck``, a separate verifier
environment, ``[[verifier.collect]]``, ``[[steps]]``. No effect on an episode: ``[task]``'s other fields, ``source``,
``artifacts``, ``build_timeout_sec`` (the backend's ``prepare_timeout_s`` applies), ``skills_dir`` (TerminalAgent
reads no skills).

``read_task`` reads a folder, ``scan`` every task under some folders and the problems of those that are broken,
``harbor_tasks`` raises them: one ``HarborTaskError`` with every problem, each naming the folder, the problem and the
fix. ``tasks(folders, split=...)`` is the run's ``tasks(seed)``; ``skip_broken=True`` trains on the tasks that read,
the broken ones listed in a warning and counted (``HarborTasks.broken``). ``solution_commands`` is the reference
solution as an agent would type it. Running a task in a sandbox (its environment, the oracle, ``verify``):
``harbor_run``; ``molt tasks check`` does both for a task set (``commands.tasks``).
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import math
import os
import posixpath
import random
import re
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harbor_run import REWARD_JSON, REWARD_TXT, Verdict, VerifierFailed, _killed, resolve_env, verify  # noqa: F401

EXAMPLES = Path(__file__).resolve().parent / "terminal"  # the example tasks (``terminal/make_tasks.py``)
SCHEMA_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")
VERIFIER_TIMEOUT_S = 600.0  # Harbor's VerifierConfig.timeout_sec; its AgentConfig.timeout_sec defaults to None
SPLITS = ("train", "heldout")
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_NETWORK = ("public", "no-network", "allowlist")
_ORG_NAME = r"[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*"  # harbor's ORG_NAME_PATTERN


class HarborTaskError(ValueError):
    """One or more bad Harbor tasks; ``problems`` lists each (the folder, the problem, the fix)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        many = f"{len(problems)} problems with Harbor tasks:\n" + "\n".join(f"- {p}" for p in problems)
        super().__init__(problems[0] if len(problems) == 1 else many)


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
    workdir: str | None = None  # [environment] workdir: where commands, solve.sh and test.sh run (None: WORKDIR's)
    env: dict = field(default_factory=dict, compare=False, hash=False)  # [environment] env (templates, unresolved)
    verifier_env: dict = field(default_factory=dict, compare=False, hash=False)  # [verifier] env
    solution_env: dict = field(default_factory=dict, compare=False, hash=False)  # [solution] env


def strip_canary(text: str) -> str:
    lines = text.split("\n")
    i = next((i for i, line in enumerate(lines) if not _CANARY.match(line.strip())), len(lines))
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def read_task(path: str | Path) -> HarborTask:
    """The task in folder ``path``; ``HarborTaskError`` listing every problem found in it, the fields refused here
    (``_refused``) included."""
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
    for key in (sections := ("task", "metadata", "agent", "verifier", "environment", "solution")):
        if not isinstance(config.get(key, {}), dict):
            bad(f"task.toml's {key} is {config.pop(key)!r}, not a table", f"write it as a [{key}] section")
    task, meta, agent, verifier, env, solution = (config.get(k, {}) for k in sections)

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

    def variables(section: dict, where: str) -> dict[str, str]:
        table = section.get("env", {})
        if not isinstance(table, dict) or not all(isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                                  for k, v in table.items()):
            bad(f"[{where}] env = {table!r} is not a table of variable names to strings",
                f'write it as a [{where}.env] section of lines NAME = "value"')
            return {}
        try:
            resolve_env(table)
        except ValueError as e:
            bad(f"[{where}] env: {e}", "export it where molt runs, or give the value a default (${NAME:-value})")
        return dict(table)

    version = config.get("schema_version", config.get("version"))
    if version is not None and str(version) not in SCHEMA_VERSIONS:
        warnings.warn(f"Harbor task {path}: task.toml schema_version {version!r} is not one this reader knows "
                      f"({', '.join(SCHEMA_VERSIONS)}); read as 1.4", stacklevel=2)
    name = task.get("name") if "task" in config else path.name  # Harbor: [task] needs a name, an org/name
    if not isinstance(name, str) or "task" in config and (not re.fullmatch(_ORG_NAME, name) or ".." in name):
        bad(f"[task] name = {name!r} is no org/name", 'write e.g. name = "org/my-task" (letters, digits, ".", "_" '
            'and "-"), or drop [task]: the folder name is the name then')
        name = path.name
    if meta.get("split", "train") not in SPLITS:
        bad(f"[metadata] split = {meta['split']!r}", 'use "train" or "heldout" (or none: a stable 20% is held out)')
    network, internet, image = env.get("network_mode"), env.get("allow_internet"), env.get("docker_image")
    if network not in (None, *_NETWORK) or internet not in (None, True, False):
        bad(f"[environment] network_mode = {network!r}, allow_internet = {internet!r}",
            f"set network_mode to one of {', '.join(_NETWORK)} (allow_internet: true or false)")
    if (workdir := env.get("workdir")) is not None and not (isinstance(workdir, str) and workdir.startswith("/")):
        bad(f"[environment] workdir = {workdir!r} is no absolute path", 'write e.g. workdir = "/app"')
        workdir = None
    _refused(config, bad)
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
        allow_internet=network == "public" if network in _NETWORK else internet is not False,
        workdir=workdir and posixpath.normpath(workdir), env=variables(env, "environment"),
        verifier_env=variables(verifier, "verifier"), solution_env=variables(solution, "solution"))
    if problems:
        raise HarborTaskError(problems)
    return result


def _refused(config: dict, bad) -> None:
    """Each field of harbor 0.26's task.toml that would change an episode and that no sandbox here gives (the module
    docstring lists them), as a problem with its fix."""
    agent, verifier, env = (config.get(k) if isinstance(config.get(k), dict) else {}
                            for k in ("agent", "verifier", "environment"))
    offline = 'set network_mode = "no-network" (`molt tasks check` shows whether the solution and tests need none)'
    if config.get("steps") or config.get("multi_step_reward_strategy"):
        bad("[[steps]]: a multi-step task", "make each step a task of its own (one instruction.md, one tests/)")
    for where, section in (("agent", agent), ("verifier", verifier)):
        if section.get("user") is not None:
            bad(f"[{where}] user = {section['user']!r}: commands run as a fresh unprivileged user of the sandbox",
                "remove it (make what the commands must change writable for any user in the Dockerfile)")
        if section.get("network_mode") not in (None, "no-network") or section.get("allowed_hosts"):
            bad(f"[{where}] network_mode = {section.get('network_mode')!r}: the sandbox has no network", offline)
    network = env.get("network_mode", {True: "public", False: "no-network"}.get(env.get("allow_internet")))
    if network in ("public", "allowlist") or env.get("allowed_hosts"):
        said = f"allowed_hosts = {env['allowed_hosts']!r}" if env.get("allowed_hosts") else \
            f"network_mode = {network!r}" if "network_mode" in env else "allow_internet = true"
        bad(f"[environment] {said}: the sandbox has no network", offline)
    if str(env.get("os", "linux")).lower() != "linux":
        bad(f"[environment] os = {env['os']!r}: the sandboxes here run Linux", 'use a Linux image (os = "linux")')
    for key in ("gpus", "gpu_types", "tpu"):
        if env.get(key):  # gpus = 0 asks for none
            bad(f"[environment] {key} = {env[key]!r}: the sandbox has no accelerator", f"remove {key}")
    if env.get("mcp_servers"):
        bad("[[environment.mcp_servers]]: TerminalAgent has no MCP client", "remove them (its tool is the shell)")
    if env.get("healthcheck") is not None:
        bad("[environment.healthcheck]: nothing runs beside the episode's commands (no CMD, no service: nothing "
            "outlives a command)", "remove it")
    if verifier.get("environment_mode") == "separate" or verifier.get("environment") is not None:
        bad("[verifier] environment_mode = 'separate' ([verifier.environment]): the tests run in the agent's sandbox "
            "once it is done", "remove it (Harbor's 'shared')")
    if verifier.get("collect"):
        bad("[[verifier.collect]]: no compose services here", "remove them (tests/test.sh reads the sandbox's files)")
    cpus = env.get("cpus")
    if isinstance(cpus, (int, float)) and not isinstance(cpus, bool) and cpus > (os.cpu_count() or 1):
        bad(f"[environment] cpus = {cpus}: this machine has {os.cpu_count()}", "lower it (Docker refuses more too)")


def _task_folders(folder: Path, seen: set[Path]) -> list[Path]:
    if folder.resolve() in seen:
        return []
    seen.add(folder.resolve())
    if (folder / "task.toml").is_file() or (folder / "instruction.md").is_file():
        return [folder]
    return [t for d in sorted(folder.iterdir()) if d.is_dir() and not d.name.startswith((".", "__"))
            for t in _task_folders(d, seen)]


def scan(*folders: str | Path, pattern: str | None = None) -> tuple[list[HarborTask], dict[Path | None, list[str]]]:
    """Every task under ``folders`` that reads (a folder with task.toml or instruction.md; a given folder may be one;
    hidden ones skipped), sorted by name, and the problems: by broken task's folder (each problem naming the fix; of
    two tasks of one name the second), None for those that are no task's (a folder not there, nothing found).
    ``pattern`` (a glob) keeps the tasks whose name or folder name matches (a broken task: its folder name)."""
    problems, found, seen, by_name = {}, [], set(), {}
    for folder in map(Path, folders):
        if folder.is_dir():
            found += _task_folders(folder, seen)
        else:
            problems.setdefault(None, []).append(f"Harbor tasks: {folder} is no folder: give a task folder or a "
                                                 "folder of task folders")
    for folder in found:
        try:
            task = read_task(folder)
        except HarborTaskError as e:
            if pattern is None or fnmatch.fnmatch(folder.name, pattern):
                problems[folder] = e.problems
            continue
        if pattern is not None and not (fnmatch.fnmatch(task.name, pattern) or fnmatch.fnmatch(folder.name, pattern)):
            continue
        if task.name in by_name:
            problems[folder] = [f"Harbor tasks {by_name[task.name].path} and {folder} are both named {task.name!r}: "
                                "give one of them another [task] name"]
        by_name.setdefault(task.name, task)
    if not problems and not by_name:
        problems[None] = [f"no Harbor task under {', '.join(map(str, folders)) or '(no folder given)'}"
                          + (f" matching {pattern!r}" if pattern else "")
                          + ": give folders holding task folders (each with task.toml and instruction.md)"]
    return [by_name[n] for n in sorted(by_name)], problems


def harbor_tasks(*folders: str | Path, pattern: str | None = None) -> list[HarborTask]:
    """``scan``'s tasks; its problems, all of them, raised together."""
    found, problems = scan(*folders, pattern=pattern)
    if problems:
        raise HarborTaskError([p for ps in problems.values() for p in ps])
    return found


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
    compares prompts (``messages``): tasks with one instruction are one prompt there (a warning says so).
    A broken task fails the whole source, with every problem, unless ``skip_broken``: then the tasks that read are
    the source, and the broken ones (``broken``: folder -> problems) are listed in a warning, counted."""

    def __init__(self, folders: str | Path | list | None = None, split: str | None = None, pattern: str | None = None,
                 heldout_fraction: float = 0.2, shuffle: bool = True, source: str = "harbor",
                 skip_broken: bool = False):
        self.named = folders is not None  # None: the examples (an Evaluate's: the run's folders, ``held_out_of``)
        folders = [EXAMPLES] if folders is None else [folders] if isinstance(folders, (str, Path)) else list(folders)
        self.folders, self.options = folders, dict(pattern=pattern, heldout_fraction=heldout_fraction,
                                                   source=source, skip_broken=skip_broken)
        if split not in (None, *SPLITS):
            raise ValueError(f"Harbor tasks: split={split!r}: use None, 'train' or 'heldout'")
        every, problems = scan(*folders, pattern=pattern)
        if problems and (not skip_broken or None in problems or not every):
            raise HarborTaskError([p for ps in problems.values() for p in ps])
        self.broken = problems
        if problems:
            warnings.warn(f"Harbor tasks: {len(problems)} broken tasks left out (skip_broken), {len(every)} read; "
                          "fix each:\n" + "\n".join(f"- {p}" for ps in problems.values() for p in ps), stacklevel=2)
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

    def held_out_of(self, train) -> HarborTasks:
        """What an ``Evaluate`` of these tasks measures beside the run's ``train`` tasks: these, unless they name no
        folders and the run trains on Harbor tasks of its own folders: then those folders' held-out split."""
        if self.named or not isinstance(train, HarborTasks) or not train.named:
            return self
        return HarborTasks(train.folders, split="heldout", **train.options)

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
    """The reference solution as the command an agent would type (``RUN ...``: ``bash -c`` in the work folder):
    ``solve.sh`` whole, one command, so that its loops, here-documents and ``cd`` act as written, without its leading
    shebang, comment and blank lines (flags of a ``#!/bin/bash -e`` become ``set -e``); [] without a solution. A
    script for another interpreter is refused: ``harbor_run.run_solution`` runs it as Harbor does."""
    lines = (task.solution / "solve.sh").read_text().splitlines() if task.solution else []
    shebang = re.fullmatch(r"#!\s*(?:/usr/bin/env\s+)?(?:\S*/)?(bash|sh)((?:\s+-\w+)*)\s*", lines[0]) if lines else None
    if lines and lines[0].startswith("#!") and shebang is None:
        raise ValueError(f"Harbor task {task.name}: solution/solve.sh runs with {lines[0][2:].strip()!r}, not bash: an "
                         "agent's commands run in bash (molt tasks check runs it as Harbor does)")
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    body = "\n".join(([f"set{shebang[2]}"] if shebang and shebang[2] else []) + lines).strip()
    return [body] if body else []
