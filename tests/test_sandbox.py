"""PythonSandbox runs model code under bubblewrap: output comes back, escapes end as tool errors, nothing is left."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")

from molt_lightning.agents.tools import PythonSandbox, python_tool_schema  # noqa: E402
from molt_lightning.agents.tools import sandbox as sandbox_module  # noqa: E402
from loopback import unreached_port  # noqa: E402  (tests/helpers)

WALL_S = 3.0


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(wall_s=WALL_S, cpu_s=2, memory_mb=256, max_processes=16, max_output=2000)


def run(sandbox: PythonSandbox, code: str, stdin: str = ""):
    return asyncio.run(sandbox.run(code, stdin=stdin))


def processes() -> list[tuple[int, int, str, bytes]]:
    """(pid, real uid, cwd, command line) of every process on the machine."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                uid = int(next(line for line in status if line.startswith("Uid:")).split()[1])
                found.append((int(pid), uid, os.readlink(f"/proc/{pid}/cwd"), cmdline.read()))
        except (OSError, StopIteration):
            continue  # gone meanwhile
    return found


def leftovers(uid: int, workdir: str, wait_s: float = 0.0) -> list[int]:
    """Pids still running as the sandbox's own uid or inside its directory; with ``wait_s``, polls until there are none
    or that time is up (a killed process that has closed its files, the run's cue that it is gone, can be listed a
    moment longer while it exits)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [pid for pid, real_uid, cwd, _ in processes()
                 if (uid != os.getuid() and real_uid == uid) or cwd.startswith(workdir)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_program_output_and_stdin(sandbox):
    result = run(sandbox, "import sys\nprint(sum(range(10)))\nprint(sys.stdin.read().upper())", stdin="abc")
    assert result.ok and result.error is None, result
    assert result.output == "45\nABC\n"
    assert result.as_message() == "45\nABC"
    assert 0 < result.seconds < WALL_S


def test_exception_and_syntax_error_are_tool_errors(sandbox):
    result = run(sandbox, "def f():\n    return 1 / 0\nf()")
    assert not result.ok and result.error == "exit code 1"
    assert "Traceback" in result.output and "ZeroDivisionError: division by zero" in result.output
    assert result.as_message().endswith("ZeroDivisionError: division by zero\nerror: exit code 1")
    result = run(sandbox, "def f(:\n    pass")
    assert not result.ok and "SyntaxError" in result.output


def test_runs_unprivileged(sandbox):
    result = run(sandbox, "import os\nstatus = open('/proc/self/status').read()\n"
                          "print(os.getuid(), [l.split()[1] for l in status.splitlines() "
                          "if l.startswith(('CapEff', 'NoNewPrivs'))])")
    uid, caps = result.output.split(" ", 1)
    assert result.ok and int(uid) != 0 and caps.strip() == "['0000000000000000', '1']", result


def test_private_directory_is_writable_and_removed(sandbox):
    code = "import os\nopen('notes.txt', 'w').write('kept')\nprint(os.getcwd(), open('notes.txt').read(), os.listdir())"
    result = run(sandbox, code)
    assert result.ok, result
    workdir, content, _ = result.output.split(" ", 2)
    assert content == "kept" and os.path.isabs(workdir)
    assert not os.path.exists(workdir)


def test_network_is_unreachable(sandbox):
    with unreached_port() as port:  # loopback only; on leaving, nobody came through
        result = run(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('IN')")
        assert not result.ok and "IN" not in result.output, result
        assert "ConnectionRefusedError" in result.output or "OSError" in result.output


def test_writes_outside_the_directory_fail(sandbox, tmp_path):
    name = f"molt-sandbox-escape-{uuid.uuid4().hex}"
    targets = [str(tmp_path / name), os.path.join(os.path.expanduser("~"), name),
               os.path.join(os.path.dirname(os.path.abspath(__file__)), name)]
    code = f"for path in {targets!r}:\n" \
           "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n" \
           "    except OSError as e:\n        print('failed', path, e.strerror)"
    try:
        result = run(sandbox, code)
        assert result.output.count("failed") == len(targets) and "WROTE" not in result.output, result
        assert not any(os.path.exists(t) for t in targets)
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)


@pytest.mark.parametrize("keep_going", [False, True], ids=["bomb", "bomb-ignoring-errors"])
@pytest.mark.slow
def test_fork_bomb_is_stopped_and_leaves_nothing(sandbox, keep_going):
    loop = "    try:\n        os.fork()\n    except OSError:\n        pass" if keep_going else "    os.fork()"
    result = run(sandbox, f"import os\nprint(os.getuid(), os.getcwd(), flush=True)\nwhile True:\n{loop}")
    assert not result.ok and result.seconds < WALL_S + 1.5, result
    assert result.error.startswith("timeout:" if keep_going else "processes:"), result.error
    uid, workdir = result.output.split("\n", 1)[0].split(" ")
    assert leftovers(int(uid), workdir) == []


@pytest.mark.parametrize("code", ["x = bytearray(2 * 1024**3)", "a = []\nwhile True:\n    a.append(b'x' * 10**7)"],
                         ids=["2GB-at-once", "growing"])
def test_memory_blowup_is_a_memory_error(sandbox, code):
    result = run(sandbox, code)
    assert not result.ok and result.error.startswith("memory:"), result
    assert "MemoryError" in result.output


@pytest.mark.slow
def test_infinite_loop_is_killed(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert not result.ok and result.error.split(":")[0] in ("cpu", "timeout"), result
    assert result.seconds < WALL_S + 1.5


@pytest.mark.slow
def test_wall_clock_limit_keeps_what_was_printed(sandbox):
    result = run(sandbox, "import time\nprint('started')\ntime.sleep(60)")
    assert result.error == f"timeout: killed after {WALL_S:g} s wall clock"
    assert WALL_S <= result.seconds < WALL_S + 1.5
    assert result.output == "started\n"
    assert result.as_message() == f"started\nerror: timeout: killed after {WALL_S:g} s wall clock"


@pytest.mark.slow
def test_output_flood_is_truncated(sandbox):
    result = run(sandbox, "print('a' * 10**6)\nprint('END')")
    assert result.ok and len(result.output) <= 2000, result.error
    assert "[... truncated]" in result.output and result.output.startswith("aaa") and result.output.endswith("END\n")
    result = run(sandbox, "while True:\n    print('spam' * 100)")
    assert not result.ok and result.error.startswith(("timeout:", "cpu:"))  # whichever limit comes first here
    assert len(result.output) <= 2000 and "[... truncated]" in result.output


def test_concurrent_runs(sandbox):
    async def main():
        return await asyncio.gather(*(sandbox.run(f"import time, os\ntime.sleep(1)\nprint({i}, os.getcwd())")
                                      for i in range(4)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert all(r.ok for r in results), results
    assert [r.output.split()[0] for r in results] == ["0", "1", "2", "3"]
    assert len({r.output.split()[1] for r in results}) == 4  # each had its own directory
    assert time.monotonic() - start < 3.5  # they ran side by side


def test_cancelled_run_leaves_nothing(sandbox):
    prefix = os.path.join(tempfile.gettempdir(), "molt-sandbox-")

    async def main():
        task = asyncio.create_task(sandbox.run("import os, time\nos.fork()\ntime.sleep(60)"))
        program = f"{sandbox.python}\0main.py\0".encode()
        for _ in range(200):  # until the program and its child run (slow on a loaded machine)
            await asyncio.sleep(0.05)
            running = [(uid, cwd) for _, uid, cwd, cmd in processes() if cwd.startswith(prefix) and cmd == program]
            if len(running) == 2:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return running

    running = asyncio.run(main())
    assert len(running) == 2, running
    uid, workdir = running[0]
    assert leftovers(uid, workdir, wait_s=10) == [] and not os.path.exists(workdir)


def test_tool_schema():
    schema = python_tool_schema()
    assert json.loads(json.dumps(schema)) == schema
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["code"]


def test_missing_bwrap_is_a_clear_error(monkeypatch):
    which = shutil.which
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, *a, **k: None if name == "bwrap" else which(name))
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        PythonSandbox()


HANGING: list[PythonSandbox] = []  # made by the test (construction probes bwrap: never at import)


async def hanging_tool_agent(client, sample) -> float:
    """Chats once, then runs a tool that never ends (every other run) or a fine one; the tool error is counted."""
    reply = await client.chat([{"role": "user", "content": sample["question"]}], max_tokens=8)
    code = "while True: pass" if client.trajectory.member % 2 == 0 else "print(1)"
    result = await HANGING[0].run(code)
    if not result.ok:
        client.count(f"tool_error/{result.error.split(':')[0]}")
    return float(result.ok) + 0.0 * len(reply)


@pytest.mark.slow
def test_a_hanging_tool_is_killed_counted_and_the_run_goes_on(tmp_path):
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from modules import make_module

    from molt_lightning.engines import TorchEngine

    HANGING[:] = [PythonSandbox(wall_s=1.0, cpu_s=1, memory_mb=128)]
    module = make_module(agent=hanging_tool_agent, engine=TorchEngine(seed=0), group_size=4, prompts_per_step=2,
                         lr=3e-4, max_failure_rate=1.0)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t0 = time.monotonic()
    trainer.fit(module)
    df = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1]
    assert df["agent/tool_error/timeout_total"].dropna().iloc[-1] >= 4  # two of four runs per group hang
    assert df["samples/failed_total"].dropna().iloc[-1] == 0  # a tool error is data, not a failed run
    assert time.monotonic() - t0 < 120
