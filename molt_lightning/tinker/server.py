"""``molt tinker``: the Tinker API on your own machine: the official ``tinker`` SDK and tinker-cookbook run as they are.

The routes and bodies are the SDK's (``tinker==0.38.0``: its source is the contract): sessions and heartbeats,
``create_model`` (a LoRA training client), ``get_info``, ``forward_backward`` (forward with ``forward_only``),
``optim_step``, ``save_weights`` / ``load_weights`` (durable state), ``save_weights_for_sampler`` and
``create_sampling_session`` (frozen samplers), ``asample`` (sampling and ``compute_logprobs``), ``retrieve_future``,
``training_runs/{id}``, ``samplers/{id}``, health and capabilities. The full list, what is not served and why:
docs/tinker.md.

Every training call and sample is a future (``futures``: a model's ops run on one training thread in ``seq_id``
order; sampling on the engines' threads, ``sampling``). A request that cannot run as asked is a 400/404 with a
``detail`` or a future's ``user`` error, never a 5xx (the SDK retries those for minutes).

State under ``--state-dir``: ``runs/<model_id>/weights/<name>`` (``save_state``: adapter, optimizer, version),
``runs/<model_id>/sampler_weights/<name>`` (a sampler's frozen weights), and ``samples.jsonl`` (every sampled
sequence: id, sampler, model, the policy version of each token). A restarted server on the same folder loads them.
Written by hand on Starlette: no maintained library serves the Tinker API (the SDK holds only the client side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import socket
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..extras import require

require("tinker", "molt tinker", ("tinker", "peft"))  # before the modules that import them

from . import wire  # noqa: E402
from .futures import Futures, Ordered  # noqa: E402
from .sampling import ENGINES, Pool, Sampler  # noqa: E402
from .training import Model, Snapshot, read_meta  # noqa: E402
from .wire import UserError  # noqa: E402

# the SDK's flags: httpx transport, one forward_backward chunk at a time, plain API keys (no JWT exchange)
CLIENT_CONFIG = {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False, "pjwt_auth_enabled": False}
DYNAMIC_CONFIG = {"refresh_interval_sec": 600}
RUN = r"[A-Za-z0-9_-]+:train:\d+"  # a model id, as the SDK derives it: <session>:train:<n>
PATH = re.compile(rf"^tinker://({RUN})/(weights|sampler_weights)/([A-Za-z0-9._-]+)$")


class NotFound(LookupError):
    pass


class Server:
    def __init__(self, folder: str, api_key: str, state_dir: str, engines_per_kind: int = 2,
                 allow_full_weights: bool = False, device: str = "cpu", engine: str = "torch"):
        from transformers import AutoConfig, AutoTokenizer

        self.folder, self.key, self.state_dir = os.path.abspath(folder), api_key, os.path.abspath(state_dir)
        self.allow_full, self.device = allow_full_weights, device
        self.config = AutoConfig.from_pretrained(self.folder)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.sessions: dict[str, bool] = {}  # id -> finished
        self.models: dict[str, Ordered] = {}
        self.samplers: dict[str, Sampler] = {}
        self.versions: dict[str, int] = {}  # sequence id -> the policy version that sampled it
        self.trainer = ThreadPoolExecutor(1, thread_name_prefix="molt-tinker-train")
        self.futures = Futures(self.trainer)
        self.pool = Pool(self.folder, self.tokenizer, engines_per_kind, device, engine)
        os.makedirs(self.state_dir, exist_ok=True)
        self._samples = open(os.path.join(self.state_dir, "samples.jsonl"), "a")

    # ----- plumbing -----
    def app(self) -> Starlette:
        post = {"client/config": lambda b: CLIENT_CONFIG, "client/dynamic_config": lambda b: DYNAMIC_CONFIG,
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
            except (UserError, KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed body
                what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                return JSONResponse({"detail": f"{request.url.path}: {what}"}, status_code=400)
            except NotFound as e:
                return JSONResponse({"detail": str(e)}, status_code=404)
        return handle

    def _trained(self, model_id: str) -> Ordered:
        if model_id not in self.models:
            raise NotFound(f"no model {model_id!r} on this server (models: {sorted(self.models) or 'none'}; a "
                           "restarted server keeps only saved state: load it with create_training_client_from_state)")
        return self.models[model_id]

    def _register(self, model: Model, session_id: str) -> None:
        self.models[model.model_id] = self.futures.ordered(model, session_id)

    def _op(self, model_id: str, seq_id: int | None, work: Callable[[Model], object], proto: bool = False) -> dict:
        return self.futures.op(self._trained(model_id), seq_id, work, proto)

    async def _build(self, build: Callable[[], Model]) -> Model:
        return await asyncio.get_running_loop().run_in_executor(self.trainer, build)

    # ----- futures -----
    async def retrieve_future(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return await self.futures.retrieve(await request.body())

    # ----- sessions -----
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
                                                    targets, lora and lora.get("seed"), self.device))
            self._register(model, body["session_id"])
            return {"model_id": model_id, "type": "create_model"}
        return self.futures.spawn(create())

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
                loaded = Model.load(model_id, self.folder, checkpoint, with_optimizer, self.device)
                self.models[model_id].model = loaded
                return {"path": body["path"], "type": "load_weights"}
            return self._op(model_id, body.get("seq_id"), work)
        self._check_base(body.get("base_model"))
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"

        async def create():
            model = await self._build(lambda: Model.load(model_id, self.folder, checkpoint, with_optimizer,
                                                         self.device))
            self._register(model, body["session_id"])
            return {"model_id": model_id, "path": body["path"], "type": "load_weights"}
        return self.futures.spawn(create())

    def training_run(self, run_id: str) -> dict:
        weights = os.path.join(self.state_dir, "runs", run_id, "weights")
        trained, saved = self.models.get(run_id), sorted(os.listdir(weights)) if os.path.isdir(weights) else []
        if not re.fullmatch(RUN, run_id) or (trained is None and not saved):
            raise NotFound(f"no training run {run_id!r} here (a run id reads <session>:train:<n>)")
        meta = trained.model.meta() if trained else read_meta(os.path.join(weights, saved[-1]))
        return {"training_run_id": run_id, "base_model": self.folder, "model_owner": "molt",
                "is_lora": meta["rank"] is not None, "lora_rank": meta["rank"], "corrupted": False,
                "last_request_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # ----- sampling -----
    def create_sampling_session(self, body: dict) -> dict:
        sampler_id = f"{body['session_id']}:sampler:{body['sampling_session_seq_id']}"
        path = body.get("model_path")
        if path:
            run, _, checkpoint = self._path(path)
            self.samplers[sampler_id] = Sampler(sampler_id, Snapshot.read(checkpoint), run, path)
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
        # the sampler is frozen: its version is every token's, known now; the id carries it (the SDK's only room)
        ids = [f"{sampler.sampler_id}:{body.get('seq_id', 0)}:{i}:v{sampler.version}" for i in range(n)]

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
        return self.futures.spawn(sample(), proto=True, sample_sequence_ids=ids)

    def close(self) -> None:
        self.pool.close()
        self.trainer.shutdown(wait=False, cancel_futures=True)
        self._samples.close()


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
    parser.add_argument("--engine", choices=ENGINES, default="torch", help="what samples: molt's torch engine or vLLM")
    parser.add_argument("--engines-per-kind", type=int, default=2, help="sampling engines per adapter shape")
    parser.add_argument("--allow-full-weights", action="store_true", help="serve training clients without LoRA")
    parser.add_argument("--device", default="cpu", help="where the trained model and the engines run (cuda: a GPU)")
    args = parser.parse_args(argv)
    key = args.api_key or f"tml-{secrets.token_urlsafe(24)}"
    if not key.startswith("tml-"):
        parser.error(f"--api-key must start with tml- (the SDK refuses other keys), got {key[:8]}...")
    import uvicorn

    from ..trainer.policy import policy_folder

    server = Server(policy_folder(args.policy), key, args.state_dir, args.engines_per_kind, args.allow_full_weights,
                    args.device, args.engine)
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
