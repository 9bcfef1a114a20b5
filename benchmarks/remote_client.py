"""The remote engine's HTTP client: CPU milliseconds per request in the trainer's process, old client vs new.

``RemoteVLLMEngine.generate`` (the rollout loop's code path: ``engine.launch`` starts the engine's loop thread,
``engine.call`` runs a batch on it) against a fake ``molt serve`` in a separate process (uvicorn + Starlette on
127.0.0.1, so its CPU is not counted): ``/inference/v1/generate`` answers after ``--delay-ms`` (the generation time a
real server takes, so requests really are in flight together) with vLLM's answer shape (``--max-tokens`` token ids,
a logprob entry per token, the weight-version span). Per client and number in flight (each in flight slot sends its
next request as soon as the previous one returns), ``max(64, 8 x in flight)`` requests; CPU is this process's
``time.process_time()`` (every thread) over the batch, divided by the requests; wall is the batch's wall time per
request. Clients: ``httpx (old)``, the httpx client ``RemoteVLLMEngine`` used before (``max_connections=None``),
rebuilt here, and ``aiohttp (new)``, the engine as it is. Rounds alternate between the clients; the table gives the
median round and the CPU ratio to the old client. ``--molt`` uses a real ``molt serve`` on the tiny arithmetic
policy instead of the fake server (its generation time replaces ``--delay-ms``).

    python benchmarks/remote_client.py [--rounds 3] [--in-flight 1,16,64] [--delay-ms 50] [--max-tokens 32] [--molt]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import httpx

from molt_lightning.engines import EngineUnavailable, RemoteVLLMEngine, Sampling

SERVER = r'''
import asyncio, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

delay = float(sys.argv[2])

async def ok(request):
    return JSONResponse({"success": True})

async def rpc(request):
    await request.body()
    return JSONResponse({"results": [291]})

async def generate(request):
    body = await request.json()
    n = body["sampling_params"]["max_tokens"]
    await asyncio.sleep(delay)
    ids = [(7 * i + len(body["token_ids"])) % 291 for i in range(n)]
    content = [{"token": f"token_id:{t}", "logprob": -0.25 - t / 1000, "bytes": None, "top_logprobs": []} for t in ids]
    return JSONResponse({"id": body["request_id"], "object": "generate", "choices": [{
        "index": 0, "token_ids": ids, "finish_reason": "length", "logprobs": {"content": content},
        "weight_versions": [{"version": "0", "start": 0, "end": n}]}]})

routes = [Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/update_weight_version")]
routes += [Route("/collective_rpc", rpc, methods=["POST"]), Route("/inference/v1/generate", generate, methods=["POST"])]
uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=int(sys.argv[1]), log_level="error", access_log=False)
'''


class _Client(httpx.AsyncClient):
    async def close(self) -> None:
        await self.aclose()


class HttpxEngine(RemoteVLLMEngine):
    """The engine with the httpx client it had before aiohttp (its client construction and ``_call``, unchanged)."""

    def _connect(self):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return _Client(base_url=self.url, headers=headers, limits=httpx.Limits(max_connections=None),
                       timeout=httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s))

    async def _call(self, verb: str, path: str, *, timeout: float | None = None, mark_down: bool = False,
                    **kw) -> dict:
        if self._http is None:
            raise EngineUnavailable(f"the engine at {self.url} is not started")
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=self.connect_timeout_s)
        try:
            r = await self._http.request(verb, path, **kw)
        except httpx.TimeoutException as e:
            err = f"{verb} {self.url}{path} timed out ({type(e).__name__})"
        except httpx.TransportError as e:
            err = f"{verb} {self.url}{path} failed: {type(e).__name__}: {e}"
        else:
            if r.status_code < 400:
                return r.json() if r.content else {}
            if r.status_code in (401, 403):
                raise PermissionError(f"{verb} {self.url}{path} was refused ({r.status_code}: {r.text[:200]})")
            if r.status_code < 500:
                raise RuntimeError(f"{verb} {self.url}{path} answered {r.status_code}: {r.text[:500]}")
            err = f"{verb} {self.url}{path} answered {r.status_code}: {r.text[:300]}"
        if mark_down:
            self.mark_down(err)
        raise EngineUnavailable(err)


CLIENTS = {"httpx (old)": HttpxEngine, "aiohttp (new)": RemoteVLLMEngine}


def batch(engine: RemoteVLLMEngine, in_flight: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per request for ``requests`` generations, ``in_flight`` at a time."""
    sampling = Sampling(max_tokens=max_tokens, ignore_eos=True)

    async def run():
        todo = iter(range(requests))

        async def slot():
            for i in todo:
                out = await engine.generate([1, 2, 3 + i % 50], sampling)
                assert len(out.token_ids) == max_tokens

        await asyncio.gather(*[slot() for _ in range(in_flight)])

    cpu, wall = time.process_time(), time.perf_counter()
    engine.call(run())
    return 1000 * (time.process_time() - cpu) / requests, 1000 * (time.perf_counter() - wall) / requests


def fake_server(delay_ms: float) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(delay_ms / 1000)])
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            return url, proc
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start") from None
            time.sleep(0.05)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", default="1,16,64")
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--molt", action="store_true", help="a real `molt serve` on the tiny policy")
    args = ap.parse_args(argv)
    if args.molt:
        from molt_lightning.engines.vllm.server import LocalServer
        from molt_lightning.models.tiny import arithmetic_policy

        server = LocalServer(str(arithmetic_policy()), cpu_threads="1")
        server.wait_ready(900)
        url, stop = server.url, server.stop
    else:
        url, proc = fake_server(args.delay_ms)
        stop = proc.terminate
    engines = {name: cls(url=url, health_interval_s=3600) for name, cls in CLIENTS.items()}
    try:
        for engine in engines.values():
            engine.launch("unused")
        rows = []
        for in_flight in [int(c) for c in args.in_flight.split(",")]:
            requests = max(64, 8 * in_flight)
            seen = {name: [] for name in engines}
            for _ in range(args.rounds + 1):  # the first round warms the connections up and is dropped
                for name, engine in engines.items():
                    seen[name].append(batch(engine, in_flight, requests, args.max_tokens))
            for name in engines:
                cpu = statistics.median(c for c, _ in seen[name][1:])
                wall = statistics.median(w for _, w in seen[name][1:])
                rows.append((in_flight, requests, name, cpu, wall))
    finally:
        for engine in engines.values():
            if engine.loop is not None:
                engine.release()
        stop()
    base = {r[0]: r[3] for r in rows if r[2] == "httpx (old)"}
    print(f"server: {'molt serve, tiny policy' if args.molt else f'fake, {args.delay_ms:g} ms per generation'}; "
          f"{args.max_tokens} tokens per request; median of {args.rounds} rounds")
    print("| in flight | requests | client | CPU ms/request | wall ms/request | CPU vs httpx |")
    print("|---|---|---|---|---|---|")
    for in_flight, requests, name, cpu, wall in rows:
        print(f"| {in_flight} | {requests} | {name} | {cpu:.2f} | {wall:.2f} | {cpu / base[in_flight]:.3f} |")


if __name__ == "__main__":
    main()
