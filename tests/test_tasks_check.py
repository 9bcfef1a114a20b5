"""``molt tasks check`` (molt_lightning/commands/tasks.py) and the task.toml fields of harbor 0.26 it relies on: the
shipped tasks check clean (every solution 1, every empty episode 0) and docs/agents.md shows that table; a broken set
is listed whole, each problem with its fix, and fails; a multi-line ``for`` loop solution scores 1 (run as Harbor's
oracle runs solve.sh, and typed by an agent as ``solution_commands`` gives it); ``[environment] workdir``, ``env``,
``[verifier] env``, ``[solution] env`` and ``docker_image`` are honoured; each refused field is refused with its
fix; ``HarborTasks(skip_broken=True)`` trains on the valid tasks and lists and counts the rest. Sandboxes: bubblewrap.
"""

from __future__ import annotations

import asyncio
import io
import shutil
from pathlib import Path

import pytest

from molt_lightning.tasks.harbor import EXAMPLES, HarborTaskError, HarborTasks, read_task, sample_of, solution_commands

ROOT = Path(__file__).resolve().parents[1]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
TOML = '[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 20\n[environment]\nnetwork_mode = "no-network"\n'
REWARD = 'echo 1 > /logs/verifier/reward.txt || true\n'  # after a check that passed ("&&")


def task(root: Path, name: str, toml: str = TOML, solve: str | None = "true\n", test: str = "exit 0\n",
         dockerfile: str | None = "FROM localhost/debian:bookworm-minbase\nWORKDIR /app\n", files=None) -> Path:
    """A task folder; ``test`` is the body of tests/test.sh (which writes 0 first: a reward file is always there)."""
    folder = root / name
    texts = {"instruction.md": f"Task {name}.\n", "task.toml": toml, "environment/Dockerfile": dockerfile,
             "tests/test.sh": f"#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n{test}",
             "solution/solve.sh": None if solve is None else f"#!/bin/bash\n{solve}", **(files or {})}
    for rel, text in texts.items():
        if text is not None:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
    return folder


def check(*folders, **kwargs) -> tuple[int, str]:
    from molt_lightning.commands.tasks import check as run_check

    out = io.StringIO()
    code = run_check([str(f) for f in folders], out=out, **kwargs)
    return code, out.getvalue()


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows: task -> [work folder, solution, empty, seconds]."""
    lines = text[text.index("task  "):].split("\n\n")[0].splitlines()[1:]
    return {cells[0]: cells[1:] for cells in (line.split() for line in lines)}


# ----- the shipped tasks, and the docs' table of them -----
@needs_bwrap
@pytest.mark.slow  # 30 episodes: ~5-15 s
def test_the_shipped_tasks_check_clean_as_the_docs_show():
    code, text = check(EXAMPLES)
    table = rows(text)
    assert code == 0 and len(table) == 15, text
    assert all(cells[:3] == ["/app", "1", "0"] for cells in table.values()), text
    assert "15 of 15 solutions score their full reward; 0 broken" in text
    doc = (ROOT / "docs" / "agents.md").read_text()
    shown = rows(doc[doc.index("molt tasks check molt_lightning/tasks/terminal"):])
    assert {k: v[:3] for k, v in shown.items()} == {k: v[:3] for k, v in table.items()}


# ----- a broken set -----
BROKEN = {  # folder -> (its task.toml, a file to drop, what its listing must say)
    "bad-toml": ("[agent]\ntimeout_sec = = 3\n", None, ["task.toml does not parse", "fix the TOML there"]),
    "no-tests": (TOML, "tests/test.sh", ["no tests/test.sh", "writes the reward to /logs/verifier/reward.txt"]),
    "online": ('[environment]\nnetwork_mode = "public"\n', None,
               ["network_mode = 'public': the sandbox has no network", 'set network_mode = "no-network"']),
    "as-root": ('[agent]\nuser = "root"\n', None, ["[agent] user = 'root'", "remove it"]),
    "two-problems": ('[task]\nname = "no org"\n[metadata]\nsplit = "test"\n', None,
                     ["[task] name = 'no org' is no org/name", 'write e.g. name = "org/my-task"',
                      "[metadata] split = 'test'", 'use "train" or "heldout"']),
}


def broken_set(root: Path) -> Path:
    for name, (toml, drop, _) in BROKEN.items():
        folder = task(root / "set", name, toml=toml)
        if drop:
            (folder / drop).unlink()
    return root / "set"


def test_a_broken_set_is_listed_whole_each_problem_with_its_fix_and_fails(tmp_path, capsys):
    from molt_lightning.commands.tasks import main

    with pytest.raises(SystemExit) as e:
        main(["check", str(broken_set(tmp_path))])
    text = capsys.readouterr().out
    assert e.value.code == 1 and text.startswith(f"{len(BROKEN)} broken tasks (fix each; "), text
    for name, (_, _, words) in BROKEN.items():
        listing = text[text.index(f"  {tmp_path}/set/{name}\n"):]
        listing = listing[:listing.index("\n  /") if "\n  /" in listing else len(listing)]
        assert all(word in listing for word in words), (name, listing)
    assert "task  " not in text  # no table: no task read


def test_skip_broken_trains_on_the_valid_tasks_and_lists_and_counts_the_rest(tmp_path):
    folder = broken_set(tmp_path)
    for name in ("good-1", "good-2"):
        task(folder, name)
    with pytest.raises(HarborTaskError) as e:  # the default: strict, every problem at once
        HarborTasks(folder)
    assert len(e.value.problems) == len(BROKEN) + 1  # two-problems has two
    with pytest.warns(UserWarning, match=rf"^Harbor tasks: {len(BROKEN)} broken tasks left out \(skip_broken\), "
                      r"2 read; fix each:\n- ") as warned:
        source = HarborTasks(folder, skip_broken=True)
    assert sorted(s["task"] for s in source(0)) == ["good-1", "good-2"] and len(source) == 2
    assert sorted(p.name for p in source.broken) == sorted(BROKEN)
    assert all(f"{folder}/{name}: " in str(warned[0].message) for name in BROKEN)
    with pytest.raises(HarborTaskError, match="is no folder"):  # a folder that is not there is no broken task
        HarborTasks([folder, tmp_path / "missing"], skip_broken=True)


# ----- task.toml fields: refused ones -----
REFUSED = {  # the [section] lines -> what the problem says (the field, and the fix)
    '[agent]\nnetwork_mode = "public"\n': ["[agent] network_mode = 'public'", "no-network"],
    "[environment]\nallow_internet = true\n": ["[environment] allow_internet = true", "no-network"],
    '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n': ["allowed_hosts = ['pypi.org']"],
    '[verifier]\nuser = "root"\n': ["[verifier] user = 'root'", "fresh unprivileged user", "remove it"],
    '[environment]\nos = "windows"\n': ["os = 'windows'", 'os = "linux"'],
    "[environment]\ngpus = 1\n": ["gpus = 1", "no accelerator", "remove gpus"],
    '[environment]\ngpu_types = ["H100"]\n': ["gpu_types = ['H100']", "remove gpu_types"],
    '[environment.tpu]\ntype = "v6e"\ntopology = "2x2"\n': ["tpu = {", "remove tpu"],
    '[[environment.mcp_servers]]\nname = "x"\nurl = "http://x"\n': ["mcp_servers", "no MCP client"],
    '[environment.healthcheck]\ncommand = "true"\n': ["healthcheck", "nothing outlives a command", "remove it"],
    '[verifier]\nenvironment_mode = "separate"\n': ["environment_mode = 'separate'", "remove it"],
    '[[verifier.collect]]\ncommand = "true"\n': ["verifier.collect", "remove them"],
    '[[steps]]\nname = "one"\n': ["[[steps]]: a multi-step task", "a task of its own"],
    "[environment]\ncpus = 100000\n": ["cpus = 100000: this machine has", "lower it"],
    '[environment.env]\nTOKEN = "${MOLT_TEST_UNSET_VARIABLE}"\n': [
        "[environment] env: TOKEN = '${MOLT_TEST_UNSET_VARIABLE}': MOLT_TEST_UNSET_VARIABLE is not set here",
        "${NAME:-value}"],
    '[environment]\nworkdir = "app"\n': ["workdir = 'app' is no absolute path", 'workdir = "/app"'],
}


@pytest.mark.parametrize("toml", sorted(REFUSED))
def test_a_field_no_sandbox_here_gives_is_refused_with_its_fix(tmp_path, toml):
    folder = task(tmp_path, "t", toml=toml)
    with pytest.raises(HarborTaskError) as e:
        read_task(folder)
    assert len(e.value.problems) == 1 and str(e.value).startswith(f"Harbor task {folder}: "), str(e.value)
    for word in REFUSED[toml]:
        assert word in str(e.value), (word, str(e.value))


def test_fields_that_ask_for_nothing_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_TEST_KEY", "k3y")
    toml = ('[agent]\nnetwork_mode = "no-network"\n[environment]\ngpus = 0\nos = "Linux"\nallow_internet = false\n'
            'workdir = "/srv/x/../work"\nskills_dir = "/skills"\nbuild_timeout_sec = 5\n[environment.env]\n'
            'KEY = "${MOLT_TEST_KEY}"\nMODE = "${MOLT_TEST_UNSET_VARIABLE:-fast}"\n[verifier.env]\nA = "1"\n'
            '[solution.env]\nB = "2"\n')
    t = read_task(task(tmp_path, "t", toml=toml))
    assert (t.workdir, t.env, t.verifier_env, t.solution_env) == ("/srv/work", {
        "KEY": "${MOLT_TEST_KEY}", "MODE": "${MOLT_TEST_UNSET_VARIABLE:-fast}"}, {"A": "1"}, {"B": "2"})
    from molt_lightning.tasks.harbor_run import resolve_env

    assert resolve_env(t.env) == {"KEY": "k3y", "MODE": "fast"}
    assert "k3y" not in str(sample_of(t, "train"))  # the samples (and the run's logs) hold no resolved value


# ----- solution_commands: solve.sh whole -----
def test_solution_commands_give_the_script_whole(tmp_path):
    loop = "for f in a b c; do\n  echo $f >> out.txt\ndone\n"
    assert solution_commands(read_task(task(tmp_path, "loop", solve=f"# make out.txt\n\n{loop}"))) == [loop.strip()]
    flagged = task(tmp_path, "flagged", solve="false\ntouch x\n")
    (flagged / "solution" / "solve.sh").write_text("#!/usr/bin/env bash -eu\nfalse\ntouch x\n")
    assert solution_commands(read_task(flagged)) == ["set -eu\nfalse\ntouch x"]
    python = task(tmp_path, "python")
    (python / "solution" / "solve.sh").write_text("#!/usr/bin/env python3\nprint(1)\n")
    with pytest.raises(ValueError, match=r"runs with '/usr/bin/env python3', not bash"):
        solution_commands(read_task(python))
    assert solution_commands(read_task(task(tmp_path, "none", solve=None))) == []


# ----- episodes in bubblewrap: the oracle, workdir, env, docker_image -----
WORKDIR_TOML = TOML + ('workdir = "/molt-check-wd"\n[environment.env]\nGREETING = "hello there"\n'
                       '[verifier.env]\nWANT = "hello there"\n[solution.env]\nSUFFIX = ".txt"\n')
CHECKED = {  # name -> task() kwargs, and (work folder, solution reward, empty reward)
    "loop": (dict(solve="for f in a b c; do\n  echo $f >> out.txt\ndone\n",
                  test='[ "$(cat /app/out.txt | tr -d "\\n")" = abc ] && ' + REWARD), ("/app", "1", "0")),
    "workdir": (dict(toml=WORKDIR_TOML, dockerfile="FROM localhost/debian:bookworm-minbase\n",
                     solve='pwd > where$SUFFIX\necho "$GREETING" > said.txt\n',
                     test='[ "$PWD" = /molt-check-wd ] && [ "$(cat where.txt)" = /molt-check-wd ] && '
                          '[ "$(cat said.txt)" = "$WANT" ] && ' + REWARD), ("/molt-check-wd", "1", "0")),
    "image": (dict(toml=TOML + 'docker_image = "example.org/base:1"\n', dockerfile=None, solve="wc -l < in.txt > n\n",
                   files={"environment/in.txt": "x\ny\n"}, test='[ "$(cat /app/n)" = 2 ] && ' + REWARD),
              ("/app", "1", "0")),
    "wrong": (dict(solve="echo nope\nexit 3\n", test="[ -f /app/done ] && " + REWARD), ("/app", "0", "0")),
}


@needs_bwrap
@pytest.mark.slow  # 8 episodes: ~2-4 s
def test_solutions_run_as_harbors_oracle_does_with_task_tomls_workdir_and_env(tmp_path):
    for name, (kwargs, _) in CHECKED.items():
        task(tmp_path, name, **kwargs)
    code, text = check(tmp_path)
    table = rows(text)
    assert code == 1 and {k: v[:3] for k, v in table.items()} == {k: list(v[1]) for k, v in CHECKED.items()}, text
    assert "\n  wrong: solution: scores 0; solve.sh exit 3, printed 'nope'; test.sh printed nothing\n" in text
    assert "3 of 4 solutions score their full reward; 0 broken" in text


@needs_bwrap
@pytest.mark.slow  # 4 episodes: ~1-2 s
def test_an_agent_works_in_the_workdir_and_replays_a_loop_solution(tmp_path):
    from molt_lightning.agents.tools.shell import BubblewrapBackend
    from molt_lightning.tasks.terminal_agent import TerminalAgent

    class Typed:
        def __init__(self, replies):
            self.replies = list(replies)

        async def chat(self, messages, max_tokens=None):
            return self.replies.pop(0) if self.replies else "DONE"

    agent = TerminalAgent(BubblewrapBackend(), max_turns=3)
    for name in ("loop", "workdir"):
        t = read_task(task(tmp_path, name, **CHECKED[name][0]))
        typed = [f"RUN {c}" for c in solution_commands(t)]
        if name == "workdir":  # the agent's commands get [environment] env, not [solution] env
            typed = ["RUN pwd > where.txt && echo \"$GREETING\" > said.txt"]
        result = asyncio.run(agent(Typed(typed), sample_of(t, "train")))
        assert result.reward == 1.0, (name, result.info)
        assert asyncio.run(agent(Typed([]), sample_of(t, "train"))).reward == 0.0
