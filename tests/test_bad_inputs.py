"""Every bad input answered: what a new user who mistypes a recipe reads, one test per mistake.

Each error must name the problem (the key, the value or the file) and the fix, in a few lines: no traceback and no
page of usage. ``molt fit`` runs in-process here (the parse and the checks take well under a second; a subprocess
pays ~7 s of imports), once as a subprocess to see exactly what the shell shows, and once for real on a full disk.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from molt_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
FAST = """\
seed_everything: 0
trainer: {accelerator: cpu, devices: 1, max_steps: 1, logger: false, enable_checkpointing: false,
          enable_progress_bar: false}
model:
  engine: molt_lightning.engines.TorchEngine
  agent: molt_lightning.tasks.arithmetic.calculator_agent
  tasks: molt_lightning.tasks.arithmetic.tasks
  rollout: {group_size: 2, prompts_per_step: 2}
  torch_threads: 1
"""


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["molt"])  # else LightningCLI warns that it got both argv and args


@pytest.fixture
def recipe(tmp_path, policy_path):
    path = tmp_path / "recipe.yaml"
    root = f"enable_progress_bar: false, default_root_dir: {tmp_path}}}"  # where LightningCLI puts config.yaml
    path.write_text(FAST.replace("enable_progress_bar: false}", root) + f"  policy: {policy_path}\n")
    return str(path)


def answer(capsys, *args: str) -> str:
    """``molt fit ARGS`` must stop with an error; returns what the user reads (stderr), checked to be short."""
    with pytest.raises(SystemExit) as stop:
        main(["fit", *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 16, err  # no traceback, no page of options
    return err


# ----- the recipe file -----
def test_yaml_syntax_error_names_the_file_the_line_and_the_fix(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  rollout:\n    group_size: 2\n     prompts_per_step: 2\n")
    err = answer(capsys, "--config", str(bad))
    assert f"in {bad}, line 4, column 22" in err
    assert "fix: the recipe is not valid YAML" in err and "indenting" in err


@pytest.mark.slow
def test_the_shell_sees_a_few_lines_not_a_page_of_usage(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  rollout: {group_size: [2\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", str(bad)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: molt fit --config RECIPE.yaml [--trainer.KEY VALUE] [--model.KEY VALUE]\n")
    assert len(out.stderr.splitlines()) <= 8 and "fix: the recipe is not valid YAML" in out.stderr


def test_unknown_top_level_key_suggests_the_right_one(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle:\n  rollout:\n    group_size: 2\n")
    err = answer(capsys, "--config", str(bad))
    assert "does not accept option 'modle.rollout.group_size'" in err
    assert "did you mean model.rollout.group_size?" in err


@pytest.mark.parametrize("where", ["recipe", "flag"])
def test_unknown_model_key_suggests_the_right_one(tmp_path, capsys, where):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  rollout:\n    group_sise: 2\n")
    err = answer(capsys, "--config", str(bad)) if where == "recipe" else \
        answer(capsys, "--model.rollout.group_sise", "2")
    assert "group_sise" in err and "did you mean model.rollout.group_size?" in err and "molt fit --help" in err


@pytest.mark.parametrize("old, new", [("group_size", "rollout.group_size"), ("lr", "optim.lr"),
                                      ("micro_batch_tokens", "batching.micro_batch_tokens"),
                                      ("routing", "moe.routing")])
def test_a_key_from_before_the_grouping_names_its_group(capsys, old, new):
    err = answer(capsys, f"--model.{old}", "2")
    assert f"did you mean model.{new}?" in err, err


def test_unknown_init_arg_names_what_the_class_takes(capsys):
    err = answer(capsys, "--model.engine", "molt_lightning.engines.TorchEngine", "--model.engine.init_args.devic", "x")
    assert "'devic' is not accepted" in err
    assert "did you mean init_args.device? TorchEngine takes device, dtype" in err


# ----- dotted paths: do not import, or import the wrong kind of object -----
@pytest.mark.parametrize("flag, value, fix", [
    ("--model.agent", "no_such_pkg.agent", "async def agent(client, sample)"),
    ("--model.agent", "molt_lightning.tasks.arithmetic.no_such_agent", "calculator_agent"),
    ("--model.tasks", "molt_lightning.tasks.nope.tasks", "tasks(seed)"),
    ("--model.engine", "molt_lightning.engines.NoSuchEngine", "molt_lightning.engines.TorchEngine"),
    ("--trainer.callbacks+", "molt_lightning.callbacks.NoSuch", "lightning.pytorch.callbacks.ModelCheckpoint"),
])
def test_a_dotted_path_that_does_not_import(capsys, flag, value, fix):
    err = answer(capsys, flag, value)
    assert value in err and f"fix: {flag.strip('-+')} takes" in err and fix in err


@pytest.mark.parametrize("value, problem", [
    ("molt_lightning.models.tiny.no_such", "does not import (module 'molt_lightning.models.tiny' has no attribute"),
    ("/no/such/folder", "'/no/such/folder': no such folder"),
    ("HuggingFaceTB/SmolLM2-135M", "a hub id is not fetched: download it to a folder first"),
])
def test_a_policy_that_does_not_resolve(recipe, capsys, value, problem):
    err = answer(capsys, "--config", recipe, "--model.policy", value)
    assert problem in err and "give model.policy a local Hugging Face model folder" in err


@pytest.mark.parametrize("flag, value, problem", [
    ("--model.agent", "molt_lightning.tasks.arithmetic", "Unexpected import object <module"),
    ("--model.agent", "molt_lightning.tasks.arithmetic.tasks",
     "model.agent molt_lightning.tasks.arithmetic.tasks is not an async function: declare it `async def agent"),
    ("--model.tasks", "molt_lightning.tasks.arithmetic.calculator_agent",
     "is async: it must be a plain function (or generator) `tasks(seed)`"),
    ("--model.policy", "molt_lightning.tasks.arithmetic", "is a module, not a function"),
    ("--model.policy", "molt_lightning.tasks.arithmetic.tasks", "returned <generator object"),
    ("--model.engine", "molt_lightning.callbacks.RewardPlot", "not correspond to a subclass of RolloutEngine"),
    ("--trainer.callbacks+", "molt_lightning.engines.TorchEngine", "not correspond to a subclass of Callback"),
])
def test_a_dotted_path_to_the_wrong_kind_of_object(recipe, capsys, flag, value, problem):
    err = answer(capsys, "--config", recipe, flag, value)
    assert value in err and problem in err
    assert "fix:" in err or "declare it" in err or "must" in err or "give model.policy" in err


def test_an_agent_with_the_wrong_parameters(recipe, capsys):
    err = answer(capsys, "--config", recipe, "--model.agent", "tests.test_bad_inputs.agent_without_sample")
    assert "model.agent tests.test_bad_inputs.agent_without_sample must take (client, sample)" in err


def test_a_recipe_without_agent_or_tasks_is_told_what_they_are(capsys):
    err = answer(capsys, "--model.engine", "molt_lightning.engines.TorchEngine")
    assert "required: fit.model.agent, fit.model.tasks" in err
    assert "fix: model.agent takes the dotted path of an `async def agent(client, sample) -> reward`" in err
    assert "model.tasks takes the dotted path of a function `tasks(seed)`" in err


async def agent_without_sample(client):
    return 0.0


def test_a_folder_that_is_no_model(recipe, tmp_path, capsys):
    err = answer(capsys, "--config", recipe, "--model.policy", str(tmp_path))
    assert f"folder {tmp_path} has no config.json" in err and "model.save_pretrained(folder)" in err


# ----- wrong types and ranges -----
@pytest.mark.parametrize("flag, value, problem", [
    ("--model.rollout.group_size", "abc", "Expected a <class 'int'>. Got value: abc"),
    ("--model.optim.lr", "fast", "Expected a <class 'float'>. Got value: fast"),
    ("--model.rollout.group_size", "0", "model.rollout.group_size must be >= 1, got 0"),
    ("--model.rollout.prompts_per_step", "-2", "model.rollout.prompts_per_step must be >= 1, got -2"),
    ("--model.rollout.max_lag", "-1", "model.rollout.max_lag must be >= 0, got -1"),
    ("--model.batching.logit_chunk_tokens", "0", "model.batching.logit_chunk_tokens must be >= 1, got 0"),
    ("--model.rollout.temperature", "0", "temperature must be > 0"),
    ("--model.batching.mini_batches", "0", "model.batching.mini_batches must be >= 1, got 0"),
    ("--model.dtype", "float17", "model.dtype 'float17' is not a torch floating-point dtype: use float32, bfloat16"),
    ("--model.algo.advantage", "nope", "unknown advantage 'nope': use one of ['dr_grpo'"),
    ("--trainer.strategy", "fsdp", "'fsdp' is not supported: use auto (one process), ddp, fsdp2"),
])
def test_a_wrong_type_or_range_is_answered_before_anything_starts(recipe, capsys, flag, value, problem):
    err = answer(capsys, "--config", recipe, flag, value)
    assert problem in err, err


# ----- a tokenizer and a model that disagree -----
def test_a_tokenizer_larger_than_the_embeddings(tmp_path, policy_path, tokenizer, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "mismatch"
    cfg = LlamaConfig(vocab_size=200, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # 291 tokens: ids 200-290 have no embedding row
    err = answer(capsys, "--model.policy", str(folder), "--model.engine", "molt_lightning.engines.TorchEngine",
                 "--model.agent", "molt_lightning.tasks.arithmetic.calculator_agent",
                 "--model.tasks", "molt_lightning.tasks.arithmetic.tasks")
    assert f"the tokenizer in {folder} has {len(tokenizer)} tokens but the policy's embeddings hold 200" in err
    assert "Save the model's own tokenizer beside it, or resize the embeddings" in err


# ----- a full disk when checkpointing -----
def test_a_full_disk_names_the_folder_the_space_and_the_fix_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from molt_lightning.callbacks.checkpoint import AtomicCheckpointIO, DiskFull

    io, ckpt = AtomicCheckpointIO(), tmp_path / "ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(4)}, ckpt / "last.ckpt")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        io.save_checkpoint({"step": 2, "w": torch.zeros(4)}, ckpt / "last.ckpt")
    msg = str(e.value)
    assert isinstance(e.value, DiskFull) and e.value.errno == errno.ENOSPC
    assert f"no space left in {ckpt} for checkpoint last.ckpt" in msg
    assert "MiB free there" in msg and "point the checkpoints at a larger disk" in msg and "save_top_k" in msg
    assert f"resume with --ckpt_path {ckpt / 'last.ckpt'}" in msg
    assert torch.load(ckpt / "last.ckpt")["step"] == 1  # the last good checkpoint, whole
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt"]  # no partial file left behind


@pytest.mark.slow
def test_molt_fit_stops_on_a_full_disk_with_that_message(recipe, tmp_path, monkeypatch, capsys):
    """Through Lightning: the CLI installs the atomic writer, the second save fails (one line, exit 1), the first
    stays loadable."""
    ckpt = tmp_path / "ckpt"
    calls = []

    def fill_up(fd):
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fill_up)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", recipe, "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
              "--trainer.callbacks.dirpath", str(ckpt), "--trainer.callbacks.every_n_train_steps", "1",
              "--trainer.callbacks.save_top_k", "-1"])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"molt: no space left in {ckpt} for checkpoint")
    [kept] = ckpt.iterdir()
    assert kept.name == "epoch=0-step=1.ckpt" and torch.load(kept, weights_only=False)["global_step"] == 1


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs user namespaces to mount a small tmpfs (unshare -rm)")
@pytest.mark.slow
def test_a_really_full_disk(recipe, tmp_path):
    """A 10 MiB tmpfs holds one checkpoint of the tiny policy (6.5 MiB) but not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    run = (f"mount -t tmpfs -o size=10m tmpfs {disk} && {sys.executable} -m molt_lightning.commands.cli fit "
           f"--config {recipe} "
           f"--trainer.max_steps 3 --trainer.enable_checkpointing true "
           f"--trainer.callbacks+ lightning.pytorch.callbacks.ModelCheckpoint --trainer.callbacks.dirpath {disk} "
           f"--trainer.callbacks.every_n_train_steps 1 --trainer.callbacks.save_top_k -1; echo rc=$?; "
           f"{sys.executable} -c \"import torch; print('kept', torch.load('{disk}/epoch=0-step=1.ckpt', "
           f"weights_only=False)['global_step'])\"; ls -a {disk}")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", run], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=300)
    assert "rc=1" in out.stdout, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"molt: no space left in {disk} for checkpoint epoch=0-step=2.ckpt")
    assert "MiB free there" in last and "Free space there" in last
    assert "Traceback" not in out.stderr and "kept 1" in out.stdout and ".partial" not in out.stdout


@pytest.mark.parametrize("args, problem", [
    (["--model.teacher", "molt_lightning.models.tiny.python_tool_policy", "--model.algo.distill_coef", "1"],
     "has another tokenizer than the policy"),
    (["--model.teacher", "/no/such/folder", "--model.algo.distill_coef", "1"], "'/no/such/folder': no such folder"),
    (["--model.algo.distill_coef", "1"], "needs both model.teacher"),
])
def test_a_distillation_teacher_that_cannot_work(recipe, capsys, args, problem):
    err = answer(capsys, "--config", recipe, *args)
    assert problem in err
