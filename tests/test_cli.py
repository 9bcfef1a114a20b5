"""``molt fit`` through LightningCLI: instant help, Trainer flags from the command line, a recipe run."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def fit_recipe(name: str, tmp_path, *flags: str, steps: int = 2):
    """``molt fit --config recipes/NAME.yaml`` for ``steps`` steps, logging under ``tmp_path``; checks it ran every
    step and returns (its output, the run folder, its config.yaml text, its metrics.csv)."""
    out = run("-m", "molt_lightning.commands.cli", "fit", "--config", f"recipes/{name}.yaml", *flags,
              "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / name).iterdir())
    df = pd.read_csv(run_dir / "metrics.csv")
    assert sorted(df.dropna(subset=["reward"])["step"].unique()) == list(range(steps))  # (evaluation: at `steps`)
    return out, run_dir, (run_dir / "config.yaml").read_text(), df


@pytest.mark.slow
def test_help_answers_without_importing_vllm():
    code = ("import sys\nfrom molt_lightning.commands.cli import main\n"
            "try:\n    main(['fit', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('VLLM-IMPORTED' if 'vllm' in sys.modules else 'NO-VLLM')")
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    assert "--model.rollout.max_lag" in out.stdout and "--trainer.max_steps" in out.stdout
    assert out.stdout.strip().endswith("NO-VLLM")


@pytest.mark.slow
def test_recipe_runs_with_trainer_flags_from_the_command_line(tmp_path):
    out, run_dir, config, _ = fit_recipe("default", tmp_path, "--model.engine", "molt_lightning.engines.TorchEngine")
    assert "Step" in out.stdout and "Epoch" not in out.stdout  # the CLI's default bar counts steps
    assert (run_dir / "reward.png").exists() and "TorchEngine" in config


def test_bad_agent_path_is_a_clear_error(capsys):
    from test_bad_inputs import answer  # molt fit in this process: the error line, no traceback

    err = answer(capsys, "--config", str(ROOT / "recipes/default.yaml"), "--model.agent",
                 "molt_lightning.tasks.arithmetic.no_such_agent", "--trainer.max_steps", "1")
    assert "no_such_agent" in err


def test_unsupported_strategy_names_the_choices(capsys):
    from test_bad_inputs import answer

    err = answer(capsys, "--config", str(ROOT / "recipes/default.yaml"), "--trainer.strategy", "fsdp",
                 "--trainer.max_steps", "1")
    assert "'fsdp' is not supported: use auto (one process), ddp, fsdp2" in err
    assert "FSDP2 runs on the CPU too" in err


def quiet_run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}
    return subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config",
                           "recipes/default.yaml",
                           "--model.engine", "molt_lightning.engines.TorchEngine", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quiet_terminal_shows_the_bar_and_a_summary_and_logs_the_rest_in_the_run_folder(tmp_path):
    before = untracked()
    out = quiet_run("--trainer.max_steps", "3", "--trainer.logger.init_args.save_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = list((tmp_path / "default").iterdir())
    # run from the checkout, it wrote nothing there: its checkpoint is in the run folder, next to metrics.csv
    assert untracked() == before and (run_dir / "metrics.csv").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    log = (run_dir / "molt.log").read_text()
    assert f"molt: full log in {run_dir / 'molt.log'}" in out.stdout
    assert "molt: 3 steps in" in out.stdout and "mean reward" in out.stdout and "0 failed, 0 dropped" in out.stdout
    assert "Step" in out.stdout  # the progress bar stays on the terminal
    # Lightning's warnings and info (written before and after the run folder existed) are in the log, not on screen
    assert "dataloader_iter" in log and "GPU available" in log
    assert "dataloader_iter" not in out.stdout + out.stderr and "GPU available" not in out.stdout + out.stderr
    assert len((out.stdout + out.stderr).splitlines()) <= 12


@pytest.mark.slow
def test_quiet_terminal_shows_the_end_of_the_log_when_the_run_fails(tmp_path):
    out = quiet_run("--trainer.max_steps", "1", "--trainer.strategy", "fsdp")  # refused while the Trainer is made
    assert out.returncode != 0
    assert "'fsdp' is not supported" in out.stderr and "molt: the run failed; the last" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config",
                          "recipes/default.yaml"],
                         cwd=ROOT, env={**os.environ, "MOLT_QUIET": "yes"}, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "MOLT_QUIET='yes': use 1" in bad.stderr


def untracked() -> set[str]:
    """What git sees new or changed in the checkout (ignored paths, such as runs/, aside)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return set(out.splitlines())


def test_a_recipe_without_a_logger_keeps_its_checkpoints_and_config_in_a_run_folder(monkeypatch, tmp_path):
    """``logger: false`` leaves no logger folder, and Lightning would then write checkpoints and config.yaml into the
    current directory (the checkout, run from there): molt gives the run a folder of its own (cli.UNLOGGED)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from molt_lightning import AsyncRLModule
    from molt_lightning.commands.cli import UNLOGGED, MoltParser, molt_cli

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "recipes/default.yaml"), "--model.engine", "molt_lightning.engines.TorchEngine"]
    for extra, folder in ([], tmp_path / "runs" / "default"), (["--trainer.logger", "false"], tmp_path / UNLOGGED):
        cli = molt_cli()(AsyncRLModule, run=False, args=args + extra, parser_class=MoltParser,
                         auto_configure_optimizers=False)
        [checkpoint] = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
        checkpoint.setup(cli.trainer, cli.model, "fit")  # where Lightning resolves its folder
        for path in checkpoint.dirpath, cli.trainer.log_dir:  # config.yaml goes to the log_dir
            assert Path(path).resolve().is_relative_to(folder), (extra, path)


def test_molt_sft_without_a_logger_keeps_its_checkpoints_and_config_in_a_run_folder(monkeypatch, tmp_path):
    """The same for ``molt sft`` (``cli.unlogged_root``): with ``--trainer.logger false`` it wrote its checkpoint and
    config.yaml into the current directory."""
    import json

    from lightning.pytorch.callbacks import ModelCheckpoint

    from molt_lightning.commands.cli import UNLOGGED, MoltParser
    from molt_lightning.commands.sft import sft_cli

    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 1+2?"},
                                             {"role": "assistant", "content": "ANSWER 3"}]}) + "\n")
    args = ["--config", str(ROOT / "recipes/sft_tiny.yaml"), "--data.train", str(rows)]
    for extra, folder in ([], tmp_path / "runs" / "sft_tiny"), (["--trainer.logger", "false"], tmp_path / UNLOGGED):
        cli = sft_cli(args + extra, MoltParser)
        [checkpoint] = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
        checkpoint.setup(cli.trainer, cli.model, "fit")
        for path in checkpoint.dirpath, cli.trainer.log_dir:
            assert Path(path).resolve().is_relative_to(folder), (extra, path)


def test_molt_help_lists_every_command_and_a_word_that_is_none_names_them(capsys):
    """``molt --help`` and ``molt`` alone list fit, eval, export, serve and sft, one line each; LightningCLI's validate,
    test and predict (no such steps in AsyncRLModule: ``molt validate`` ended in a Lightning traceback) are refused
    with the commands there are, as is any other word."""
    from molt_lightning.commands.cli import COMMANDS, main, molt_cli

    assert list(COMMANDS) == ["fit", "eval", "export", "serve", "sft", "tasks", "view", "tinker"]
    for argv, code in (["--help"], 0), ([], 2):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr().out
        assert e.value.code == code and all(f"\n  {name} " in out for name in COMMANDS), out
    for word in "validate", "test", "predict", "nope":
        with pytest.raises(SystemExit) as e:
            main([word, "--config", "recipes/default.yaml"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"molt: no command {word!r}: the commands are fit, eval, export, serve, " \
            "sft, tasks, view, tinker (`molt --help` says what each does)\n"
    assert list(molt_cli().subcommands()) == ["fit"]


def test_quiet_molt_eval_shows_a_bar_and_a_table_and_logs_the_rest_beside_its_out(tmp_path):
    """``molt eval`` printed one line per source; now a table (metric, value, 95% interval), and with ``MOLT_QUIET=1``
    (as on a terminal) only a progress bar and that table show, Lightning's lines going to OUT.log beside ``--out``."""
    from test_export import EVAL_RECIPE

    (tmp_path / "eval.yaml").write_text(EVAL_RECIPE)
    out = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "eval", "--config",
                          str(tmp_path / "eval.yaml"), "--out", str(tmp_path / "e.json")], cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    shown, log = out.stdout + out.stderr, (tmp_path / "e.log").read_text()
    assert "GPU available" in log and "GPU available" not in shown and f"full log in {tmp_path / 'e.log'}" in shown
    lines = shown.splitlines()
    head = lines.index("source   metric  value  95% interval")
    assert [line.split()[:2] for line in lines[head + 1:head + 4]] == [["heldout", "avg@2"], ["heldout", "pass@1"],
                                                                      ["heldout", "pass@2"]]
    assert "heldout: 6 prompts x 2 runs, 0 failed" in shown and "Eval" in shown and "12/12" in shown
    assert len(lines) <= 12, shown
