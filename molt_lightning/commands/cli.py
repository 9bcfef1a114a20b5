"""``molt``: the command line, LightningCLI over ``AsyncRLModule`` (``molt fit --config recipes/X.yaml``).

Every Trainer flag works (``--trainer.max_steps 3``); ``--trainer.strategy`` is ``auto``, ``ddp``, ``fsdp2`` or
``fsdp2_ep`` (two CPU processes: ``--trainer.devices 2``). vLLM is imported only when an engine starts, so
``--help`` answers at once. The progress bar counts optimizer steps (``StepProgressBar``) unless the recipe brings its
own or ``--trainer.enable_progress_bar false``; a summary closes the run (``RunSummary``). Checkpoints and
``config.yaml`` go to the run folder (the logger's; ``UNLOGGED`` for ``logger: false``), never the current
directory. On a terminal (or with ``MOLT_QUIET=1``) that is all the terminal shows: everything else goes to
``molt.log`` in the run folder (``callbacks.runlog``). Checkpoints are written atomically, a full disk named
(``callbacks.checkpoint.AtomicCheckpointIO``), unless the recipe brings its own ``CheckpointIO``. ``molt serve`` starts
a vLLM server for ``RemoteVLLMEngine``/``EnginePool`` (``molt_lightning.commands.serve``); ``molt export`` writes a
checkpoint as a Hugging Face folder (``molt_lightning.commands.export``); ``molt eval`` runs a recipe's ``Evaluate``
alone on a policy folder or a checkpoint (``commands.eval``). ``molt --help`` lists the commands (``COMMANDS``);
LightningCLI's ``validate``, ``test`` and ``predict`` are left out (``AsyncRLModule`` has no such steps), and a word
that is no command is answered with the ones there are.

A bad recipe is answered before anything starts, with the problem and its fix and no traceback: jsonargparse's
parse errors (YAML syntax, unknown keys, wrong types, dotted paths that do not import or are the wrong kind of
class) get a ``fix:`` line (``MoltParser``); ``check_recipe`` then checks what the parser cannot (the policy folder
and its tokenizer against its embeddings, an async agent, a plain ``tasks(seed)``, the dtype, and what the engine
will refuse in the policy: its ``check_policy``); a ``ValueError`` or
Lightning ``MisconfigurationException`` from a constructor (sizes, ranges, names) is printed the same way.
``JSONARGPARSE_DEBUG=1`` shows the traceback of any of them.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import importlib
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser

from ..callbacks.runlog import UNLOGGED, unlogged_root  # noqa: F401  (UNLOGGED: tests and docs name it here)
from ..config import imported

EXAMPLES = {  # what a parser key takes, for the fix line of its errors
    "model.agent": "the dotted path of an `async def agent(client, sample) -> reward`, importable where molt runs "
                   "(e.g. molt_lightning.tasks.arithmetic.calculator_agent), or a class_path whose instances are "
                   "such agents, with its init_args (e.g. molt_lightning.agents.env.EnvAgent with init_args "
                   "{environment: molt_lightning.tasks.arithmetic_env.CalculatorEnv})",
    "model.tasks": "the dotted path of a function `tasks(seed)` returning an iterator of samples "
                   "(e.g. molt_lightning.tasks.arithmetic.tasks), or molt_lightning.data.Tasks with its data sources "
                   "under init_args (e.g. {class_path: molt_lightning.data.Tasks, init_args: {sources: [{path: "
                   "data/train.jsonl, prompt: question, answer: answer}]}})",
    "model.engine": "a RolloutEngine class: molt_lightning.engines.VLLMEngine, molt_lightning.engines.TorchEngine, "
                    "molt_lightning.engines.RemoteVLLMEngine or molt_lightning.engines.EnginePool (its arguments "
                    "under init_args)",
    "model.algo": "the fields of molt_lightning.algorithms.Algorithm (see recipes/algorithms/)",
    "trainer.callbacks": "a list of Lightning Callback classes, each a class_path and its init_args "
                         "(e.g. lightning.pytorch.callbacks.ModelCheckpoint, molt_lightning.callbacks.RolloutSamples)",
    "trainer.logger": "a Lightning logger class (e.g. lightning.pytorch.loggers.CSVLogger) or false",
    "trainer.plugins": "Lightning plugins (e.g. a CheckpointIO class)",
}
# an overlay's first line (recipes/distill_teacher_engine.yaml; tests/test_recipes.py holds every recipe to it)
OVERLAY = re.compile(r"^# Overlay on (recipes/[\w/]+\.yaml): `(molt fit --config \1 --config (recipes/[\w/]+\.yaml))`")
COMMANDS = {  # molt's commands, one line each (`molt --help`); LightningCLI's validate/test/predict are not among them
    "fit": "train a policy with RL on a recipe (molt fit --config recipes/default.yaml)",
    "eval": "a recipe's held-out evaluation alone, on a policy folder or a checkpoint (molt eval --config RECIPE)",
    "export": "a checkpoint of molt fit as a Hugging Face folder (molt export CKPT OUT)",
    "serve": "a vLLM server for RemoteVLLMEngine and EnginePool (molt serve --policy FOLDER)",
    "sft": "supervised fine-tuning on conversations (molt sft --config recipes/sft_tiny.yaml)",
    "tasks": "check a Harbor task set: broken tasks, solution and empty rewards (molt tasks check FOLDER...)",
    "view": "a run browser: curves, steps, every token of the samples (molt view runs/default/version_0)",
    "tinker": "the Tinker API for a model folder: the tinker SDK and tinker-cookbook run against it (molt tinker)",
}
# `molt serve` (a vLLM server for the remote engine), `molt export CKPT OUT` (a Hugging Face folder), `molt view
# RUN_DIR...` (the run browser, outside fit's imports: scripts/size.py)
OWN_PARSERS = {"serve": ".serve", "export": ".export", "view": "..view.server", "tasks": ".tasks",
               "tinker": "..tinker.server"}
_UNKNOWN = re.compile(r"does not accept option '([^']+)'|unrecognized arguments: (\S+)|Option '([^']+)' is not acc")


class _Dropped(logging.Handler):
    """Keeps jsonargparse's (debug-level) line for init_args it discards when a class_path changes (a recipe's
    VLLMEngine made TorchEngine by ``--model.engine TorchEngine``: its ``cpu_threads``) in ``MoltParser.dropped``."""

    LINE = re.compile(r"class_path change from '([^']+)' to '([^']+)', discarding init_args: (.*)\.$", re.S)

    def emit(self, record: logging.LogRecord) -> None:
        if m := self.LINE.search(record.getMessage()):
            MoltParser.dropped[m[1], m[2]] = re.findall(r"'(\w+)': ", m[3])


DROPS = logging.getLogger("molt_lightning.commands.cli.dropped")  # the parsers' logger (jsonargparse's is silent)
DROPS.setLevel(logging.DEBUG)
DROPS.propagate = False
DROPS.addHandler(_Dropped())


class MoltParser(LightningArgumentParser):
    """LightningCLI's parser with a one-line usage (not the page of every option) and a ``fix:`` after each error;
    init_args dropped by a class_path change are noted (``dropped``: said by ``dropped_settings``)."""

    _reading = None  # the recipe file being read, if any
    read: list[str] = []  # every recipe file read since main() started: an overlay among them is named in errors
    dropped: dict[tuple[str, str], list[str]] = {}  # (class_path before, after) -> the init_args it dropped

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not os.environ.get("JSONARGPARSE_DEBUG"):  # (with it, jsonargparse's own debug log says it all)
            self.logger = DROPS  # class parsers take their parent's: the class_path-change line reaches _Dropped

    def print_usage(self, file=None) -> None:
        if self._subcommands_action is not None:
            return super().print_usage(file)
        prog = self.prog.replace(" [options]", "")
        (file or sys.stdout).write(f"usage: {prog} --config RECIPE.yaml [--trainer.KEY VALUE] [--model.KEY VALUE]\n")

    def parse_path(self, path, *args, **kwargs):
        self._reading = path  # a YAML error in it is reported while it is read: name the file
        # the recipes given (the error comes from another parser instance), absolute: jsonargparse reads a recipe from
        # its own folder, so an error while it is read comes with the working directory moved there
        MoltParser.read.append(str(Path(str(path)).absolute()))
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            self._reading = None

    def error(self, message: str, ex: Exception | None = None):
        fix = fix_for(message, getattr(ex, "subcommand_parser", None) or self)
        if getattr(self, "_reading", None):
            message = message.replace('"<unicode string>"', str(self._reading))
        super().error(f"{message}\nfix: {fix}" if fix else message, ex)


def fix_for(message: str, parser) -> str | None:
    """The fix line for a parse error, or None when the message says it already."""
    if message.startswith("Problems parsing config"):
        return ("the recipe is not valid YAML at the line and column above: nest keys by indenting them under their "
                "parent (spaces, not tabs), write `key: value`, and close every bracket and quote")
    if over := _overlay_alone():  # whatever fails first (a missing key, a logger's init_args without its class)
        return f"{over[3]} is an overlay on {over[1]}, not a whole recipe: stack it on its base: {over[2]}"
    if m := re.search(r"arguments are required: (.+)", message):
        wanted = [k.strip().removeprefix("fit.") for k in m[1].split(",")]
        return "; ".join(f"{k} takes {EXAMPLES[k]}" for k in wanted if k in EXAMPLES) or None
    if m := re.match(r'Parser key "([^"]+)"', message):
        if bad := re.search(r"class_path '([^']+)':\s+Option '([^']+)' is not accepted", message):
            return _init_arg_fix(*bad.groups())
        key = next((k for k in EXAMPLES if m[1] == k or m[1].startswith(k + ".")), None)
        return f"{key} takes {EXAMPLES[key]}" if key else None
    if m := _UNKNOWN.search(message):
        key = next(g for g in m.groups() if g).lstrip("-").split("=")[0]
        keys, (parent, _, leaf), root = _keys(parser), key.rpartition("."), key.partition(".")[0]
        moved = [k for k in keys if k.rpartition(".")[2] == leaf and k.partition(".")[0] == root]  # in a group now
        beside = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]  # a typo in the leaf:
        siblings = [f"{parent}.{s}" for s in difflib.get_close_matches(leaf, beside, n=2, cutoff=0.7)]  # the keys
        leaves = difflib.get_close_matches(leaf, {k.rpartition(".")[2] for k in keys}, n=2)  # beside it first
        close = moved[:3] or siblings or difflib.get_close_matches(key, keys, n=3, cutoff=0.75) \
            or [k for k in keys if k.rpartition(".")[2] in leaves][:3]
        prog = parser.prog.replace(" [options]", "")
        known = f"`{prog} --help` lists every key (a recipe nests them under trainer:, model:, seed_everything:)"
        return f"did you mean {' or '.join(close)}? {known}" if close else known
    return None


def _overlay_alone() -> re.Match | None:
    """The first recipe read that declares itself an overlay on a base that was not read (its first line)."""
    read = [Path(p).resolve().as_posix() for p in MoltParser.read]
    for p in MoltParser.read:
        over = OVERLAY.match(Path(p).read_text()) if Path(p).is_file() else None
        if over and not any(r.endswith("/" + over[1]) for r in read):
            return over
    return None


def _init_arg_fix(class_path: str, arg: str) -> str:
    """The fix for an init_args key the class does not take: the close ones it does."""
    name = class_path.rpartition(".")[2]
    params = list(inspect.signature(imported(class_path, "class_path")).parameters)
    close = difflib.get_close_matches(arg, params, n=2, cutoff=0.7)
    guess = f"did you mean {' or '.join(f'init_args.{c}' for c in close)}? " if close else ""
    return f"{guess}{name} takes {', '.join(params)}"


def dropped_settings() -> list[str]:
    """A line per class_path changed on top of a recipe that dropped init_args the new class does not take (as
    jsonargparse does, silently): which, and where they were set."""
    where = f" in {', '.join(dict.fromkeys(MoltParser.read))}" if MoltParser.read else ""
    short = {cls: cls.rpartition(".")[2] for pair in MoltParser.dropped for cls in pair}
    it = {True: "it", False: "them"}
    return [f"molt: warning: {short[new]} does not take {', '.join(keys)} (set for {short[old]}{where}): the run "
            f"goes on without {it[len(keys) == 1]} (fix: remove {it[len(keys) == 1]} from the recipe, or use a recipe "
            f"written for {short[new]})" for (old, new), keys in MoltParser.dropped.items() if keys]


def _keys(parser) -> list[str]:
    parsers = [parser, *getattr(parser._subcommands_action, "_name_parser_map", {}).values()]
    return sorted({a.dest for p in parsers for a in p._actions if a.dest and not a.dest.endswith("help")})


def check_recipe(model) -> None:
    """What the parser cannot check in the model's settings (``model``: its parsed namespace); raises ``ValueError``
    naming the setting and the fix."""
    import torch

    from ..trainer.policy import policy_folder

    dtype = getattr(torch, str(model.dtype), None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"model.dtype {model.dtype!r} is not a torch floating-point dtype: use float32, bfloat16 or "
                         "float16")
    # a class_path: a class whose instances are the agent (or tasks(seed), e.g. molt_lightning.data.Tasks); its
    # __call__ is what runs, its init_args are checked when it is made (jsonargparse imported it already)
    agent, tasks = (imported(x.class_path, "class_path").__call__ if getattr(x, "class_path", None) else x
                    for x in (model.agent, model.tasks))
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):
        raise ValueError(f"model.agent {_name(agent)} is not an async function: declare it "
                         "`async def agent(client, sample)` (it awaits client.chat / client.generate)")
    if agent is model.agent:
        _check_call(agent, "model.agent", "(client, sample)", None, None)
    if inspect.iscoroutinefunction(tasks) or inspect.isasyncgenfunction(tasks):
        raise ValueError(f"model.tasks {_name(tasks)} is async: it must be a plain function (or generator) "
                         "`tasks(seed)` returning an iterator of samples")
    if tasks is model.tasks:
        _check_call(tasks, "model.tasks", "(seed)", 0)
    folder = policy_folder(model.policy)
    engine = model.get("engine")  # what the engine will refuse in the policy (VLLMEngine: head sizes on the CPU)
    if getattr(engine, "class_path", None):
        getattr(imported(engine.class_path, "class_path"), "check_policy", lambda folder: None)(folder)
    if model.get("teacher") is not None:  # distillation: the teacher's folder and tokenizer, before anything starts
        from transformers import AutoTokenizer

        from ..trainer.policy import teacher_folder

        teacher = model.teacher  # a folder, or an engines.Auxiliary's settings: its model
        teacher_folder(teacher.init_args.model if getattr(teacher, "class_path", None) else teacher,
                       AutoTokenizer.from_pretrained(folder))


def _check_call(fn, key: str, params: str, *args) -> None:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as e:
        raise ValueError(f"{key} {_name(fn)} must take {params}, but: {e}") from None
    except ValueError:  # no signature to read (a builtin): it will tell at the call
        pass


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: molt COMMAND [options]   (molt COMMAND --help: its options)\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    MoltParser.read.clear()
    MoltParser.dropped.clear()
    if argv[:1] in ([], ["-h"], ["--help"]):  # `molt` alone: the commands too, but it is a usage error
        print(usage())
        sys.exit(0 if argv else 2)
    if not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"molt: no command {argv[0]!r}: the commands are {', '.join(COMMANDS)} (`molt --help` says what each "
              "does)", file=sys.stderr)
        sys.exit(2)
    from ..extras import MissingExtra

    try:
        if argv[0] in OWN_PARSERS:  # serve, export, view, tasks, tinker: their own parsers, imported when run
            return importlib.import_module(OWN_PARSERS[argv[0]], __package__).main(argv[1:])
        if argv[:1] == ["eval"]:
            # `molt eval --config RECIPE`: the recipe's evaluation alone (molt_lightning.rollout.heldout)
            from .eval import main as evaluate

            return evaluate(argv[1:], molt_cli, MoltParser)
        if argv[:1] == ["sft"]:  # `molt sft --config RECIPE`: supervised fine-tuning (molt_lightning.commands.sft)
            from .sft import main as sft

            return sft(argv[1:], MoltParser)
    except MissingExtra as e:  # an extra the recipe or command needs (a SmolLM2 policy, molt tinker): one line
        print(f"molt: {e}", file=sys.stderr)
        sys.exit(1)
    from ..callbacks.checkpoint import DiskFull
    from ..callbacks.runlog import QuietTerminal, quieted
    from ..data.judge import JudgeFailed
    from ..engines import EngineUnavailable
    from ..module import AsyncRLModule
    from ..rollout.source import RolloutFailures, RolloutStopped

    quiet: list[QuietTerminal] = []  # the fit's quiet terminal, once it is set up
    try:
        with quieted(quiet):  # a failure below shows the end of the log
            molt_cli(quiet)(AsyncRLModule, save_config_kwargs={"overwrite": True}, parser_class=MoltParser,
                            args=args, parser_kwargs={"prog": "molt"},  # also under python -m ...commands.cli
                            auto_configure_optimizers=False)
    # SIGTERM while waiting for rollouts (the engine is shut down by now: exit 143); the failure breaker; remote
    # engines gone or not answering; a checkpoint that did not fit (the earlier ones are intact); a judge that did not
    # answer its test question at the start: one line each
    except (RolloutStopped, RolloutFailures, EngineUnavailable, DiskFull, MissingExtra, JudgeFailed) as e:
        print(f"molt: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        sys.exit(128 + 15 if isinstance(e, RolloutStopped) else 1)
    except Exception as e:  # a collective's peer on another node gone; a vLLM engine that died: the cause, last
        from ..trainer.parallel import lost_peer

        if (why := (lost_peer(e) if isinstance(e, RuntimeError) else None) or engine_died(e, quiet)) is None:
            raise
        print(f"molt: {why}", file=sys.stderr)
        sys.exit(1)


def engine_died(e: Exception, quiet: list) -> str | None:
    """When ``e`` says a vLLM engine died and the run's log (the quiet terminal's: the engine process wrote there)
    holds the error it died of, that error and where the rest is, as one line; the traceback goes to the log."""
    import traceback

    from ..engines.vllm.refusals import start_failure

    log = quiet[0].path if quiet else None
    cause = start_failure(e, Path(log).read_text(errors="replace")) if log and Path(log).exists() else None
    if cause is None:
        return None
    with open(log, "a") as f:
        traceback.print_exception(e, file=f)
    return f"the vLLM engine died: {cause} (its log and the traceback: {log})"


def molt_cli(quiet: list | None = None):
    """The LightningCLI class of ``molt`` (made on demand: importing Lightning's CLI costs a second); given a list,
    ``quiet`` gets a quiet terminal (``wants_quiet``) when the classes are made."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.plugins import CheckpointIO

    from ..callbacks.checkpoint import AtomicCheckpointIO
    from ..callbacks.runlog import QuietTerminal, RunSummary, run_folder, terminal_callbacks, wants_quiet
    from ..extras import require_for
    from ..trainer.parallel import LORA_UNDER_FSDP2, STRATEGIES, SUPPORTED

    asked, quiet = quiet is not None, [] if quiet is None else quiet

    class MoltCLI(LightningCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:  # fit only: AsyncRLModule has no validation, test or predict step
            return {"fit": LightningCLI.subcommands()["fit"]}

        def before_instantiate_classes(self) -> None:
            # an extra the recipe needs and .venv lacks: one line with its install command (molt eval's too)
            require_for(self.config[self.subcommand] if self.subcommand else self.config)
            if self.subcommand is not None:
                for line in dropped_settings():  # on the terminal, before the run (and its quiet log) starts
                    print(line, file=sys.stderr)
                with self._answered():
                    config = self.config[self.subcommand]
                    check_recipe(config.model)
                    sharded = config.trainer.get("strategy") in ("fsdp2", "fsdp2_ep")
                    if config.model.get("lora") is not None and sharded:
                        raise ValueError(LORA_UNDER_FSDP2)  # before any process starts (parallel.shard says it too)

        def instantiate_classes(self) -> None:
            with self._answered():
                if asked and wants_quiet():
                    quiet.append(QuietTerminal())
                super().instantiate_classes()

        def before_fit(self) -> None:
            if quiet:  # the run folder is known now; the log moves there before fit starts any other process
                quiet[0].move_to(run_folder(self.trainer) / "molt.log")

        @contextmanager
        def _answered(self):
            """A recipe error raised inside becomes the parser's error message (problem and fix, no traceback)."""
            try:
                yield
            except (ValueError, MisconfigurationException) as e:
                parser = self._subcommand_parsers[self.subcommand] if self.subcommand else self.parser
                parser.error(str(e), e)

        def instantiate_trainer(self, **kwargs):
            trainer = self._get(self.config_init, "trainer", default={})
            strategy = trainer.get("strategy")
            if isinstance(strategy, str) and strategy not in STRATEGIES:
                hint = " (FSDP1 needs a GPU; FSDP2 runs on the CPU too)" if strategy.startswith("fsdp") else ""
                raise ValueError(f"--trainer.strategy {strategy!r} is not supported: use {SUPPORTED}{hint}")
            terminal = quiet[0].terminal if quiet else None
            kwargs["callbacks"] = terminal_callbacks(list(trainer.get("callbacks") or []),
                                                     trainer.get("enable_progress_bar") is not False, terminal,
                                                     RunSummary(out=terminal))
            kwargs.update(unlogged_root(trainer))
            plugins = trainer.get("plugins") or []
            plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
            if isinstance(strategy, str) and not any(isinstance(p, CheckpointIO) for p in plugins):
                kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
            return super().instantiate_trainer(**kwargs)

    return MoltCLI


if __name__ == "__main__":  # vLLM's engine core starts with spawn: keep the entry point guarded
    main()  # LightningCLI reads sys.argv itself (given them as args too, it warns that both were given)
