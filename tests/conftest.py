"""Shared fixtures: the embedded tiny policy (built once per machine), one real vLLM engine per policy kind per test
session (dense, LoRA, mixture-of-experts: each test puts back the weights it changed; for all but the LoRA one, the
remote engine and a pool's servers a check after each test that used them says so by fingerprints), and two ``molt
serve`` servers on loopback (started together on first use) with a remote engine on the first; after a test that trains
on those servers itself, the policy goes back on them.

A shared engine is stopped after the last test of the last file that names it (``pytest_runtest_teardown``), not at the
session's end: five engines alive at once beside a later file's own (the SmolLM2 recipe's 8 GB trainer) ran a 24 GiB
machine out of memory (CI killed the suite at 87%)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # the tests' shared helpers (invariant, modules, ...)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each (and in their subprocesses)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# lightning imported here: its loggers' handlers bind to the session's stderr, not to the capsys of the first test
# that imports it (a later test's "Seed set to 0" then wrote to a closed file: test_cli.py run alone)
import lightning  # noqa: E402,F401
import pytest  # noqa: E402

from suite import SHARED, names, text  # noqa: E402  (how the suite runs: tests/helpers/suite.py)

pytest_plugins = ["suite"]
_last_user: dict[str, str] = {}  # shared fixture -> node id of the last collected test of the last file naming it
_live: dict[str, tuple] = {}  # the shared engines while they live (but the LoRA one), with their policy folder


@pytest.hookimpl(trylast=True)  # after -k/-m deselection and any reordering
def pytest_collection_modifyitems(items) -> None:
    """Find each shared engine's last user: a test that requests it, or any test of a file that names it (tests
    that ``request.getfixturevalue`` it by name)."""
    for item in items:
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()) or names(text(item.path), name):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared engines whose last user just ran (their fixtures' own teardown, and what depends on them)."""
    for name, last in _last_user.items():
        if last == item.nodeid:
            for fixturedef in item.session._fixturemanager.getfixturedefs(name, item) or ():
                fixturedef.finish(item._request)


@pytest.fixture(scope="session")
def policy_path() -> str:
    from molt_lightning.models.tiny import arithmetic_policy

    return arithmetic_policy()


@pytest.fixture(scope="session")
def tokenizer(policy_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_path)


@pytest.fixture
def torch_engine(policy_path):
    """A fresh torch engine on the tiny policy, released after the test."""
    from molt_lightning.engines import TorchEngine

    engine = TorchEngine(seed=0)
    engine.launch(policy_path)
    yield engine
    engine.release()


@pytest.fixture(scope="session")
def vllm_engine(policy_path):
    """One in-process vLLM engine for the whole session (start-up costs 25-60 s); modules share it."""
    pytest.importorskip("vllm")
    from molt_lightning.engines import VLLMEngine

    engine = VLLMEngine(seed=0)
    engine.launch(policy_path)
    _live["vllm_engine"] = engine, policy_path
    yield engine
    del _live["vllm_engine"]
    engine.release()


@pytest.fixture(autouse=True)
def _shared_engines_serve_the_policy(request):
    """After a test that used a shared engine (dense, MoE, remote), that engine still serves the policy: a test that
    changes its weights puts them back, or the tests after it pass or fail by their order (test_scoring's vLLM tests
    failed after a test_engines test that left perturbed weights; nothing but the order showed it)."""
    yield
    try:
        for name, (engine, policy_path) in list(_live.items()):
            if name in request.fixturenames and name != "molt_servers":
                serves_the_policy(engine, policy_path, name)
    finally:
        users = set(request.fixturenames)
        if "molt_servers" in users and "molt_servers" in _live and not users & {"served_engine", "remote_engine"}:
            servers_back_on_the_policy(*_live["molt_servers"])


def servers_back_on_the_policy(servers, policy_path: str) -> None:
    """A test that trains on the session's servers itself (a pool's run, several nodes) leaves them on its trained
    weights: the policy goes back on them, through a pool of their own for this, when a fingerprint says it is not
    served (tests through ``served_engine``/``remote_engine`` put it back themselves, and are checked)."""
    from molt_lightning.engines import EnginePool

    pool = EnginePool(urls=[s.url for s in servers])
    pool.launch(policy_path)
    try:
        try:
            for member in pool.members:
                serves_the_policy(member, policy_path, member.url, pool)
        except AssertionError:
            pool.call(pool.update_weights(policy_weights_of(policy_path), 0), timeout=300)
    finally:
        pool.release()


@functools.cache
def policy_weights_of(policy_path: str) -> dict:
    """A policy folder's weights, read once (the checks after each test compare with them; never modified)."""
    from safetensors.torch import load_file

    return load_file(f"{policy_path}/model.safetensors")


def serves_the_policy(engine, policy_path: str, who: str, via=None) -> None:
    """Fail naming the tensors when ``engine`` (a member of the engine ``via``) does not serve the policy's weights
    (by their fingerprints)."""
    from molt_lightning.engines.fingerprint import fingerprint

    weights = policy_weights_of(policy_path)
    served = (via or engine).call(engine.fingerprints({k: tuple(v.shape) for k, v in weights.items()}), timeout=120)
    # (checksum None: a tensor the engine cannot read back, vLLM's CPU MoE experts, repacked in place)
    wrong = sorted(k for k, v in weights.items() if served.get(k) is None
                   or served[k].checksum not in (None, fingerprint(v).checksum))
    assert not wrong, (f"the shared {who} no longer serves the policy after this test ({len(wrong)} tensors differ, "
                       f"e.g. {wrong[0]}): put its weights back in a finally (update_weights(policy weights, 0))")


@pytest.fixture(scope="session")
def lora_lm(policy_path):
    """The HF PeftModel (``LORA`` on the tiny policy) whose adapter the session's LoRA engine serves."""
    import torch
    from transformers import AutoModelForCausalLM

    from modules import LORA

    from molt_lightning.policies import lora

    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    return lora.apply(lm, lora.LoraSpec(**LORA)).eval()


@pytest.fixture(scope="session")
def vllm_lora_engine(policy_path, lora_lm):
    """One LoRA-enabled vLLM engine for the session (start-up 25-60 s); it holds no adapter until a test commits one."""
    pytest.importorskip("vllm")
    from molt_lightning.engines import Sampling, VLLMEngine
    from molt_lightning.policies import lora

    engine = VLLMEngine(seed=0)
    engine.launch(policy_path, lora.adapter_of(lora_lm))
    with pytest.raises(RuntimeError, match="holds no adapter yet: commit one"):  # version 0 is an adapter too
        engine.call(engine.generate([1, 2, 3], Sampling(max_tokens=2)))
    yield engine
    engine.release()


@pytest.fixture(scope="session")
def moe_path() -> str:
    from molt_lightning.models.tiny import moe_policy

    return moe_policy()


@pytest.fixture(scope="session")
def vllm_moe_engine(moe_path):
    """One vLLM engine of the tiny mixture-of-experts policy for the session, recording the routing (eager mode)."""
    pytest.importorskip("vllm")
    from molt_lightning.engines import VLLMEngine

    engine = VLLMEngine(seed=0, capture_routing=True)
    engine.launch(moe_path)
    _live["vllm_moe_engine"] = engine, moe_path
    yield engine
    del _live["vllm_moe_engine"]
    engine.release()


@pytest.fixture(scope="session")
def molt_servers(policy_path):
    """Two vLLM servers (``engines.server.LocalServer``, loopback, a core each), stopped at the session's end."""
    pytest.importorskip("vllm")
    from molt_lightning.engines.vllm.server import LocalServer

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    servers = []
    try:
        servers = [LocalServer(policy_path, cpu_threads=str(i % cores)) for i in range(2)]
        for server in servers:
            server.wait_ready(600)  # two vLLM start-ups at once on a loaded 2-core machine took over 300 s
        _live["molt_servers"] = servers, policy_path
        yield servers
    finally:
        _live.pop("molt_servers", None)
        for server in servers:
            server.stop()


@pytest.fixture
def served_engine(request, policy_path, vllm_engine, molt_servers):
    """Each vLLM-backed engine in turn (parametrize indirectly with "vllm", "remote", "remote-http", "pool": the
    remote ones on the session's ``molt serve`` servers; the pool over both of them lives for one test, so that no
    other test's pool reloads a server it shares)."""
    if request.param == "vllm":
        return vllm_engine
    if request.param == "pool":
        from molt_lightning.engines import EnginePool

        pool = EnginePool(urls=[s.url for s in molt_servers])
        pool.launch(policy_path)
        request.addfinalizer(pool.release)
        request.addfinalizer(lambda: [serves_the_policy(m, policy_path, f"molt serve server at {m.url}", pool)
                                      for m in pool.members])  # the session's servers, before the pool goes
        return pool
    engine = request.getfixturevalue("remote_engine")
    channel, engine.channel = engine.channel, "http" if request.param == "remote-http" else "shm"
    request.addfinalizer(lambda: setattr(engine, "channel", channel))
    return engine


@pytest.fixture(scope="session")
def remote_engine(molt_servers, policy_path):
    """A ``RemoteVLLMEngine`` on the first session server (weights over the shared-memory channel)."""
    from molt_lightning.engines import RemoteVLLMEngine

    engine = RemoteVLLMEngine(url=molt_servers[0].url)
    engine.launch(policy_path)
    _live["remote_engine"] = engine, policy_path
    yield engine
    del _live["remote_engine"]
    engine.release()
