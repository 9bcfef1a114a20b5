"""Waiting for requests to be in flight, on the event the test needs and never for a duration: ``decoding`` (torch
engines: decode steps counted by a forward hook), ``started_together`` and ``held`` (vLLM-backed engines: requests
queued while the engine is paused, counted by vLLM itself)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from contextlib import contextmanager


@contextmanager
def decoding(engine, steps: int):
    """An event set once every torch engine among ``engine``'s members has run ``steps`` forward passes (a prefill,
    then decode steps) since the block began."""
    members, seen, done = engine.members, Counter(), threading.Event()

    def hook(member):
        def count(*_):
            seen[member] += 1
            if all(seen[m] >= steps for m in range(len(members))):
                done.set()
        return count

    handles = [e.model.register_forward_hook(hook(i)) for i, e in enumerate(members)]
    try:
        yield done
    finally:
        for h in handles:
            h.remove()


async def started_together(engine, requests: list) -> list[asyncio.Future]:
    """Send ``requests`` (coroutines) to a vLLM-backed engine while it is paused (vLLM queues them), wait until it
    holds them all, then resume it: they start together, first come first served, however slow the client is."""
    await engine.pause()
    try:
        tasks = [asyncio.ensure_future(r) for r in requests]
        deadline = asyncio.get_running_loop().time() + 120
        while (n := await held(engine)) < len(tasks):
            assert asyncio.get_running_loop().time() < deadline, f"vLLM holds {n} of {len(tasks)} requests after 120 s"
            await asyncio.sleep(0.01)
    finally:
        await engine.resume()
    return tasks


async def held(engine) -> int:
    """The generate requests vLLM holds, summed over the engine's members: a server's ``/load`` (``molt serve``
    tracks it), the in-process engine's unfinished requests."""
    total = 0
    for e in engine.members:
        if hasattr(e, "url"):
            total += (await e._call("GET", "/load"))["server_load"]
        else:
            total += e.llm.output_processor.get_num_unfinished_requests()
    return total
