"""Several engines behind the one ``RolloutEngine`` protocol: least-loaded routing, sticky per trajectory, weight
sync that reaches every engine before any serves the new version, and engines that die or come back.

Routing: a request goes to the live engine with the fewest requests in flight, except that every turn of one
trajectory (``Sampling.route_key``, set by the agent client) goes to the engine its first turn went to, so its
growing context stays in that engine's prefix cache. A trajectory whose engine is down continues on another one
(each generation still comes whole from one engine; only the cache locality is lost).

Weight sync: every engine (live or not) stages each bucket; the commit then pauses every live engine, loads the
weights into each, resets their caches and sets the version, and only then resumes them all: no engine samples a
token of version v while another still loads it, and each engine's per-token versions stay its own exact ones.
An engine that is down (or fails during the update) keeps the update and loads it before it serves again
(``RemoteVLLMEngine.adopt_staged``).

Failures: an engine's in-flight requests fail with ``EngineUnavailable`` when it dies, so their trajectories fail
and are counted by the rollout source (``status_failed``, with the reason); they are not retried (a retry would be
a new request whose record the agent never asked for). New requests go to the live engines. ``check`` raises once
every engine has been down longer than its ``down_timeout_s``, so a run with no engine left fails with a message.

vllm-router (PyPI) routes the same way (``consistent_hash``/``sticky_least_loaded``), but the weight sync and the
health checks must reach every engine directly anyway, and the pool needs each engine's liveness to keep versions
exact: a routing table of a few lines is simpler than a second process in between.

Recipe: ``engine: {class_path: molt_lightning.engines.EnginePool, init_args: {urls: [http://engine-1:8000, ...]}}``,
or ``init_args: {servers: 2}`` to start two loopback servers (``molt serve``) for the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from contextlib import AsyncExitStack

import torch

from .base import Generation, RolloutEngine, Sampling
from .remote import EngineUnavailable, RemoteVLLMEngine

log = logging.getLogger("molt_lightning.engines.pool")


class EnginePool(RolloutEngine):
    def __init__(
        self,
        urls: list[str] | None = None,
        servers: int = 0,
        engines: list[RolloutEngine] | None = None,
        server_cpu_threads: list[str] | None = None,
        max_routes: int = 100_000,
        down_timeout_s: float = 60.0,
        **remote_kwargs,
    ):
        """``urls``: running servers; ``servers``: how many loopback servers to start (server i bound to
        ``server_cpu_threads[i]``, default core ``i`` modulo the cores there are); ``engines``: any engines, e.g.
        in-process ones. ``remote_kwargs`` go to every ``RemoteVLLMEngine`` (``channel``, ``api_key``, timeouts;
        with ``channel: nccl``, remote engine i rendezvouses on ``nccl_master_port + i``)."""
        super().__init__()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = server_cpu_threads or [str(i % cores) for i in range(servers)]
        remote_kwargs["down_timeout_s"] = down_timeout_s
        port = remote_kwargs.pop("nccl_master_port", 29600)  # channel nccl: one rendezvous port per server
        remote = [(url, None) for url in urls or []] + [(None, threads[i]) for i in range(servers)]
        self.engines: list[RolloutEngine] = [*(engines or []), *(
            RemoteVLLMEngine(url=url, cpu_threads=cpu, nccl_master_port=port + i, **remote_kwargs)
            for i, (url, cpu) in enumerate(remote))]
        if not self.engines:
            raise ValueError("EnginePool needs engines: give urls (running `molt serve` servers), servers: N "
                             "(started on loopback for the run) or engines")
        self.down_timeout_s, self.max_routes = down_timeout_s, max_routes
        self._routes: OrderedDict[str, RolloutEngine] = OrderedDict()  # route key -> engine, oldest first
        self.routed: Counter = Counter()  # requests sent to each engine (by index)

    # ----- lifecycle -----
    async def start(self, model_path: str) -> None:
        results = await asyncio.gather(*(e.start(model_path) for e in self.engines), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await self.shutdown()
            raise EngineUnavailable("the pool could not start: " + "; ".join(
                f"engine {i} ({_where(self.engines[i])}): {r}" for i, r in failed)) from failed[0][1]
        sizes = {e.vocab_size for e in self.engines}
        if len(sizes) != 1:
            raise ValueError(f"the pool's engines serve different vocabularies ({sorted(sizes)}): one policy for all")
        self.vocab_size = sizes.pop()
        for e in self.engines:
            e.loop = self.loop

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)

    async def pause(self) -> None:
        await asyncio.gather(*(e.pause() for e in self.live()))

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.live()))

    def live(self) -> list[RolloutEngine]:
        return [e for e in self.engines if getattr(e, "alive", True)]

    def check(self) -> None:
        errors = []
        for i, e in enumerate(self.engines):
            try:
                e.check()
                return  # one engine that still counts keeps the run going
            except EngineUnavailable as err:
                errors.append(f"engine {i}: {err}")
        raise EngineUnavailable(f"every engine of the pool is gone ({'; '.join(errors)})")

    # ----- generation -----
    async def _generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        engine = await self._route(sampling.route_key)
        self.routed[self.engines.index(engine)] += 1
        return await engine.generate(prompt_ids, sampling)

    async def _route(self, key: str | None) -> RolloutEngine:
        deadline = time.monotonic() + self.down_timeout_s
        while not (live := self.live()):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"no engine of the pool has answered for {self.down_timeout_s:.0f} s: "
                                        f"{', '.join(_where(e) for e in self.engines)}")
            await asyncio.sleep(0.2)
        engine = self._routes.get(key) if key is not None else None
        if engine is None or engine not in live:
            engine = min(live, key=lambda e: e._in_flight)  # least in flight; ties go to the first
            if key is not None:
                self._routes[key] = engine
                if len(self._routes) > self.max_routes:
                    self._routes.popitem(last=False)
        elif key is not None:
            self._routes.move_to_end(key)
        return engine

    # ----- weights -----
    async def _stage(self, bucket: Mapping[str, torch.Tensor]) -> None:
        for e in self.engines:  # every engine, live or not: one that comes back loads the latest update
            await e.stage_weights(bucket)

    async def _commit(self, version: int) -> None:
        async with AsyncExitStack() as locks:  # no engine's own reload (after a restart) runs during the update
            for e in self.engines:
                if (lock := getattr(e, "weights_lock", None)) is not None:
                    await locks.enter_async_context(lock)
            live = await self._each(self.live(), lambda e: e.pause(), version)
            try:
                live = await self._each(live, lambda e: _load(e, version), version)
                live = await self._each(live, lambda e: _finish(e, version), version)
            finally:
                await self._each(live, lambda e: e.resume(), version)
            for e in self.engines:
                if e not in live and isinstance(e, RemoteVLLMEngine):
                    e.adopt_staged(version)  # loads it before it serves again
        if not live:  # as a single engine does: the version waits for an engine to return; ``check`` bounds the wait
            log.warning("no engine of the pool is up to take version %d: the first one back loads it", version)

    async def _each(self, engines: list[RolloutEngine], step, version: int) -> list[RolloutEngine]:
        """Run ``step`` on every engine at once; those that fail with ``EngineUnavailable`` drop out (marked down)."""
        results = await asyncio.gather(*(step(e) for e in engines), return_exceptions=True)
        ok = []
        for e, r in zip(engines, results):
            if isinstance(r, EngineUnavailable) and isinstance(e, RemoteVLLMEngine):
                e.mark_down(f"the update to version {version} failed: {r}")
            elif isinstance(r, BaseException):
                raise r
            else:
                ok.append(e)
        return ok


async def _load(engine: RolloutEngine, version: int) -> None:
    if isinstance(engine, RemoteVLLMEngine):
        await engine.load_staged()
    else:  # an in-process engine swaps and tags in one call (it is paused: nothing is sampled in between)
        await engine.commit_weights(version)


async def _finish(engine: RolloutEngine, version: int) -> None:
    if isinstance(engine, RemoteVLLMEngine):
        await engine.finish_update(version)


def _where(engine: RolloutEngine) -> str:
    return getattr(engine, "url", None) or type(engine).__name__
