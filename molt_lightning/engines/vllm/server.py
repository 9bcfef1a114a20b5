"""The command line and environment of a ``molt serve`` vLLM server, and ``LocalServer``, which runs one as a child
process in its own process group (stopped with the whole group: vLLM's engine core is a grandchild) on a free
loopback port. ``RemoteVLLMEngine`` starts one when given no URL; ``molt serve`` (``molt_lightning.commands.serve``) runs the
same command in its own process.

``--enable-server-load-tracking`` makes ``GET /load`` count the generate requests the server is handling (tests and
operators read it to see requests arrive).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TOKEN_ENV = "MOLT_API_KEY"
WORKER = "molt_lightning.engines.vllm.worker.MoltWorkerExtension"


def server_command(policy: str, host: str, port: int, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy, "--host", host,
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out", "--worker-extension-cls", WORKER, "--middleware", "molt_lightning.commands.serve.Guard",
            "--disable-log-stats", "--enable-server-load-tracking", "--uvicorn-log-level", "warning", *extra]


def server_env(api_key: str | None = None, cpu_threads: str | None = None) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a crash, or the SIGABRT that stops a start that hangs (wait_ready), logs every stack
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONFAULTHANDLER="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    root = str(Path(__file__).resolve().parents[3])  # this checkout's package, for the worker extension too
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    if api_key:
        env[TOKEN_ENV] = env["VLLM_API_KEY"] = api_key
    if cpu_threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One ``molt serve`` child process on a free loopback port."""

    def __init__(self, policy: str, port: int | None = None, cpu_threads: str | None = None,
                 api_key: str | None = None, extra_args: list[str] = (), log_path: str | None = None):
        self.policy, self.port = policy, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cpu_threads, self.api_key, self.extra_args = cpu_threads, api_key, list(extra_args)
        self.log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"molt-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (or restart, on the same port) the server process."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(server_command(self.policy, "127.0.0.1", self.port, self.extra_args),
                                         env=server_env(self.api_key, self.cpu_threads), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server on port {self.port} exited with {self.proc.returncode} while "
                                   f"starting; its log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop(signal.SIGABRT)  # its processes write their Python stacks to the log (PYTHONFAULTHANDLER) and exit
        raise TimeoutError(f"the vLLM server on port {self.port} did not answer /health within {timeout_s:.0f} s "
                           f"(raise start_timeout_s on a slow machine); its log {self.log_path}:\n{self.log_tail(60)}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (the API server and vLLM's engine core)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self.kill(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core too, if it outlived the API server
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
