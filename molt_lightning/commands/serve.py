"""``molt serve``: one vLLM OpenAI-compatible server set up for RL, for ``RemoteVLLMEngine`` and ``EnginePool``.

``molt serve --policy DIR [--port 8000] [--host 127.0.0.1] [--api-key KEY] [--cpu-threads 1] [--seed N] [--nccl]
[-- VLLM ARGS]`` runs
``python -m vllm.entrypoints.openai.api_server`` (on the CPU platform through ``engines.vllm.server.main``: the model
worker inside the engine core's process) with what the remote engine relies on: the project's worker
extension (weight loads through ``/collective_rpc``), processed logprobs, the token-in/token-out route
(``--enable-scale-out``), the RL and dev routes (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/update_weight_version``, ``/reset_prefix_cache``, ``/collective_rpc``), ``Guard``, and the dtype and eager mode
vLLM's platform needs (float32 and ``--enforce-eager`` on the CPU; vLLM's own choice elsewhere; a ``--dtype`` or
``--enforce-eager`` after ``--`` wins), and a sampling seed of its own (``--seed``; by default a random one, printed:
servers seeded alike sample the same completions wherever requests carry no seed, as on vLLM's CPU platform). It
answers to the model names ``DIR`` as given (first: the name in its responses), ``policy`` and the folder's name
(``engines.vllm.server.served_names``), as a run's endpoint does.

``--nccl`` (GPU servers) also enables vLLM's NCCL weight-transfer engine (``--weight-transfer-config
{"backend": "nccl"}``), for ``RemoteVLLMEngine(channel="nccl")``: the trainer joins the server's workers in an NCCL
group through ``/init_weight_transfer_engine`` and broadcasts each update (``engines/vllm/nccl.py``). The
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
import os
import secrets
import sys

from ..engines.vllm.server import LOOPBACK, TOKEN_ENV, server_command, server_env

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
    p.add_argument("--seed", type=int, default=None, help="the engine's sampling seed (default: a random one; give "
                                                          "each server of a pool its own)")
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
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    print(f"molt serve: sampling seed {seed}", file=sys.stderr)
    env = server_env(args.api_key, args.cpu_threads)
    cmd = server_command(policy, args.host, args.port, extra, seed)
    os.execvpe(cmd[0], cmd, env)  # the server becomes this process: signals reach it directly


if __name__ == "__main__":
    main()
