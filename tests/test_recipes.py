"""Every recipe under recipes/ (its algorithms/ and research/ overlays too) says what it is: a whole recipe (``molt
fit``'s has ``model.agent`` and ``model.tasks``, ``molt sft``'s ``data``), or an overlay whose first line names its base
and the command that stacks them (``# Overlay on recipes/BASE.yaml: `molt fit --config recipes/BASE.yaml --config
recipes/THIS.yaml```); that command parses, and the overlay alone is refused with that command as its fix."""

from __future__ import annotations

import shlex
import re
from pathlib import Path

import pytest
import yaml

from molt_lightning.commands.cli import OVERLAY, main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))  # recipes/, its algorithm overlays, its research examples


def name(path: Path) -> str:
    """The recipe's path from the repository root (recipes/X.yaml, recipes/algorithms/X.yaml)."""
    return path.relative_to(ROOT).as_posix()


def overlay(path: Path) -> re.Match | None:
    return OVERLAY.match(path.read_text())


@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_a_recipe_is_whole_or_a_declared_overlay(path):
    recipe = yaml.safe_load(path.read_text())
    model = recipe.get("model") or {}
    whole = ("agent" in model and "tasks" in model) or "data" in recipe
    m = overlay(path)
    assert whole != bool(m), f"{name(path)}: " + ("a whole recipe marked as an overlay" if whole else
                                                "neither a whole recipe (model.agent, model.tasks) nor an overlay "
                                                "whose first line is `# Overlay on recipes/BASE.yaml: `molt fit "
                                                "--config recipes/BASE.yaml --config recipes/THIS.yaml``")
    if m:
        assert (ROOT / m[1]).exists() and m[3] == name(path), m[0]


OVERLAYS = [p for p in RECIPES if overlay(p)]


@pytest.mark.parametrize("path", OVERLAYS, ids=name)
def test_an_overlay_stacked_as_its_first_line_says_parses(path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(shlex.split(overlay(path)[2])[1:] + ["--print_config"])
    assert e.value.code in (0, None), capsys.readouterr().err


@pytest.mark.parametrize("path", OVERLAYS, ids=name)
def test_an_overlay_alone_is_refused_with_the_command_that_stacks_it(path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", name(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{name(path)} is an overlay" in err and overlay(path)[2] in err, err
