"""Remote engines at scale: ``molt serve``'s access guard, a pool of servers in a real run (consistency invariant,
sticky routing), a server killed mid-run, a server that never answers and one whose start hangs. The remote engine's
agreement with the in-process ones is in ``test_engines.py`` (parametrized over engines). Every server binds loopback
and every request goes to loopback."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from molt_lightning.engines.vllm.server import Guard

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from loopback import rpc_results  # noqa: E402


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
    from molt_lightning.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--policy" in capsys.readouterr().out


def test_a_server_whose_start_hangs_is_stopped_with_its_stacks_in_the_error(tmp_path, monkeypatch):
    from molt_lightning.engines.vllm import server

    started = tmp_path / "started"
    hang = (f"import pathlib, resource, time\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file\n"
            f"pathlib.Path({str(started)!r}).touch()\ndef starting_up():\n    time.sleep(600)\nstarting_up()")
    monkeypatch.setattr(server, "server_command", lambda *a, **k: [sys.executable, "-c", hang])
    local = server.LocalServer("unused", log_path=str(tmp_path / "serve.log"))
    pid, deadline = local.proc.pid, time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:  # its interpreter (and faulthandler) is up
        time.sleep(0.01)
    with pytest.raises(TimeoutError, match="did not answer /health within 1 s") as e:
        local.wait_ready(1)
    assert "in starting_up" in str(e.value)  # the stack of the hung process, from its log
    assert local.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped, not left behind


@pytest.mark.slow
def test_served_guard_is_installed(molt_servers):
    """On a real server: a control request that comes (per the proxy header uvicorn trusts from loopback) from
    another host is refused; the same request from loopback is served."""
    url = molt_servers[0].url
    foreign = httpx.post(f"{url}/reset_prefix_cache", headers={"X-Forwarded-For": "192.0.2.7"}, timeout=10)
    assert foreign.status_code == 403 and "loopback" in foreign.text
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).json() == {"success": True}


@pytest.mark.slow  # a real vLLM engine
def test_a_cpu_server_runs_its_model_worker_inside_the_engine_core(molt_servers):
    """``cpu.one_process`` through ``server.main``: each server is the API process and one engine core, no separate
    worker process (a second import of vLLM, ~0.7 GB)."""
    import psutil

    for server in molt_servers:
        names = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names


# ----- a pool of engines in a real run -----

def fit(module, tmp_path, steps, callbacks=()):
    import lightning as L

    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


def make(engine, **kw):
    from modules import make_module

    return make_module(**{**dict(engine=engine, group_size=4, prompts_per_step=4, max_lag=1, lr=3e-4), **kw})


def record_routes(pool, monkeypatch):
    """Wrap every engine of the pool: (engine index, route key, prompt ids, Generation) of each finished request."""
    records = []
    for i, engine in enumerate(pool.engines):
        async def generate(prompt_ids, sampling, images=None, _i=i, _original=engine.generate):
            out = await _original(prompt_ids, sampling, images)
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


class KillAt:
    """After step ``step``, SIGKILL ``server`` (its whole process group) as soon as it has requests in flight, paused
    first so that they are still in flight when it dies (from a thread: the trainer goes on, and the next groups'
    requests reach the server)."""

    def __init__(self, server, engine, step: int = 1):
        self.server, self.engine, self.step, self.killed_at, self.thread = server, engine, step, None, None

    def on_train_batch_end(self, trainer, *args):
        import threading

        if trainer.global_step == self.step and self.thread is None:
            self.thread = threading.Thread(target=self._kill, daemon=True)
            self.thread.start()

    def _kill(self):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.engine._in_flight:  # freeze them (pause, mode keep): none can finish between now and the kill
                self.engine.call(self.engine.pause())  # (with the faster client, one sometimes did: a flaky test)
                if self.engine._in_flight:
                    break
                self.engine.call(self.engine.resume())
            time.sleep(0.002)
        self.server.kill()
        self.killed_at = time.monotonic()


@pytest.mark.slow
def test_a_killed_server_fails_its_requests_and_a_restarted_one_loads_the_current_weights(
        molt_servers, policy_path, tmp_path, monkeypatch, tokenizer):
    import lightning as L
    from invariant import Batches

    from molt_lightning.engines import EnginePool

    pool = EnginePool(urls=[s.url for s in molt_servers], health_interval_s=0.5)
    pool.launch(policy_path)  # the test holds the pool across the run, to watch the killed server come back
    try:
        initial = pool.call(pool.engines[1].weight_checksums())
        records, batches = record_routes(pool, monkeypatch), Batches()
        kill = type("Kill", (KillAt, L.Callback), {})(molt_servers[1], pool.engines[1])
        module = make(pool, max_failure_rate=1.0)
        fit(module, tmp_path, steps=4, callbacks=[batches, kill])
        kill.thread.join(30)
        counts = module.source.counts
        assert kill.killed_at is not None and not pool.engines[1].healthy
        assert counts.failed > 0  # the dead server's requests in flight failed their trajectories
        assert any("EngineUnavailable" in kind for kind in module.source._failure_kinds)
        # every trained token comes from a finished generation; requests cut by the kill finished nowhere
        from invariant import check_trained_tokens

        check_trained_tokens([(p, o) for _, _, p, o in records], batches, tokenizer)
        served_after = [i for i, *_ in records[-20:]]
        assert set(served_after) == {0}, "requests after the kill went to the dead server"

        molt_servers[1].start()  # same port: the pool's health watch finds it and reloads it before it serves
        molt_servers[1].wait_ready(600)
        deadline = time.monotonic() + 60
        while not pool.engines[1].healthy and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pool.engines[1].healthy and pool.engines[1].version == pool.version == 4
        back, live = (pool.call(e.weight_checksums()) for e in pool.engines[::-1])
        assert back == live != initial  # the trained weights, not the ones the server started with
    finally:
        pool.release()


@pytest.mark.slow
def test_a_server_that_never_answers_fails_the_run_within_its_timeout(tmp_path):
    """A loopback socket that accepts connections and never answers: the run fails, naming the server, in time."""
    from molt_lightning.engines import EngineUnavailable, RemoteVLLMEngine

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engine = RemoteVLLMEngine(url=url, connect_timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="timed out") as e:
            fit(make(engine), tmp_path, steps=1)
        assert time.monotonic() - t0 < 20 and url in str(e.value) and "molt serve" in str(e.value)


class FakeServer:
    """A stand-in for `molt serve` on loopback (uvicorn in a thread): the routes the remote engine calls, with canned
    generations (a few tokens and end-of-sequence, tagged with the version set last). ``stop`` makes it vanish."""

    def __init__(self):
        import threading

        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.version = "default"

        async def ok(request):
            return JSONResponse({"success": True, "status": "ok"})

        async def version(request):
            self.version = (await request.json())["new_version"]
            return JSONResponse({"success": True})

        async def rpc(request):
            return JSONResponse(rpc_results(await request.json()))

        async def generate(request):
            ids = [16, 17, 2]
            return JSONResponse({"choices": [{"token_ids": ids, "finish_reason": "stop",
                                              "logprobs": {"content": [{"logprob": -1.0} for _ in ids]},
                                              "weight_versions": [{"version": self.version, "start": 0, "end": 3}]}]})

        paths = ("/health", "/pause", "/resume", "/reset_prefix_cache")
        routes = [Route(p, ok, methods=["GET", "POST"]) for p in paths]
        routes += [Route("/update_weight_version", version, methods=["POST"]),
                   Route("/collective_rpc", rpc, methods=["POST"]),
                   Route("/inference/v1/generate", generate, methods=["POST"])]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class StopAt:
    def __init__(self, fake, step: int):
        self.fake, self.step = fake, step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            self.fake.stop()


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.slow
def test_a_run_whose_engines_are_all_gone_fails_within_the_down_timeout(tmp_path, pooled):
    import lightning as L

    from molt_lightning.engines import EnginePool, EngineUnavailable, RemoteVLLMEngine

    fake = FakeServer()
    try:
        kw = dict(health_interval_s=0.2, down_timeout_s=3.0)
        engine = EnginePool(urls=[fake.url], **kw) if pooled else RemoteVLLMEngine(url=fake.url, **kw)
        stop = type("Stop", (StopAt, L.Callback), {})(fake, step=2)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="down for more than 3 s|gone") as e:
            fit(make(engine, max_failure_rate=1.0), tmp_path, steps=50, callbacks=[stop])
        assert time.monotonic() - t0 < 40 and fake.url in str(e.value)
    finally:
        fake.stop()
