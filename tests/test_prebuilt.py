"""The shipped tiny policies (``models/prebuilt/``): each is the build of the spec that names it, small, and as good as
its spec's target; ``arithmetic_policy`` takes the shipped build and builds (then caches) only specs without one."""

from __future__ import annotations

import json
import random

import pytest

from molt_lightning.models import tiny, tiny_vlm

SPECS = tiny.SPECS  # arithmetic, python_tool, moe


@pytest.mark.parametrize("task", sorted(SPECS))
def test_shipped_build_matches_its_spec(task):
    spec = SPECS[task]
    folder = tiny.PREBUILT / tiny.folder_name(spec)
    assert (folder / "model.safetensors").exists(), (
        f"no shipped build for the current {task} spec: run `python -m molt_lightning.models.tiny` and commit "
        f"{tiny.PREBUILT}")
    recorded = json.loads((folder / "molt_spec.json").read_text())
    built = recorded.pop("built")
    assert recorded == spec and built["tool_route_success"] >= spec["sft"]["target"]
    assert (folder / "model.safetensors").stat().st_size < 4 * 2**20  # "a few MB"
    shipped = {tiny.folder_name(s) for s in [*SPECS.values(), tiny_vlm.VLM_SPEC]}  # the VLM: tests/test_vlm.py
    assert {p.name for p in tiny.PREBUILT.iterdir()} == shipped | {tiny.teacher_name()}  # no stale ones


@pytest.mark.parametrize("task", sorted(SPECS))
def test_shipped_weights_do_what_the_spec_says(task):
    """Recompute the warm start's check on the shipped weights: the tool route is reliable (the recorded value)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_lightning.agents.chat import ChatTemplate

    folder = tiny.arithmetic_policy(SPECS[task])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    success = tiny.tool_route_success(model, ChatTemplate(tokenizer), tokenizer.pad_token_id, task=tiny._task(
        SPECS[task]))
    recorded = json.loads((tiny.PREBUILT / tiny.folder_name(SPECS[task]) / "molt_spec.json").read_text())["built"]
    assert success == pytest.approx(recorded["tool_route_success"], abs=0.01) and success >= 0.9


def test_a_spec_without_a_shipped_build_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(tiny, "build", lambda out, spec: (calls.append(spec),
                                                          (out / "model.safetensors").write_text("")))
    spec = {**tiny.SPEC, "sft": {**tiny.SPEC["sft"], "seed": random.randint(1, 10**6)}}
    first, second = tiny.arithmetic_policy(spec), tiny.arithmetic_policy(spec)
    assert first == second == str(tmp_path / tiny.folder_name(spec)) and calls == [spec]
    assert tiny.arithmetic_policy() == str(tiny.PREBUILT / tiny.folder_name(tiny.SPEC))


def test_the_shipped_teacher_is_its_spec_built_from_the_shipped_student():
    """recipes/distill.yaml's teacher: the student's tokenizer, a reliable tool route, its spec recorded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_lightning.agents.chat import ChatTemplate

    folder = tiny.teacher_policy()
    assert folder == str(tiny.PREBUILT / tiny.teacher_name())
    recorded = json.loads((tiny.PREBUILT / tiny.teacher_name() / "molt_spec.json").read_text())
    built = recorded.pop("built")
    assert recorded == {**tiny.TEACHER_SPEC, "student": tiny.folder_name(tiny.SPEC)}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny.arithmetic_policy()).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    success = tiny.tool_route_success(model, ChatTemplate(tokenizer), tokenizer.pad_token_id)
    assert success == pytest.approx(built["tool_route_success"], abs=0.01) and success >= 0.95
