"""A Python tool for agents: run model-written code in a bubblewrap sandbox with hard limits, return what it printed.

``await PythonSandbox().run(code)`` runs ``code`` as ``main.py`` in a fresh private temporary directory, removed after.
Bubblewrap (``bwrap``, Debian package ``bubblewrap``) does the isolation: new mount, pid, network, ipc and uts
namespaces; the filesystem read-only but for that directory (cwd, $HOME and $TMPDIR; the host's /tmp is hidden); a
network namespace of its own, so even the host's 127.0.0.1 is out of reach; no capabilities, no_new_privs.
Written by hand: the limits. Wall clock (``wall_s``): SIGKILL to bwrap's process group; the sandbox's pid 1 dies and
the kernel kills all else in its pid namespace. RLIMIT_CPU (``cpu_s``), RLIMIT_AS (``memory_mb``; RLIMIT_FSIZE caps
each file at as much), no core files and RLIMIT_NPROC (``max_processes``, threads count too) are set by a launcher in
the sandbox before it execs the program. stdout and stderr come back merged, clipped to ``max_output`` characters.

RLIMIT_NPROC counts the processes of a real uid, and root is exempt. So as root bwrap runs privileged (no user
namespace) and the launcher, which alone keeps CAP_SETUID/CAP_SETGID, drops to a fresh random unprivileged uid each
run; directories that uid cannot search on the way to the interpreter (/root is 0700) are covered by an empty tmpfs
holding only the interpreter's install. As a normal user bwrap makes a user namespace (no nested ones), in which the
limit counts only the sandbox's processes. An interpreter installed under /tmp (a clone there) is bound back in. Not
limited: memory outside the address space (page cache, memfd; as root
also tmpfs in a nested user namespace) and the total size of the private directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The sandbox's first program: set the limits, drop to the sandbox's uid (when started as root), exec the interpreter.
_LAUNCHER = """
import os, resource, sys
uid, limits, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
for item in limits.split(","):
    name, value = item.split("=")
    resource.setrlimit(getattr(resource, name), (int(value), int(value) + (name == "RLIMIT_CPU")))
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
os.execv(argv[0], argv)
"""
_UID_RANGE = (1_000_000_000, 2_000_000_000)  # as root, each run gets a fresh uid, far from any real account
_TRUNCATED = "\n[... truncated]\n"
_GONE_S = 30.0  # how long a killed sandbox's processes may take to be gone (2 s, the wait after a normal end, is short
# on a loaded machine: a cancelled run's forked child was once seen alive after the run returned)
_working: set[tuple[str, str]] = set()  # (bwrap, python) pairs that already ran a sandbox here


@dataclass
class SandboxResult:
    ok: bool  # exited 0 within every limit
    output: str  # stdout and stderr as the model should see them, clipped to max_output characters
    error: str | None  # None when ok, else a kind and a reason: "timeout: ...", "memory: ...", "exit code 1", ...
    seconds: float

    def as_message(self) -> str:
        """The text of the tool turn: the output, then an ``error: ...`` line when the run failed."""
        text = self.output.rstrip("\n")
        if self.ok:
            return text or "(no output)"
        return f"{text}\nerror: {self.error}" if text else f"error: {self.error}"


class PythonSandbox:
    def __init__(self, wall_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 256, max_processes: int = 16,
                 max_output: int = 2000, python: str = sys.executable):
        bwrap, found = shutil.which("bwrap"), shutil.which(python)
        if bwrap is None:
            raise RuntimeError("PythonSandbox needs bubblewrap to isolate model code and `bwrap` is not on PATH: "
                               "install it with `apt-get install bubblewrap` (it will not run code unsandboxed)")
        if found is None:
            raise ValueError(f"PythonSandbox: no Python interpreter at {python!r}")
        self.python = os.path.abspath(found)
        self.wall_s, self.cpu_s, self.memory_mb = wall_s, cpu_s, memory_mb
        self.max_processes, self.max_output = max_processes, max_output
        self._root = os.geteuid() == 0
        self._bwrap = [*_isolation(bwrap, self._root), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # the installs: e.g. the venv, and /root/.pyenv/versions/3.11.7 that its bin/python links to
        self._installs = {os.path.dirname(os.path.dirname(p)) for p in (self.python, os.path.realpath(self.python))}
        if self._root:
            self._bwrap += _reexpose(self._installs)
        if (bwrap, self.python) not in _working:
            self._probe()
            _working.add((bwrap, self.python))

    def _argv(self, workdir: str, uid: int, program: list[str]) -> list[str]:
        mb = 1 << 20
        limits = (f"RLIMIT_CPU={self.cpu_s},RLIMIT_AS={self.memory_mb * mb},RLIMIT_FSIZE={self.memory_mb * mb},"
                  f"RLIMIT_CORE=0,RLIMIT_NPROC={self.max_processes}")
        env = {"HOME": workdir, "TMPDIR": workdir, "USER": "sandbox", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        hidden = sorted({"/tmp", os.path.dirname(workdir)})  # no host temp files, no other sandbox's directory
        argv = [*self._bwrap, *[a for path in hidden for a in ("--tmpfs", path)]]
        for install in sorted(self._installs):  # an interpreter that lives in a hidden folder (a clone in /tmp)
            top = next((h for h in hidden if install.startswith(h + "/")), None)
            if top is not None:
                argv += _bind_under(top, install)
        argv += ["--bind", workdir, workdir]
        argv += [a for path in [*hidden, "/dev"] for a in ("--remount-ro", path)]
        argv += [a for key, value in env.items() for a in ("--setenv", key, value)]
        return argv + ["--chdir", workdir, "--", self.python, "-I", "-S", "-c", _LAUNCHER, str(uid), limits, *program]

    def _workdir(self) -> tuple[str, int]:
        workdir = tempfile.mkdtemp(prefix="molt-sandbox-")
        uid = _uid(self._root)
        if self._root:
            os.chown(workdir, uid, uid)
        return workdir, uid

    def _probe(self) -> None:
        """Fail at construction, in bwrap's own words, when this machine cannot build the sandbox."""
        workdir, uid = self._workdir()
        try:
            done = subprocess.run(self._argv(workdir, uid, [self.python, "-c", "print('ok')"]), capture_output=True,
                                  text=True, timeout=60)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if done.returncode != 0 or done.stdout.strip() != "ok":
            raise RuntimeError(f"PythonSandbox: bubblewrap could not run {self.python} in a sandbox (exit code "
                               f"{done.returncode}): {(done.stderr or done.stdout).strip()[-1000:]}")

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` as ``python main.py`` in a fresh sandbox; whatever the code does comes back as a result."""
        start = time.monotonic()
        workdir, uid = self._workdir()
        capture = _Capture(4 * self.max_output)
        try:
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            rc, timed_out = await _spawn(self._argv(workdir, uid, [self.python, "main.py"]), self.wall_s, capture,
                                         stdin.encode())
        finally:
            shutil.rmtree(workdir, ignore_errors=True)  # small; also safe while the loop is closing
        output = capture.text(self.max_output)
        error = self._error(rc, timed_out, output)
        return SandboxResult(ok=error is None, output=output, error=error, seconds=time.monotonic() - start)

    def _error(self, rc: int | None, timed_out: bool, output: str) -> str | None:
        if timed_out:
            return f"timeout: killed after {self.wall_s:g} s wall clock"
        if rc == 0:
            return None
        if rc == 128 + signal.SIGXCPU:  # bwrap exits 128 + n when its program dies of signal n
            return f"cpu: killed after using its {self.cpu_s} s of CPU time"
        tail = "\n".join(output.splitlines()[-10:])
        if "MemoryError" in tail or "Cannot allocate memory" in tail:
            return f"memory: ran out of its {self.memory_mb} MB of memory"
        if "Resource temporarily unavailable" in tail or "can't start new thread" in tail:
            return f"processes: hit the limit of {self.max_processes} processes and threads"
        if rc > 128 and rc - 128 in signal.valid_signals():
            return f"exit code {rc}: killed by {signal.Signals(rc - 128).name}"
        return f"exit code {rc}"


def python_tool_schema() -> dict:
    """The OpenAI ``tools`` entry for :class:`PythonSandbox`: a tool named "python" with one string argument, code."""
    return {"type": "function", "function": {
        "name": "python",
        "description": ("Run a Python 3 program in a sandbox and return what it prints (stdout and stderr). Every call "
                        "starts fresh: no network, nothing kept between calls, only the current directory is writable, "
                        "and time and memory are limited. Print the results you need."),
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "The complete Python program to run."}}},
    }}


def _isolation(bwrap: str, root: bool) -> list[str]:
    """bwrap and the isolation flags of both sandboxes (this one and ``shell.BubblewrapBackend``): new ipc, pid, net,
    uts and cgroup namespaces, a session of its own, a clear environment; as root (privileged bwrap) no capability
    but the two the launcher needs to drop to its uid (--cap-drop ALL would also stop bwrap's chdir), else a user
    namespace in which no other can be made."""
    return [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv",
            *(["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root
              else ["--unshare-user", "--disable-userns"])]


def _uid(root: bool) -> int:
    """The uid a run drops to: as root a fresh unprivileged one each time, else -1 (stay the user)."""
    return random.randrange(*_UID_RANGE) if root else -1


def _reexpose(paths: set[str]) -> list[str]:
    """bwrap arguments that let an unprivileged uid reach ``paths``: the first ancestor of each that others cannot
    search (such as /root, 0700) becomes an empty read-only tmpfs in which only those paths are bound again."""
    argv: list[str] = []
    tops: list[str] = []
    for path in sorted(paths):
        parts = path.split("/")
        closed = [i for i in range(2, len(parts)) if not os.stat("/".join(parts[:i])).st_mode & 0o001]
        if closed:
            if (top := "/".join(parts[:closed[0]])) not in tops:
                tops.append(top)
                argv += ["--tmpfs", top]
            argv += _bind_under(top, path)
    return argv + [a for top in tops for a in ("--remount-ro", top)]


def _bind_under(top: str, path: str) -> list[str]:
    """bwrap arguments that bind ``path`` read-only into the tmpfs at its ancestor ``top``, the directories in
    between made 0755 (bwrap would make them 0700)."""
    parts = path.split("/")
    dirs = ["/".join(parts[:i]) for i in range(top.count("/") + 2, len(parts))]
    return [a for d in dirs for a in ("--perms", "0755", "--dir", d)] + ["--ro-bind", path, path]


class _Capture:
    """Keeps the first and the last ``keep`` bytes of a stream and counts the ones dropped in between."""

    def __init__(self, keep: int):
        self.keep, self.head, self.tail, self.dropped = keep, bytearray(), bytearray(), 0

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.add(chunk)

    def add(self, chunk: bytes) -> None:
        room = max(self.keep - len(self.head), 0)
        self.head += chunk[:room]
        self.tail += chunk[room:]
        if len(self.tail) > self.keep:
            self.dropped += len(self.tail) - self.keep
            del self.tail[:-self.keep]

    def text(self, limit: int) -> str:
        if self.dropped:
            head, tail = self.head.decode(errors="replace"), self.tail.decode(errors="replace")
        else:
            head = tail = (self.head + self.tail).decode(errors="replace")
            if len(head) <= limit:
                return head
        n_head = max(limit - len(_TRUNCATED), 0) // 2
        n_tail = max(limit - len(_TRUNCATED) - n_head, 0)
        return head[:n_head] + _TRUNCATED + tail[len(tail) - n_tail:]


async def _spawn(argv: list[str], timeout: float, capture: _Capture, stdin: bytes | None = None,
                 procs: set | None = None) -> tuple[int | None, bool]:
    """Run ``argv`` in a process group of its own, stdout and stderr merged into ``capture``, fed ``stdin`` (None: no
    stdin), held in ``procs`` while it runs: (exit code, or None when killed at ``timeout``; timed out). Cancelled or
    failed, it is killed too: nothing is left running. Killing reaches bwrap's group only; the sandbox's processes (a
    session and a pid namespace of their own) die as the kernel tears the namespace down after bwrap, a while later on
    a loaded machine: the end of the output pipe, which they all hold, says they are gone."""
    proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                start_new_session=True)
    procs = set() if procs is None else procs
    procs.add(proc)
    tasks = [asyncio.create_task(capture.pump(proc.stdout))]
    if stdin is not None:
        tasks.append(asyncio.create_task(_feed(proc.stdin, stdin)))
    try:
        await asyncio.wait([asyncio.ensure_future(proc.wait())], timeout=timeout)
    finally:
        if timed_out := proc.returncode is None:  # the deadline, or cancelled: leave nothing running
            _kill(proc)
            await proc.wait()
        procs.discard(proc)
        _, pending = await asyncio.wait(tasks, timeout=_GONE_S if timed_out else 2.0)  # closed: the namespace is gone
        for task in pending:
            task.cancel()
    return (None if timed_out else proc.returncode), timed_out


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may exit without reading all of stdin
        stream.write(data)
        await stream.drain()
    stream.close()


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
