"""The remote engine's HTTP client (aiohttp) against a loopback server: every outcome of a call (the bearer token
sent, 401/403, another 4xx, a 5xx with and without marking the engine down, a per-call timeout, a refused
connection, a server that is not there at launch) and 64 generations in flight at once, all answered."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from pathlib import Path

import pytest
from starlette.responses import JSONResponse, PlainTextResponse

from molt_lightning.engines import EngineUnavailable, RemoteVLLMEngine, Sampling

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from loopback import Loopback, rpc_results  # noqa: E402

IDS = [16, 17, 2]


def generation(body: dict, version: str = "0") -> dict:
    """A `/inference/v1/generate` answer of vLLM's shape: the prompt's last id, then IDS."""
    ids = [body["token_ids"][-1], *IDS]
    return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5 - t / 100,
                                                   "bytes": None, "top_logprobs": []} for t in ids]},
                         "weight_versions": [{"version": version, "start": 0, "end": len(ids)}]}]}


class Scripted:
    """The routes ``open`` calls, then ``answers[path]`` (status, body) for the others; records each request's path
    and Authorization header. ``/slow`` answers once ``release`` is set."""

    def __init__(self):
        self.answers, self.seen, self.release = {}, [], threading.Event()

    async def handle(self, request):
        path = request.url.path
        self.seen.append((path, request.headers.get("authorization")))
        if path == "/slow":
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if path in self.answers:
            status, text = self.answers[path]
            return PlainTextResponse(text, status_code=status)
        if path == "/collective_rpc":
            return JSONResponse(rpc_results(json.loads(await request.body())))
        if path == "/inference/v1/generate":
            return JSONResponse(generation(json.loads(await request.body())))
        return JSONResponse({"success": True})


@pytest.fixture
def scripted():
    server = Scripted()
    with Loopback(server.handle) as http:
        server.url = http.url
        yield server
        server.release.set()


def test_each_outcome_of_a_call(scripted):
    engine = RemoteVLLMEngine(url=scripted.url, api_key="s3cret", health_interval_s=3600)
    engine.launch("unused")
    try:
        assert engine.vocab_size == 291 and engine.channel == "shm"
        assert {auth for _, auth in scripted.seen} == {"Bearer s3cret"}
        out = engine.call(engine.generate([5, 9], Sampling(max_tokens=4)))
        assert out.token_ids == [9, *IDS] and out.versions == [0] * 4 and out.finish_reason == "stop"
        assert out.logprobs == pytest.approx([-0.59, -0.66, -0.67, -0.52])

        for status in (401, 403):
            scripted.answers["/pause"] = (status, "no token")
            with pytest.raises(PermissionError, match=rf"POST {scripted.url}/pause was refused \({status}: no token"
                                                      r"\): pass the server's token \(api_key"):
                engine.call(engine.pause())
        scripted.answers["/resume"] = (404, "no such route")
        with pytest.raises(RuntimeError, match="answered 404: no such route") as e:
            engine.call(engine.resume())
        assert not isinstance(e.value, EngineUnavailable)
        scripted.answers["/resume"] = (503, "busy")
        with pytest.raises(EngineUnavailable, match=f"POST {scripted.url}/resume answered 503: busy"):
            engine.call(engine.resume())
        assert engine.healthy  # no mark_down asked
        with pytest.raises(EngineUnavailable, match=r"GET .*/slow timed out \(\w+"):
            engine.call(engine._call("GET", "/slow", timeout=0.5))
        scripted.release.set()
        scripted.answers["/inference/v1/generate"] = (500, "engine dead")
        with pytest.raises(EngineUnavailable, match="answered 500: engine dead"):
            engine.call(engine.generate([5], Sampling(max_tokens=4)))
        assert not engine.healthy  # a failed generation marks the engine down
    finally:
        engine.release()
    with pytest.raises(EngineUnavailable, match="is not started"):
        asyncio.run(engine._call("GET", "/health"))


def test_a_server_that_is_not_there_fails_the_launch_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends: connections are refused
    engine = RemoteVLLMEngine(url=url)
    with pytest.raises(EngineUnavailable, match=rf"GET {url}/health failed: \w+.*Is `molt serve --policy unused` "
                                                "running there"):
        engine.launch("unused")
    assert engine._http is None  # closed after the failed open


def test_64_generations_in_flight_at_once_are_all_answered():
    """The server holds every generation until all 64 have arrived (each on its own connection), then answers
    them: none waits behind another in the client."""
    n, arrived, held = 64, [], {}

    async def handle(request):
        if request.url.path != "/inference/v1/generate":
            if request.url.path == "/collective_rpc":
                return JSONResponse(rpc_results(json.loads(await request.body())))
            return JSONResponse({"success": True})
        body = json.loads(await request.body())
        all_in = held.setdefault("event", asyncio.Event())
        arrived.append(body["token_ids"][-1])
        if len(arrived) == n:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), 120)
        except asyncio.TimeoutError:
            return PlainTextResponse(f"only {len(arrived)} requests arrived", status_code=500)
        return JSONResponse(generation(body, version="0"))

    with Loopback(handle) as http:
        engine = RemoteVLLMEngine(url=http.url, health_interval_s=3600, request_timeout_s=300)
        engine.launch("unused")
        try:
            async def all_at_once():
                return await asyncio.gather(*[engine.generate([1, 100 + i], Sampling(max_tokens=4)) for i in range(n)])

            outs = engine.call(all_at_once(), timeout=300)
        finally:
            engine.release()
    assert sorted(arrived) == [100 + i for i in range(n)]
    assert [o.token_ids for o in outs] == [[100 + i, *IDS] for i in range(n)]
    assert all(o.versions == [0] * 4 and len(o.logprobs) == 4 for o in outs)
