"""Requests that arrive together, answered by one call (``Batched``): the torch engine's scoring (one forward for the
sequences that arrive together) and the vLLM engine's routing capture (one worker call for the requests that finish
together)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Batched:
    """Requests that arrive together, answered by one call: ``await batched(request)`` queues ``request`` and waits for
    its answer; ``answer(requests)`` (a coroutine function) gets every request queued while its previous call ran, in
    order, and returns one answer each (an exception instance is raised in that request's caller; an exception it
    raises, in every caller of the batch). A caller that gave up meanwhile (a deadline) is skipped."""

    def __init__(self, answer: Callable[[list], Awaitable[list]]):
        self.answer = answer
        self._waiting: list[tuple[object, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def __call__(self, request):
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((request, done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                answers = await self.answer([request for request, _ in batch])
            except Exception as e:  # noqa: BLE001 (every request of the batch gets it)
                answers = [e] * len(batch)
            for (_, done), answer in zip(batch, answers):
                if done.done():  # its caller gave up
                    continue
                if isinstance(answer, Exception):
                    done.set_exception(answer)
                else:
                    done.set_result(answer)
