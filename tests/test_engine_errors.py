"""Errors about the engine where the user looks (issue 59, item 6): what vLLM will refuse in the policy is refused
before launch, an engine that dies at start ends on its root cause, and settings the chosen engine does not take are
named."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tiny_config_folder(tmp_path, head_dim: int, name: str = "") -> Path:
    """A Qwen3 policy folder with ``head_dim`` in its config: the shipped tiny policy's tokenizer and a config.json
    (no weights: nothing is loaded before the refusal)."""
    import shutil

    from molt_lightning.models.tiny import arithmetic_policy

    folder = tmp_path / f"qwen3-hd{head_dim}{name}"
    shutil.copytree(arithmetic_policy(), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=head_dim)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_vllm_on_the_cpu_refuses_a_head_dim_it_does_not_take_before_launch(tmp_path, capsys):
    """vLLM's CPU attention takes head sizes 32, 64, ... (CPUAttentionBackend), not 16: molt fit says so, with the
    fix, before anything starts; the torch engine takes 16, and vLLM takes 32."""
    pytest.importorskip("vllm")
    from test_bad_inputs import answer

    from molt_lightning.engines.vllm.refusals import check_policy, cpu_head_sizes

    assert cpu_head_sizes()[:2] == [32, 64] and 16 not in cpu_head_sizes()
    err = answer(capsys, "--config", str(ROOT / "recipes/default.yaml"), "--model.policy",
                 str(tiny_config_folder(tmp_path, 16)), "--trainer.max_steps", "1")
    assert "has head_dim 16, which vLLM's CPU attention does not take (it takes 32, 64," in err
    assert err.strip().endswith("or serve it with the torch engine: --model.engine TorchEngine"), err
    check_policy(tiny_config_folder(tmp_path, 32))  # taken
    # hidden_size // num_attention_heads when the config gives no head_dim
    folder = tiny_config_folder(tmp_path, 16, "-no-head-dim")
    config = json.loads((folder / "config.json").read_text())
    del config["head_dim"]
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 48, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="has head_dim 24"):
        check_policy(folder)


def test_switching_engines_names_the_settings_the_new_engine_does_not_take(capsys):
    """jsonargparse drops the recipe's init_args that a class_path given on the command line does not take (at debug
    level: silently); molt names them on the terminal, once, before the run. (A bad dtype stops the run right after.)"""
    from test_bad_inputs import answer

    recipe = str(ROOT / "recipes/default.yaml")
    err = answer(capsys, "--config", recipe, "--model.engine", "TorchEngine", "--model.dtype", "int8")
    [line] = [x for x in err.splitlines() if "does not take" in x]
    assert line == (f"molt: warning: TorchEngine does not take cpu_threads (set for VLLMEngine in {recipe}): the run "
                    "goes on without it (fix: remove it from the recipe, or use a recipe written for TorchEngine)"), line
    err = answer(capsys, "--config", recipe, "--model.dtype", "int8")  # no switch: nothing dropped, nothing said
    assert "does not take" not in err
