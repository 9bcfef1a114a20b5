"""Two processes on the CPU (gloo) through ``molt fit``: DDP and FSDP2 train disjoint groups per rank, FSDP2 really
shards the parameters, the engine's weights equal the gathered weights after every sync, ``max_lag=0`` stays exactly
on-policy (IS ratio 1) with several optimizer steps per batch, and an FSDP2 run resumes from its distributed
checkpoint at the saved step, version and prompt position. The tiny policy and the torch engine keep each run short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def grouped(model: dict) -> dict:
    """Flat model settings (``max_lag=0``) in the records that hold them (``rollout: {max_lag: 0}``)."""
    from dataclasses import fields

    from molt_lightning.config import Batching, MoE, Optim, Rollout

    out = dict(model)
    for key, cls in (("rollout", Rollout), ("optim", Optim), ("batching", Batching), ("moe", MoE)):
        mine = {f.name: out.pop(f.name) for f in fields(cls) if f.name in out}
        if mine:
            out[key] = mine
    return out


def recipe(tmp_path: Path, strategy: str, steps: int, name: str = "run", engine: dict | None = None,
           bucket_mb: int = 256, devices: int = 2, callbacks: tuple[dict, ...] = (), **model) -> tuple[Path, Path]:
    """A ``molt fit`` config for the tiny task (the torch engine unless ``engine``) with the ``Probe`` callback and a
    checkpoint per step in ``tmp_path / "ckpt"``; returns it and the probe's folder."""
    probe = tmp_path / f"probe-{name}"
    model = grouped({"group_size": 4, "prompts_per_step": 4, "lr": 3.0e-4, **model})
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": devices, "strategy": strategy, "max_steps": steps,
            "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": name}},
            "callbacks": [
                {"class_path": "dist_probe.Probe", "init_args": {"out": str(probe)}},
                {"class_path": "molt_lightning.callbacks.WeightSync", "init_args": {"bucket_mb": bucket_mb}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 1, "save_last": True}},
                *callbacks,
            ],
        },
        "model": {"engine": engine or {"class_path": "molt_lightning.engines.TorchEngine", "init_args": {"seed": 0}},
                  "agent": "molt_lightning.tasks.arithmetic.calculator_agent",
                  "tasks": "molt_lightning.tasks.arithmetic.tasks", "torch_threads": 1, **model},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, probe


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT / 'tests' / 'helpers'}:{ROOT}"}


def fit(tmp_path: Path, strategy: str, steps: int, name: str = "run", ckpt: str | None = None, **kw) -> Path:
    path, probe = recipe(tmp_path, strategy, steps, name, **kw)
    args = [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", str(path)]
    if ckpt:
        args += ["--ckpt_path", ckpt]
    out = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return probe


def records(probe: Path, rank: int, event: str) -> list[dict]:
    lines = [json.loads(x) for x in (probe / f"rank{rank}.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


def metrics(tmp_path: Path, name: str) -> pd.DataFrame:
    [run] = sorted((tmp_path / name).iterdir())[-1:]
    return pd.read_csv(run / "metrics.csv")


def check_disjoint_groups_and_exact_sync(probe: Path, steps: int, first_version: int = 0, changing: bool = True):
    step0, step1 = records(probe, 0, "step"), records(probe, 1, "step")
    assert [r["version"] for r in step0] == [r["version"] for r in step1] == list(range(first_version, steps))
    for a, b in zip(step0, step1):
        assert a["samples"] and b["samples"] and not set(a["samples"]) & set(b["samples"])  # no prompt twice
        assert sorted(a["samples"] + b["samples"]) == a["all_samples"] == b["all_samples"]  # together: the batch
        assert len(a["all_samples"]) == 4  # prompts_per_step groups
    syncs = records(probe, 0, "sync")
    assert [s["version"] for s in syncs] == [s["engine_version"] for s in syncs] == list(range(first_version, steps))
    assert all(s["max_abs_diff"] == 0.0 for s in syncs)  # the engine holds exactly the gathered weights
    if changing:  # and they change every step (unless a batch had no learning signal, e.g. every reward 0)
        assert len({s["checksum"] for s in syncs}) == len(syncs)


def check_on_policy_mini_batches(tmp_path: Path, probe: Path, strategy: str, versions: int) -> pd.DataFrame:
    """Disjoint groups per rank, exact syncs, each rank's share of every tensor, and ``max_lag=0`` with two optimizer
    steps per batch (mini-batches) and micro-batches: the IS ratio stays 1. Returns the logged steps."""
    check_disjoint_groups_and_exact_sync(probe, steps=versions)
    shares = [records(probe, rank, "shares")[0]["shares"] for rank in (0, 1)]
    for name, share in shares[0].items():
        if strategy == "fsdp2":  # each rank holds its half of every tensor (dim 0 split; an odd size is off by one)
            assert 0.4 <= share <= 0.6 and abs(share + shares[1][name] - 1) < 1e-9, name
        else:
            assert share == 1.0
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    assert len(steps) == versions and steps["lag/max"].max() == 0
    assert (steps["batch/optimizer_steps"] == 2).all()
    assert ((steps["is/ratio_min"] - 1).abs() < 1e-3).all() and ((steps["is/ratio_max"] - 1).abs() < 1e-3).all()
    assert records(probe, 0, "step")[-1]["global_step"] == 2 * versions  # optimizer steps; versions count batches
    return steps


ON_POLICY = dict(max_lag=0, mini_batches=2, micro_batch_tokens=96)


@pytest.mark.slow
def test_two_ddp_ranks_train_a_lora_adapter_on_policy_with_exact_sync(tmp_path):
    """model.lora under DDP, on policy with mini- and micro-batches: disjoint groups per rank, the engine holds exactly
    rank 0's adapter after every sync (the run that was also test_ddp_trains_a_lora_adapter_with_exact_sync)."""
    probe = fit(tmp_path, "ddp", steps=6, lora={"r": 8, "alpha": 16}, **ON_POLICY)
    steps = check_on_policy_mini_batches(tmp_path, probe, "ddp", versions=3)
    assert (steps["perf/sync_bytes"] == 188_416).all()  # the tiny policy's r=8 adapter


@pytest.mark.slow
def test_two_fsdp2_ranks_train_disjoint_groups_on_policy_with_exact_sync(tmp_path):
    """FSDP2 on policy with mini- and micro-batches: each rank holds half of every tensor."""
    check_on_policy_mini_batches(tmp_path, fit(tmp_path, "fsdp2", steps=6, **ON_POLICY), "fsdp2", versions=3)


@pytest.fixture(scope="module")
def one_process_sgd(tmp_path_factory):
    return sgd_weights("auto", 1, tmp_path_factory.mktemp("sgd"))


def sgd_weights(strategy: str, devices: int, tmp: Path) -> dict:
    import torch

    out = tmp / f"{strategy}.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "sgd_step.py"), strategy, str(devices),
                          str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.slow
def test_two_ranks_take_the_same_step_as_one_process(strategy, one_process_sgd, tmp_path, policy_path):
    """Two SGD steps (lr 1: the gradient's scale shows, unlike Adam's) on one batch, micro-batched, by two ranks:
    the weights equal the one-process run's (the loss normalizers are batch-wide and the ranks' average is undone)."""
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(policy_path).named_parameters())
    two = sgd_weights(strategy, 2, tmp_path)
    moved = max(float((one_process_sgd[k] - start[k].detach()).abs().max()) for k in two)
    diff = max(float((one_process_sgd[k] - two[k]).abs().max()) for k in two)
    assert moved > 1e-3 and diff < 1e-6, (moved, diff)


@pytest.mark.slow
def test_fsdp2_resumes_from_its_distributed_checkpoint(tmp_path):
    """An FSDP2 run resumes from its distributed checkpoint at the saved step, version and prompt position; before
    that, ``molt export`` makes one folder of the checkpoint, whose logprobs equal those the sharded trainer computed
    at the end (every rank in the forward) within 1e-5, and ``molt eval`` evaluates that folder."""
    first = fit(tmp_path, "fsdp2", steps=4, name="first", max_lag=1, updates_per_batch=2)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_dir()  # a distributed checkpoint: a folder of shards
    exported_and_evaluated(tmp_path, ckpt, trainer_side=torch.load(first / "logprobs.pt"))
    seen_first = {s for r in records(first, 0, "step") + records(first, 1, "step") for s in r["samples"]}
    second = fit(tmp_path, "fsdp2", steps=8, name="second", ckpt=str(ckpt), max_lag=1, updates_per_batch=2)
    # max_steps counts optimizer steps: 2 batches x 2 updates per run; the resumed run trains versions 2 and 3
    check_disjoint_groups_and_exact_sync(second, steps=4, first_version=2)
    seen_second = {s for r in records(second, 0, "step") + records(second, 1, "step") for s in r["samples"]}
    assert seen_first and not seen_first & seen_second  # continues at the saved prompt position
    for r in records(second, 0, "step"):
        assert r["version"] - r["token_versions"][0] <= 1  # lag bound holds across the resume


def exported_and_evaluated(tmp_path: Path, ckpt: Path, trainer_side) -> None:
    from test_export import EVAL_RECIPE, logprobs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT / 'tests' / 'helpers'}:{ROOT}"}
    molt = [sys.executable, "-m", "molt_lightning.commands.cli"]
    done = subprocess.run([*molt, "export", str(ckpt), str(tmp_path / "hf")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (logprobs(loaded, AutoTokenizer.from_pretrained(tmp_path / "hf")) - trainer_side).abs().max() < 1e-5
    (tmp_path / "eval.yaml").write_text(EVAL_RECIPE)
    done = subprocess.run([*molt, "eval", "--config", str(tmp_path / "eval.yaml"), "--model.policy",
                           str(tmp_path / "hf"), "--out", str(tmp_path / "eval.json")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["metrics"]["heldout"]["prompts"] == 6 and len(result["per_prompt"]["heldout"]) == 6
    assert "heldout: 6 prompts x 2 runs" in done.stdout


@pytest.mark.slow
def test_fsdp2_with_vllm_syncs_every_bucket(tmp_path):
    """Rank 0's in-process vLLM engine under FSDP2, weights sent in many small buckets (one safetensors file each):
    at max_lag=0 the IS ratio is 1 only if vLLM serves exactly the gathered weights of every version."""
    vllm = {"class_path": "molt_lightning.engines.VLLMEngine", "init_args": {"seed": 0, "cpu_threads": "1"}}
    probe = fit(tmp_path, "fsdp2", steps=3, engine=vllm, max_lag=0, bucket_mb=1)
    steps0, steps1 = records(probe, 0, "step"), records(probe, 1, "step")
    assert [r["version"] for r in steps0] == [r["version"] for r in steps1] == [0, 1, 2]
    for a, b in zip(steps0, steps1):
        assert not set(a["samples"]) & set(b["samples"]) and sorted(a["samples"] + b["samples"]) == a["all_samples"]
        assert a["token_versions"] == [a["version"], a["version"]]
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    assert ((steps["is/ratio_min"] - 1).abs() < 1e-3).all() and ((steps["is/ratio_max"] - 1).abs() < 1e-3).all()


@pytest.mark.slow
def test_fsdp2_with_critic_reference_and_activation_checkpointing(tmp_path):
    """The paths that need more than the policy under FSDP2: a value head whose predictions are gathered from both
    ranks (GAE sees the whole batch), a sharded frozen reference (KL), and activation checkpointing."""
    algo = {"advantage": "gae", "lam": 0.95, "kl_coef": 0.05}
    probe = fit(tmp_path, "fsdp2", steps=4, max_lag=1, algo=algo, activation_checkpointing=True)
    check_disjoint_groups_and_exact_sync(probe, steps=4, changing=False)  # a first batch may hold only 0 rewards
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    assert len(steps) == 4 and steps["loss/value"].notna().all()
    assert steps["kl/ref"].iloc[0] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert steps["kl/ref"].iloc[-1] > 0 and steps["value/mean"].abs().iloc[-1] > 0  # both moved once rewards came
