"""``molt eval``: a recipe's held-out evaluation alone (its ``Evaluate`` callback), on a policy folder or a checkpoint,
outside training; the recipe is read by ``molt fit``'s own CLI (``commands.cli.molt_cli``), so every key and check is
the same."""

from __future__ import annotations

import inspect
from pathlib import Path


def main(argv: list[str], molt_cli, parser_class) -> None:
    """``molt eval --config RECIPE [--ckpt CKPT] [--out FILE] [--model.policy FOLDER] [other recipe keys]``: one round
    of the recipe's ``Evaluate`` callback on a policy folder (the recipe's ``model.policy``, or another one), or on a
    checkpoint (exported first, a LoRA adapter merged), with the recipe's engine and agent; prints the table (metric,
    value, 95% interval) and writes the metrics and per-prompt rewards as JSON to ``--out``. On a terminal (or with
    ``MOLT_QUIET=1``) only a progress bar and the table show; the rest goes to a log beside ``--out`` (its name with
    ``.log``), or to ``molt-eval.log`` in the recipe's run folder. ``molt_cli`` and ``parser_class``: ``molt``'s
    (``commands.cli``, which calls this)."""
    import argparse
    import json
    import tempfile
    import warnings

    from ..callbacks.evaluate import Evaluate
    from ..callbacks.runlog import QuietTerminal, quieted, run_folder
    from ..rollout.heldout import per_prompt_rewards, summarize, table
    from ..module import AsyncRLModule

    if {"-h", "--help"} & set(argv):
        print("usage: molt eval --config RECIPE.yaml [--ckpt CKPT] [--out FILE.json] [--model.policy FOLDER] "
              "[--trainer.KEY VALUE] [--model.KEY VALUE]\n\n" + inspect.cleandoc(main.__doc__ or "")
              + "\n\n`molt fit --help` lists every recipe key.")
        return
    p = argparse.ArgumentParser(prog="molt eval", add_help=False)
    p.add_argument("--ckpt", default=None, help="a checkpoint of molt fit to evaluate (exported first)")
    p.add_argument("--out", default=None, help="write the metrics and per-prompt rewards here (JSON)")
    ours, rest = p.parse_known_args(argv)
    quiet: list[QuietTerminal] = []
    with quieted(quiet), tempfile.TemporaryDirectory() as tmp:
        if ours.ckpt:
            from .export import export

            rest = [*rest, "--model.policy", str(export(ours.ckpt, tmp, merge=True))]
        # "args and sys.argv both given": the eval's own flags are not LightningCLI's
        with warnings.catch_warnings(action="ignore", category=UserWarning):
            cli = molt_cli(quiet)(AsyncRLModule, run=False, args=rest, parser_class=parser_class,
                                  parser_kwargs={"prog": "molt eval"}, auto_configure_optimizers=False,
                                  save_config_callback=None)
        if quiet:
            log = Path(ours.out).with_suffix(".log") if ours.out else run_folder(cli.trainer) / "molt-eval.log"
            quiet[0].move_to(log)
        found = [c for c in cli.trainer.callbacks if isinstance(c, Evaluate)]
        if not found:
            raise SystemExit("molt eval: the recipe has no molt_lightning.callbacks.Evaluate under trainer.callbacks: "
                             "add one with the held-out tasks (docs/workflow.md)")
        evaluate, module = found[0], cli.model
        try:
            outcomes, seconds = evaluate_policy(module, evaluate, quiet[0].terminal if quiet else None)
        except ValueError as e:  # a policy folder that is not one: the message names the fix
            raise SystemExit(str(e)) from None
    summary = summarize(outcomes, evaluate.k)
    print(table(summary, evaluate.k))
    print(f"molt eval: {len(outcomes)} runs in {seconds:.1f} s" + (f"; metrics in {ours.out}" if ours.out else ""))
    if ours.out:
        with open(ours.out, "w") as f:
            json.dump({"policy": module.hparams.policy, "k": evaluate.k, "seconds": seconds, "metrics": summary,
                       "per_prompt": per_prompt_rewards(outcomes)}, f, indent=1)


def evaluate_policy(module, evaluate, terminal=None) -> tuple[list, float]:
    """One round of ``evaluate`` on ``module``'s policy folder and engine, outside training, with a progress bar (on
    ``terminal`` when given) counting the agent runs."""
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoConfig, AutoTokenizer

    from ..agents.sessions import AgentSessions
    from ..trainer.policy import policy_folder

    if os.path.exists(os.path.join(str(module.hparams.policy), "adapter_config.json")):
        raise ValueError(f"molt eval: {module.hparams.policy} is a LoRA adapter folder: export with --merge (or pass "
                         "--ckpt)")
    path = policy_folder(module.hparams.policy)
    rollout = module.rollout
    evaluate.select(module.source.tasks, fitting=False)
    sessions = AgentSessions.for_run(module.engine, path, AutoTokenizer.from_pretrained(path), rollout,
                                     AutoConfig.from_pretrained(path))
    module.engine.seed_from(rollout.task_seed)
    module.engine.launch(path)
    bar = Progress(TextColumn("Eval"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(file=terminal) if terminal else None)
    runs = bar.add_task("runs", total=len(evaluate.samples) * evaluate.k)
    try:
        sessions.start()
        with bar:
            outcomes, seconds = module.engine.call(evaluate.run(sessions, module.source.agent, rollout,
                                                                lambda: bar.advance(runs)), timeout=None)
        sessions.stop()
    finally:
        module.engine.release()
    return outcomes, seconds
