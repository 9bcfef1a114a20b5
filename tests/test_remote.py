"""Remote engines at scale: ``molt serve``'s access guard, a pool of servers in a real run (consistency invariant,
sticky routing), a server killed mid-run, and a server that never answers. The remote engine's agreement with the
in-process ones is in ``test_engines.py`` (parametrized over engines). Every server binds loopback and every request
goes to loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from molt_lightning.serve import Guard

sys.path.insert(0, str(Path(__file__).parent / "helpers"))


# ----- molt serve: who may call the control routes -----

def _scope(path: str, client: str, token: str | None = None, method: str = "POST") -> dict:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return {"type": "http", "path": path, "method": method, "client": (client, 4242), "headers": headers}


@pytest.mark.parametrize("path", ["/collective_rpc", "/pause", "/update_weight_version", "/reset_prefix_cache"])
def test_guard_refuses_control_routes_from_other_hosts_without_a_token(path):
    guard = Guard(app=None, token="")
    assert guard.allowed(_scope(path, "127.0.0.1")) and guard.allowed(_scope(path, "::1"))
    assert not guard.allowed(_scope(path, "192.0.2.7"))
    assert guard.allowed(_scope("/health", "192.0.2.7", method="GET"))  # probes stay open
    assert guard.allowed(_scope("/inference/v1/generate", "192.0.2.7"))  # serving routes: vLLM's --api-key


def test_guard_with_a_token_refuses_requests_without_it_even_from_loopback():
    guard = Guard(app=None, token="s3cret")
    assert not guard.allowed(_scope("/collective_rpc", "127.0.0.1"))
    assert not guard.allowed(_scope("/collective_rpc", "127.0.0.1", token="wrong"))
    assert guard.allowed(_scope("/collective_rpc", "192.0.2.7", token="s3cret"))
    assert guard.allowed(_scope("/health", "192.0.2.7", method="GET"))


def test_molt_serve_is_a_subcommand(capsys):
    from molt_lightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--policy" in capsys.readouterr().out


@pytest.mark.slow
def test_served_guard_is_installed(molt_servers):
    """On a real server: a control request that comes (per the proxy header uvicorn trusts from loopback) from
    another host is refused; the same request from loopback is served."""
    url = molt_servers[0].url
    foreign = httpx.post(f"{url}/reset_prefix_cache", headers={"X-Forwarded-For": "192.0.2.7"}, timeout=10)
    assert foreign.status_code == 403 and "loopback" in foreign.text
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).json() == {"success": True}


# ----- a pool of engines in a real run -----

def fit(module, tmp_path, steps, callbacks=()):
    import lightning as L

    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


def make(engine, **kw):
    from molt_lightning.module import AsyncRLModule

    return AsyncRLModule(**{**dict(engine=engine, group_size=4, prompts_per_step=4, max_lag=1, lr=3e-4), **kw})


def record_routes(pool, monkeypatch):
    """Wrap every engine of the pool: (engine index, route key, prompt ids, Generation) of each finished request."""
    records = []
    for i, engine in enumerate(pool.engines):
        async def generate(prompt_ids, sampling, _i=i, _original=engine.generate):
            out = await _original(prompt_ids, sampling)
            records.append((_i, sampling.route_key, list(prompt_ids), out))
            return out

        monkeypatch.setattr(engine, "generate", generate)
    return records


def check_run(records, batches, tokenizer, engines=2):
    """The consistency invariant over the pool's generations, and every trajectory's turns on one engine."""
    from invariant import check_trained_tokens

    check_trained_tokens([(p, o) for _, _, p, o in records], batches, tokenizer)
    by_key = {}
    for i, key, _, _ in records:
        by_key.setdefault(key, []).append(i)
    assert all(key is not None for key in by_key)
    assert all(len(set(served)) == 1 for served in by_key.values()), "a trajectory's turns went to two engines"
    assert any(len(served) > 1 for served in by_key.values()), "no multi-turn trajectory: stickiness untested"
    assert len({i for i, *_ in records}) == engines, "an engine of the pool served nothing"


def test_pool_of_torch_engines_routes_sticky_and_trains_exact_tokens(tmp_path, monkeypatch, tokenizer):
    from invariant import Batches

    from molt_lightning.engines import EnginePool, TorchEngine

    pool = EnginePool(engines=[TorchEngine(seed=0), TorchEngine(seed=1)])
    records, batches = record_routes(pool, monkeypatch), Batches()
    fit(make(pool), tmp_path, steps=3, callbacks=[batches])
    check_run(records, batches, tokenizer)
    assert {e.version for e in pool.engines} == {pool.version} == {3}  # every engine holds the last push


@pytest.mark.slow
def test_pool_of_two_servers_run(molt_servers, tmp_path, monkeypatch, tokenizer):
    from invariant import Batches

    from molt_lightning.engines import EnginePool

    pool = EnginePool(urls=[s.url for s in molt_servers])
    records, batches = record_routes(pool, monkeypatch), Batches()
    fit(make(pool), tmp_path, steps=3, callbacks=[batches])
    check_run(records, batches, tokenizer)
    assert {e.version for e in pool.engines} == {3}
