"""The command line and environment of a ``molt serve`` vLLM server, the ``Guard`` on its control routes, and
``LocalServer``, which runs one as a child process in its own process group (stopped with the whole group: vLLM's
engine core is a grandchild) on a free loopback port. ``RemoteVLLMEngine`` starts one when given no URL; ``molt
serve`` (``commands.serve``) runs the same command in its own process.

``--enable-server-load-tracking`` makes ``GET /load`` count the generate requests the server is handling (tests and
operators read it to see requests arrive).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import cpu

SERVER = "vllm.entrypoints.openai.api_server"
TOKEN_ENV = "MOLT_API_KEY"
WORKER = "molt_lightning.engines.vllm.worker.MoltWorkerExtension"
GUARD = "molt_lightning.engines.vllm.server.Guard"


def server_command(policy: str, host: str, port: int, extra: list[str] = (), seed: int | None = None) -> list[str]:
    """The server's command line (vLLM's OpenAI server; on the CPU platform through ``main``, which keeps the model
    worker in the engine core's process: ``cpu.one_process``); the platform's dtype and eager mode (``cpu.defaults``)
    unless ``extra`` sets them; the engine's sampling seed (``--seed``: servers seeded alike sample the same completions
    where requests carry no seed of their own); the names it answers to (``served_names``)."""
    platform = cpu.defaults()
    chosen = ([] if "--dtype" in extra or "dtype" not in platform else ["--dtype", platform["dtype"]]) + \
        (["--enforce-eager"] if platform.get("enforce_eager") and "--enforce-eager" not in extra else [])
    module = "molt_lightning.engines.vllm.server" if platform else SERVER  # on the CPU: main() below
    names = [] if "--served-model-name" in extra else ["--served-model-name", *served_names(policy)]
    return [sys.executable, "-m", module, "--model", policy, *names, "--host", host, "--port", str(port), *chosen,
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--worker-extension-cls", WORKER,
            "--middleware", GUARD, "--disable-log-stats", "--enable-server-load-tracking", "--uvicorn-log-level",
            "warning",
            *([] if seed is None or "--seed" in extra else ["--seed", str(seed)]), *extra]


def served_names(policy: str) -> list[str]:
    """The model names a server answers to, as a run's endpoint does (``agents/sessions.py``): the folder as given
    (first: vLLM puts it in every response and first in ``/v1/models``), ``policy``, and the folder's own name
    (``out/`` -> ``out``). vLLM serves any of them; ``--served-model-name`` after ``--`` replaces them."""
    return list(dict.fromkeys([policy, "policy", os.path.basename(policy.rstrip("/")) or policy]))


def server_env(api_key: str | None = None, cpu_threads: str | None = None) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a crash, or the SIGABRT that stops a start that hangs (wait_ready), logs every stack
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONFAULTHANDLER="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cpu.defaults():
        cpu.set_environment(env, 1, cpu_threads)
    root = str(Path(__file__).resolve().parents[3])  # this checkout's package, for the worker extension too
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    if api_key:
        env[TOKEN_ENV] = env["VLLM_API_KEY"] = api_key
    return env


PUBLIC = ("/health", "/ping", "/load", "/version", "/is_paused", "/weight_info", "/metrics")  # read-only probes
SERVING = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's --api-key guards these
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class Guard:
    """vLLM's own ``--api-key`` guards only the ``/v1``, ``/inference`` routes; its control routes (weights, pause, RPC:
    arbitrary worker methods) stay open. This ASGI middleware (given to vLLM as ``--middleware``) refuses them
    (everything but the ``PUBLIC`` probes and the ``SERVING`` routes) to anything but loopback, or, with a token
    (``--api-key`` or ``$MOLT_API_KEY``, handed to vLLM as ``VLLM_API_KEY`` so the serving routes need it too), to any
    request that does not carry it as a bearer token (403)."""

    def __init__(self, app, token: str | None = None):
        self.app = app
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.digest = hashlib.sha256(token.encode()).digest() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.allowed(scope):
            from starlette.responses import JSONResponse

            why = ("this control route needs the server's token (Authorization: Bearer ...)" if self.digest else
                   "control routes answer loopback only; start the server with --api-key to use them remotely")
            return await JSONResponse({"error": why}, status_code=403)(scope, receive, send)
        return await self.app(scope, receive, send)

    def allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(PUBLIC) or path.startswith(SERVING) or scope.get("method") == "OPTIONS":
            return True
        if self.digest is None:
            return (scope.get("client") or ("?",))[0] in LOOPBACK
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(given.encode()).digest(),
                                                                     self.digest)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One ``molt serve`` child process on a free loopback port."""

    def __init__(self, policy: str, port: int | None = None, cpu_threads: str | None = None,
                 api_key: str | None = None, extra_args: list[str] = (), log_path: str | None = None,
                 seed: int | None = None):
        """``seed``: the engine's sampling seed (None: a random one, so that two servers never share a stream)."""
        self.policy, self.port = policy, port or free_port()
        self.seed = secrets.randbelow(2**31) if seed is None else seed
        self.url = f"http://127.0.0.1:{self.port}"
        self.cpu_threads, self.api_key, self.extra_args = cpu_threads, api_key, list(extra_args)
        self.log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"molt-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (or restart, on the same port) the server process."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(server_command(self.policy, "127.0.0.1", self.port, self.extra_args,
                                                        self.seed),
                                         env=server_env(self.api_key, self.cpu_threads), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server on port {self.port} exited with {self.proc.returncode} while "
                                   f"starting; its log: {self.log_path}\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(0.5)
        self.stop(signal.SIGABRT)  # its processes write their Python stacks to the log (PYTHONFAULTHANDLER) and exit
        raise TimeoutError(f"the vLLM server on port {self.port} did not answer /health within {timeout_s:.0f} s "
                           f"(raise start_timeout_s on a slow machine); its log {self.log_path}:\n{self.log_tail(60)}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (the API server and vLLM's engine core)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self.kill(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core too, if it outlived the API server
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def main() -> None:
    """``python -m molt_lightning.engines.vllm.server ARGS``: vLLM's OpenAI server with ``ARGS``, its engine config
    made with the model worker inside the engine core's process (``cpu.one_process``)."""
    import runpy

    from vllm.engine.arg_utils import EngineArgs

    make = EngineArgs.create_engine_config
    EngineArgs.create_engine_config = lambda self, *a, **kw: cpu.one_process(make(self, *a, **kw))
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
