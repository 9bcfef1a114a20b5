"""``make_module``: an ``AsyncRLModule`` for a test, on the default calculator task unless told otherwise. Flat keyword
arguments (``max_lag=0``, ``lr=1e-2``, ``micro_batch_tokens=200``) go into the record that holds them
(``molt_lightning.config``), so a test names only what it changes; recipes and the golden test use the records.
``LORA``: the adapter the session's LoRA engine (tests/conftest.py) serves.
``running``: a rollout source producing on an engine outside a module (what the module's start and stop do)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import fields

from molt_lightning import AsyncRLModule, Batching, MoE, Optim, Rollout
from molt_lightning.agents.sessions import AgentSessions
from molt_lightning.tasks import arithmetic

LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}  # the adapter the session's LoRA engine serves
RECORDS = {"rollout": Rollout, "optim": Optim, "batching": Batching, "moe": MoE}


def make_module(engine=None, **kw) -> AsyncRLModule:
    for key, cls in RECORDS.items():
        mine = {k: kw.pop(k) for k in [f.name for f in fields(cls)] if k in kw}
        if mine:
            kw[key] = cls(**mine)
    kw.setdefault("agent", arithmetic.calculator_agent)
    kw.setdefault("tasks", arithmetic.tasks)
    return AsyncRLModule(engine=engine, **kw)


@contextmanager
def running(source, engine, model_path: str = "fake", tokenizer=None, max_context: int = 1024):
    engine.launch(model_path)
    try:
        clients = AgentSessions(engine, model_path, tokenizer, source.rollout.temperature, max_context)
        clients.start()
        try:
            source.start(clients)
            try:
                yield source
            finally:
                source.stop()
        finally:
            clients.stop()
    finally:
        engine.release()
