"""A shell per agent episode: ``session = await backend.start(backend.prepare(env_dir), 600)``, then ``run`` (``bash
-c`` in the work dir), ``put``, ``read``, ``close``. Commands have deadlines and clipped output, the episode one too; no
network; a clean environment (PATH, HOME=work dir, LANG=C.UTF-8, TERM=dumb, the Dockerfile's ENV).

- ``BubblewrapBackend`` (default): the host's root file system, read-only, is the image (FROM is ignored). ``prepare``
  runs a Dockerfile subset (bwrap_image.py) into a layer folder cached by content hash: one WORKDIR (default /app), ENV
  (plain ``$VAR``), COPY/ADD of files or folders of the build context into the work dir (no glob, URL or archive), RUN
  (only the work dir and /tmp writable; what it writes there is kept); LABEL, CMD and such are ignored, anything else
  (USER, ARG, COPY --from, ...) is an error: use BuildahBackend. An episode gets a private copy of the layer at the work
  dir, and private /logs, /tmp and ``put`` folders; the work dir may be anywhere, the host's folders above it stay
  read-only and unwritten (bwrap_image.tree: a tmpfs covers a host folder that must hold a new mount point).
  Each command is a ``bwrap`` of its own (pid, net, ipc, uts and mount namespaces, no capabilities, as root a fresh
  random uid per episode) under sandbox.py's launcher's rlimits (SIGPIPE, SIGXFSZ reset): AS (``memory_mb``), NPROC
  (``max_processes``), FSIZE (``file_mb``), no core. Its pid namespace dies with it, so only files stay between
  commands: the cwd resets (``cd x && cmd`` works), background jobs end. About 0.015 s a command.
- ``BuildahBackend`` (root): any Dockerfile, ``buildah bud --isolation chroot``, nothing pulled; an episode is a working
  container, its whole root file system its own. buildah 1.28 refuses ``--network none`` with chroot isolation and
  makes only mount and uts namespaces, so builds run in ``unshare --net`` and commands in ``setpriv --no-new-privs
  unshare --net --pid --ipc --uts --mount-proc``: no network, only its own processes in /proc, no setuid gains, nothing
  outlives a command; buildah adds its seccomp filter. Commands run as a fresh unprivileged uid owning the work dir and
  /logs (root escapes RLIMIT_NPROC); else only /tmp and /dev/shm are writable. Limits: ``buildah from --ulimit`` nproc,
  fsize, core and (no ``as`` there) RLIMIT_DATA; no cgroups (``--memory``) under chroot. A command's output comes
  through a FIFO of the session, bound in read-only at /.molt-io, not through ``buildah run``'s stdout, which under
  load lost output (``_exec``). About 0.15 s a command.

Neither limits disk use (only each file's size), CPU beyond the deadlines, page cache or tmpfs (buildah's /dev/shm).
Written by hand: no maintained library makes per-episode sandboxes on bwrap or buildah (launcher, capture: sandbox.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from .bwrap_image import PATH, STAGE, PrepareError, mount_point, plan, tree
from .sandbox import _LAUNCHER, _TRUNCATED, _Capture, _isolation, _kill, _spawn, _uid

_VERSION = "molt-shell-1"  # part of every cache key
_NOISE = re.compile(r"(^(subprocess exited (with status \d+|on \w+)|Error: exit status \d+)\n?)+\Z", re.M)  # buildah's
_FIFOS = "/.molt-io"  # buildah: where the session's FIFOs are bound, read-only
_LAUNCH = "import signal\n[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGPIPE, signal.SIGXFSZ)]" + _LAUNCHER


@dataclass
class ShellResult:
    output: str  # stdout+stderr merged, clipped to max_output characters (with a marker saying how much was cut)
    exit_code: int | None  # None when the command was killed (its deadline, or the episode's)
    timed_out: bool
    seconds: float


@dataclass(frozen=True)
class Prepared:
    key: str  # sha256 of the environment folder's files (and the backend's settings)
    workdir: str  # the agent's working directory inside
    env: dict[str, str] = field(default_factory=dict)  # bwrap: the Dockerfile's ENV (an image carries its own)
    layer: Path | None = None  # bwrap: the prepared contents of the work dir
    image: str | None = None  # buildah: the image's tag


class ShellBackend(Protocol):
    def prepare(self, environment: Path) -> Prepared: ...

    async def start(self, prepared: Prepared, episode_timeout_s: float) -> ShellSession: ...


class ShellSession:
    """One agent episode's sandbox; ``commands`` logs every ``run``."""

    def __init__(self, backend, workdir: str, uid: int, episode_timeout_s: float):
        self.backend, self.workdir, self.uid, self.commands = backend, workdir, uid, []
        self.deadline, self._procs, self._closed = time.monotonic() + episode_timeout_s, set(), False

    async def run(self, command: str, timeout_s: float | None = None) -> ShellResult:
        if self._closed:
            raise RuntimeError("this shell session is closed")
        start, left, capture = time.monotonic(), self.deadline - time.monotonic(), _Capture(4 * self.backend.max_output)
        if left <= 0:
            result = ShellResult("[episode deadline passed: not run]", None, True, 0.0)
        else:
            rc, timed_out, said = await self._exec(["/bin/bash", "-c", command],
                                                   min(timeout_s or self.backend.command_timeout_s, left), capture)
            capture.add(said)  # the backend's own words (buildah's) after the command's output
            result = ShellResult(_NOISE.sub("", _clip(capture, self.backend.max_output)), rc, timed_out,
                                 time.monotonic() - start)
        self.commands.append({"command": command, **asdict(result), "seconds": round(result.seconds, 3)})
        return result

    async def read(self, path: str) -> bytes | None:
        """The file at absolute ``path`` inside, read as the sandbox's user (links resolve inside), or None."""
        script, capture = '[ -f "$1" ] || exit 66; exec cat -- "$1"', _Capture(1 << 62)  # keeps it all
        rc, _, _ = await self._exec(["/bin/bash", "-c", script, "_", path], 600, capture)
        return bytes(capture.head) if rc == 0 else None

    async def _exec(self, program: list[str], timeout: float, capture: _Capture) -> tuple[int | None, bool, bytes]:
        """Run ``program`` inside, its stdout and stderr into ``capture``: (exit code, timed out, the backend's own
        words on its stderr, where they come apart)."""
        return *await _spawn(self._argv(program), timeout, capture, procs=self._procs), b""

    async def close(self) -> None:
        """Kill whatever still runs, throw the episode away; idempotent."""
        if not self._closed:
            self._closed, _ = True, [_kill(proc) for proc in self._procs]
            await asyncio.gather(*(proc.wait() for proc in list(self._procs)))
            await self._teardown()


class BubblewrapBackend:
    """Episodes in bubblewrap on the host's read-only root file system (see the module's docstring)."""

    def __init__(self, max_output: int = 8000, command_timeout_s: float = 30, memory_mb: int = 1024,
                 max_processes: int = 64, file_mb: int = 64, cache_dir: str | Path | None = None,
                 prepare_timeout_s: float = 600):
        if (bwrap := shutil.which("bwrap")) is None:
            raise RuntimeError("BubblewrapBackend needs bubblewrap: apt-get install bubblewrap (or use BuildahBackend)")
        self.max_output, self.command_timeout_s = max_output, command_timeout_s
        self.cache_dir, self.prepare_timeout_s = Path(cache_dir or "~/.cache/molt-lightning/shell").expanduser(), \
            prepare_timeout_s
        self.limits = f"RLIMIT_AS={memory_mb << 20},RLIMIT_FSIZE={file_mb << 20},RLIMIT_CORE=0," \
                      f"RLIMIT_NPROC={max_processes}"
        self.python, self.root = os.path.realpath(sys.executable), os.geteuid() == 0  # the launcher's: -I -S, no venv
        self.base = _isolation(bwrap, self.root)  # as root, the uid it drops to reaches the interpreter's install:
        self.keep = (os.path.dirname(os.path.dirname(self.python)),) if self.root else ()  # it is bound in anew

    def argv(self, mounts: dict[str, str], cwd: str, env: dict[str, str], uid: int, program: list[str]) -> list[str]:
        """bwrap's command line: the host's top-level entries read-only but those a mount replaces, ``mounts`` (inside
        -> host folder) writable wherever they are (bwrap_image.tree), the launcher's interpreter reachable."""
        argv, tops = list(self.base), {"/proc", "/dev", *(m for m in mounts if m.count("/") == 1)}
        for path in sorted("/" + name for name in os.listdir("/")):
            if path not in tops:
                argv += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
        argv += ["--dev", "/dev", "--proc", "/proc"]
        argv += tree(mounts, self.keep)
        env = {"PATH": PATH, "HOME": cwd, "LANG": "C.UTF-8", "TERM": "dumb", **env}
        argv += ["--remount-ro", "/", *[a for k, v in env.items() for a in ("--setenv", k, v)], "--chdir", cwd]
        return argv + ["--", self.python, "-I", "-S", "-c", _LAUNCH, str(uid), self.limits, *program]

    def prepare(self, environment: Path) -> Prepared:
        dockerfile = (environment := Path(environment).resolve()) / "Dockerfile"
        key, (workdir, env, steps) = _content_hash(environment, f"{_VERSION} bwrap"), plan(dockerfile, self.keep)
        if (done := self.cache_dir / key).exists():
            return Prepared(key, workdir, env, done / "layer")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        build, uid = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.cache_dir)), _uid(self.root)
        try:  # the context is staged at STAGE for COPY's `cp`, which runs in the sandbox like RUN: no link leads out
            shutil.copytree(environment, build / "stage", symlinks=True)
            (build / "layer").mkdir(), (build / "tmp").mkdir(), _chown_tree(build, uid)
            mounts = {workdir: str(build / "layer"), "/tmp": str(build / "tmp"), STAGE: str(build / "stage")}
            for line, word, argv, env_then in steps:
                try:
                    ran = subprocess.run(self.argv(mounts, workdir, env_then, uid, argv), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, timeout=self.prepare_timeout_s)
                except subprocess.TimeoutExpired as e:
                    ran = subprocess.CompletedProcess(e.cmd, f"killed after {e.timeout:g} s", e.stdout or b"")
                if ran.returncode != 0:
                    raise PrepareError(f"{dockerfile}:{line}: {word} failed ({ran.returncode}); only the work dir and "
                                       f"/tmp are writable, the host's root file system is the image (to install "
                                       f"packages, use BuildahBackend): {ran.stdout[-3000:].decode(errors='replace')}")
            with contextlib.suppress(OSError):  # else prepared meanwhile by another process: theirs is as good
                os.rename(build, done)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        return Prepared(key, workdir, env, done / "layer")

    async def start(self, prepared: Prepared, episode_timeout_s: float) -> ShellSession:
        return await asyncio.to_thread(_BwrapSession, self, prepared, episode_timeout_s)  # copies the layer


class _BwrapSession(ShellSession):
    def __init__(self, backend: BubblewrapBackend, prepared: Prepared, timeout_s: float):
        super().__init__(backend, prepared.workdir, _uid(backend.root), timeout_s)
        self.env, self.base = prepared.env, Path(tempfile.mkdtemp(prefix="molt-shell-"))
        self.mounts = {prepared.workdir: str(self.base / "work"), "/logs": str(self.base / "logs"),
                       "/tmp": str(self.base / "tmp")}
        shutil.copytree(prepared.layer, self.base / "work", symlinks=True)
        for sub in ("logs/verifier", "logs/agent", "tmp"):
            (self.base / sub).mkdir(parents=True)
        _chown_tree(self.base, self.uid)

    def _argv(self, program: list[str]) -> list[str]:
        return self.backend.argv(self.mounts, self.workdir, self.env, self.uid, program)

    async def put(self, src: Path, dest: str) -> None:
        """A copy of host folder ``src``'s contents becomes a new private folder of the episode, bound at ``dest``."""
        if not posixpath.isabs(dest := posixpath.normpath(dest)) or any(  # not "/", nor in or above a mount
                f"{dest}/".startswith(f"{m}/") or m.startswith(dest.rstrip("/") + "/") for m in self.mounts):
            raise ValueError(f"put: {dest!r} must be an absolute path outside {sorted(self.mounts)} (a new folder)")
        staged = Path(tempfile.mkdtemp(prefix="put-", dir=self.base))
        await asyncio.to_thread(shutil.copytree, src, staged, symlinks=True, dirs_exist_ok=True)
        _chown_tree(staged, self.uid)
        self.mounts[mount_point(dest, f"put({str(src)!r}, {dest!r})", self.backend.keep)] = str(staged)

    async def _teardown(self) -> None:
        await asyncio.to_thread(shutil.rmtree, self.base, ignore_errors=True)


class BuildahBackend:
    """``base_images`` rewrites FROM lines, e.g. ``{"ubuntu:24.04": "localhost/debian:bookworm-minbase"}``."""

    def __init__(self, max_output: int = 8000, command_timeout_s: float = 30, memory_mb: int = 1024,
                 max_processes: int = 64, file_mb: int = 64, base_images: dict[str, str] | None = None,
                 prepare_timeout_s: float = 1800):
        if (buildah := shutil.which("buildah")) is None:
            raise RuntimeError("BuildahBackend needs buildah: apt-get install -y buildah (or use BubblewrapBackend)")
        if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
            raise RuntimeError("BuildahBackend needs root (buildah's chroot isolation) and util-linux's setpriv and "
                               "unshare (to take the network away): use BubblewrapBackend")
        self.buildah, self.max_output, self.command_timeout_s = buildah, max_output, command_timeout_s
        self.base_images, self.prepare_timeout_s = dict(base_images or {}), prepare_timeout_s
        self.ulimits = [a for name, n in (("nproc", max_processes), ("fsize", file_mb << 20), ("core", 0),
                                          ("data", memory_mb << 20)) for a in ("--ulimit", f"{name}={n}:{n}")]
        self.wrap = ["setpriv", "--no-new-privs", "unshare", "--net", "--pid", "--ipc", "--uts", "--fork",
                     "--kill-child", "--mount-proc", "--"]

    def _buildah(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.buildah, *args], capture_output=True, text=True, timeout=timeout)

    def prepare(self, environment: Path) -> Prepared:
        dockerfile = (environment := Path(environment).resolve()) / "Dockerfile"
        key = _content_hash(environment, f"{_VERSION} buildah {sorted(self.base_images.items())}")
        if self._buildah("inspect", "--type", "image", tag := f"localhost/molt-shell:{key}").returncode != 0:
            text = re.sub(r"(?im)^(\s*FROM\s+(?:--\S+\s+)*)(\S+)", lambda m: m[1] + self.base_images.get(m[2], m[2]),
                          dockerfile.read_text())
            with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile") as rewritten:
                rewritten.write(text), rewritten.flush()
                built = subprocess.run(["unshare", "--net", "--", self.buildah, "bud", "--isolation", "chroot",
                                        "--pull=never", "--quiet", "-f", rewritten.name, "-t", tag, str(environment)],
                                       capture_output=True, text=True, timeout=self.prepare_timeout_s)
            if (missing := re.search(r"(\S+): image not known", built.stderr)) and built.returncode:
                line = next((n for n, line in enumerate(text.splitlines(), 1) if re.match(
                    rf"\s*FROM\s+(--\S+\s+)*{re.escape(missing[1])}(\s|$)", line, re.I)), "?")
                raise PrepareError(
                    f"{dockerfile}:{line}: FROM {missing[1]}: the image is not in buildah's local store (nothing is "
                    f"pulled). Build it (debootstrap into `buildah from scratch`, then commit, as containers/build.sh "
                    f"does) and tag it {missing[1]}, or map it to a local image: BuildahBackend(base_images="
                    f"{{{missing[1]!r}: 'localhost/debian:bookworm-minbase'}})")
            if built.returncode != 0:
                raise PrepareError(f"{dockerfile}: buildah bud failed (exit code {built.returncode}; no network while "
                                   f"building): {(built.stderr + built.stdout).strip()[-3000:]}")
        config = self._buildah("inspect", "--type", "image", "--format", "{{.OCIv1.Config.WorkingDir}}", tag)
        if (workdir := config.stdout.strip() or "/app") == "/":
            raise PrepareError(f"{dockerfile}: WORKDIR / is not supported: set a WORKDIR for the agent's files")
        return Prepared(key, workdir, image=tag)

    async def start(self, prepared: Prepared, episode_timeout_s: float) -> ShellSession:
        name = f"molt-shell-{uuid.uuid4().hex[:16]}"
        made = await asyncio.to_thread(self._buildah, "from", "--quiet", "--pull=never", "--name", name, *self.ulimits,
                                       prepared.image)
        if made.returncode != 0:
            raise RuntimeError(f"buildah from {prepared.image} failed: {made.stderr.strip()[-2000:]}")
        session, capture = _BuildahSession(self, name, prepared.workdir, _uid(True), episode_timeout_s), _Capture(4096)
        setup = 'mkdir -p -- "$1" /logs/verifier /logs/agent && chown -R -- "$2" "$1" /logs'  # as root, for the user
        rc, _, said = await session._exec(["/bin/bash", "-c", setup, "_", session.workdir,
                                           f"{session.uid}:{session.uid}"], self.prepare_timeout_s, capture, user=False)
        if rc != 0:
            await session.close()
            raise RuntimeError(f"setting up {name} failed ({rc}): {capture.text(4096)}{said[-2000:].decode()}")
        return session


class _BuildahSession(ShellSession):
    def __init__(self, backend: BuildahBackend, name: str, workdir: str, uid: int, timeout_s: float):
        super().__init__(backend, workdir, uid, timeout_s)
        self.name, self.fifos = name, tempfile.mkdtemp(prefix="molt-buildah-io-")  # bound in at _FIFOS
        os.chmod(self.fifos, 0o711)

    def _argv(self, program: list[str], fifo: str, user: bool) -> list[str]:
        env = [a for kv in (f"HOME={self.workdir}", "LANG=C.UTF-8", "TERM=dumb") for a in ("-e", kv)]
        return [*self.backend.wrap, self.backend.buildah, "run", "--isolation", "chroot", "--volume",
                f"{self.fifos}:{_FIFOS}:ro", *(["--user", f"{self.uid}:{self.uid}"] if user else []),
                "--workingdir", self.workdir if user else "/", *env, self.name, "--",
                "/bin/bash", "-c", 'exec >"$0" 2>&1; exec "$@"', f"{_FIFOS}/{fifo}", *program]

    async def _exec(self, program: list[str], timeout: float, capture: _Capture,
                    user: bool = True) -> tuple[int | None, bool, bytes]:
        """The command writes its output into a FIFO of the session (stderr joins stdout there: kept in order) that
        this process reads itself. Through ``buildah run``'s stdout it got lost: buildah relays a command's output in a
        goroutine it does not wait for before it exits (chroot/run_common.go, 1.28 and still upstream), so under load
        the output, or its end, was gone with exit code 0 (2 of 48 reads of a reward file came back empty)."""
        os.mkfifo(fifo := os.path.join(self.fifos, uuid.uuid4().hex), 0o600)
        if user:
            os.chown(fifo, self.uid, self.uid)
        reader, reading = asyncio.StreamReader(), open(fifo, "rb", buffering=0, opener=_nonblocking)
        held = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # no end of file before the command has opened it
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), reading)
        pump, said = asyncio.create_task(capture.pump(reader)), _Capture(4096)
        try:
            rc, timed_out = await _spawn(self._argv(program, os.path.basename(fifo), user), timeout, said,
                                         procs=self._procs)
        finally:  # the FIFO ends once the command's processes, gone with its pid namespace, and this one close it
            os.close(held)
            await asyncio.wait([pump], timeout=2.0)
            pump.cancel(), transport.close(), os.unlink(fifo)
        return rc, timed_out, bytes(said.head + said.tail)

    async def put(self, src: Path, dest: str) -> None:
        """``buildah copy`` (it resolves ``dest`` inside the container) of the folder's contents, made the user's."""
        if not posixpath.isabs(dest):
            raise ValueError(f"put: {dest!r} is not an absolute path")
        done = await asyncio.to_thread(self.backend._buildah, "copy", "--quiet", "--chown", f"{self.uid}:{self.uid}",
                                       self.name, str(src), dest, timeout=self.backend.prepare_timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"buildah copy {src} {dest} failed: {done.stderr.strip()[-2000:]}")

    async def _teardown(self) -> None:
        await asyncio.to_thread(self.backend._buildah, "rm", self.name)
        shutil.rmtree(self.fifos, ignore_errors=True)


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)


def _chown_tree(path: Path, uid: int) -> None:
    for folder, dirs, files in os.walk(path) if uid >= 0 else ():
        for p in [folder, *(os.path.join(folder, name) for name in dirs + files)]:
            os.lchown(p, uid, uid)


def _content_hash(folder: Path, salt: str) -> str:  # sha256 of the names, modes and contents (links: targets)
    digest = hashlib.sha256(salt.encode())
    for path in sorted(folder.rglob("*")):  # links to folders are not followed
        link = path.is_symlink()
        digest.update(f"{path.relative_to(folder)}\0{os.readlink(path) if link else path.stat().st_mode}\0".encode())
        digest.update(path.read_bytes() if path.is_file() and not link else b"")
    return digest.hexdigest()


def _clip(capture: _Capture, limit: int) -> str:
    """The output, at most ``limit`` characters: head and tail around sandbox.py's marker, saying how much was cut."""
    text, total = capture.text(limit - 32), len(capture.head) + capture.dropped + len(capture.tail)
    return text.replace(_TRUNCATED, f"\n[... {total - len(text) + len(_TRUNCATED)} characters cut]\n", 1)
