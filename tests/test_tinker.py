"""``molt tinker`` against the official ``tinker`` SDK (0.38): the semantics other self-hosted servers get wrong.

- A sampler made from saved weights is frozen: later ``optim_step``s change neither what it scores nor what it samples.
- LoRA trains only the adapter: the base weights' fingerprints, in the trainer and in the sampling engine, are
  unchanged after training, and a base-model sampler scores as before.
- ``save_state`` is durable: a restarted server loads it, and the next ``forward_backward`` (and the step after it)
  gives the numbers the uninterrupted run gives.
- The policy version of every sampled token is known (the server's ``samples.jsonl``) and is the sampler's.
- Bad requests get the SDK's error shapes and the server keeps serving.

The server runs in this process on a thread (``running``): a restart is a new ``Server`` on the same state folder,
which keeps nothing but the disk. tests/test_tinker_cookbook.py runs the cookbook's trainers through a ``molt tinker``
process.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker extra (make extra-tinker)")
from tinker import types  # noqa: E402

from molt_lightning.engines.fingerprint import fingerprint  # noqa: E402
from molt_lightning.models.tiny import arithmetic_policy  # noqa: E402

KEY = "tml-molt-test"


@contextmanager
def running(state_dir: str, key: str = KEY, **options):
    """A ``molt tinker`` server (``Server``'s ``options``) on a free loopback port, in a thread; yields (server, base
    url)."""
    import uvicorn

    from molt_lightning.tinker.server import Server

    server = Server(arithmetic_policy(), key, str(state_dir), **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(60)
        server.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running(tmp_path_factory.mktemp("tinker")) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    with tinker.ServiceClient(base_url=served[1], api_key=KEY) as service:  # its session finishes before the server
        yield service


def sft_datum(tokenizer, text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def train(tc, data, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_a_sampler_is_frozen(client):
    tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, "What is 12*34?CALC 12*34")]
    train(tc, data, 2)
    frozen = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("What is 12*34?CALC 12*34"))
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    before = frozen.compute_logprobs(prompt).result()
    sampled = frozen.sample(prompt, 1, greedy).result().sequences[0].tokens
    losses = train(tc, data, 3)
    assert losses[-1] < losses[0]  # the training client did move
    assert frozen.compute_logprobs(prompt).result() == before
    assert frozen.sample(prompt, 1, greedy).result().sequences[0].tokens == sampled
    now = tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert now != before and before[0] is None and len(before) == prompt.length
    # a sampler saved by name is read from disk: frozen as well, and equal to the in-memory one it was saved with
    path = tc.save_weights_for_sampler("named").result().path
    named = client.create_sampling_client(model_path=path).result()
    train(tc, data, 1)
    assert named.compute_logprobs(prompt).result() == now


def test_samplers_sharing_one_engine_each_serve_their_own_weights(tmp_path):
    """Two samplers of different versions, one engine for both (``engines_per_kind=1``), requests interleaved and
    in flight together: every answer is its own sampler's (the engine is rebound only when idle)."""
    with running(tmp_path, engines_per_kind=1) as (server, url):
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        data = [sft_datum(tok, "What is 6*7?CALC 6*7")]
        samplers = []
        for _ in range(2):
            train(tc, data, 2)
            samplers.append(tc.save_weights_and_get_sampling_client().result())
        prompt = types.ModelInput.from_ints(tok.encode("What is 6*7?CALC 6*7"))
        alone = [s.compute_logprobs(prompt).result() for s in samplers]
        assert alone[0] != alone[1]
        futures = [(i % 2, samplers[i % 2].compute_logprobs(prompt)) for i in range(24)]
        assert all(f.result() == alone[which] for which, f in futures)
        assert len(server.pool.slots) == 1 and len(server.pool.slots[0].verified) >= 3  # it was rebound
        client.close("success").result()


def test_lora_trains_only_the_adapter(served, client):
    server, _ = served
    folder = arithmetic_policy()
    base_sampler = client.create_sampling_client(base_model=folder).result()
    tc = client.create_lora_training_client(base_model=folder, rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("What is 7*8?ANSWER 56"))
    base_before = base_sampler.compute_logprobs(prompt).result()
    lm = server.models[tc.model_id].model.lm

    def prints(adapter: bool) -> dict:
        return {n: fingerprint(p) for n, p in lm.named_parameters() if ("lora_" in n) == adapter}

    base, adapter = prints(False), prints(True)
    assert base and adapter and all(p.requires_grad == ("lora_" in n) for n, p in lm.named_parameters())
    train(tc, [sft_datum(tok, "What is 7*8?ANSWER 56")], 3)
    tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert prints(False) == base
    changed = {n for n, p in prints(True).items() if p != adapter[n]}
    assert any(".lora_B." in n for n in changed)  # B starts at 0: training moved it
    assert base_sampler.compute_logprobs(prompt).result() == base_before
    # the sampling engines' base weights too: every engine's non-adapter parameters are the folder's
    from molt_lightning.policies import load_lm

    original = {n: fingerprint(p) for n, p in load_lm(folder, torch.float32).named_parameters()}
    for slot in server.pool.slots:
        served_base = {n.replace("base_model.model.", "").replace(".base_layer", ""): fingerprint(p)
                       for n, p in slot.engine.model.named_parameters() if "lora_" not in n}
        assert served_base == original
        assert all(slot.verified)  # each rebind's fingerprints read back as sent


def test_save_state_survives_a_restart(tmp_path):
    folder = arithmetic_policy()

    def step_and_forward(tc, data) -> tuple[float, float]:
        first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        return first, tc.forward(data, "cross_entropy").result().metrics["loss:sum"]

    with running(tmp_path) as (_, url):
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=folder, rank=8, seed=3).result()
        data = [sft_datum(tc.get_tokenizer(), "What is 3*9?CALC 3*9")]
        train(tc, data, 3, lr=5e-3)
        path = tc.save_state("ckpt").result().path
        uninterrupted = step_and_forward(tc, data)
        sc.close("success").result()
    with running(tmp_path) as (server, url):  # a new server: nothing but the state folder
        assert not server.models
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_training_client_from_state_with_optimizer(path).result()
        assert tc.get_info().lora_rank == 8
        assert step_and_forward(tc, data) == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
        assert server.models[tc.model_id].model.version == 4
        # without the optimizer state the step differs (so the check above could fail)
        fresh = sc.create_training_client_from_state(path).result()
        assert step_and_forward(fresh, data)[1] != pytest.approx(uninterrupted[1], rel=1e-6)
        # and a client loads a state into itself (load_state_with_optimizer), in its turn among its ops
        fresh.load_state_with_optimizer(path).result()
        assert step_and_forward(fresh, data) == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
        sc.close("success").result()


def test_every_sampled_token_has_its_policy_version(served, client):
    server, _ = served
    tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, "What is 5*6?CALC 5*6")]
    prompt = types.ModelInput.from_ints(tok.encode("What is 5*6?"))
    params = types.SamplingParams(max_tokens=5, temperature=1.0)
    futures = {}
    for version in range(3):
        sampler = tc.save_weights_and_get_sampling_client().result()
        futures[version] = sampler.sample(prompt, 2, params)
        train(tc, data, 1)
    ids = {version: [s.sequence_id for s in f.result().sequences] for version, f in futures.items()}
    with open(os.path.join(server.state_dir, "samples.jsonl")) as f:
        record = {row["sequence_id"]: row for row in map(json.loads, f)}
    for version, sequence_ids in ids.items():
        for sid in sequence_ids:
            assert record[sid]["model_id"] == tc.model_id
            assert record[sid]["versions"] and set(record[sid]["versions"]) == {version}
            assert sid.endswith(f":v{version}")  # the sequence id the SDK hands back says it too
    # a datum that names its sampled tokens' sequence (the cookbook's provenance spans) gets its staleness reported
    seq, sid = futures[0].result().sequences[0], ids[0][0]
    full, p, n = prompt.to_ints() + list(seq.tokens), prompt.length, len(seq.tokens)
    datum = types.Datum(  # spans tile each field, as the cookbook's data_processing writes them
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (p - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (len(full) - 1)},
        model_input_spans=[types.PromptProvenanceSpan(sequence_id=sid, length=p),
                           types.SampledProvenanceSpan(sequence_id=sid, length=n - 1)],
        loss_fn_input_spans=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
                             types.SampledProvenanceSpan(sequence_id=sid, length=n)])
    metrics = tc.forward_backward([datum], "importance_sampling").result().metrics
    assert metrics["molt/staleness:max"] == 3.0


def test_bad_requests_get_the_sdks_errors_and_the_server_keeps_serving(served, client):
    _, url = served
    tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=4).result()
    tok = tc.get_tokenizer()
    good = sft_datum(tok, "What is 1*2?ANSWER 2")
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'dro' is not served") as bad_loss:
        tc.forward_backward([good], "dro").result()
    assert bad_loss.value.category == "user"
    ids = tok.encode("What is 1*2?")
    short = types.Datum(model_input=types.ModelInput.from_ints(ids),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    with pytest.raises(tinker.RequestFailedError, match="one value per input position"):
        tc.forward_backward([short], "cross_entropy").result()
    missing = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    with pytest.raises(tinker.RequestFailedError, match=r"missing \['advantages', 'logprobs'\]"):
        tc.forward_backward([missing], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="not served here: this server trains"):
        client.create_lora_training_client(base_model="/no/such/model", rank=4).result()
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as http:
        unknown = http.post("/api/v1/get_info", json={"model_id": "nobody:train:0"})
        assert unknown.status_code == 404 and "no model 'nobody:train:0'" in unknown.json()["detail"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": "nope"}).status_code == 410
        assert http.get(f"/api/v1/training_runs/{tc.model_id}").json()["lora_rank"] == 4
        assert http.get("/api/v1/training_runs/..").status_code == 404
        assert http.post("/api/v1/optim_step", json={"model_id": tc.model_id}).status_code == 400
        assert http.post("/api/v1/create_session", headers={"X-API-Key": "tml-wrong"}).status_code == 401
        full = http.post("/api/v1/create_model", json={"session_id": "s", "model_seq_id": 9,
                                                        "base_model": arithmetic_policy()})  # no lora_config
        assert full.status_code == 400 and "--allow-full-weights" in full.json()["detail"]
        assert http.get("/api/v1/healthz", headers={"X-API-Key": ""}).json() == {"status": "ok"}
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
            base_model=arithmetic_policy(), rank=4)
    # after all of that, the same client trains
    loss = tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"]
    assert math.isfinite(loss) and loss > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_a_client_side_custom_loss_trains_as_its_cross_entropy_twin(client):
    """``forward_backward_custom`` (the SDK computes a custom loss on the logprobs, then sends its gradient as
    cross_entropy weights): the same step as ``cross_entropy`` when the custom loss is the summed NLL."""
    import torch

    def nll(data, logprobs_list):
        loss = -torch.stack([lp.sum() for lp in logprobs_list]).sum()
        return loss, {"nll:sum": float(loss)}

    twins = [client.create_lora_training_client(base_model=arithmetic_policy(), rank=4, seed=7).result()
             for _ in range(2)]
    data = [sft_datum(twins[0].get_tokenizer(), "What is 9*9?CALC 9*9")]
    custom = twins[0].forward_backward_custom(data, nll).result()
    plain = twins[1].forward_backward(data, "cross_entropy").result()
    assert custom.metrics["nll:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
    for tc in twins:
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [tc.forward(data, "cross_entropy").result().metrics["loss:sum"] for tc in twins]
    assert after[0] == pytest.approx(after[1], rel=1e-5) and after[0] < plain.metrics["loss:sum"]


def test_full_weights_where_the_server_allows_them():
    """``--allow-full-weights`` (the SDK asks only for LoRA; a raw ``create_model`` without ``lora_config`` gets this):
    every weight trains, and a sampler of such a model serves its snapshot, frozen (the engine's prompt logprobs equal
    the model's own before and after another step)."""
    import asyncio

    import numpy as np

    from molt_lightning.tinker.sampling import Pool, Sampler
    from molt_lightning.tinker.training import Model
    from molt_lightning.tinker.wire import Datum, ForwardBackward

    folder = arithmetic_policy()
    model = Model("s:train:0", folder, None)
    ids = np.array(model.tokenizer.encode("What is 8*9?CALC 8*9"))
    datum = Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(ids.size - 1, np.float32)})

    def step() -> np.ndarray:
        logprobs, _ = model.forward_backward(ForwardBackward("s:train:0", 1, "cross_entropy", {}, False, [datum]))
        model.optim_step({"learning_rate": 1e-3})
        return logprobs[0]

    before = {n: p.detach().clone() for n, p in model.lm.named_parameters()}
    step()
    assert all(not torch.equal(before[n], p) for n, p in model.lm.named_parameters())
    sampler = Sampler("s:train:0:sample:0", model.snapshot(), "s:train:0")
    after_one = step()  # the model's logprobs at version 1 (computed before this step's update)

    async def served() -> list[float]:
        pool = Pool(folder, model.tokenizer, 1)
        try:
            return (await pool.sample(sampler, ids.tolist(), 1, {"max_tokens": 1}, True))[2]
        finally:
            pool.close()

    assert sampler.kind == "full" and sampler.version == 1
    assert np.allclose(asyncio.run(served())[1:], after_one, atol=1e-4)  # version 1 still, after a second step


def test_the_docs_sdk_block_runs(served, monkeypatch, capsys):
    """docs/tinker.md's SDK example, as written, with the two lines `molt tinker` prints exported."""
    from tests.test_docs_run import python_block

    monkeypatch.setenv("TINKER_BASE_URL", served[1])
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    exec(compile(python_block("docs/tinker.md: import tinker"), "docs/tinker.md", "exec"), {})  # noqa: S102
    losses = [float(line) for line in capsys.readouterr().out.splitlines()[:5]]
    assert losses[-1] < losses[0]


def test_malformed_bodies_are_never_a_server_error(served):
    """Whatever a route is sent, a client error is a 4xx (a 5xx makes the SDK retry for minutes)."""
    _, url = served
    routes = [r.path for r in served[0].app().routes if "POST" in (r.methods or ())]
    bodies = [b"not json", b"[]", b"{}", json.dumps({k: 5 for k in (
        "model_id", "session_id", "model_seq_id", "lora_config", "prompt", "sampling_params", "path", "request_id",
        "adam_params", "sampling_session_id", "num_samples", "seq_id", "base_model", "model_path")}).encode()]
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60) as http:
        for route in routes:
            for body in bodies:
                answer = http.post(route.replace("{id}", "x"), content=body)
                assert answer.status_code < 500, (route, body, answer.status_code, answer.text)


def test_losses_are_tinkers_sums(served, client):
    """The four losses against their definitions (per token, summed), on the logprobs the server returns."""
    tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=4, seed=2).result()
    ids = tc.get_tokenizer().encode("What is 4*4?CALC 4*4")
    n = len(ids) - 1
    lp = tc.forward([sft_datum(tc.get_tokenizer(), "What is 4*4?CALC 4*4")], "cross_entropy").result()
    logp = lp.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp.metrics["loss:sum"] == pytest.approx(-logp.sum(), rel=1e-5)
    q = logp - 0.3 * ((-1) ** (__import__("numpy").arange(n)))  # ratios e^{+-0.3}: outside [0.8, 1.2] both ways
    adv = [1.0 if i % 3 else -2.0 for i in range(n)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "logprobs": q.astype("float32").tolist(),
                                        "advantages": adv})
    r = [math.exp(a - b) for a, b in zip(logp, q.astype("float32"))]
    want = {"importance_sampling": -sum(ri * a for ri, a in zip(r, adv)),
            "ppo": -sum(min(ri * a, min(max(ri, 0.8), 1.2) * a) for ri, a in zip(r, adv)),
            "cispo": -sum(min(max(ri, 0.8), 1.2) * a * lpi for ri, a, lpi in zip(r, adv, logp))}
    for loss, value in want.items():
        assert tc.forward([datum], loss).result().metrics["loss:sum"] == pytest.approx(value, rel=1e-4), loss
    tight = tc.forward([datum], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    assert tight.metrics["loss:sum"] == pytest.approx(
        -sum(min(ri * a, min(max(ri, 0.9), 1.1) * a) for ri, a in zip(r, adv)), rel=1e-4)
