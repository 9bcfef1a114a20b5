"""Waiting for requests to be in flight, on the event the test needs and never for a duration: ``decoding`` (torch
engines: decode steps counted by a forward hook), ``generating`` and ``held`` (vLLM-backed engines: requests queued
while the engine is paused, counted by vLLM itself, then a short request behind them), ``in_flight`` (either, by the
engine's kind), ``delivered`` (every request the engine finished has reached its caller)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from contextlib import contextmanager

from molt_lightning.engines import Sampling


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


async def generating(engine, requests: list, probe: list[int]) -> tuple[list[asyncio.Future], asyncio.Future]:
    """Start ``requests`` (coroutines) on a vLLM-backed engine so that they are generating when this returns: they
    are sent while the engine is paused (vLLM queues them) until it holds them all, the engine is resumed, and a
    2-token request for ``probe``, queued behind them, has returned (first come first served: each of them has run at
    least as many steps). Returns their tasks and the resume call, which may answer late (vLLM's API server replies
    to control calls between steps): await it after acting on the engine."""
    await engine.pause()
    try:
        tasks = [asyncio.ensure_future(r) for r in requests]
        deadline = asyncio.get_running_loop().time() + 120
        while (n := await held(engine)) < len(tasks):
            assert asyncio.get_running_loop().time() < deadline, f"vLLM holds {n} of {len(tasks)} requests after 120 s"
            await asyncio.sleep(0.01)
    finally:
        resumed = asyncio.ensure_future(engine.resume())
    await engine.generate(probe, Sampling(max_tokens=2, temperature=1.0, ignore_eos=True))
    return tasks, resumed


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


async def in_flight(engine, prompts: list, sampling, continuous: bool) -> tuple[list[asyncio.Future], asyncio.Future]:
    """Start ``engine.generate`` for each of ``prompts`` and return once they are generating: ``generating`` for
    vLLM-backed engines (``continuous``), else once every member has run a few decode steps of the batch
    (``decoding``). Returns their tasks and an awaitable to await after acting on the engine (the late resume)."""
    if continuous:
        return await generating(engine, [engine.generate(p, sampling) for p in prompts], prompts[0])
    with decoding(engine, steps=5) as decoded:
        tasks = [asyncio.ensure_future(engine.generate(p, sampling)) for p in prompts]
        assert await asyncio.to_thread(decoded.wait, 120), "no decode steps within 120 s"
    return tasks, asyncio.ensure_future(asyncio.sleep(0))


async def delivered(engine, tasks: list[asyncio.Future]) -> None:
    """Return once every request the vLLM-backed ``engine`` no longer holds has reached its caller: a request that
    finished just before a pause can still be on its way back (an HTTP response, a future the engine loop resolves)."""
    deadline = asyncio.get_running_loop().time() + 120
    while (n := sum(t.done() for t in tasks)) + (h := await held(engine)) < len(tasks):
        assert asyncio.get_running_loop().time() < deadline, f"{len(tasks) - n - h} finished requests never arrived"
        await asyncio.sleep(0.01)
