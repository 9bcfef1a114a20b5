"""Expert parallelism (``--trainer.strategy fsdp2_ep``, ``expert_parallel``) on the tiny MoE with two processes on the
CPU (gloo): one sparse layer's forward and backward equal transformers' experts (uneven and empty splits); each rank
holds half of every expert tensor, and two SGD steps at lr 1 land on the one-process weights with free and replayed
routing (the experts' gradient scale shows: without the 1/world they are off by 0.025); the weight push gathers the
full Hugging Face expert tensors and a torch engine receives exactly them; a dense policy or an expert count the ranks
do not divide is a clear error. The one-process reference runs the stock transformers experts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MOE = "molt_lightning.models.tiny.moe_policy"


def ep_step(strategy: str, devices: int, routing: str, tmp: Path) -> dict:
    out = tmp / f"{strategy}-{routing}.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "ep_step.py"), strategy, str(devices),
                          str(out), routing], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(out)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_ep_experts_equal_the_stock_experts_forward_and_backward_with_uneven_and_empty_splits(tmp_path):
    """One sparse layer on 2 gloo processes (``helpers/ep_forward.py``) against transformers' experts in one: the
    outputs and the gradients of hidden states, routing weights and (times world) this rank's expert block."""
    import json

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    helper = ROOT / "tests" / "helpers" / "ep_forward.py"
    run = subprocess.run([sys.executable, str(helper), str(tmp_path / "rendezvous")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-4000:]}"
    cases = {c["case"]: c for c in map(json.loads, run.stdout.splitlines())}
    assert set(cases) == {"random", "skewed", "local"}
    for case in cases.values():
        for d in case["ranks"]:
            assert d["out"] < 1e-6 and d["grad_hidden"] < 1e-6 and d["grad_weights"] < 1e-6, case
            assert d["grad_gate_up"] < 1e-5 and d["grad_down"] < 1e-5, case
    skewed = cases["skewed"]["ranks"]  # rank 1 computed rank 0's tokens, rank 0's experts got none
    assert skewed[1]["ref_grad_gate_up_max"] > 0.1 and skewed[0]["ref_grad_gate_up_max"] == 0.0


@pytest.mark.parametrize("routing", ["free", "replay"])
@pytest.mark.slow
def test_two_ranks_with_half_the_experts_each_take_the_same_step_as_one_process(routing, tmp_path):
    from transformers import AutoModelForCausalLM

    from molt_lightning.models.tiny import moe_policy

    one, two = ep_step("auto", 1, routing, tmp_path), ep_step("fsdp2_ep", 2, routing, tmp_path)
    for rank, local in enumerate(two["local"]):  # every expert tensor: 4 of the 8 experts on each rank
        assert len(local) == 4 and all(shape[0] == 4 for shape in local.values()), (rank, local)
    assert all(shape[0] == 8 for shape in one["local"][0].values())
    hf = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(moe_policy()).named_parameters()}
    assert max_diff(two["start"], hf) == 0.0  # the gathered state is the checkpoint's, experts (8, 2I, H) included
    assert two["start"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert two["start"]["model.layers.0.mlp.experts.down_proj"].shape == (8, 128, 64)
    # the same loss: the micro-batches differ (each rank has its own rows) but their batch-normalized sum does not
    assert abs(sum(map(sum, one["losses"])) - sum(map(sum, two["losses"]))) < 1e-6
    norms = two["grad_norms"]  # every rank computes the global norm, over all the experts: the one-process norm
    assert len(norms[0]) == 2 and norms[0] == norms[1]
    assert max(abs(a / b - 1) for a, b in zip(norms[0], one["grad_norms"][0])) < 1e-5, (norms, one["grad_norms"])
    moved = min(float((one["final"][k] - hf[k]).abs().max()) for k in hf if "experts" in k)
    diff = max_diff(one["final"], two["final"])
    assert moved > 1e-3 and diff < 1e-6, (moved, diff)  # a wrong expert-gradient scale is off by ~moved
    # the push (small buckets, experts and FSDP2 shards interleaved): the engine holds exactly the gathered weights
    assert two["buckets"] > 4 and max_diff(two["engine"], two["final"]) == 0.0


class _Mesh:  # a stand-in for the data-parallel mesh: shard_experts checks before any collective
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return 0

    def __getitem__(self, name):
        return self


def _ep_strategy(world: int):
    from lightning.pytorch.strategies import StrategyRegistry

    from molt_lightning.trainer.parallel import STRATEGIES, FSDP2EPStrategy

    assert "fsdp2_ep" in STRATEGIES  # the CLI accepts it
    strategy = StrategyRegistry.get("fsdp2_ep")
    assert isinstance(strategy, FSDP2EPStrategy)
    strategy._device_mesh = _Mesh(world)
    return strategy


def test_a_dense_policy_or_experts_the_ranks_do_not_divide_are_clear_errors(policy_path):
    from transformers import AutoModelForCausalLM

    from molt_lightning.models.tiny import moe_policy
    from molt_lightning.trainer.parallel import shard
    from molt_lightning.trainer.policy import Policy

    dense = Policy(AutoModelForCausalLM.from_pretrained(policy_path))
    with pytest.raises(ValueError, match="is dense.*use --trainer.strategy fsdp2"):
        shard(dense, _ep_strategy(2))
    sparse = Policy(AutoModelForCausalLM.from_pretrained(moe_policy()))
    with pytest.raises(ValueError, match="8 experts per layer do not split evenly over 3 ranks.*divides 8"):
        shard(sparse, _ep_strategy(3))
    assert all(p.ndim < 3 or p.shape[0] == 8 for p in sparse.parameters())  # refused before anything was split


@pytest.mark.slow
def test_molt_fit_with_expert_parallelism_stays_on_policy_with_exact_sync(tmp_path):
    """``molt fit`` on the tiny MoE, ``fsdp2_ep`` on 2 ranks, routing replay, ``max_lag=0``: disjoint groups per rank,
    half of every expert tensor per rank, the engine serves exactly the gathered weights after every sync, and the
    IS ratio is 1 (the EP forward's logprobs equal the engine's); the distributed checkpoint holds the full expert
    tensors and a run resumes from it."""
    from test_distributed import check_disjoint_groups_and_exact_sync, fit, metrics, records

    probe = fit(tmp_path, "fsdp2_ep", steps=3, policy=MOE, routing="replay", max_lag=0)
    check_disjoint_groups_and_exact_sync(probe, steps=3, changing=False)  # a first batch may hold only 0 rewards
    syncs = records(probe, 0, "sync")
    assert syncs[0]["checksum"] != syncs[-1]["checksum"]  # the weights moved
    for rank in (0, 1):
        shares = records(probe, rank, "shares")[0]["shares"]
        experts = {n: s for n, s in shares.items() if "experts" in n}
        assert len(experts) == 4 and all(s == 0.5 for s in experts.values()), experts
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    assert len(steps) == 3 and steps["lag/max"].max() == 0
    assert ((steps["is/ratio_min"] - 1).abs() < 1e-3).all() and ((steps["is/ratio_max"] - 1).abs() < 1e-3).all()
    # the distributed checkpoint holds the full expert tensors, and a run resumes from it with exactly those weights
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "ckpt" / "last.ckpt", tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", weights_only=False)["state_dict"]
    lm = {k[len("policy.lm."):]: v for k, v in saved.items() if k.startswith("policy.lm.")}
    assert lm["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    from transformers import AutoModelForCausalLM

    from molt_lightning.commands.export import export  # molt export reads the same shards into one Hugging Face folder

    exported = AutoModelForCausalLM.from_pretrained(export(str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "hf")))
    assert all(torch.equal(p, lm[n]) for n, p in exported.named_parameters())
    resumed = fit(tmp_path, "fsdp2_ep", steps=4, name="resumed", ckpt=str(tmp_path / "ckpt" / "last.ckpt"),
                  policy=MOE, routing="replay", max_lag=0)
    [sync] = records(resumed, 0, "sync")
    assert sync["version"] == sync["engine_version"] == 3 and sync["max_abs_diff"] == 0.0
    from molt_lightning.models.tiny import moe_policy

    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(moe_policy()).named_parameters()]  # tied head once
    assert sync["checksum"] == pytest.approx(float(sum(lm[n].double().sum() for n in names)), rel=1e-12, abs=0)
