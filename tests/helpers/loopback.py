"""Loopback for tests: an HTTP server for client tests, and a port no sandbox may reach (``unreached_port``). The
server: one async handler answers every request (uvicorn in a thread, on a free 127.0.0.1 port); ``url`` while it
runs, ``stop`` to end it. The remote engine's tests used ``httpx.MockTransport`` before its client became aiohttp;
this serves the same handlers over a real socket."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest


@contextmanager
def unreached_port():
    """A port listening on 127.0.0.1 (loopback only, never any other address) for a sandbox's no-network test to try;
    on leaving, that nobody came through."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        yield listener.getsockname()[1]
        with pytest.raises(BlockingIOError):
            listener.accept()


class Loopback:
    """``handler(request)``: a Starlette ``Request`` in, a Starlette ``Response`` out, for any path and method."""

    def __init__(self, handler):
        import uvicorn
        from starlette.requests import Request

        async def app(scope, receive, send):
            await (await handler(Request(scope, receive)))(scope, receive, send)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:  # uvicorn's flag (it has no event); a server that died ends the wait
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the loopback server on {self.url} did not start")
            time.sleep(0.005)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def rpc_results(body: dict, vocab_size: int = 291, seed: int = 7) -> dict:
    """A fake server's ``/collective_rpc`` answer to a ``MoltWorkerExtension`` method, shaped as the real worker's:
    ``molt_sampler`` gives the engine's seed and no per-request seeds (the CPU platform), every other method
    ``vocab_size`` (the vocabulary's size, and a true ``molt_open``)."""
    if body.get("method") == "molt_sampler":
        return {"results": [{"seed": seed, "request_seeds": False}]}
    return {"results": [vocab_size]}
