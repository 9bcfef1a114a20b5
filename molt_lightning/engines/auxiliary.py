"""Models beside the policy: a frozen model (a judge, a distillation teacher) served by an engine of its own.

An ``Auxiliary`` holds one engine (any ``RolloutEngine``: ``TorchEngine``, ``VLLMEngine``, a ``RemoteVLLMEngine`` on a
``molt serve`` server, an ``EnginePool`` of them) launched on a frozen model folder and never synced: the trainer's
weight flow never sees it, so it serves version 0 of its folder for the whole run. It starts with the run (the module
starts a teacher; a judge starts at its first request) and stops with it (``stop_all``, from the module's stop).

Its requests come from the rollout side (agents and their graders, the teacher scoring completed groups) and run on
the engine's own loop, each under a limit on requests in flight (``max_in_flight``) and a deadline (``timeout_s``).
A request that raises or passes its deadline raises ``AuxiliaryFailed``: the caller fails that sample (counted, never
trained on), never the run. What it did is counted and logged per step by ``RolloutMonitor`` (``take_metrics``:
``<name>/requests``, ``<name>/tokens`` generated or scored, ``<name>/latency_s`` mean per request, ``<name>/failures``,
``<name>/timeouts``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import ClassVar

from ..config import imported
from .base import Generation, RolloutEngine, Sampling


class AuxiliaryFailed(RuntimeError):
    """A request to a model beside the policy failed or passed its deadline: that sample fails, the run goes on.
    ``kind``: "timeout" or "engine_error"."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class Auxiliary:
    started: ClassVar[list[Auxiliary]] = []  # the ones serving now (``stop_all``, ``RolloutMonitor``)

    def __init__(self, model: str, engine: RolloutEngine | None = None, name: str = "aux", max_in_flight: int = 32,
                 timeout_s: float = 120.0):
        """``model``: a Hugging Face model folder, or the dotted path of a function returning one (as
        ``model.policy``); ``engine``: what serves it (default ``TorchEngine()``, in this process); ``name``: the
        prefix of its metrics (``teacher/requests``, ...)."""
        if max_in_flight < 1 or timeout_s <= 0:
            raise ValueError(f"Auxiliary {name}: max_in_flight must be >= 1 and timeout_s > 0, got {max_in_flight}, "
                             f"{timeout_s}")
        if engine is None:
            from .torch_engine import TorchEngine

            engine = TorchEngine()
        self.model, self.engine, self.name = model, engine, name
        self.max_in_flight, self.timeout_s = max_in_flight, timeout_s
        self.folder: str | None = None
        self.tokenizer = None
        self._start_lock, self._counts_lock = threading.Lock(), threading.Lock()
        self._slots: asyncio.Semaphore | None = None  # made on the engine's loop
        self._counts = dict.fromkeys(("requests", "tokens", "latency_s", "failures", "timeouts"), 0.0)

    # ----- lifecycle -----
    def start(self, folder: str | None = None) -> None:
        """Launch the engine on ``folder`` (default: the model's folder); once, from any thread."""
        with self._start_lock:
            if self.folder is not None:
                return
            from transformers import AutoTokenizer

            folder = folder or model_folder(self.model)
            self.engine.launch(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.folder = folder
            Auxiliary.started.append(self)

    def stop(self) -> None:
        with self._start_lock:
            if self.folder is None:
                return
            self.folder, self._slots = None, None
            Auxiliary.started.remove(self)
            self.engine.release()

    @classmethod
    def stop_all(cls) -> None:
        for aux in list(cls.started):
            aux.stop()

    # ----- requests (from any event loop) -----
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        out = await self._request(lambda: self.engine.generate(prompt_ids, sampling))
        self._add(tokens=len(out.token_ids))
        return out

    async def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """The model's logprob of each of ``token_ids[start:]`` given the tokens before it (``RolloutEngine.score``)."""
        out = await self._request(lambda: self.engine.score(token_ids, start, temperature))
        self._add(tokens=len(out))
        return out

    async def _request(self, make):
        if self.folder is None:
            await asyncio.to_thread(self.start)
        t0 = time.perf_counter()
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._guarded(make), self.engine.loop))
        except TimeoutError:
            self._add(timeouts=1)
            raise AuxiliaryFailed(f"{self.name} did not answer within {self.timeout_s} s; raise its timeout_s or give "
                                  f"it a faster engine (model {self.model})", "timeout") from None
        except (asyncio.CancelledError, AuxiliaryFailed):
            raise
        except Exception as e:
            self._add(failures=1)
            raise AuxiliaryFailed(f"{self.name} failed: {type(e).__name__}: {e} (model {self.model})",
                                  "engine_error") from e
        finally:
            self._add(requests=1, latency_s=time.perf_counter() - t0)  # counted when it ends, with its latency

    async def _guarded(self, make):
        """(On the engine's loop.) At most ``max_in_flight`` at once; the deadline counts from the request's start."""
        self._slots = self._slots or asyncio.Semaphore(self.max_in_flight)
        async with asyncio.timeout(self.timeout_s):
            async with self._slots:
                return await make()

    def _add(self, **counts: float) -> None:
        with self._counts_lock:  # requests come from agents' loops, the trainer's thread takes the counts
            for k, v in counts.items():
                self._counts[k] += v

    def take_metrics(self) -> dict[str, float]:
        """What it did since the previous call, under ``<name>/``."""
        with self._counts_lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0.0)
        counts["latency_s"] /= max(counts["requests"], 1.0)
        return {f"{self.name}/{k}": v for k, v in counts.items()}


def model_folder(model: str) -> str:
    """A folder, or what the function at the dotted path ``model`` returns; else ``ValueError`` naming the fix."""
    if os.path.isdir(model):
        return model
    fn = imported(model, "the model", "give a Hugging Face model folder or the dotted path of a function returning one")
    folder = fn() if callable(fn) else fn
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        raise ValueError(f"the model {model!r} gave {folder!r}, not a model folder")
    return str(folder)
