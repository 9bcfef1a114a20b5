"""The Tinker SDK's futures: every training call and sample answers ``{request_id}`` at once, the result comes later.

``Futures.spawn`` resolves a future by a coroutine (model creation, a sample); ``Futures.op`` queues work on a
model that runs on the one training thread in the order of the ops' ``seq_id`` (the SDK pipelines them: it submits
the next before the last has finished, and may resend one after a timeout: the same ``seq_id`` gets the same future).
``Futures.retrieve`` answers the SDK's poll: it holds the poll up to ``POLL_S`` for the result (the SDK re-polls a
``try_again`` at once, so an immediate answer would spin), then answers the result (protobuf for samples and
forward_backward), ``{"error", "category"}`` (``user`` for a request that cannot run as asked: the client raises
``RequestFailedError`` and keeps working; ``server`` for a fault, logged with its traceback), or ``try_again``. An
unknown id is a 410 (a sampling client submits again; a training client fails with the message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from .wire import UserError

log = logging.getLogger("molt.tinker")
POLL_S = 20.0  # the SDK's poll times out after 45 s
KEEP_S = 600.0  # a finished future's result is kept this long
SEEN = 64  # a model's last ops remembered for resends


@dataclass
class Pending:
    proto: bool  # its result goes back as protobuf
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: object = None
    error: BaseException | None = None
    at: float = 0.0


@dataclass
class Ordered:
    """A model and the queue of its ops, run in ``seq_id`` order from 1 (the SDK numbers each client's ops so)."""

    model: object
    session_id: str
    next_seq: int = 1
    ops: dict[int, tuple[Callable, str]] = field(default_factory=dict)  # seq_id -> (work, request id)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id: a resent op is not run twice
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task | None = None


class Futures:
    def __init__(self, trainer: Executor):
        self.trainer = trainer
        self.pending: dict[str, Pending] = {}

    def new(self, proto: bool = False, **extra) -> tuple[str, Pending, dict]:
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.done.is_set() and now - p.at > KEEP_S]:
            del self.pending[rid]
        rid = uuid.uuid4().hex
        self.pending[rid] = pending = Pending(proto)
        return rid, pending, {"request_id": rid, **extra}

    @staticmethod
    def finish(pending: Pending, result=None, error: BaseException | None = None) -> None:
        if error is not None and not isinstance(error, UserError):
            log.error("molt tinker: a request failed", exc_info=error)
        pending.result, pending.error, pending.at = result, error, time.monotonic()
        pending.done.set()

    def spawn(self, work, proto: bool = False, **extra) -> dict:
        """A future resolved by the coroutine ``work``."""
        rid, pending, answer = self.new(proto, **extra)

        async def run():
            try:
                self.finish(pending, await work)
            except Exception as e:
                self.finish(pending, error=e)
        asyncio.get_running_loop().create_task(run())
        return answer

    def ordered(self, model, session_id: str) -> Ordered:
        queue = Ordered(model, session_id)
        queue.runner = asyncio.get_running_loop().create_task(self._run(queue))
        return queue

    def op(self, queue: Ordered, seq_id: int | None, work: Callable, proto: bool = False) -> dict:
        """A future resolved by ``work(queue.model)`` on the training thread, in ``seq_id`` order."""
        seq = queue.next_seq + len(queue.ops) if seq_id is None else int(seq_id)
        if seq in queue.seen:  # the SDK resent it (a timeout on its side): the same future
            return {"request_id": queue.seen[seq]}
        if seq < queue.next_seq:
            raise UserError(f"seq_id {seq} is behind this model's next one ({queue.next_seq})")
        rid, _, answer = self.new(proto)
        queue.seen[seq] = rid
        queue.ops[seq] = (work, rid)
        queue.wake.set()
        return answer

    async def _run(self, queue: Ordered) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while queue.next_seq not in queue.ops:
                queue.wake.clear()
                await queue.wake.wait()
            work, rid = queue.ops.pop(queue.next_seq)
            queue.seen.pop(queue.next_seq - SEEN, None)
            queue.next_seq += 1
            try:
                self.finish(self.pending[rid], await loop.run_in_executor(self.trainer, work, queue.model))
            except Exception as e:
                self.finish(self.pending[rid], error=e)

    async def retrieve(self, body: bytes) -> Response:
        """The answer to a poll, whose body is ``{"request_id": ...}``."""
        try:
            rid = json.loads(body or b"{}").get("request_id")
        except (ValueError, AttributeError):
            return JSONResponse({"detail": 'retrieve_future takes {"request_id": ...}'}, status_code=400)
        pending = self.pending.get(rid)
        if pending is None:
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
