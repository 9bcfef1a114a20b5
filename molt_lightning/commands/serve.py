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

``engines.server.LocalServer`` starts one as a child process on a free loopback port (the remote engine uses it when
given no URL); the command line and environment it runs with are written there, once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys

from ..engines.vllm.server import TOKEN_ENV, server_command, server_env

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
        from ..engines.vllm.nccl import SERVER_ARGS

        extra = SERVER_ARGS + extra
    from ..trainer.policy import policy_folder

    policy = policy_folder(args.policy)
    if args.host not in LOOPBACK and not args.api_key:
        print(f"molt serve: binding {args.host} without --api-key: control routes (weights, pause, RPC) answer "
              "loopback only, serving routes are open to the network", file=sys.stderr)
    env = server_env(args.api_key, args.cpu_threads)
    cmd = server_command(policy, args.host, args.port, extra)
    os.execvpe(cmd[0], cmd, env)  # the server becomes this process: signals reach it directly


if __name__ == "__main__":
    main()
