"""Harbor-format tasks (molt_lightning/tasks/harbor.py): the reader on good and bad tasks, the task stream and its
split, ``verify`` against a fake shell session (plain subprocesses in a tmp folder, the absolute paths /app, /tests,
/logs and /solution mapped into it), and every example task: its solution passes its tests, nothing or a wrong
command fails them. No containers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from molt_lightning.tasks.harbor import (EXAMPLES, HarborTask, HarborTaskError, HarborTasks, VerifierFailed, _killed,
                                         harbor_tasks, read_task, solution_commands, split_of, tasks, verify)

HELD_OUT = {"molt/write-file-3", "molt/find-line-3", "molt/count-lines-3", "molt/rename-file-2"}
GOOD_TOML = '[verifier]\ntimeout_sec = 5.0\n\n[agent]\ntimeout_sec = 60.0\n'


# ----- a fake shell session -----
@dataclass
class ShellResult:
    output: str
    exit_code: int | None
    timed_out: bool
    seconds: float


class FakeShell:
    """The ShellSession interface on the host: commands run with bash in ``root/app``; the absolute paths /app,
    /tests, /logs and /solution, in commands and in the files ``put`` copies in, are rewritten to folders of ``root``.
    A command past its timeout has its process group killed."""

    ROOTS = ("app", "tests", "logs", "solution")

    def __init__(self, root: Path, workdir: str = "/app"):
        self.root, self.workdir = root, workdir
        for name in self.ROOTS:
            (root / name).mkdir(parents=True, exist_ok=True)

    def map(self, text: str) -> str:
        return re.sub(r"(?<![\w./-])/(app|tests|logs|solution)(?![\w.-])", lambda m: f"{self.root}/{m.group(1)}",
                      text)

    async def run(self, command: str, timeout_s: float | None = None) -> ShellResult:
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec("bash", "-c", self.map(command), cwd=self.root / "app",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return ShellResult("", None, True, time.monotonic() - start)
        code = proc.returncode
        return ShellResult(out.decode(errors="replace"), None if code < 0 else code, False, time.monotonic() - start)

    async def put(self, src: Path, dest: str) -> None:
        target = Path(self.map(dest))
        shutil.copytree(src, target, dirs_exist_ok=True)
        for path in target.rglob("*"):
            if path.is_file():
                try:
                    path.write_text(self.map(path.read_text()))
                except UnicodeDecodeError:
                    pass

    async def read(self, path: str) -> bytes | None:
        p = Path(self.map(path))
        return p.read_bytes() if p.is_file() else None


def seed_app(task: HarborTask, shell: FakeShell) -> None:
    """/app as the task's Dockerfile makes it: its WORKDIR and COPY lines (nothing else is run)."""
    workdir = "/"
    for line in (task.environment / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "WORKDIR":
            workdir = words[1]
        elif words and words[0].upper() == "COPY":
            *srcs, dest = [w for w in words[1:] if not w.startswith("--")]
            dest = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
            for src in srcs:
                into = dest.endswith("/") or len(srcs) > 1
                target = Path(shell.map(dest)) / Path(src).name if into else Path(shell.map(dest))
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(task.environment / src, target)


def write_task(root: Path, name: str, toml: str | None = GOOD_TOML, instruction: str | None = "Do it.\n",
               test: str | None = "exit 0\n", dockerfile: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for rel, text in (("task.toml", toml), ("instruction.md", instruction), ("tests/test.sh", test),
                      ("environment/Dockerfile", "FROM scratch\n" if dockerfile else None)):
        if text is not None:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
    return folder


def run_verify(tmp_path: Path, test: str, timeout: float = 5.0, before: str | None = None, **kwargs):
    folder = write_task(tmp_path / "tasks", "t", toml=f"[verifier]\ntimeout_sec = {timeout}\n", test=test)
    shell = FakeShell(tmp_path / "box")

    async def go():
        if before:
            await shell.run(before)
        return await verify(shell, read_task(folder), **kwargs)

    return asyncio.run(go())


# ----- the reader -----
def test_every_example_task_reads_as_written():
    found = harbor_tasks(EXAMPLES)
    assert len(found) == 15 and [t.name for t in found] == sorted(t.name for t in found)
    for t in found:
        assert t.name == f"molt/{t.path.name}" and t.path.parent == EXAMPLES
        assert (t.agent_timeout_s, t.verifier_timeout_s, t.cpus, t.memory_mb, t.allow_internet) == (60, 30, 1, 256,
                                                                                                      False)
        assert t.instruction == (t.path / "instruction.md").read_text().strip() and len(t.instruction) < 160
        assert t.environment == t.path / "environment" and t.tests == t.path / "tests"
        assert t.metadata["family"] == t.path.name.rsplit("-", 1)[0]
        assert solution_commands(t) == [(t.solution / "solve.sh").read_text().removeprefix("#!/bin/bash\n").strip()]
        assert (t.environment / "Dockerfile").read_text().startswith("FROM localhost/debian:bookworm-minbase\n"
                                                                      "WORKDIR /app\n")
    assert {t.name for t in found if t.metadata["split"] == "heldout"} == HELD_OUT
    families = {t.metadata["family"] for t in found}
    assert {t.metadata["family"] for t in found if t.name in HELD_OUT} < families  # held out: new instances


def test_the_generator_writes_the_committed_tasks(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tasks", EXAMPLES / "make_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(EXAMPLES) for p in EXAMPLES.rglob("*") if p.is_file()
                       and p.parent != EXAMPLES and "__pycache__" not in p.parts)
    assert made == committed
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (EXAMPLES / rel).read_bytes(), rel


def test_fields_and_harbors_defaults(tmp_path):
    bare = read_task(write_task(tmp_path, "bare", toml='version = "1.0"\n'))
    assert (bare.name, bare.agent_timeout_s, bare.verifier_timeout_s, bare.cpus, bare.memory_mb, bare.allow_internet,
            bare.solution, bare.metadata) == ("bare", None, 600.0, None, None, True, None, {})
    toml = ('schema_version = "1.1"\n[task]\nname = "org/full"\n[metadata]\nsplit = "heldout"\nlevel = 2\n'
            '[agent]\ntimeout_sec = 90\n[verifier]\ntimeout_sec = 12.5\n'
            '[environment]\ncpus = 2\nmemory = "4G"\nstorage = "512M"\nallow_internet = false\n')
    folder = write_task(tmp_path, "full", toml=toml)
    (folder / "solution").mkdir()
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\n# the fix\ntouch x\n")
    full = read_task(folder)
    assert (full.name, full.agent_timeout_s, full.verifier_timeout_s, full.cpus, full.memory_mb, full.storage_mb,
            full.allow_internet) == ("org/full", 90.0, 12.5, 2.0, 4096, 512, False)
    assert full.metadata == {"split": "heldout", "level": 2} and solution_commands(full) == ["touch x"]
    image = read_task(write_task(tmp_path, "image", dockerfile=False, toml='[environment]\ndocker_image = "x:1"\n'
                                 'network_mode = "no-network"\nallow_internet = true\nmemory_mb = 2048\n'))
    assert (image.docker_image, image.allow_internet, image.memory_mb) == ("x:1", False, 2048)  # network_mode wins


def test_canary_lines_are_dropped(tmp_path):
    text = ("<!-- harbor-canary GUID 26b5c67b -->\n# BENCHMARK DATA canary GUID 1234\n\nCount the lines.\n"
            "# a canary line later stays\n")
    assert read_task(write_task(tmp_path, "c", instruction=text)).instruction == ("Count the lines.\n# a canary line "
                                                                                 "later stays")


BAD = {  # name -> (what write_task gets, words the error must hold)
    "no-instruction": ({"instruction": None}, ["no instruction.md", "write the agent's prompt"]),
    "no-toml": ({"toml": None}, ["no task.toml", "add one"]),
    "no-dockerfile": ({"dockerfile": False}, ["no environment/Dockerfile", "docker_image"]),
    "no-test": ({"test": None}, ["no tests/test.sh", "reward.txt"]),
    "bad-toml": ({"toml": '[agent]\ntimeout_sec = = 3\n'}, ["does not parse", "line 2", "fix the TOML"]),
    "negative-timeout": ({"toml": "[agent]\ntimeout_sec = -1\n"}, ["timeout_sec = -1 is not a positive", "set e.g."]),
    "zero-timeout": ({"toml": "[verifier]\ntimeout_sec = 0\n"}, ["timeout_sec = 0 is not a positive", "set e.g."]),
    "text-timeout": ({"toml": '[verifier]\ntimeout_sec = "soon"\n'}, ["'soon' is not a positive", "set e.g."]),
    "nan-timeout": ({"toml": "[agent]\ntimeout_sec = nan\n"}, ["nan is not a positive", "set e.g."]),
    "empty-instruction": ({"instruction": " \n\n"}, ["instruction.md is empty", "write the agent's prompt"]),
    "only-canary": ({"instruction": "<!-- canary 1 -->\n"}, ["empty once its canary lines", "write"]),
    "bad-memory": ({"toml": '[environment]\nmemory = "lots"\n'}, ["memory = 'lots' is no size", "memory_mb = 2048"]),
    "memory-disagrees": ({"toml": '[environment]\nmemory = "1G"\nmemory_mb = 512\n'}, ["disagree", "keep only"]),
    "bad-network": ({"toml": '[environment]\nnetwork_mode = "sometimes"\n'}, ["'sometimes'", "no-network"]),
    "metadata-not-table": ({"toml": 'metadata = "x"\n'}, ["metadata is 'x', not a table", "[metadata] section"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_task_names_its_folder_the_problem_and_the_fix(tmp_path, case):
    kwargs, words = BAD[case]
    folder = write_task(tmp_path, case, **kwargs)
    with pytest.raises(HarborTaskError) as e:
        read_task(folder)
    assert str(e.value).startswith(f"Harbor task {folder}: ") and len(e.value.problems) == 1
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_an_unknown_schema_version_warns_and_reads(tmp_path):
    with pytest.warns(UserWarning, match=r"schema_version '9.9' is not one this reader knows"):
        assert read_task(write_task(tmp_path, "v", toml='schema_version = "9.9"\n')).name == "v"


def test_every_problem_of_a_dataset_is_raised_together(tmp_path):
    write_task(tmp_path, "good")
    write_task(tmp_path, "a", instruction=None, test=None)  # two problems in one task
    write_task(tmp_path, "b", toml="[agent]\ntimeout_sec = 0\n")
    write_task(tmp_path / "group", "c", dockerfile=False)  # one level deeper
    write_task(tmp_path, ".hidden", toml=None)  # skipped
    with pytest.raises(HarborTaskError) as e:
        harbor_tasks(tmp_path, tmp_path / "missing")
    problems = e.value.problems
    assert len(problems) == 5 and str(e.value).startswith("5 problems with Harbor tasks:\n- ")
    for part in (f"{tmp_path}/a: no instruction.md", f"{tmp_path}/a: no tests/test.sh", f"{tmp_path}/b: [agent]",
                 f"{tmp_path}/group/c: no environment/Dockerfile", f"{tmp_path}/missing is no folder"):
        assert any(part in p for p in problems), part


def test_discovery_names_pattern_and_nothing_found(tmp_path):
    write_task(tmp_path / "set", "one", toml='[task]\nname = "org/same"\n')
    write_task(tmp_path / "set", "two", toml='[task]\nname = "org/same"\n')
    with pytest.raises(HarborTaskError, match=r"are both named 'org/same': give one of them another \[task\] name"):
        harbor_tasks(tmp_path / "set")
    assert [t.name for t in harbor_tasks(tmp_path / "set" / "one")] == ["org/same"]  # a folder that is a task
    assert [t.name for t in harbor_tasks(EXAMPLES, pattern="molt/count-*")] == [f"molt/count-lines-{i}"
                                                                                  for i in (1, 2, 3)]
    assert len(harbor_tasks(EXAMPLES, pattern="sort-file-?")) == 2  # folder names match too
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(HarborTaskError, match=rf"no Harbor task under {tmp_path}/empty: give folders"):
        harbor_tasks(tmp_path / "empty")
    with pytest.raises(HarborTaskError, match="matching 'nope'"):
        harbor_tasks(EXAMPLES, pattern="nope")


# ----- the task stream -----
def test_the_stream_and_its_split():
    train, held, every = tasks(split="train"), tasks(split="heldout"), tasks()
    assert (len(train), len(held), len(every)) == (11, 4, 15)
    assert {s["task"] for s in held()} == HELD_OUT and not {s["task"] for s in train()} & HELD_OUT
    first = list(train(3))
    assert [s["task"] for s in first] == [s["task"] for s in train(3)]  # a pure function of the seed
    assert [s["task"] for s in first] != [s["task"] for s in train(4)]
    assert sorted(s["task"] for s in first) == sorted(t.name for t in train.tasks)  # an epoch: each task once
    s = first[0]
    assert s["messages"] == [{"role": "user", "content": s["instruction"]}] and s["answer"] is None
    assert Path(s["task_dir"], "tests", "test.sh").is_file() and Path(s["environment"], "Dockerfile").is_file()
    assert (s["split"], s["source"], s["agent_timeout_s"], s["verifier_timeout_s"]) == ("train", "harbor", 60.0, 30.0)
    assert (s["cpus"], s["memory_mb"], s["allow_internet"]) == (1.0, 256, False)
    json.dumps(first)  # plain data
    s["metadata"]["family"] = "changed"
    assert all(x["metadata"]["family"] != "changed" for x in train(3))  # each sample is a copy
    assert train.keys().isdisjoint(held.keys())  # no held-out prompt is a training prompt
    assert train.exclude(held.keys()) == 0 and len(train) == 11
    with pytest.raises(ValueError, match="split='test'"):
        HarborTasks(EXAMPLES, split="test")


def test_tasks_with_one_instruction_are_warned_about(tmp_path):
    for name in ("a", "b", "c"):
        write_task(tmp_path, name, instruction="Same words.\n")
    with pytest.warns(UserWarning, match=r"2 Harbor tasks have the instruction of another \(b that of a, ...\)"):
        assert len(HarborTasks(tmp_path).keys()) == 1


def test_the_split_by_hash_and_bad_splits(tmp_path):
    for i in range(40):
        write_task(tmp_path / "set", f"task-{i:02d}", instruction=f"Do task {i}.")
    held = HarborTasks(tmp_path / "set", split="heldout", heldout_fraction=0.25)
    train = HarborTasks(tmp_path / "set", split="train", heldout_fraction=0.25)
    assert len(held) + len(train) == 40 and 3 <= len(held) <= 18
    again = HarborTasks(tmp_path / "set", split="heldout", heldout_fraction=0.25)
    assert [t.name for t in again.tasks] == [t.name for t in held.tasks]  # stable
    assert all(split_of(t, 0.25) == "heldout" for t in held.tasks)
    write_task(tmp_path / "odd", "x", toml='[metadata]\nsplit = "test"\n')
    with pytest.raises(HarborTaskError, match=r"split = 'test': use \"train\" or \"heldout\""):
        HarborTasks(tmp_path / "odd")
    with pytest.raises(HarborTaskError, match="no heldout task among the 1 Harbor tasks"):
        HarborTasks(write_task(tmp_path / "one", "y", toml='[metadata]\nsplit = "train"\n'), split="heldout")



def test_an_evaluation_of_harbor_tasks_naming_no_folders_follows_the_runs_own(tmp_path):
    """recipes/terminal.yaml's Evaluate names no folders: with the run's tasks set to your folders, it evaluates
    their held-out split, not the examples; tasks that name their folders are evaluated as given."""
    from molt_lightning.callbacks import Evaluate

    for i in range(20):
        write_task(tmp_path / "mine", f"task-{i:02d}", instruction=f"Do my task {i}.")
    train = HarborTasks(tmp_path / "mine", split="train")
    evaluate = Evaluate(HarborTasks(split="heldout"), k=1)
    assert all(s["task_dir"].startswith(str(EXAMPLES)) for s in evaluate.samples)  # before the fit: the examples
    evaluate.select(train)
    mine = HarborTasks(tmp_path / "mine", split="heldout")
    assert sorted(s["task"] for s in evaluate.samples) == sorted(t.name for t in mine.tasks)
    named = Evaluate(HarborTasks(EXAMPLES, split="heldout"), k=1)
    named.select(train)
    assert all(s["task_dir"].startswith(str(EXAMPLES)) for s in named.samples)
    examples = Evaluate(HarborTasks(split="heldout"), k=1)
    examples.select(HarborTasks(split="train"))  # the examples both sides: unchanged
    assert len(examples.samples) == len(HarborTasks(split="heldout"))

# ----- verify -----
@pytest.mark.parametrize("test, reward, how", [
    ("echo 0.25 > /logs/verifier/reward.txt\n", 0.25, "reward.txt"),
    ('echo \'{"reward": 0.5, "style": 1}\' > /logs/verifier/reward.json\n', 0.5, "reward.json"),
    ('echo \'{"tests": 1, "style": 0}\' > /logs/verifier/reward.json\n', 0.5, "reward.json"),  # no "reward": the mean
    ("echo 0 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json\n", 1.0, "reward.json"),
    ("echo 1 > /logs/verifier/reward.txt; exit 3\n", 1.0, "reward.txt"),  # the reward file wins over the exit code
    ("exit 0\n", 1.0, "exit code"),
    ("exit 1\n", 0.0, "exit code"),
])
def test_verify_reads_the_reward(tmp_path, test, reward, how):
    verdict = run_verify(tmp_path, test)
    assert (verdict.reward, verdict.how) == (reward, how)
    assert verdict.seconds >= 0 and verdict.exit_code == (3 if "exit 3" in test else 1 if test == "exit 1\n" else 0)


def test_verify_runs_from_the_workdir_and_removes_stale_rewards(tmp_path):
    # the agent left a reward of 1 behind; the tests write none and fail: 0, from the exit code
    verdict = run_verify(tmp_path, "test -f marker && echo found\nexit 1\n", before="touch marker; mkdir -p "
                         "/logs/verifier; echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > "
                         "/logs/verifier/reward.json")
    assert (verdict.reward, verdict.how, verdict.output.strip()) == (0.0, "exit code", "found")
    with pytest.raises(VerifierFailed, match="^bad_reward: .* wrote neither") as e:
        run_verify(tmp_path / "strict", "exit 0\n", exit_code_reward=False)
    assert e.value.kind == "bad_reward"


def test_a_hanging_verifier_fails_with_timeout_within_its_deadline(tmp_path):
    start = time.monotonic()
    with pytest.raises(VerifierFailed) as e:
        run_verify(tmp_path, "sleep 60\necho 1 > /logs/verifier/reward.txt\n", timeout=0.5)
    assert e.value.kind == "timeout" and "timeout_sec = 0.5 s" in str(e.value)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kill, says", [("kill -9 $$", "SIGKILL"), ("kill -TERM $$", "SIGTERM")])
def test_a_killed_verifier_is_a_crash(tmp_path, kill, says):
    with pytest.raises(VerifierFailed, match=rf"^crash: the verifier of Harbor task t: tests/test.sh was killed by "
                       rf"{says}") as e:
        run_verify(tmp_path, f"echo 1 > /logs/verifier/reward.txt\n{kill}\n")  # even after writing a reward
    assert e.value.kind == "crash"
    # how exit codes read: None (a session that cannot tell), a negative one (a signal), 128+N (bash's), else none
    assert [_killed(c) for c in (None, -9, 137, 130, 1, 0, 128, 255)] == [
        "killed", "killed by SIGKILL", "killed by SIGKILL", "killed by SIGINT", None, None, None, None]


@pytest.mark.parametrize("write", ["echo abc > /logs/verifier/reward.txt", "echo nan > /logs/verifier/reward.txt",
                                   ": > /logs/verifier/reward.txt", "echo inf > /logs/verifier/reward.txt",
                                   "echo '{\"reward\": \"1\"}' > /logs/verifier/reward.json",
                                   "echo '{\"reward\": NaN}' > /logs/verifier/reward.json",
                                   "echo '[1]' > /logs/verifier/reward.json", "echo '{}' > /logs/verifier/reward.json",
                                   "echo '{bad' > /logs/verifier/reward.json"])
def test_a_bad_reward_fails(tmp_path, write):
    with pytest.raises(VerifierFailed) as e:
        run_verify(tmp_path, write + "\n")
    assert e.value.kind == "bad_reward" and "Harbor task t" in str(e.value)


def test_verify_takes_a_sample(tmp_path):
    sample = next(iter(tasks(split="train")(0)))
    shell = FakeShell(tmp_path)
    assert asyncio.run(verify(shell, read_task(sample["task_dir"]))).reward == 0.0  # nothing was done


# ----- the example tasks -----
WRONG = {  # family -> a plausible wrong attempt, from the solution's command
    "write-file": lambda cmd: cmd.replace("printf '", "printf 'x"),
    "find-line": lambda cmd: "head -n 1 data.txt > answer.txt",
    "count-lines": lambda cmd: cmd.replace(" < ", " "),  # "3 data.txt"
    "fix-script": lambda cmd: "bash run.sh",  # run it without fixing it
    "rename-file": lambda cmd: cmd.replace("mv ", "cp "),
    "sort-file": lambda cmd: cmd.replace("sort ", "cat "),
}


def test_every_example_solution_passes_and_nothing_or_a_wrong_command_fails(tmp_path):
    async def attempt(task: HarborTask, box: Path, commands: list[str]) -> float:
        shell = FakeShell(box)
        seed_app(task, shell)
        await shell.put(task.solution, "/solution")  # as Harbor's oracle: the reference runs as bash /solution/solve.sh
        for command in commands:
            result = await shell.run(command, timeout_s=10)
            assert not result.timed_out
        return (await verify(shell, task)).reward

    async def go():
        for i, task in enumerate(harbor_tasks(EXAMPLES)):
            solution = solution_commands(task)
            wrong = [WRONG[task.metadata["family"]](solution[-1])]
            assert wrong != solution
            rewards = [await attempt(task, tmp_path / f"{i}-{kind}", cmds)
                       for kind, cmds in (("solve", ["bash /solution/solve.sh"]), ("nothing", []), ("wrong", wrong))]
            assert rewards == [1.0, 0.0, 0.0], (task.name, rewards)

    asyncio.run(go())
