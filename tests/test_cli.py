"""``molt fit`` through LightningCLI: instant help, Trainer flags from the command line, a recipe run."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_help_answers_without_importing_vllm():
    code = ("import sys\nfrom molt_lightning.cli import main\n"
            "try:\n    main(['fit', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('VLLM-IMPORTED' if 'vllm' in sys.modules else 'NO-VLLM')")
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    assert "--model.max_lag" in out.stdout and "--trainer.max_steps" in out.stdout
    assert out.stdout.strip().endswith("NO-VLLM")


def test_recipe_runs_with_trainer_flags_from_the_command_line(tmp_path):
    out = run("-m", "molt_lightning.cli", "fit", "--config", "recipes/default.yaml",
              "--model.engine", "molt_lightning.engines.TorchEngine", "--trainer.max_steps", "2",
              "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Step" in out.stdout and "Epoch" not in out.stdout  # the CLI's default bar counts steps
    [run_dir] = list((tmp_path / "default").iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df["step"].dropna().unique()) == [0, 1]
    assert (run_dir / "reward.png").exists() and (run_dir / "config.yaml").exists()
    assert "TorchEngine" in (run_dir / "config.yaml").read_text()


def test_bad_agent_path_is_a_clear_error(tmp_path):
    out = run("-m", "molt_lightning.cli", "fit", "--config", "recipes/default.yaml",
              "--model.agent", "molt_lightning.tasks.arithmetic.no_such_agent", "--trainer.max_steps", "1")
    assert out.returncode != 0
    assert "no_such_agent" in out.stderr


def test_unsupported_strategy_names_the_choices():
    out = run("-m", "molt_lightning.cli", "fit", "--config", "recipes/default.yaml", "--trainer.strategy", "fsdp",
              "--trainer.max_steps", "1")
    assert out.returncode != 0
    assert "'fsdp' is not supported: use auto (one process), ddp, fsdp2" in out.stderr
    assert "FSDP2 runs on the CPU too" in out.stderr
