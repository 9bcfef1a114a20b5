"""Several engines behind the one ``RolloutEngine`` protocol: least-loaded routing, sticky per trajectory, weight
sync that reaches every engine before any serves the new version, and engines that die or come back.

Routing: a request goes to the live engine with the fewest requests in flight, except that every turn of one
trajectory (``Sampling.route_key``, set by the agent client) goes to the engine its first turn went to, so its
growing context stays in that engine's prefix cache. A trajectory whose engine is down continues on another one
(each generation still comes whole from one engine; only the cache locality is lost).

Weight sync: the pool's ``members`` are its engines, so ``commit_weights`` runs the one update sequence
(``engines.base.update``) across all of them: every engine (up or not) stages each bucket; then every engine that
serves is paused, loads and is tagged, and only then do they all resume: no engine samples a token of version v
while another still loads it, and each engine's per-token versions stay its own exact ones. An engine that is down
(or fails during the update) keeps the update and loads it before it serves again (``defer``).

Failures: an engine's in-flight requests fail with ``EngineUnavailable`` when it dies, so their trajectories fail
and are counted by the rollout source (``status_failed``, with the reason); they are not retried (a retry would be
a new request whose record the agent never asked for). New requests go to the live engines. ``check`` raises once
every engine has been down longer than its ``down_timeout_s``, so a run with no engine left fails with a message.

Seeds: engine i of the pool samples from a stream of its own, seeded from the run's seed and i (``seed_from``; the
servers it starts get it as ``--seed``); running servers keep theirs, and two that share one while their requests
carry no seed (vLLM's CPU platform) are named at open: their completions would repeat each other.

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

from .base import EngineUnavailable, Generation, RolloutEngine, Sampling
from .vllm.remote import RemoteVLLMEngine

log = logging.getLogger(__name__)


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
        super().__init__(down_timeout_s)
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
        self.max_routes = max_routes
        self._routes: OrderedDict[str, RolloutEngine] = OrderedDict()  # route key -> engine, oldest first
        self.routed: Counter = Counter()  # requests sent to each engine (by index)

    @property
    def members(self) -> list[RolloutEngine]:
        return self.engines

    def seed_from(self, run_seed: int, index: int = 0) -> None:
        for i, e in enumerate(self.engines):
            e.seed_from(run_seed, i)

    # ----- lifecycle -----
    async def open(self, model_path: str) -> None:
        results = await asyncio.gather(*(e.open(model_path) for e in self.engines), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            raise EngineUnavailable("the pool could not start: " + "; ".join(
                f"engine {i} ({self.engines[i].where}): {r}" for i, r in failed)) from failed[0][1]
        sizes = {e.vocab_size for e in self.engines}
        if len(sizes) != 1:
            raise ValueError(f"the pool's engines serve different vocabularies ({sorted(sizes)}): one policy for all")
        self.vocab_size = sizes.pop()
        for e in self.engines:
            e.loop = self.loop
        alike = Counter(e.seed for e in self.engines if not getattr(e, "request_seeds", True) and e.seed is not None)
        if shared := [seed for seed, n in alike.items() if n > 1]:
            log.warning("engines of the pool sample from the same seed (%s) and their requests carry none: their "
                        "completions repeat each other (samples/duplicates). Start each server with its own "
                        "`molt serve --seed`", ", ".join(map(str, shared)))

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

    async def pause(self) -> None:
        await asyncio.gather(*(e.pause() for e in self.live()))

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.live()))

    def live(self) -> list[RolloutEngine]:
        return [e for e in self.engines if e.healthy]

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

    def check_score(self, temperature: float) -> None:
        for engine in self.engines:
            engine.check_score(temperature)

    async def _score(self, token_ids: list[int], start: int, temperature: float) -> list[float]:
        engine = await self._route(None)  # the live engine with the fewest requests in flight
        self.routed[self.engines.index(engine)] += 1
        return await engine.score(token_ids, start, temperature)

    async def _route(self, key: str | None) -> RolloutEngine:
        deadline = time.monotonic() + self.down_timeout_s
        while not (live := self.live()):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"no engine of the pool has answered for {self.down_timeout_s:.0f} s: "
                                        f"{', '.join(e.where for e in self.engines)}")
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
