"""The shell sandbox per agent episode (molt_lightning.agents.tools.shell): the same escape suite against both backends.

bubblewrap tests need `bwrap`; buildah tests need root, buildah and the local base image that containers/build.sh
makes (``localhost/debian:bookworm-minbase``; nothing is pulled), and are marked slow. Commands only use bash and
coreutils, which both the host (bwrap's image) and the debootstrapped base have.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from loopback import unreached_port  # (tests/helpers)
from molt_lightning.agents.tools.shell import BubblewrapBackend, BuildahBackend, PrepareError, ShellSession

BASE = "localhost/debian:bookworm-minbase"
LIMITS = dict(max_output=2000, command_timeout_s=20, memory_mb=256, max_processes=32, file_mb=8)


def _buildah_missing() -> str | None:
    if shutil.which("buildah") is None:
        return "buildah is not installed (apt-get install -y buildah)"
    if os.geteuid() != 0:
        return "BuildahBackend needs root (buildah's chroot isolation)"
    if subprocess.run(["buildah", "inspect", "--type", "image", BASE], capture_output=True).returncode != 0:
        return f"the local base image {BASE} is missing: build it with containers/build.sh (debootstrap)"
    return None


NO_BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install "
                              "bubblewrap)")
BACKENDS = [pytest.param("bwrap", marks=NO_BWRAP),
            pytest.param("buildah", marks=[pytest.mark.slow, pytest.mark.skipif(_buildah_missing() is not None,
                                                                                reason=str(_buildah_missing()))])]


def make_backend(kind: str, cache_dir: Path, **overrides):
    limits = {**LIMITS, **overrides}
    return BubblewrapBackend(cache_dir=cache_dir, **limits) if kind == "bwrap" else BuildahBackend(**limits)


def environment(folder: Path, dockerfile: str, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


TASK = f"FROM {BASE}\nWORKDIR /app\nENV GREETING=hello\nCOPY data.txt .\nRUN sort data.txt > sorted.txt\n"


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request, tmp_path_factory):
    """(backend, prepared task) for each backend: prepared once per module."""
    backend = make_backend(request.param, tmp_path_factory.mktemp("cache"))
    return request.param, backend, backend.prepare(environment(tmp_path_factory.mktemp("env"), TASK,
                                                               **{"data.txt": "pear\napple\nfig\n"}))


def episode(setup, body, episode_timeout_s: float = 120):
    """Start an episode, ``await body(session)``, close it; returns (body's result, the closed session)."""
    _, backend, prepared = setup

    async def main():
        session = await backend.start(prepared, episode_timeout_s)
        try:
            return await body(session), session
        finally:
            await session.close()
    return asyncio.run(main())


def leftovers(uid: int, marker: str = "\0", wait_s: float = 0.0) -> list[int]:
    """Pids on this machine running as the episode's uid, or with ``marker`` in their command line (zombies, dead and
    waiting to be reaped, do not count); with ``wait_s``, polls until there are none or that time is up (bwrap
    returns the command's exit status while the kernel still tears its pid namespace down)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [proc.pid for proc in psutil.process_iter(["uids", "cmdline", "status"])
                 if proc.info["status"] != psutil.STATUS_ZOMBIE and (proc.info["uids"] and proc.info["uids"].real == uid
                                                                    or marker in " ".join(proc.info["cmdline"] or []))]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_prepared_files_state_between_commands_put_and_read(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_HOST_SECRET", "leak")
    tests = environment(tmp_path / "tests", "unused", **{"test.sh": "echo testing\n"})

    async def body(session: ShellSession):
        first = await session.run("pwd; cat sorted.txt; ls; echo $GREETING $HOME $TERM $LANG; env")
        second = await session.run("echo kept > notes.txt; cd /tmp && echo scratch > t.txt && pwd")
        third = await session.run("pwd; cat notes.txt /tmp/t.txt; exit 3")
        await session.put(tests, "/tests")
        fourth = await session.run("bash /tests/test.sh; echo 1 > /logs/verifier/reward.txt")
        return (first, second, third, fourth, await session.read("/logs/verifier/reward.txt"),
                await session.read("/app/sorted.txt"), await session.read("/app/missing"))

    (first, second, third, fourth, reward, sorted_, missing), session = episode(setup, body)
    assert first.exit_code == 0 and not first.timed_out, first
    lines = first.output.splitlines()
    assert lines[:4] == ["/app", "apple", "fig", "pear"]  # RUN at prepare time: the episode sees its output
    assert "data.txt" in lines and "sorted.txt" in lines
    assert "hello /app dumb C.UTF-8" in lines
    assert "MOLT_HOST_SECRET" not in first.output  # nothing of the host's environment
    assert second.output == "/tmp\n"
    assert third.output == "/app\nkept\nscratch\n" and third.exit_code == 3  # cwd reset, files kept
    assert fourth.output == "testing\n" and fourth.exit_code == 0
    assert reward == b"1\n" and sorted_ == b"apple\nfig\npear\n" and missing is None
    assert [c["command"] for c in session.commands][1].startswith("echo kept")
    assert set(session.commands[0]) == {"command", "output", "exit_code", "timed_out", "seconds"}


def test_writes_outside_the_work_dir_fail_and_the_host_is_unchanged(setup):
    name = f"molt-shell-escape-{uuid.uuid4().hex}"
    targets = [f"/etc/{name}", f"/usr/{name}", f"/usr/bin/{name}", f"/{name}"]

    async def body(session):
        writes = "; ".join(f"echo x > {t} && echo WROTE {t}" for t in targets)
        return await session.run(f"{writes}; echo x > /tmp/{name}")  # its own /tmp: allowed, but not the host's

    try:
        result, _ = episode(setup, body)
        assert "WROTE" not in result.output, result
        assert result.output.count("Read-only file system") + result.output.count("Permission denied") == 4, result
        assert not any(os.path.exists(t) for t in [*targets, f"/tmp/{name}"])  # the host's /tmp too
    finally:
        for target in [*targets, f"/tmp/{name}"]:
            if os.path.exists(target):
                os.remove(target)


def test_network_is_unreachable(setup):
    with unreached_port() as port:  # loopback only; on leaving, nobody came through
        async def body(session):
            return await session.run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED", timeout_s=10)

        result, _ = episode(setup, body)
        assert "CONNECTED" not in result.output and result.exit_code not in (0, None), result
        assert "Network is unreachable" in result.output or "Connection refused" in result.output, result


def test_fork_bomb_is_contained_and_the_machine_keeps_working(setup):
    # the command ends at the event the test waits for: the bomb's first fork refused at the process limit (grep
    # exits at that line, and the rest of the bomb dies with the command), not at a deadline a loaded machine misses
    bomb_until_refused = "(:(){ :|:& };:) 2>&1 | grep -m1 -o 'Resource temporarily unavailable'"

    async def body(session):
        bomb, most = asyncio.create_task(session.run(bomb_until_refused, timeout_s=60.0)), 0
        while not bomb.done():  # the episode's processes, counted from here while it runs
            most = max(most, len(leftovers(session.uid)))
            await asyncio.sleep(0.02)
        return await bomb, most, await session.run("echo still here")

    (bomb, most, after), session = episode(setup, body)
    # the limit refused a fork: grep's line, or (buildah, seen once in 1,432 tests on two busy workers) buildah's own
    # chroot helper, which runs under the same RLIMIT_NPROC, failing to start a thread at that limit
    # ("runtime/cgo: pthread_create failed: Resource temporarily unavailable", then its goroutine dump)
    assert "Resource temporarily unavailable" in bomb.output and not bomb.timed_out, bomb
    assert most <= LIMITS["max_processes"], most  # it reached the limit (a fork refused) and no further
    assert after.output == "still here\n" and after.exit_code == 0
    assert subprocess.run(["true"]).returncode == 0 and leftovers(session.uid, wait_s=5) == []


def test_huge_output_is_clipped_and_returns_promptly(setup):
    async def body(session):
        return await session.run("yes | head -c 50M; echo THE-END")  # yes ends by SIGPIPE, silently

    result, _ = episode(setup, body)
    assert result.exit_code == 0 and len(result.output) <= LIMITS["max_output"], len(result.output)
    assert "characters cut]" in result.output and result.output.startswith("y\ny\n")
    assert result.output.endswith("y\nTHE-END\n") and "Broken pipe" not in result.output and result.seconds < 15


def test_a_command_that_never_ends_is_killed_at_its_deadline(setup):
    async def body(session):
        return await session.run("echo started; sleep 1000", timeout_s=1.0)

    result, _ = episode(setup, body)
    assert result.timed_out and result.exit_code is None and result.output == "started\n", result
    assert 1.0 <= result.seconds < 6


def test_the_episode_deadline(setup):
    async def body(session):
        killed = await session.run("sleep 1000")  # the command's own deadline (20 s) is later than the episode's
        return killed, await session.run("echo never"), session.deadline

    (killed, after, deadline), session = episode(setup, body, episode_timeout_s=1.0)
    assert killed.timed_out and killed.exit_code is None and killed.seconds < 6, killed
    assert after.timed_out and after.exit_code is None and after.seconds == 0 and "never" not in after.output
    assert time.monotonic() >= deadline and len(session.commands) == 2


def test_no_process_outlives_its_command_or_the_episode(setup):
    marker = f"1000.{uuid.uuid4().int % 10**8}"

    async def body(session):
        started = await session.run(f"sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & setsid -f sleep {marker};"
                                    f" (sleep {marker} &); disown -a; id -u")
        return started, leftovers(int(started.output.split()[-1]), marker, wait_s=5)

    (started, during), session = episode(setup, body)
    assert started.exit_code == 0 and started.seconds < 10 and during == [], (started, during)
    assert leftovers(session.uid, marker) == []


def test_memory_and_file_size_limits(setup):
    async def body(session):
        memory = await session.run(f"printf -v x '%*s' $(({LIMITS['memory_mb'] + 64} * 1024 * 1024)) ''; echo NOPE")
        big = await session.run(f"head -c {LIMITS['file_mb'] + 1}M /dev/zero > big || echo failed $?; stat -c %s big")
        return memory, big, await session.run("echo fine")

    (memory, big, after), _ = episode(setup, body)
    assert memory.exit_code not in (0, None) and "cannot allocate" in memory.output and "NOPE" not in memory.output
    assert f"failed 153\n{LIMITS['file_mb'] << 20}\n" in big.output, big  # SIGXFSZ (128 + 25) at the limit
    assert after.output == "fine\n"


def test_close_throws_the_episode_away(setup):
    kind = setup[0]

    async def body(session):
        await session.run("echo data > kept.txt")
        return session.base if kind == "bwrap" else session.name

    where, session = episode(setup, body)
    if kind == "bwrap":
        assert not where.exists()
    else:
        assert subprocess.run(["buildah", "inspect", where], capture_output=True).returncode != 0
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(session.run("true"))
    asyncio.run(session.close())  # idempotent


def test_prepare_is_cached(setup, tmp_path):
    _, backend, prepared = setup
    start = time.monotonic()  # a copy elsewhere: the same content, so the same key and nothing rebuilt
    again = backend.prepare(environment(tmp_path / "copy", TASK, **{"data.txt": "pear\napple\nfig\n"}))
    assert again == prepared and time.monotonic() - start < 1.0


def test_prepare_errors_name_the_file_the_line_and_the_fix(setup, tmp_path):
    kind, backend, _ = setup
    if kind == "bwrap":
        for bad, line in [("USER nobody", 3), ("COPY --from=build /x .", 3), ("ARG VERSION=1", 3)]:
            env = environment(tmp_path / uuid.uuid4().hex, f"FROM {BASE}\nWORKDIR /app\n{bad}\n")
            with pytest.raises(PrepareError, match=rf"{env / 'Dockerfile'}:{line}: .*use BuildahBackend"):
                backend.prepare(env)
        env = environment(tmp_path / "fails", f"FROM {BASE}\nWORKDIR /app\nRUN echo x > /etc/molt-x\n")
        with pytest.raises(PrepareError, match=rf"{env / 'Dockerfile'}:3: RUN failed"):
            backend.prepare(env)  # only the work dir is writable at prepare time too
        assert not os.path.exists("/etc/molt-x")
    else:
        env = environment(tmp_path / "missing", f"FROM {BASE}\nWORKDIR /app\nFROM ubuntu:99.04 AS two\n")
        fix = rf"{env / 'Dockerfile'}:3: FROM ubuntu:99.04: .*debootstrap.*base_images"
        with pytest.raises(PrepareError, match=fix):
            backend.prepare(env)


def test_time_per_episode(setup, capsys):
    """Start, three commands, close (prepare excluded): printed, not asserted."""
    async def body(session):
        for command in ("ls", "echo hi > a.txt", "cat a.txt"):
            await session.run(command)

    start = time.monotonic()
    episode(setup, body)
    with capsys.disabled():
        print(f"\n[{setup[0]}] one episode (start + 3 commands + close): {time.monotonic() - start:.3f} s")


@NO_BWRAP
def test_bwrap_dockerfile_subset_and_its_limits(tmp_path):
    backend = make_backend("bwrap", tmp_path / "cache")
    env = environment(tmp_path / "env", "FROM whatever:latest\n# a comment\nENV A=1 B=\"two words\"\nENV C $A-x\n"
                      "WORKDIR /project\nCOPY src/ lib/\nCOPY one.txt renamed.txt\nCOPY [\"one.txt\", \"two/\"]\n"
                      "RUN echo \"$B\" > b.txt && \\\n    ls -R > tree.txt\nCMD [\"bash\"]\n", **{"one.txt": "1\n"})
    (env / "src").mkdir()
    (env / "src" / "mod.py").write_text("x = 1\n")
    prepared = backend.prepare(env)
    assert prepared.workdir == "/project" and prepared.env == {"A": "1", "B": "two words", "C": "1-x"}
    layer = prepared.layer
    assert (layer / "lib" / "mod.py").read_text() == "x = 1\n" and (layer / "renamed.txt").read_text() == "1\n"
    assert (layer / "two" / "one.txt").exists() and (layer / "b.txt").read_text() == "two words\n"
    (tmp_path / "secret").write_text("outside the context")
    refused = [("WORKDIR /etc/passwd/x", "/etc/passwd is a file on the host"),  # (a work dir anywhere else goes:
               ("WORKDIR /tmp/work", "/tmp is the sandbox's own"),  # tests/test_workdirs.py)
               ("COPY ../secret .", "not a file or folder of"), ("COPY one.txt /elsewhere/", "in the work dir /app"),
               ("ADD https://x.org/a.tgz .", "URL")]
    if backend.keep:  # as root: the interpreter's install is bound in anew
        refused.append((f"WORKDIR {os.path.dirname(backend.keep[0])}", "would hide .* the Python that starts every"))
    if os.path.islink("/bin"):  # a merged /usr
        refused.append(("WORKDIR /bin/x", r"/bin is a link on the host \(to usr/bin\).*write the folder it leads to"))
    for bad, why in refused:
        with pytest.raises(PrepareError, match=rf"Dockerfile:2: .*{why}"):
            backend.prepare(environment(tmp_path / uuid.uuid4().hex, f"FROM x\n{bad}\n", **{"one.txt": "1\n"}))

    async def puts():
        session = await backend.start(prepared, 60)
        try:
            for dest, error in [("/project/sub", ValueError), ("/", ValueError), ("/dev/molt-x", PrepareError)]:
                with pytest.raises(error):
                    await session.put(env / "src", dest)
            await session.put(env / "src", "/usr/molt-x")  # a new folder in a host folder: the sandbox's own
            return await session.run("cat /usr/molt-x/mod.py; ls /usr/bin/env")
        finally:
            await session.close()
    listed = asyncio.run(puts())
    assert listed.output == "x = 1\n/usr/bin/env\n" and not os.path.exists("/usr/molt-x"), listed  # /usr's kept


@pytest.mark.slow
def test_reads_return_every_byte_under_concurrency(setup, capsys):
    """16 episodes at once, each reading back two files it wrote 13 times in turn (208 reads): the exact bytes every
    time (buildah lost the output of 2 of 48 reads of a reward file this way, exit code 0, before the FIFO)."""
    episodes, reads = 16, 13
    _, backend, prepared = setup

    async def one(i: int) -> list[bytes | None]:
        session = await backend.start(prepared, 300)
        try:
            written = await session.run(f"echo {i} > /logs/verifier/reward.txt && seq {i} 99999 > numbers.txt")
            assert written.exit_code == 0, written
            return [await session.read(("/logs/verifier/reward.txt", f"{session.workdir}/numbers.txt")[k % 2])
                    for k in range(reads)]
        finally:
            await session.close()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(episodes)))

    start = time.monotonic()
    got = asyncio.run(main())
    seconds = time.monotonic() - start
    expected = [[(f"{i}\n", "".join(f"{n}\n" for n in range(i, 100000)))[k % 2].encode() for k in range(reads)]
                for i in range(episodes)]
    lost = [(i, k, len(g[k] or b"")) for i, g in enumerate(got) for k in range(reads) if g[k] != expected[i][k]]
    with capsys.disabled():
        print(f"\n[{setup[0]}] {episodes} episodes at once, {episodes * reads} reads: {len(lost)} empty or short, "
              f"{seconds:.1f} s")
    assert lost == [], lost  # (episode, read, bytes got)
