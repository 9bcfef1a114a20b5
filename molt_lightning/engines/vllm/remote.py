"""The rollout-engine protocol over one vLLM OpenAI-compatible server (``molt serve``), through an async HTTP client.

Token ids in, token ids out: ``POST /inference/v1/generate`` (vLLM's token-in/token-out route, ``--enable-scale-out``)
returns the sampled ids, each one's logprob (the server runs ``--logprobs-mode processed_logprobs``: after
temperature, as ``VLLMEngine``) and vLLM's own per-token weight-version spans. A weight update runs the phases that
both vLLM engines share (``phases``) over HTTP: ``/pause?mode=keep`` (requests in flight freeze), load
(``/collective_rpc`` into ``MoltWorkerExtension``), tag (``/reset_prefix_cache?reset_running_requests=true``:
requests in flight are preempted and their KV recomputed under the new weights; then ``/update_weight_version``),
``/resume``. The spans
are cut by the engine core between scheduler steps, so a token tagged v was sampled by weights v from a KV cache
computed by weights v: the same guarantee as in-process, read from the same field.

Weights travel over a named channel:
- ``shm``: the buckets are copied into shared-memory slabs under ``weight_dir`` (``/dev/shm``, ``engines.shm``; two
  per bucket, used in turn, so the slab of the version a server serves stays intact for a server that restarts),
  their paths and indexes posted; the server's worker maps them and loads straight into its layers
  (``molt_load_slabs``, as in process; on the CPU platform with the kernels packed ahead). Same machine only (or a
  shared memory filesystem).
- ``http``: the safetensors bytes travel in the request body, base64 in the JSON ``collective_rpc`` args (vLLM's
  only route that reaches the worker with data; its weight routes take NCCL/IPC handles, not bytes).
  ``molt_load_weights_bytes`` decodes them. Cost: base64's extra third, a JSON parse in the API server and a msgpack
  copy to the engine core and its worker (measured by ``benchmarks/remote_sync.py``).
- ``nccl`` (GPUs, across machines; the server runs ``molt serve --nccl``): the tensors are broadcast over an NCCL
  group of the trainer (rank 0) and the server's workers, through vLLM's weight-transfer routes
  (``/init_weight_transfer_engine`` once, then ``/start_weight_update``, ``/update_weights`` per bucket,
  ``/finish_weight_update``) and vLLM's own trainer-side helpers: ``nccl``. Untested on GPUs here.

Failures: every call has a timeout. A request that fails (connection refused or dropped, timeout, a 5xx, an aborted
request) raises ``EngineUnavailable``: the agent's trajectory fails with that reason and is counted by the rollout
source; a partial generation is never returned. A failed request or health check marks the engine down
(``RolloutEngine.mark_down``); a health task then polls ``/health`` and, when the server answers again (restarted or
back), loads it the last update's weights and version (the same ``update`` sequence, ``rejoin``) before it serves
again. ``check`` (called by the rollout source while it waits) raises once the engine has been down longer than
``down_timeout_s``, so a run whose server is gone fails with a message instead of waiting. With ``url=None`` the
engine starts its own loopback server (``server.LocalServer``) and stops it.

Seeds: a server this engine starts gets ``seed`` (None: the run's, ``RolloutEngine.seed_from``) as ``--seed``; a
running server keeps the one it was started with (``molt serve --seed``), which the engine reads at open. Requests
carry ``Sampling.seed`` where the server's platform takes it (not on the CPU: ``phases``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import Mapping
from urllib.parse import urlparse

import torch

from ..base import EngineUnavailable, Generation, Sampling, update
from . import nccl as nccl_channel
from .phases import Payload, VLLMPhases

log = logging.getLogger(__name__)
CHANNELS = ("auto", "shm", "http", "nccl")


class RemoteVLLMEngine(VLLMPhases):
    def __init__(
        self,
        url: str | None = None,
        channel: str = "auto",
        api_key: str | None = None,
        request_timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        weight_timeout_s: float = 300.0,
        health_interval_s: float = 2.0,
        down_timeout_s: float = 60.0,
        weight_dir: str = "/dev/shm",
        cpu_threads: str | None = None,
        start_timeout_s: float = 300.0,
        server_args: list[str] | None = None,
        nccl_master_port: int = 29600,
        nccl_master_address: str | None = None,
        load_ahead: bool = True,
        direct_load: bool = True,
        seed: int | None = None,
    ):
        """``url``: the server (``http://127.0.0.1:8000``); ``None`` starts one on a free loopback port (with
        ``cpu_threads``, ``server_args`` for vLLM, ``start_timeout_s``). ``api_key`` (default: ``$MOLT_API_KEY``)
        is sent as a bearer token. ``channel``: ``shm``, ``http``, ``nccl`` or ``auto`` (``shm`` for a loopback
        server). ``nccl``: the trainer hosts the group's rendezvous on ``nccl_master_address`` (default: this
        machine's address toward the server) and ``nccl_master_port``, which the server must reach. ``direct_load`` and
        ``load_ahead`` (shm, a CPU server): as ``VLLMEngine``'s."""
        super().__init__(weight_dir, copies=2, down_timeout_s=down_timeout_s)  # one served, one being staged
        if channel not in CHANNELS:
            raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
        self.url = url.rstrip("/") if url else None
        self.channel, self.api_key = channel, api_key if api_key is not None else os.environ.get("MOLT_API_KEY")
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.weight_timeout_s, self.health_interval_s = weight_timeout_s, health_interval_s
        self.direct_load, self.load_ahead = direct_load, load_ahead
        self.cpu_threads, self.start_timeout_s, self.server_args = cpu_threads, start_timeout_s, server_args or []
        self.nccl_master_port, self.nccl_master_address = nccl_master_port, nccl_master_address
        self.server, self.seed = None, seed  # the LocalServer this engine started, if any
        self._http = None  # the aiohttp.ClientSession, while open
        self._nccl = None  # the NcclChannel, channel nccl
        self._current: list[Payload] = []  # the last update's buckets: a server that comes back gets them
        self._health: asyncio.Task | None = None

    # ----- lifecycle -----
    async def open(self, model_path: str) -> None:
        if self.channel == "nccl":
            nccl_channel.require_cuda()
        if self.url is None:
            from .server import LocalServer

            extra = self.server_args + (nccl_channel.SERVER_ARGS if self.channel == "nccl" else [])
            self.server = LocalServer(model_path, cpu_threads=self.cpu_threads, extra_args=extra, seed=self.seed)
            self.url = self.server.url
            await asyncio.to_thread(self.server.wait_ready, self.start_timeout_s)
        self.where = f"at {self.url}"
        if self.channel == "auto":
            self.channel = "shm" if urlparse(self.url).hostname in ("127.0.0.1", "localhost", "::1") else "http"
        self._http = self._connect()
        if self.channel == "nccl":
            self._nccl = nccl_channel.NcclChannel(self._call, self.url, self.nccl_master_port,
                                                  self.nccl_master_address, timeout_s=self.weight_timeout_s)
        try:
            await self._call("GET", "/health", timeout=self.connect_timeout_s + 5)
            self.vocab_size = int((await self._rpc("molt_vocab_size", timeout=30))[0])
            await self._set_version(self.version)
            await self._open(timeout=30)
            await self._open_sampler(timeout=30)
        except EngineUnavailable as e:
            await self.close()
            raise EngineUnavailable(f"{e}. Is `molt serve --policy {model_path}` running there (and reachable, with "
                                    "the same --api-key)?") from None
        self._health = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            self._health = None
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()
        self.staging.close()
        self._current, self._staged = [], []
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server, self.url = None, None

    async def wait_healthy(self) -> None:
        """Return once the engine serves; raise ``EngineUnavailable`` once it has been down ``down_timeout_s``."""
        while not self.healthy:
            self.check()
            await asyncio.sleep(min(0.2, self.health_interval_s))

    async def _pause(self) -> None:
        await self._post("/pause", params={"mode": "keep", "clear_cache": "false"})

    async def resume(self) -> None:
        await self._post("/resume")

    # ----- generation -----
    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        out = (await self._request("molt", prompt_ids, self._sample_params(sampling)))["choices"][0]
        ids = list(out["token_ids"])
        if out["finish_reason"] not in ("stop", "length"):
            raise EngineUnavailable(f"the engine at {self.url} ended a request with {out['finish_reason']!r} "
                                    f"after {len(ids)} tokens; its partial output is dropped")
        logprobs = [float(c["logprob"]) for c in out["logprobs"]["content"]]
        versions = [-1] * len(ids)
        for span in out.get("weight_versions") or []:
            versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
        if -1 in versions or len(logprobs) != len(ids):
            raise RuntimeError(f"the engine at {self.url} returned tokens without a weight version or a logprob: "
                               "start it with `molt serve` (processed logprobs, weight versions set)")
        return Generation(ids, logprobs, versions, out["finish_reason"])

    async def _score(self, token_ids: list[int], start: int, temperature: float) -> list[float]:
        """The prompt logprobs of one request on the generate route (``phases``: temperature 1.0 only); the
        response's ``prompt_logprobs`` is vLLM's list, one ``{token id: {"logprob": ...}}`` per position."""
        params = self._score_params(temperature)
        out = await self._request("molt-score", token_ids, params)
        return self._scores(out.get("prompt_logprobs"), token_ids, start)

    async def _request(self, kind: str, token_ids: list[int], params: dict) -> dict:
        """One request on vLLM's token-in/token-out route, once the engine serves (a failure marks it down)."""
        await self.wait_healthy()
        body = {"request_id": f"{kind}-{next(self._ids)}", "token_ids": token_ids, "stream": False,
                "sampling_params": params}
        return await self._post("/inference/v1/generate", json=body, mark_down=True)

    # ----- the transport of the weight phases (``phases``), and the channels -----
    async def _open(self, timeout: float | None = None) -> None:
        if self.channel in ("shm", "http"):  # the loads the worker extension makes (nccl: vLLM's own routes)
            await self._open_weights(self.direct_load, self.load_ahead and self.channel == "shm", timeout)

    async def _reset_cache(self) -> None:
        reset = await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not reset.get("success"):
            raise RuntimeError(f"the engine at {self.url} could not reset its prefix cache after a weight load: "
                               "tokens would be sampled from KV of the old weights")

    async def _set_version(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)})

    async def load(self) -> None:
        """Load the staged buckets (a new update: they become what a returning server gets), or, with none staged
        (a server that comes back), the current ones."""
        fresh = bool(self._staged)
        self._adopt()
        await self._deliver(self._current, self.ahead.token if fresh and self.ahead is not None else None)

    def defer(self, version: int) -> None:
        self._adopt()  # down: a server that comes back loads this update before it serves (``_rejoin``)
        self.version = version

    def _adopt(self) -> None:
        if self._staged:
            self._current, self._staged = self._staged, []

    async def _deliver(self, payloads: list[Payload], token: str | None) -> None:
        await super()._deliver(payloads, token)  # the shm channel's slabs
        if items := [data for kind, data in payloads if kind == "http"]:
            await self._rpc("molt_load_weights_bytes", items)
        if items := [data for kind, data in payloads if kind == "nccl"]:
            await self._nccl.load(items)

    def _payload(self, state: Mapping[str, torch.Tensor]) -> Payload:
        from safetensors.torch import save

        if self.channel == "nccl":  # a copy: the trainer's tensors change after the commit, the bucket must not
            return "nccl", {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        if self.channel == "http":
            return "http", base64.b64encode(save({k: v.detach().to("cpu").contiguous()
                                                  for k, v in state.items()})).decode("ascii")
        return super()._payload(state)

    # ----- health -----
    async def _watch(self) -> None:
        """Poll ``/health``; mark the engine down on a failure and bring it back (current weights first) after."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self._call("GET", "/health", timeout=self.connect_timeout_s + 5)
            except EngineUnavailable as e:
                self.mark_down(str(e))
                continue
            if not self.healthy:
                await self._rejoin()

    async def _rejoin(self) -> None:
        log.warning("the engine at %s answers again: loading version %d before it serves", self.url, self.version)
        if self._nccl is not None:
            self._nccl.reset()  # the server may have restarted: it joins a new group
        try:
            await self._open()  # a restarted server is asked again
            if await update([self], self.version, rejoin=True, expected=self.expected):
                self._down_since = None  # up: it serves again
                log.warning("the engine at %s serves again (version %d)", self.url, self.version)
        except RuntimeError as e:  # e.g. its prefix cache did not reset: it stays down, and is tried again
            self.mark_down(f"could not reload its weights: {e}")

    # ----- HTTP -----
    async def _rpc(self, method: str, *args, timeout: float | None = None) -> list:
        timeout = timeout or self.weight_timeout_s
        body = {"method": method, "args": list(args), "timeout": timeout}
        return (await self._post("/collective_rpc", json=body, timeout=timeout))["results"]

    async def _post(self, path: str, **kw) -> dict:
        return await self._call("POST", path, **kw)

    def _connect(self):
        """The HTTP client: aiohttp, one keep-alive connection per request in flight, no pool limit. Not httpx: its
        connection pool's bookkeeping costs the loop far more CPU per request once dozens are in flight
        (``benchmarks/remote_client.py``, docs/engines.md)."""
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # idle connections close after 4 s, before vLLM's server drops them (5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a
        # request never goes out on a connection the server is closing
        return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                                     timeout=self._timeout(self.request_timeout_s))

    def _timeout(self, seconds: float):
        """``seconds`` for the connection and for each wait on the response (as httpx's read timeout)."""
        import aiohttp

        return aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=seconds)

    async def _call(self, verb: str, path: str, *, timeout: float | None = None, mark_down: bool = False,
                    **kw) -> dict:
        """``kw``: ``json`` and ``params``. Raises ``EngineUnavailable`` on a timeout, a transport error or a 5xx (and
        marks the engine down with ``mark_down``), ``PermissionError`` on 401/403, ``RuntimeError`` on another 4xx."""
        import aiohttp

        if self._http is None:
            raise EngineUnavailable(f"the engine at {self.url} is not started")
        if timeout is not None:
            kw["timeout"] = self._timeout(timeout)
        try:
            async with self._http.request(verb, f"{self.url}{path}", **kw) as r:
                status, body = r.status, await r.read()
        except asyncio.TimeoutError as e:  # aiohttp's timeouts (its ServerTimeoutError among them)
            err = f"{verb} {self.url}{path} timed out ({type(e).__name__})"
        except (aiohttp.ClientError, OSError) as e:
            err = f"{verb} {self.url}{path} failed: {type(e).__name__}: {e}"
        else:
            if status < 400:
                return json.loads(body) if body else {}
            text = body.decode("utf-8", "replace")
            if status in (401, 403):
                raise PermissionError(f"{verb} {self.url}{path} was refused ({status}: {text[:200]}): pass "
                                      "the server's token (api_key, or $MOLT_API_KEY)")
            if status < 500:
                raise RuntimeError(f"{verb} {self.url}{path} answered {status}: {text[:500]}")
            err = f"{verb} {self.url}{path} answered {status}: {text[:300]}"
        if mark_down:
            self.mark_down(err)
        raise EngineUnavailable(err)
