"""Weight fingerprints: after every sync each engine proves it serves what the trainer sent, and a sync that did not
land stops the run naming the tensor, the version and the engine.

The fingerprint itself: one changed, or two swapped, sampled elements change it, as do shape and dtype; equal tensors
give equal ones; the trainer's side and the engine's side compute the same number. Then the failures users hit,
injected into real engines: a bucket staged but never loaded, a load that silently did nothing, a version tagged
without a load, a LoRA adapter never loaded; and a normal run that verifies every sync (``sync/verified`` 1). The
``slow`` tests use the session's real vLLM engine (and one LoRA-enabled vLLM engine for this module), and put the
shared engine back on the policy's weights afterwards."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from molt_lightning.engines import TorchEngine
from molt_lightning.engines.fingerprint import (SAMPLES, Print, Sample, WeightMismatch, checksum, fingerprint,
                                                positions, sample)
from molt_lightning.trainer.weights import WeightFlow

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from modules import make_module  # noqa: E402

TRAINER = SimpleNamespace(global_rank=0, strategy=None)  # what WeightFlow.push reads of a one-process trainer


# ----- the fingerprint -----
@pytest.mark.parametrize("shape", [(300, 70), (7,), (5, 3, 4), (1000,), ()])
def test_sample_positions_are_fixed_distinct_and_span_the_tensor(shape):
    pos = positions(shape)
    n = math.prod(shape)
    assert len(set(pos.tolist())) == len(pos) == min(n, SAMPLES)
    assert pos.min() == 0 and pos.max() == n - 1  # the first and the last element are in
    assert torch.equal(pos, positions(tuple(shape)))


def test_one_changed_or_two_swapped_samples_change_the_fingerprint_and_shape_and_dtype_do_too():
    t = torch.randn(300, 70, generator=torch.Generator().manual_seed(0))
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base  # equal tensors, equal fingerprints
    pos = positions(tuple(t.shape))
    for k in (0, 1, len(pos) // 2, len(pos) - 1):  # one sampled element, by the smallest step float32 takes
        u = t.clone().reshape(-1)
        u[pos[k]] = torch.nextafter(u[pos[k]], torch.tensor(math.inf))
        assert fingerprint(u.reshape(t.shape)).checksum != base.checksum, k
    u = t.clone().reshape(-1)
    u[pos[3]], u[pos[4]] = t.reshape(-1)[pos[4]], t.reshape(-1)[pos[3]]  # two samples swapped
    assert fingerprint(u.reshape(t.shape)).checksum != base.checksum
    assert fingerprint(t.reshape(70, 300)) != base and fingerprint(t.reshape(70, 300)).shape == (70, 300)
    assert fingerprint(t.double()) != base and fingerprint(t.double()).dtype == "float64"


def test_the_trainer_side_and_the_engine_side_compute_the_same_fingerprint():
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    sent = Sample.of(t)
    assert sent.print() == fingerprint(t)
    assert sent.print("bfloat16") == fingerprint(t.to(torch.bfloat16))  # an engine serving bfloat16: cast as it does
    assert sent.print("float32", 2.5).checksum == fingerprint(t * 2.5).checksum  # vLLM's LoRA B: alpha / r folded in
    p = fingerprint(t, "somewhere")
    assert Print.from_wire(json.loads(json.dumps(p.to_wire()))) == p  # exact through JSON (the remote engine)
    nan = t.clone()
    nan[0, 0] = math.nan
    assert fingerprint(nan) == fingerprint(nan.clone())  # diverged weights still compare (and differ from t's)
    assert checksum(sample(torch.zeros(0))) == 0.0


# ----- the torch engine, through WeightFlow and through a run -----
def changed(state: dict[str, torch.Tensor], scale: float = 0.01, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


class Weights(torch.nn.Module):
    """A stand-in for the policy: ``buckets`` iterates its parameters by the names the engine serves."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self.state = {k: torch.nn.Parameter(v.clone()) for k, v in state.items()}

    def named_parameters(self, *args, **kwargs):
        return iter(self.state.items())


def push(engine, state, version, bucket_bytes=2**30) -> WeightFlow:
    flow = WeightFlow(engine)
    flow.push(Weights(state), version, TRAINER, bucket_bytes)
    return flow


@pytest.fixture
def policy_state(torch_engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in torch_engine.model.named_parameters()}


def test_a_normal_sync_verifies_on_the_torch_engine(torch_engine, policy_state):
    flow = push(torch_engine, changed(policy_state), 1, bucket_bytes=100_000)  # several buckets
    flow.settle()
    assert flow.verified and flow.metrics() == {"sync/verified": 1.0} and torch_engine.version == 1


def test_a_load_that_silently_did_nothing_stops_with_the_tensor_version_and_engine(torch_engine, policy_state,
                                                                                   monkeypatch):
    monkeypatch.setattr(torch_engine, "_swap", lambda state: None)  # the load runs its checks, then swaps nothing
    flow = push(torch_engine, changed(policy_state), 3)
    with pytest.raises(WeightMismatch) as err:
        flow.settle()
    first = next(iter(policy_state))
    assert err.value.tensor == first and err.value.version == 3 and err.value.engine == "TorchEngine"
    message = str(err.value)
    assert f"the engine TorchEngine does not serve the weights of version 3: {first} differs" in message
    assert "verify_weights=False" in message and "stage -> load -> tag" in message
    assert not flow.verified


def test_a_version_tagged_without_a_load_stops_the_run(tmp_path, monkeypatch):
    """A real run: the engine tags each version but never loads (the version counter moves, the weights do not);
    the first sync that changes the weights (version 1) stops ``trainer.fit``."""
    from test_loop import fit

    engine = TorchEngine(seed=0)

    async def tag_only():
        engine._staged = {}

    monkeypatch.setattr(engine, "load", tag_only)
    with pytest.raises(WeightMismatch, match=r"the engine TorchEngine does not serve the weights of version 1: "
                                             r"\S+ differs") as err:
        fit(make_module(engine, group_size=2, prompts_per_step=2, max_lag=0, lr=1e-2), tmp_path, steps=3)
    assert err.value.version == 1 and engine.version == 1  # tagged all the same: what the check exists for


@pytest.mark.slow
def test_a_normal_run_logs_sync_verified_and_the_switch_turns_it_off(tmp_path, caplog):
    from test_loop import fit

    _, df = fit(make_module(TorchEngine(seed=0), group_size=2, prompts_per_step=2, max_lag=1), tmp_path, steps=3)
    assert (df["sync/verified"].dropna() == 1.0).all() and df["sync/verified"].notna().sum() == 3
    module = make_module(TorchEngine(seed=0), group_size=2, prompts_per_step=2, verify_weights=False)
    _, df = fit(module, tmp_path, steps=1, name="off")
    assert "sync/verified" not in df and module.weights.verify is False


@pytest.mark.slow
def test_fsdp2_syncs_verify_bucket_by_bucket(tmp_path):
    """Two FSDP2 ranks, 1 MiB buckets (each all-gathered, then sampled by rank 0 as it stages it): every sync of a
    real run is verified."""
    from test_distributed import fit, metrics

    fit(tmp_path, "fsdp2", steps=2, max_lag=0, bucket_mb=1)
    df = metrics(tmp_path, "run")
    assert (df["sync/verified"].dropna() == 1.0).all() and df["sync/verified"].notna().sum() == 2


def test_a_lora_adapter_never_loaded_stops_with_the_adapter_tensor(policy_path, monkeypatch):
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from molt_lightning.policies import lora

    lm = lora.apply(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32), lora.LoraSpec(r=4))
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(lm).items()}
    engine = TorchEngine(seed=0)
    engine.launch(policy_path, lora.adapter_of(lm))
    try:
        flow = push(engine, adapter, 0)
        flow.settle()
        assert flow.verified  # the fresh adapter (B = 0) is served
        monkeypatch.setattr(engine, "_swap", lambda state: None)  # the adapter is never copied in
        flow = push(engine, changed(adapter, 0.1), 1)
        with pytest.raises(WeightMismatch, match=r"version 1: base_model\.model\..*\.lora_[AB]\.weight differs"):
            flow.settle()
    finally:
        engine.release()


def test_a_pool_checks_every_engine_and_names_the_one_that_failed(policy_path, policy_state, monkeypatch):
    from molt_lightning.engines import EnginePool

    engines = [TorchEngine(seed=0), TorchEngine(seed=0)]
    pool = EnginePool(engines=engines)
    pool.launch(policy_path)
    try:
        flow = push(pool, changed(policy_state), 1)
        flow.settle()
        assert flow.verified
        monkeypatch.setattr(engines[1], "_swap", lambda state: None)
        flow = push(pool, changed(policy_state, seed=1), 2)
        with pytest.raises(WeightMismatch, match=r"the engine TorchEngine \(engine 2 of 2\) does not serve the "
                                                 r"weights of version 2"):
            flow.settle()
    finally:
        pool.release()


def test_an_engine_without_fingerprints_is_not_verified_and_says_so(policy_path, caplog):
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from scripted import ScriptedEngine

    engine = ScriptedEngine([])
    engine.launch(policy_path)
    try:
        flow = push(engine, {"w": torch.ones(3)}, 1)
        flow.settle()
        assert not flow.verified and flow.metrics() == {"sync/verified": 0.0}
        assert "reports no fingerprints" in caplog.text
    finally:
        engine.release()


# ----- real vLLM (the session's engine; one LoRA engine for this module) -----
@pytest.fixture
def policy_weights(policy_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(policy_path) / "model.safetensors"))


@pytest.mark.slow
def test_vllm_serves_what_was_sent_read_through_its_kernels(vllm_engine, policy_weights):
    """Every tensor, fused (q/k/v in qkv_proj, gate/up in gate_up_proj) and repacked ones included, reads back equal
    to the trainer's fingerprint after a normal sync (``sync/verified`` 1)."""
    try:
        new = changed(policy_weights)
        flow = push(vllm_engine, new, 5, bucket_bytes=200_000)
        flow.settle()
        assert flow.verified
        served = vllm_engine.call(vllm_engine.fingerprints({k: tuple(v.shape) for k, v in new.items()}))
        assert {k: p.checksum for k, p in served.items()} == {k: fingerprint(v).checksum for k, v in new.items()}
        assert "qkv_proj.weight rows 128:256 (its kernel)" in served["model.layers.0.self_attn.k_proj.weight"].via
    finally:
        vllm_engine.call(vllm_engine.update_weights(policy_weights, 0))  # the session's engine goes back


@pytest.mark.slow
def test_vllm_kernels_packed_ahead_change_nothing_served_until_the_commit_swaps_them_in(vllm_engine, policy_weights,
                                                                                       policy_path, monkeypatch):
    """Each staged bucket's kernels are packed in the worker while the engine serves (``load_ahead``, the default),
    on copies of the layers: until the commit the engine serves the previous weights, read through its kernels; the
    commit swaps in every kernel packed ahead (4 per decoder layer, 1 for the tied embedding and head) and then
    serves the new weights exactly. The buckets split fused layers (200 kB), so q/k/v packs once all have come."""
    from molt_lightning.trainer.weights import buckets

    config = json.loads((Path(policy_path) / "config.json").read_text())
    shapes = {k: tuple(v.shape) for k, v in policy_weights.items()}
    prints = lambda state: {k: fingerprint(v).checksum for k, v in state.items()}  # noqa: E731
    monkeypatch.setattr(vllm_engine.ahead, "min_bytes", 0)  # the tiny policy's buckets are under the default
    try:
        old, new = changed(policy_weights, seed=5), changed(policy_weights, seed=6)
        push(vllm_engine, old, 11).settle()
        for bucket in buckets(Weights(new), 200_000):
            vllm_engine.call(vllm_engine.stage_weights(bucket))
        vllm_engine.call(vllm_engine.ahead.settle())  # every bucket's kernels packed, none served
        served = vllm_engine.call(vllm_engine.fingerprints(shapes))
        assert {k: p.checksum for k, p in served.items()} == prints(old)
        vllm_engine.call(vllm_engine.commit_weights(12))
        assert vllm_engine.ahead.used == 4 * config["num_hidden_layers"] + 1 and config["tie_word_embeddings"]
        served = vllm_engine.call(vllm_engine.fingerprints(shapes))
        assert {k: p.checksum for k, p in served.items()} == prints(new)
    finally:
        vllm_engine.call(vllm_engine.update_weights(policy_weights, 0))


@pytest.mark.slow
def test_vllm_an_update_with_part_of_a_fused_layer_is_refused_and_changes_nothing(vllm_engine, policy_weights):
    """A sync loads straight into the served layers (``vllm_load``). An update with only part of a fused kernel
    (k_proj without q_proj and v_proj) cannot be packed from what came (and vLLM's ``reload_weights`` left q and v as
    garbage: 5e302): it is refused naming the layer, before anything changed, and the engine serves the previous
    version's weights, every tensor of them."""
    try:
        new = changed(policy_weights, seed=3)
        flow = push(vllm_engine, new, 8)
        flow.settle()
        assert flow.verified
        part = {k: v + 0.5 for k, v in new.items() if k.endswith("layers.0.self_attn.k_proj.weight")}
        flow = push(vllm_engine, part, 9)
        with pytest.raises(Exception, match=r"qkv_proj.weight: this update has \['model.layers.0.self_attn.k_proj."
                                            r"weight'\] but not every row block .* \(1 of 3\)"):
            flow.settle()
        served = vllm_engine.call(vllm_engine.fingerprints({k: tuple(v.shape) for k, v in new.items()}))
        assert {k: p.checksum for k, p in served.items()} == {k: fingerprint(v).checksum for k, v in new.items()}
        assert vllm_engine.version == 8
    finally:
        vllm_engine.call(vllm_engine.update_weights(policy_weights, 0))


@pytest.mark.slow
def test_vllm_dropped_bucket_and_tag_without_load_stop_with_the_tensor(vllm_engine, policy_weights, monkeypatch):
    stage, staged = vllm_engine.stage, []

    async def drop_first(bucket):  # the first bucket (embedding, a norm, a down_proj) never reaches the engine
        staged.append(list(bucket))
        if len(staged) != 1:
            await stage(bucket)

    try:
        monkeypatch.setattr(vllm_engine, "stage", drop_first)
        flow = push(vllm_engine, changed(policy_weights), 6, bucket_bytes=200_000)
        with pytest.raises(WeightMismatch) as err:
            flow.settle()
        assert not any(p in name for name in staged[0] for p in ("q_proj", "k_proj", "v_proj", "gate_", "up_"))
        assert err.value.tensor == staged[0][0] and err.value.version == 6 and err.value.engine == "VLLMEngine"
        assert {name for name, _ in err.value.problems} <= set(staged[0])  # only the dropped bucket's tensors
        monkeypatch.undo()

        async def no_load():  # staged, tagged, never loaded
            vllm_engine._staged = []

        monkeypatch.setattr(vllm_engine, "load", no_load)
        flow = push(vllm_engine, changed(policy_weights, seed=1), 7)
        with pytest.raises(WeightMismatch, match="VLLMEngine does not serve the weights of version 7"):
            flow.settle()
    finally:
        monkeypatch.undo()
        vllm_engine.call(vllm_engine.update_weights(policy_weights, 0))


@pytest.fixture
def vllm_lora(vllm_lora_engine, lora_lm):
    """The session's LoRA-enabled vLLM engine and the adapter (peft's names) of the policy it serves."""
    from peft import get_peft_model_state_dict

    return vllm_lora_engine, {k: v.detach().clone() for k, v in get_peft_model_state_dict(lora_lm).items()}


@pytest.mark.slow
def test_vllm_lora_adapter_verified_and_one_never_loaded_stops(vllm_lora, monkeypatch):
    engine, adapter = vllm_lora
    flow = push(engine, changed(adapter, 0.1), 1)  # B != 0: vLLM folds alpha / r = 2 into it
    flow.settle()
    assert flow.verified
    served = engine.call(engine.fingerprints({k: tuple(v.shape) for k, v in adapter.items()}))
    assert all(p.scale == (2.0 if ".lora_B." in k else 1.0) for k, p in served.items())

    async def never_loaded(tensors, version):  # the commit returns, the adapter of version 1 still serves
        pass

    monkeypatch.setattr(engine.adapters, "commit", never_loaded)
    flow = push(engine, changed(adapter, 0.1, seed=1), 2)
    with pytest.raises(WeightMismatch, match=r"VLLMEngine does not serve the weights of version 2: base_model\.model"
                                             r"\..*lora_[AB]\.weight differs.*read at adapter \d+"):
        flow.settle()


@pytest.mark.slow
def test_remote_engine_verifies_over_http_and_names_its_server(remote_engine, policy_weights, monkeypatch):
    """The same worker method behind ``/collective_rpc`` (fingerprints as JSON): a normal sync verifies, a load that
    never reaches the server stops naming the server's address."""
    try:
        flow = push(remote_engine, changed(policy_weights, seed=2), 8)
        flow.settle()
        assert flow.verified

        async def never_posted(payloads, token=None):
            pass

        monkeypatch.setattr(remote_engine, "_deliver", never_posted)
        flow = push(remote_engine, changed(policy_weights, seed=3), 9)
        with pytest.raises(WeightMismatch, match=rf"the engine at {remote_engine.url} does not serve the weights of "
                                                 r"version 9"):
            flow.settle()
    finally:
        monkeypatch.undo()
        remote_engine.call(remote_engine.update_weights(policy_weights, 0))


@pytest.mark.slow
def test_vllm_moe_experts_are_unverified_and_everything_else_verifies(vllm_moe_engine, moe_path, caplog, monkeypatch):
    """A mixture-of-experts policy on vLLM: the CPU MoE kernel repacks the expert weights in place, so they are not
    read back (one warning, ``sync/verified`` 0: no false alarm); every other tensor (the routers included, through
    their kernels) is, and a load that did nothing is still caught."""
    from safetensors.torch import load_file

    state, engine = load_file(str(Path(moe_path) / "model.safetensors")), vllm_moe_engine
    engine._warned_unverified = False  # the warning comes once per engine
    try:
        flow = push(engine, changed(state), 1)
        flow.settle()
        assert not flow.verified and "expert weights are not read back" in caplog.text
        served = engine.call(engine.fingerprints({k: tuple(v.shape) for k, v in state.items()}))
        unread = {k for k, p in served.items() if p.checksum is None}
        assert unread == {k for k in state if ".experts." in k} and unread
        assert any(".mlp.gate." in k for k in served.keys() - unread)  # a router, read through its kernel

        async def no_load():
            engine._staged = []

        monkeypatch.setattr(engine, "load", no_load)
        flow = push(engine, changed(state, seed=1), 2)
        with pytest.raises(WeightMismatch, match="VLLMEngine does not serve the weights of version 2"):
            flow.settle()
    finally:
        monkeypatch.undo()
        engine.call(engine.update_weights(state, 0))  # the session's engine goes back
