"""``molt serve``: one vLLM OpenAI-compatible server set up for RL, for ``RemoteVLLMEngine`` and ``EnginePool``.

``molt serve --policy DIR [--port 8000] [--host 127.0.0.1] [--api-key KEY] [--cpu-threads 1] [--nccl]
[-- VLLM ARGS]`` runs
``python -m vllm.entrypoints.openai.api_server`` with what the remote engine relies on: the project's worker
extension (weight loads through ``/collective_rpc``), processed logprobs, the token-in/token-out route
(``--enable-scale-out``), the RL and dev routes (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/update_weight_version``, ``/reset_prefix_cache``, ``/collective_rpc``), and ``Guard``.

``--nccl`` (GPU servers) also enables vLLM's NCCL weight-transfer engine (``--weight-transfer-config
{"backend": "nccl"}``), for ``RemoteVLLMEngine(channel="nccl")``: the trainer joins the server's workers in an NCCL
group through ``/init_weight_transfer_engine`` and broadcasts each update (``engines/nccl_channel.py``). The
workers dial the trainer's rendezvous address and port, so that port must be open from the server to the trainer.

Access: the server binds loopback unless ``--host`` says otherwise. vLLM's own ``--api-key`` guards only the
``/v1``, ``/inference`` routes; its control routes (weights, pause, RPC: arbitrary worker methods) stay open. ``Guard``
(an ASGI middleware, given to vLLM as ``--middleware``) closes them: with a shared token (``--api-key`` or
``$MOLT_API_KEY``, handed to vLLM as ``VLLM_API_KEY`` so the serving routes need it too) every control request must
carry it as a bearer token; without one, control requests from anything but loopback are refused (403).

``LocalServer`` starts one as a child process in its own process group (stopped with the whole group: vLLM's engine
core is a grandchild) on a free loopback port; the remote engine uses it when given no URL.
"""

from __future__ import annotations

import argparse
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

TOKEN_ENV = "MOLT_API_KEY"
WORKER = "molt_lightning.engines.vllm_worker.MoltWorkerExtension"
PUBLIC = ("/health", "/ping", "/load", "/version", "/is_paused", "/weight_info", "/metrics")  # read-only probes
SERVING = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's --api-key guards these
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class Guard:
    """Refuse vLLM's control routes (everything but ``PUBLIC`` probes and the ``SERVING`` routes) from non-loopback
    clients, or, with a token configured, from any request that does not carry it."""

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


def server_command(policy: str, host: str, port: int, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy, "--host", host,
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out", "--worker-extension-cls", WORKER, "--middleware", "molt_lightning.serve.Guard",
            "--disable-log-stats", "--uvicorn-log-level", "warning", *extra]


def server_env(api_key: str | None = None, cpu_threads: str | None = None) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's package, for the worker extension too
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
        self.stop()
        raise TimeoutError(f"the vLLM server on port {self.port} did not answer /health within {timeout_s:.0f} s "
                           f"(log: {self.log_path}); raise start_timeout_s on a slow machine")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (the API server and vLLM's engine core)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="molt serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="a Hugging Face policy folder, or a dotted path returning one "
                                                   "(molt_lightning.models.tiny.arithmetic_policy)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(TOKEN_ENV),
                   help=f"shared token for every route but the probes (default ${TOKEN_ENV})")
    p.add_argument("--cpu-threads", default=None, help="cores for vLLM's CPU threads, e.g. 1 or 0-1")
    p.add_argument("--nccl", action="store_true", help="enable vLLM's NCCL weight-transfer engine (GPUs), for the "
                                                       "remote engine's channel nccl")
    args = p.parse_args(argv)
    if args.nccl:
        from .engines.nccl_channel import SERVER_ARGS

        extra = SERVER_ARGS + extra
    from .policy import policy_folder

    policy = policy_folder(args.policy)
    if args.host not in LOOPBACK and not args.api_key:
        print(f"molt serve: binding {args.host} without --api-key: control routes (weights, pause, RPC) answer "
              "loopback only, serving routes are open to the network", file=sys.stderr)
    env = server_env(args.api_key, args.cpu_threads)
    cmd = server_command(policy, args.host, args.port, extra)
    os.execvpe(cmd[0], cmd, env)  # the server becomes this process: signals reach it directly


if __name__ == "__main__":
    main()
