"""Shared-memory weight slabs (``engines.shm``) and the direct load's planning (``engines.vllm_load``): what a vLLM
sync stages and how the worker views it, without a vLLM engine (``test_fingerprints`` and ``test_engines`` check the
served weights after real syncs)."""

from __future__ import annotations

import os

import pytest
import torch

from molt_lightning.engines.vllm import shm
from molt_lightning.engines.vllm.cpu import _block, apply


@pytest.fixture
def staging(tmp_path):
    s = shm.Staging(str(tmp_path))
    yield s
    s.close()


def bucket(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.q_proj.weight": torch.randn(4, 3, generator=g), "a.k_proj.weight": torch.randn(2, 3, generator=g),
            "a.v_proj.weight": torch.randn(2, 3, generator=g), "norm.weight": torch.randn(3, generator=g),
            "half": torch.randn(5, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 3)}


def test_a_slab_round_trips_and_is_written_again_in_place(staging):
    first = staging.write(bucket(0))
    seen = shm.read([first.to_wire()])  # the worker's views
    assert {k: v.dtype for k, v in seen.items()} == {k: v.dtype for k, v in bucket(0).items()}
    assert all(torch.equal(seen[k], v) for k, v in bucket(0).items())
    second = staging.write(bucket(1))  # the next sync: same layout, same file, new values
    assert second == first and staging.paths == [first.path]
    assert all(torch.equal(seen[k], v) for k, v in bucket(1).items())  # visible through the old views: no copy
    other = staging.write({"x": torch.ones(2)})  # another layout: another slab
    assert other.path != first.path and len(staging.paths) == 2


def test_offsets_are_aligned_and_row_blocks_lie_back_to_back(staging):
    slab = staging.write(bucket(0))
    assert all(offset % shm.ALIGN == 0 for *_, offset in slab.index)
    seen = shm.read([slab])
    q, k, v = (seen[f"a.{p}_proj.weight"] for p in "qkv")
    assert q.dtype == torch.float32 and (4 * 3 * 4) % shm.ALIGN != 0  # 48 bytes: padded, so not back to back
    fused = _block([q, k, v])  # falls back to a copy
    assert torch.equal(fused, torch.cat([q, k, v]))
    wide = staging.write({"q": torch.randn(2, 16), "k": torch.randn(1, 16), "v": torch.randn(1, 16)})  # 64-byte rows
    parts = list(shm.read([wide]).values())
    view = _block(parts)
    assert view.data_ptr() == parts[0].data_ptr() and torch.equal(view, torch.cat(parts))  # one view, no copy


def test_forgotten_names_leave_dev_shm_but_the_mapping_works(staging):
    slab = staging.write(bucket(0))
    seen = shm.read([slab], live=staging.paths)
    staging.forget()
    assert not os.path.exists(slab.path)
    staging.write(bucket(2))
    again = shm.read([slab], live=staging.paths)  # the worker's kept mapping, though the name is gone
    assert all(torch.equal(again[k], v) and torch.equal(seen[k], v) for k, v in bucket(2).items())


def test_a_slab_that_is_gone_says_which_channel_to_use(staging, tmp_path):
    slab = staging.write(bucket(0))
    staging.close()
    shm.read([], live=[])  # the worker drops mappings the trainer no longer has
    with pytest.raises(FileNotFoundError, match="channel='http' or 'nccl'"):
        shm.read([slab])


def test_slabs_cross_the_wire_as_json():
    import json

    slab = shm.Slab("/dev/shm/x", (("w", "float32", (2, 3), 0), ("b", "bfloat16", (3,), 64)))
    assert shm.Slab.from_wire(json.loads(json.dumps(slab.to_wire()))) == slab


class _Packed(torch.nn.Module):
    """A layer that computes with a kept weight through a kernel packed from it (vLLM's CPU embedding and head)."""

    def __init__(self, weight, bias=None, packs=None):
        super().__init__()
        self.weight, self.bias, self.packs = weight, bias, packs
        self.quant_method = self
        self.cpu_linear = None

    def process_weights_after_loading(self, layer):  # its own quant method: ``self`` is the served layer, ``layer``
        layer.packs.append(self)  # what is packed (a shallow copy of it, when the load packs on one)
        w = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, w=w: x @ w.T


def test_layers_tied_to_one_weight_share_one_kernel_packed_from_the_new_weight():
    packs = []
    weight = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    model = torch.nn.Module()
    model.embed, model.head = _Packed(weight, packs=packs), _Packed(weight, packs=packs)
    model.biased = _Packed(weight, bias=torch.nn.Parameter(torch.ones(4)), packs=packs)  # its own pack: bias
    new = torch.arange(12.0).reshape(4, 3)
    apply(model, [(model.embed, "weight", [(0, new)])])
    assert packs == [model.embed, model.biased]  # once for the tied pair, once for the layer with a bias
    assert model.head.cpu_linear is model.embed.cpu_linear
    x = torch.eye(3)
    for m in (model.embed, model.head, model.biased):
        torch.testing.assert_close(m.cpu_linear(x, None, None), new.T)


class UnquantizedLinearMethod:
    """Stands in for vLLM's CPU linear method (the direct load goes by its name): packs the weight into a kernel and
    empties the parameter, recording each pack by the layer's name (a pack ahead packs a shallow copy of it)."""

    def __init__(self, packs: list, keep: bool = False):
        self.packs, self.keep = packs, keep

    def process_weights_after_loading(self, layer):
        self.packs.append(layer.name)
        w = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, w=w: x @ w.T
        if not self.keep:
            layer.weight = torch.nn.Parameter(torch.empty(0, w.shape[1]), requires_grad=False)


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    def __init__(self, packs: list):
        super().__init__(packs, keep=True)


def _served(packs: list) -> torch.nn.Module:
    """A vLLM-like model: q/k/v served fused (rows 4, 2, 2) in a layer whose weight lives only in its kernel, and an
    embedding tied to the output head, each computing through a kernel packed from the kept weight."""
    model = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model.a = torch.nn.Module()
    model.a.qkv_proj = qkv = torch.nn.Module()
    qkv.output_sizes, qkv.output_size_per_partition, qkv.name = [4, 2, 2], 8, "qkv"
    qkv.weight = torch.nn.Parameter(torch.zeros(8, 3), requires_grad=False)
    qkv.quant_method = UnquantizedLinearMethod(packs)
    qkv.quant_method.process_weights_after_loading(qkv)
    tied = torch.nn.Parameter(torch.zeros(5, 3), requires_grad=False)
    for name in ("embed", "head"):
        layer = torch.nn.Module()
        layer.weight, layer.quant_method, layer.name = tied, UnquantizedEmbeddingMethod(packs), name
        layer.quant_method.process_weights_after_loading(layer)
        setattr(model, name, layer)
    packs.clear()
    return model


def test_kernels_packed_ahead_leave_the_served_layers_alone_until_the_commit_swaps_them_in():
    pytest.importorskip("vllm")  # the plan asks vLLM's platform
    from molt_lightning.engines.vllm.cpu import Prepacked, plan

    packs = []
    model = _served(packs)
    served = {name: m.cpu_linear for name, m in (("qkv", model.a.qkv_proj), ("embed", model.embed))}
    g = torch.Generator().manual_seed(0)
    new = {n: torch.randn(r, 3, generator=g) for n, r in (("embed.weight", 5), ("a.q_proj.weight", 4),
                                                          ("a.k_proj.weight", 2), ("a.v_proj.weight", 2))}
    ahead = Prepacked(model, "sync-1")
    ahead.add("slab-0", {k: new[k] for k in ("embed.weight", "a.q_proj.weight")})  # q/k/v not all here yet
    assert packs == ["embed"] and set(ahead.ready) == {id(model.embed), id(model.head)}  # packed once, shared
    ahead.add("slab-1", {k: new[k] for k in ("a.k_proj.weight", "a.v_proj.weight")})
    assert packs == ["embed", "qkv"] and id(model.a.qkv_proj) in ahead.ready
    x = torch.eye(3)
    assert model.a.qkv_proj.cpu_linear is served["qkv"] and model.embed.cpu_linear is served["embed"]
    assert model.a.qkv_proj.weight.numel() == 0 and not model.embed.weight.any()  # nothing served changed
    assert ahead.covers("sync-1", ["slab-0", "slab-1"])
    assert not ahead.covers("sync-2", ["slab-0", "slab-1"]) and not ahead.covers("sync-1", ["slab-1"])

    assert apply(model, plan(model, new), ahead.ready) == 2  # qkv's and the tied pair's: swapped in, not packed
    assert len(packs) == 2
    fused = torch.cat([new[f"a.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(model.a.qkv_proj.cpu_linear(x, None, None), fused.T)
    for m in (model.embed, model.head):
        torch.testing.assert_close(m.cpu_linear(x, None, None), new["embed.weight"].T)
    assert torch.equal(model.embed.weight, new["embed.weight"]) and model.head.weight is model.embed.weight

    ahead.add("slab-0", {"embed.weight": new["embed.weight"]})  # staged again under one token: written again
    assert set(ahead.ready) == {id(model.embed), id(model.head)} and ahead.paths == ["slab-0"]
