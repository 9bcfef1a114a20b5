"""Every recipe says what it is: a whole recipe (``molt fit``'s has ``model.agent`` and ``model.tasks``, ``molt sft``'s
``data``), or an overlay whose first line names its base and the command that stacks them
(``# Overlay on recipes/BASE.yaml: `molt fit --config recipes/BASE.yaml --config recipes/THIS.yaml```); that command
parses, and the overlay alone is refused with that command as its fix."""

from __future__ import annotations

import shlex
import re
from pathlib import Path

import pytest
import yaml

from molt_lightning.commands.cli import OVERLAY, main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def overlay(path: Path) -> re.Match | None:
    return OVERLAY.match(path.read_text())


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipe_is_whole_or_a_declared_overlay(path):
    recipe = yaml.safe_load(path.read_text())
    model = recipe.get("model") or {}
    whole = ("agent" in model and "tasks" in model) or "data" in recipe
    m = overlay(path)
    assert whole != bool(m), f"{path.name}: " + ("a whole recipe marked as an overlay" if whole else
                                                "neither a whole recipe (model.agent, model.tasks) nor an overlay "
                                                "whose first line is `# Overlay on recipes/BASE.yaml: `molt fit "
                                                "--config recipes/BASE.yaml --config recipes/THIS.yaml``")
    if m:
        assert (ROOT / m[1]).exists() and m[3] == f"recipes/{path.name}", m[0]


OVERLAYS = [p for p in RECIPES if overlay(p)]


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_an_overlay_stacked_as_its_first_line_says_parses(path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(shlex.split(overlay(path)[2])[1:] + ["--print_config"])
    assert e.value.code in (0, None), capsys.readouterr().err


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_an_overlay_alone_is_refused_with_the_command_that_stacks_it(path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", f"recipes/{path.name}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"recipes/{path.name} is an overlay" in err and overlay(path)[2] in err, err
