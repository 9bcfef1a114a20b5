"""``molt tinker``: the Tinker API on your own machine: the official ``tinker`` SDK and tinker-cookbook run as they are.

The routes and bodies are the SDK's (``tinker==0.38.0``: its source is the contract): sessions and heartbeats,
``create_model`` (a LoRA training client), ``get_info``, ``forward_backward`` (forward with ``forward_only``),
``optim_step``, ``save_weights`` / ``load_weights`` (durable state), ``save_weights_for_sampler`` and
``create_sampling_session`` (frozen samplers), ``asample`` (sampling and ``compute_logprobs``), ``retrieve_future``,
``training_runs/{id}``, ``samplers/{id}``, health and capabilities. The full list, what is not served and why:
docs/tinker.md.

Futures: every training call and every sample answers ``{request_id}`` at once; ``retrieve_future`` holds the poll
up to ``POLL_S`` for the result (the SDK re-polls a ``try_again`` at once, so an immediate answer would spin), then
answers the result (protobuf for samples and forward_backward), ``{"error", "category"}`` (``user`` for a request
that cannot run as asked: the client raises ``RequestFailedError`` and keeps working; ``server`` for a fault), or
``try_again``. A user error is never a 5xx (the SDK retries those for minutes). A model's operations run one at a
time in the order of their ``seq_id`` on one training thread (the SDK pipelines them: it submits the next before
the last has finished); sampling runs on the engines' threads (``sampling``).

State under ``--state-dir``: ``runs/<model_id>/weights/<name>`` (``save_state``: adapter, optimizer, version),
``runs/<model_id>/sampler_weights/<name>`` (a sampler's frozen weights), and ``samples.jsonl`` (every sampled
sequence: id, sampler, model, the policy version of each token). A restarted server on the same folder loads them.
Written by hand on Starlette: no maintained library serves the Tinker API (the SDK holds only the client side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import secrets
import socket
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import wire
from .sampling import Pool, Sampler
from .training import Model, Snapshot, read_meta
from .wire import UserError

log = logging.getLogger("molt.tinker")
POLL_S = 20.0  # the SDK's poll times out after 45 s
KEEP_S = 600.0  # a finished future's result is kept this long
PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([A-Za-z0-9._-]+)$")


@dataclass
class Pending:
    proto: bool  # its result goes back as protobuf
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: object = None
    error: BaseException | None = None
    at: float = 0.0


@dataclass
class Trained:
    model: Model
    session_id: str
    next_seq: int = 1
    ops: dict[int, tuple[Callable, str]] = field(default_factory=dict)  # seq_id -> (work, request id)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id: a resent op is not run twice
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task | None = None


class NotFound(LookupError):
    pass


class Server:
    def __init__(self, folder: str, api_key: str, state_dir: str, engines_per_kind: int = 2,
                 allow_full_weights: bool = False):
        from transformers import AutoConfig, AutoTokenizer

        self.folder, self.key, self.state_dir = os.path.abspath(folder), api_key, os.path.abspath(state_dir)
        self.allow_full = allow_full_weights
        self.config = AutoConfig.from_pretrained(self.folder)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.sessions: dict[str, bool] = {}  # id -> finished
        self.models: dict[str, Trained] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Pending] = {}
        self.versions: dict[str, int] = {}  # sequence id -> the policy version that sampled it
        self.trainer = ThreadPoolExecutor(1, thread_name_prefix="molt-tinker-train")
        self.pool = Pool(self.folder, self.tokenizer, engines_per_kind)
        os.makedirs(self.state_dir, exist_ok=True)
        self._samples = open(os.path.join(self.state_dir, "samples.jsonl"), "a")

    # ----- plumbing -----
    def app(self) -> Starlette:
        post = {"client/config": self.client_config, "client/dynamic_config": self.dynamic_config,
                "create_session": self.create_session, "session_heartbeat": self.heartbeat,
                "telemetry": lambda b: {"status": "accepted"}, "create_model": self.create_model,
                "get_info": self.get_info, "optim_step": self.optim_step, "save_weights": self.save_weights,
                "save_weights_for_sampler": self.save_for_sampler, "load_weights": self.load_weights,
                "create_sampling_session": self.create_sampling_session, "asample": self.asample,
                "healthz": lambda b: {"status": "ok"}}
        get = {"healthz": lambda b: {"status": "ok"}, "get_server_capabilities": self.capabilities}
        routes = [Route(f"/api/v1/{name}", self._json(fn), methods=["POST"]) for name, fn in post.items()]
        routes += [Route(f"/api/v1/{name}", self._json(fn), methods=["GET"]) for name, fn in get.items()]
        routes += [Route("/api/v1/forward_backward", self.forward_backward, methods=["POST"]),
                   Route("/api/v1/retrieve_future", self.retrieve_future, methods=["POST"]),
                   Route("/api/v1/sessions/{id}/finish", self._json(self.finish, "id"), methods=["POST"]),
                   Route("/api/v1/samplers/{id:path}", self._json(self.get_sampler, "id"), methods=["GET"]),
                   Route("/api/v1/training_runs/{id}", self._json(self.training_run, "id"), methods=["GET"])]
        return Starlette(routes=routes)

    def _denied(self, request: Request) -> Response | None:
        if request.url.path.endswith("/healthz"):
            return None
        if secrets.compare_digest(request.headers.get("x-api-key", ""), self.key):
            return None
        return JSONResponse({"detail": "missing or wrong API key: send the server's key in X-API-Key (the SDK reads "
                                       "TINKER_API_KEY; `molt tinker` printed it)"}, status_code=401)

    def _json(self, fn: Callable, param: str | None = None):
        async def handle(request: Request) -> Response:
            if (denied := self._denied(request)) is not None:
                return denied
            try:
                body = json.loads(await request.body() or b"{}") if request.method == "POST" else {}
                if not isinstance(body, dict):
                    raise UserError("the body must be a JSON object")
                out = fn(request.path_params[param]) if param else fn(body)
                if asyncio.iscoroutine(out):
                    out = await out
                return out if isinstance(out, Response) else JSONResponse(out)
            except (UserError, KeyError, TypeError, ValueError) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                return JSONResponse({"detail": f"{request.url.path}: {what}"}, status_code=400)
            except NotFound as e:
                return JSONResponse({"detail": str(e)}, status_code=404)
        return handle

    def _future(self, proto: bool = False, **extra) -> tuple[str, Pending, dict]:
        now = time.monotonic()
        for rid in [r for r, p in self.futures.items() if p.done.is_set() and now - p.at > KEEP_S]:
            del self.futures[rid]
        rid = uuid.uuid4().hex
        self.futures[rid] = pending = Pending(proto)
        return rid, pending, {"request_id": rid, **extra}

    @staticmethod
    def _finish(pending: Pending, result=None, error: BaseException | None = None) -> None:
        if error is not None and not isinstance(error, UserError):
            log.error("molt tinker: a request failed", exc_info=error)
        pending.result, pending.error, pending.at = result, error, time.monotonic()
        pending.done.set()

    def _spawn(self, work, proto: bool = False, **extra) -> dict:
        """A future resolved by the coroutine ``work``."""
        rid, pending, answer = self._future(proto, **extra)

        async def run():
            try:
                self._finish(pending, await work)
            except Exception as e:
                self._finish(pending, error=e)
        asyncio.get_running_loop().create_task(run())
        return answer

    def _op(self, model_id: str, seq_id: int | None, work: Callable[[Model], object], proto: bool = False) -> dict:
        """A future resolved by ``work(model)`` on the training thread, in the model's ``seq_id`` order."""
        trained = self._trained(model_id)
        seq = trained.next_seq + len(trained.ops) if seq_id is None else int(seq_id)
        if seq in trained.seen:  # the SDK resent it (a timeout on its side): the same future
            return {"request_id": trained.seen[seq]}
        if seq < trained.next_seq:
            raise UserError(f"seq_id {seq} of {model_id} is behind the next one ({trained.next_seq})")
        rid, _, answer = self._future(proto)
        trained.seen[seq] = rid
        trained.ops[seq] = (work, rid)
        trained.wake.set()
        return answer

    async def _run_ops(self, trained: Trained) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while trained.next_seq not in trained.ops:
                trained.wake.clear()
                await trained.wake.wait()
            work, rid = trained.ops.pop(trained.next_seq)
            trained.seen.pop(trained.next_seq - 64, None)
            trained.next_seq += 1
            try:
                self._finish(self.futures[rid], await loop.run_in_executor(self.trainer, work, trained.model))
            except Exception as e:
                self._finish(self.futures[rid], error=e)

    def _trained(self, model_id: str) -> Trained:
        if model_id not in self.models:
            raise NotFound(f"no model {model_id!r} on this server (models: {sorted(self.models) or 'none'}; a "
                           "restarted server keeps only saved state: load it with create_training_client_from_state)")
        return self.models[model_id]

    def _register(self, model: Model, session_id: str) -> Trained:
        trained = Trained(model, session_id)
        trained.runner = asyncio.get_running_loop().create_task(self._run_ops(trained))
        self.models[model.model_id] = trained
        return trained

    async def _build(self, build: Callable[[], Model]) -> Model:
        return await asyncio.get_running_loop().run_in_executor(self.trainer, build)

    # ----- futures -----
    async def retrieve_future(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        rid = json.loads(await request.body() or b"{}").get("request_id")
        pending = self.futures.get(rid)
        if pending is None:  # 410: a sampling client submits again; a training client fails with this message
            return JSONResponse({"detail": f"unknown request_id {rid!r}: the server restarted, or the result expired "
                                           f"({KEEP_S:.0f} s after it was ready)"}, status_code=410)
        try:
            await asyncio.wait_for(asyncio.shield(pending.done.wait()), POLL_S)
        except TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if pending.error is not None:
            user = isinstance(pending.error, UserError)
            return JSONResponse({"error": str(pending.error) if user else f"molt tinker: {pending.error!r}",
                                 "category": "user" if user else "server"})
        if pending.proto:
            return Response(pending.result, media_type="application/x-protobuf")
        return JSONResponse(pending.result)

    # ----- sessions -----
    def client_config(self, body: dict) -> dict:
        # httpx transport, one forward_backward chunk at a time, plain API keys (no JWT exchange)
        return {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False, "pjwt_auth_enabled": False}

    def dynamic_config(self, body: dict) -> dict:
        return {"refresh_interval_sec": 600}

    def create_session(self, body: dict) -> dict:
        session_id = uuid.uuid4().hex[:12]
        self.sessions[session_id] = False
        return {"session_id": session_id, "type": "create_session"}

    def heartbeat(self, body: dict) -> Response | dict:
        if self.sessions.get(body.get("session_id"), True):  # unknown (a restart) or finished: the SDK stops beating
            return JSONResponse({"detail": "no such live session"}, status_code=410)
        return {"type": "session_heartbeat"}

    def finish(self, session_id: str) -> dict:
        self.sessions[session_id] = True
        return {}

    def capabilities(self, body: dict) -> dict:
        return {"supported_models": [{"model_name": self.folder, "trainable": True, "sampleable": True,
                                      "max_context_length": getattr(self.config, "max_position_embeddings", None)}]}

    # ----- training -----
    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and os.path.abspath(base_model) != self.folder and base_model != self.folder:
            raise UserError(f"base_model {base_model!r} is not served here: this server trains {self.folder} (pass "
                            "that folder as base_model / the cookbook's model_name)")

    def create_model(self, body: dict) -> dict:
        self._check_base(body.get("base_model"))
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer {optimizer!r}: molt tinker trains with adamw")
        lora = body.get("lora_config")
        if lora is None and not self.allow_full:
            raise UserError("full-weight training is off on this server: ask for a LoRA client, or start molt tinker "
                            "with --allow-full-weights")
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        targets = None if lora is None else {k: lora.get(f"train_{k}", True) for k in ("attn", "mlp", "unembed")}

        async def create():
            model = await self._build(lambda: Model(model_id, self.folder, None if lora is None else int(lora["rank"]),
                                                    targets, lora and lora.get("seed")))
            self._register(model, body["session_id"])
            return {"model_id": model_id, "type": "create_model"}
        return self._spawn(create())

    def get_info(self, body: dict) -> dict:
        model = self._trained(body["model_id"]).model
        return {"type": "get_info", "model_id": model.model_id, "is_lora": model.rank is not None,
                "lora_rank": model.rank, "model_name": self.folder, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": self.config.model_type, "model_name": self.folder,
                               "tokenizer_id": self.folder}}

    async def forward_backward(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            fb = wire.read_forward_backward(await request.body())
            self._trained(fb.model_id)
        except UserError as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        except NotFound as e:
            return JSONResponse({"detail": str(e)}, status_code=404)

        def work(model: Model) -> bytes:
            if fb.error is not None:
                raise fb.error
            logprobs, metrics = model.forward_backward(fb)
            sampled = [self.versions[s] for d in fb.data for s, _, _ in d.sampled if s in self.versions]
            if sampled:  # how many optimizer steps behind the trained policy the sampled tokens' policy was
                metrics["molt/staleness:max"] = float(model.version - min(sampled))
            return wire.forward_backward_output(logprobs, metrics)
        return JSONResponse(self._op(fb.model_id, fb.seq_id, work, proto=True))

    def optim_step(self, body: dict) -> dict:
        adam = body.get("adam_params")
        if adam is None:
            raise UserError("optim_step needs adam_params: molt tinker trains with AdamW")

        def work(model: Model) -> dict:
            return {"metrics": model.optim_step(adam), "type": "optim_step"}
        return self._op(body["model_id"], body.get("seq_id"), work)

    # ----- weights -----
    def _folder(self, model_id: str, kind: str, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name or "") or name in (".", ".."):
            raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-'")
        return os.path.join(self.state_dir, "runs", model_id, kind, name)

    def _path(self, path: str) -> tuple[str, str, str]:
        m = PATH.match(path or "")
        if m is None:
            raise UserError(f"path {path!r}: expected tinker://<model id>/weights/<name> or .../sampler_weights/<name>")
        folder = os.path.join(self.state_dir, "runs", *m.groups())
        if not os.path.isdir(folder):
            raise UserError(f"no checkpoint {path} under {self.state_dir}")
        return m[1], m[2], folder

    def save_weights(self, body: dict) -> dict:
        model_id, name = body["model_id"], body.get("path") or f"step{int(time.time())}"
        folder = self._folder(model_id, "weights", name)

        def work(model: Model) -> dict:
            model.save(folder, optimizer=True, overwrite=body.get("overwrite", False))
            return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}
        return self._op(model_id, body.get("seq_id"), work)

    def save_for_sampler(self, body: dict) -> dict:
        model_id, name = body["model_id"], body.get("path")
        if body.get("kind", "snapshot") != "snapshot":
            raise UserError(f"sampler kind {body.get('kind')!r}: molt tinker makes frozen snapshots only")
        if name:
            folder = self._folder(model_id, "sampler_weights", name)

            def work(model: Model) -> dict:
                model.save(folder, optimizer=False, overwrite=body.get("overwrite", True))
                return {"path": f"tinker://{model_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
        else:
            sampler_id = f"{model_id}:sample:{body.get('sampling_session_seq_id', 0)}"

            def work(model: Model) -> dict:
                self.samplers[sampler_id] = Sampler(sampler_id, model.snapshot(), model_id)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
        return self._op(model_id, body.get("seq_id"), work)

    def load_weights(self, body: dict) -> dict:
        run, kind, checkpoint = self._path(body["path"])
        with_optimizer = bool(body.get("optimizer"))
        if body.get("model_id"):  # a training client loads into itself, in its seq_id order
            model_id = body["model_id"]

            def work(model: Model) -> dict:
                loaded = Model.load(model_id, self.folder, checkpoint, with_optimizer)
                self.models[model_id].model = loaded
                return {"path": body["path"], "type": "load_weights"}
            return self._op(model_id, body.get("seq_id"), work)
        self._check_base(body.get("base_model"))
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"

        async def create():
            model = await self._build(lambda: Model.load(model_id, self.folder, checkpoint, with_optimizer))
            self._register(model, body["session_id"])
            return {"model_id": model_id, "path": body["path"], "type": "load_weights"}
        return self._spawn(create())

    def training_run(self, run_id: str) -> dict:
        trained = self.models.get(run_id)
        saved = sorted(os.listdir(os.path.join(self.state_dir, "runs", run_id, "weights"))) \
            if os.path.isdir(os.path.join(self.state_dir, "runs", run_id, "weights")) else []
        if trained is None and not saved:
            raise NotFound(f"no training run {run_id!r} here")
        meta = trained.model.meta() if trained else read_meta(os.path.join(self.state_dir, "runs", run_id,
                                                                           "weights", saved[-1]))
        return {"training_run_id": run_id, "base_model": self.folder, "model_owner": "molt",
                "is_lora": meta["rank"] is not None, "lora_rank": meta["rank"], "corrupted": False,
                "last_request_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # ----- sampling -----
    def create_sampling_session(self, body: dict) -> dict:
        sampler_id = f"{body['session_id']}:sampler:{body['sampling_session_seq_id']}"
        path = body.get("model_path")
        if path:
            run, _, checkpoint = self._path(path)
            self.samplers[sampler_id] = Sampler(sampler_id, _read_snapshot(checkpoint), run, path)
        else:
            self._check_base(body.get("base_model") or self.folder)
            self.samplers[sampler_id] = Sampler(sampler_id, None)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(f"no sampler {sampler_id!r} here")
        return {"sampler_id": sampler_id, "base_model": self.folder, "model_path": sampler.path}

    def asample(self, body: dict) -> dict:
        sampler = self.samplers.get(body.get("sampling_session_id"))
        if sampler is None:
            raise NotFound(f"no sampler {body.get('sampling_session_id')!r}: make one with save_weights_for_sampler "
                           "or create_sampling_client (a restarted server keeps only samplers saved by name)")
        for option in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(option):
                raise UserError(f"{option} is not served by molt tinker")
        if body.get("target_prompt_logprobs") is not None:
            raise UserError("target_prompt_logprobs is not served by molt tinker")
        prompt = []
        for chunk in body["prompt"]["chunks"]:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"a {chunk.get('type')} chunk: molt tinker samples from token prompts only")
            prompt += [int(t) for t in chunk["tokens"]]
        if not prompt or min(prompt) < 0 or max(prompt) >= self.config.get_text_config().vocab_size:
            raise UserError("the prompt must hold at least one token id within the model's vocabulary")
        n = int(body.get("num_samples", 1))
        ids = [f"{sampler.sampler_id}:{body.get('seq_id', 0)}:{i}" for i in range(n)]

        async def sample():
            seqs, versions, prompt_lps = await self.pool.sample(sampler, prompt, n, body["sampling_params"],
                                                                bool(body.get("prompt_logprobs")))
            for sid, vers in zip(ids, versions):
                self.versions[sid] = min(vers, default=sampler.version)
                self._samples.write(json.dumps({"sequence_id": sid, "sampler_id": sampler.sampler_id,
                                                "model_id": sampler.model_id, "version": sampler.version,
                                                "versions": vers, "time": time.time()}) + "\n")
            self._samples.flush()
            return wire.sample_response(seqs, prompt_lps)
        return self._spawn(sample(), proto=True, sample_sequence_ids=ids)

    def close(self) -> None:
        self.pool.close()
        self.trainer.shutdown(wait=False, cancel_futures=True)
        self._samples.close()


def _read_snapshot(checkpoint: str) -> Snapshot:
    """A saved checkpoint's weights as a sampler's frozen snapshot (read from disk: it survives restarts)."""
    import torch
    from safetensors.torch import load_file

    from ..policies.lora import Adapter

    meta = read_meta(checkpoint)
    if meta["rank"] is None:
        from ..policies import load_lm

        return Snapshot(load_lm(checkpoint, torch.float32).state_dict(), None, meta["version"])
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        config = json.load(f)
    return Snapshot(load_file(os.path.join(checkpoint, "adapter_model.safetensors")), Adapter(config),
                    meta["version"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="molt tinker", description="Serve the Tinker API for a model folder: the "
                                     "tinker SDK and tinker-cookbook run against it (docs/tinker.md).")
    parser.add_argument("--policy", default="molt_lightning.models.tiny.arithmetic_policy",
                        help="a model folder, or a function returning one (default: the embedded tiny policy)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"),
                        help="the key clients must send (starts with tml-; default: $TINKER_API_KEY, else a new one)")
    parser.add_argument("--state-dir", default="runs/tinker", help="checkpoints and the sample record")
    parser.add_argument("--engines-per-kind", type=int, default=2, help="sampling engines per adapter shape")
    parser.add_argument("--allow-full-weights", action="store_true", help="serve training clients without LoRA")
    args = parser.parse_args(argv)
    key = args.api_key or f"tml-{secrets.token_urlsafe(24)}"
    if not key.startswith("tml-"):
        parser.error(f"--api-key must start with tml- (the SDK refuses other keys), got {key[:8]}...")
    import uvicorn

    from ..trainer.policy import policy_folder

    server = Server(policy_folder(args.policy), key, args.state_dir, args.engines_per_kind, args.allow_full_weights)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    print(f"molt tinker: serving {server.folder} (state in {server.state_dir})\n"
          f"export TINKER_BASE_URL={url}\nexport TINKER_API_KEY={key}", flush=True)
    config = uvicorn.Config(server.app(), log_level="warning", timeout_keep_alive=75)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
