"""A quiet terminal for ``molt fit``, ``molt sft``, ``molt eval`` and a script's own Trainer: the progress bar and a
short summary on the terminal, the full log in the run folder (``quieted``, ``terminal_callbacks``,
``script_terminal``).

``QuietTerminal`` moves file descriptors 1 and 2 (so the vLLM engine process, C++ warnings and Python's ``warnings``
follow, not only Python's ``sys.stdout``) into a log file, and keeps a handle on the real terminal for the progress bar
(rich's console, through ``StepProgressBar(console_kwargs=...)``) and the summary. Output made before the run folder
exists (Trainer set-up) goes to a temporary file and is copied to ``molt.log`` in the run folder as soon as it is known
(``move_to``, before ``Trainer.fit`` launches any other process, so DDP ranks and the engine inherit the real file). On
a failure the terminal gets the log's last lines and its path. ``MOLT_QUIET=1`` / ``0`` forces it on / off; by default
it is on when standard output is a terminal.

``RunSummary`` prints what a user wants after a run: steps and time, the reward at the start and at the end (in windows
that never overlap: on a short run each is at most half of it), the agent runs that finished and what became of them
(trained, failed, dropped, or still waiting when the run ended), the share of duplicate completions when it reaches
``DUPLICATES_NOTED`` in the first steps (``samples/duplicates``: engines sharing one random stream, or a policy already
sure of its answers, such as a warm start), where everything was written (the files that are there) and the
``molt view`` command that browses the run. Written by hand: Lightning has no run summary, and file-descriptor
redirection is a few ``os.dup2`` calls.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import lightning as L

UNLOGGED = "runs/unlogged"  # the run folder of a recipe with `logger: false` and no trainer.default_root_dir


def unlogged_root(trainer: dict) -> dict:
    """The Trainer's ``default_root_dir`` for a recipe with ``logger: false`` and none of its own: ``UNLOGGED``, so
    that its checkpoints and config.yaml do not land in the current directory (``molt fit`` and ``molt sft``)."""
    return {"default_root_dir": UNLOGGED} if trainer.get("logger") is False and not trainer.get("default_root_dir") \
        else {}


DUPLICATES_NOTED = 0.25  # the summary names samples/duplicates from this share in the first steps up
WRITTEN = ("metrics.csv", "eval.jsonl", "reward.png", "trace.jsonl.gz", "config.yaml", "molt.log",  # named if there
           "checkpoints")


def wants_quiet() -> bool:
    setting = os.environ.get("MOLT_QUIET", "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"MOLT_QUIET={setting!r}: use 1 (progress bar and summary; full log in the run folder), 0 "
                         "(everything on the terminal), or leave it unset (1 when standard output is a terminal)")
    child = os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("RANK", "0") != "0"  # inherits rank 0's files
    return not child and (setting == "1" or (setting == "" and sys.stdout.isatty()))


class QuietTerminal:
    TAIL = 25  # log lines shown on the terminal when the run fails

    def __init__(self):
        sys.stdout.flush()
        self.terminal = os.fdopen(os.dup(1), "w", buffering=1)
        self._saved_err = os.dup(2)
        self._tmp = tempfile.NamedTemporaryFile(prefix="molt-", suffix=".log", delete=False)
        self.path = Path(self._tmp.name)
        self._redirect(self._tmp.fileno())
        self.ended = False

    @staticmethod
    def _redirect(out: int, err: int | None = None) -> None:
        """Point file descriptors 1 and 2 at ``out`` (2 at ``err`` when given), what was buffered flushed first."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(out if err is None else err, 2)

    def move_to(self, path: Path) -> None:
        """Continue the log in ``path`` (what was written so far comes along)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(path, "ab") as dst, open(self.path, "rb") as src:
            shutil.copyfileobj(src, dst)
        with open(path, "ab") as dst:
            self._redirect(dst.fileno())
        self._tmp.close()
        os.unlink(self.path)
        self.path = path
        print(f"molt: full log in {path}", file=self.terminal)

    def end(self, failed: bool) -> None:
        """Give the terminal back (once); after a failure, show the log's last lines and where the rest is."""
        if self.ended:
            return
        self.ended = True
        self._redirect(self.terminal.fileno(), self._saved_err)
        if failed:
            lines = self.path.read_text(errors="replace").splitlines()[-self.TAIL:]
            print("\n".join(lines), file=sys.stderr)
            print(f"molt: the run failed; the last {len(lines)} lines of its log are above, all of it in {self.path}",
                  file=sys.stderr)


def run_folder(trainer) -> Path:
    """Where a run writes: its logger's folder, else the Trainer's root (``logger: false``)."""
    return Path(trainer.logger.log_dir if trainer.logger else trainer.default_root_dir)


@contextmanager
def quieted(quiet: list):
    """Ends the quiet terminal in ``quiet`` (if one was set up inside) when the block ends, as a failure unless it
    ended normally or by a zero exit."""
    failed = True
    try:
        yield
        failed = False
    except SystemExit as e:
        failed = e.code not in (0, None)
        raise
    finally:
        if quiet:
            quiet[0].end(failed)


def terminal_callbacks(callbacks: list, progress_bar: bool, terminal, summary: L.Callback) -> list:
    """``callbacks`` with a ``StepProgressBar`` on ``terminal`` (unless they hold a progress bar or ``progress_bar`` is
    off) and ``summary``: what ``molt fit`` and ``molt sft`` show on the terminal."""
    from lightning.pytorch.callbacks import ProgressBar

    from .progress import StepProgressBar

    if progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks = [*callbacks, StepProgressBar(console_kwargs={"file": terminal} if terminal else None)]
    return [*callbacks, summary]


def script_terminal(trainer) -> list:
    """``molt fit``'s terminal for a script's own ``L.Trainer`` (``AsyncRLModule.configure_callbacks``; nothing when
    the Trainer has a ``RunSummary``, as ``molt fit``'s has): Lightning's default bar (a plain ``RichProgressBar`` or
    ``TQDMProgressBar``, "Epoch 0/-2") becomes a ``StepProgressBar``, a ``RunSummary`` closes the run, and with
    ``wants_quiet()`` everything else goes to ``molt.log`` in the run folder from here on (``QuietLog``, with a
    logger; the Trainer's own lines from its construction, "GPU available" and Lightning's tips, came before)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from .progress import StepProgressBar

    if any(isinstance(c, RunSummary) for c in trainer.callbacks):  # molt fit's own Trainer: its terminal is set
        return []
    logged = trainer.logger is not None and trainer.logger.log_dir  # a run folder (else no log: not the cwd)
    quiet = QuietLog(trainer.logger.log_dir) if logged and wants_quiet() and trainer.global_rank == 0 else None
    terminal = quiet.quiet.terminal if quiet else None
    added = [RunSummary(out=terminal)] + ([quiet] if quiet else [])  # (the summary after the bar's last frame)
    if type(bar := trainer.progress_bar_callback) in (RichProgressBar, TQDMProgressBar):  # Lightning's default bar
        trainer.callbacks.remove(bar)
        added.insert(0, StepProgressBar(console_kwargs={"file": terminal} if terminal else None))
    return added


class QuietLog(L.Callback):
    """A ``QuietTerminal`` for a script's fit, its log in the run folder; the terminal comes back when fit ends."""

    def __init__(self, log_dir: str):
        self.quiet = QuietTerminal()
        self.quiet.move_to(Path(log_dir) / "molt.log")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.quiet.end(failed=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.quiet.end(failed=False)


class RunSummary(L.Callback):
    """Prints, at the end of training on rank 0: steps and wall time, ``metric`` at the start and the end, samples."""

    def __init__(self, out=None, first: int = 5, last: int = 10, metric: str = "reward", digits: str = ".2f"):
        self.out, self.first, self.last, self.metric, self.digits = out, first, last, metric, digits
        self.started, self.rewards, self.step_times, self.duplicates = time.perf_counter(), [], [], []

    def on_train_start(self, trainer, pl_module) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._t)
        self._t = now
        for key, kept in ((self.metric, self.rewards), ("samples/duplicates", self.duplicates)):
            if key in trainer.callback_metrics:
                kept.append(float(trainer.callback_metrics[key]))

    def teardown(self, trainer, pl_module, stage: str) -> None:  # after the progress bar's last frame
        if stage == "fit" and trainer.global_rank == 0 and self.step_times:
            print(self.text(trainer), file=self.out or sys.stdout, flush=True)

    def _ends(self, values: list[float]) -> tuple[float, str, float, str] | None:
        """The mean of the first ``first`` and of the last ``last`` values, each with its steps, in windows that never
        overlap (each at most half of a short run); None when there are fewer than two values."""
        n = len(values)
        f = min(self.first, n // 2)
        if f == 0:
            return None
        k = min(self.last, n - f)
        return statistics.fmean(values[:f]), f"steps 0-{f - 1}", statistics.fmean(values[-k:]), f"steps {n - k}-{n - 1}"

    def text(self, trainer) -> str:
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("samples/")}
        n, r = len(self.step_times), self.rewards
        head = (f"molt: {n} steps in {_clock(sum(self.step_times))} ({statistics.median(self.step_times):.3g} s/step "
                f"median); {_clock(time.perf_counter() - self.started)} in all, start-up included")
        lines = [head]
        if ends := self._ends(r):
            f = self.digits
            lines.append(f"  mean {self.metric} {ends[0]:{f}} ({ends[1]}) -> {ends[2]:{f}} ({ends[3]})")
        elif r:
            lines.append(f"  {self.metric} {r[0]:{self.digits}} (step 0)")
        names = ("finished", "trained", "failed", "dropped_stale_samples", "dropped_filtered_samples",
                 "dropped_empty_groups")
        total = {k: int(m.get(f"samples/{k}_total", 0)) for k in names}
        dropped = total["dropped_stale_samples"] + total["dropped_filtered_samples"]
        left = total["finished"] - total["trained"] - total["failed"] - dropped
        if m:  # an RL run's rollout side (not molt sft's)
            lines.append(f"  samples: {total['finished']} finished: {total['trained']} trained, {total['failed']} "
                         f"failed, {dropped} dropped ({total['dropped_stale_samples']} stale, "
                         f"{total['dropped_filtered_samples']} filtered), {left} not trained when the run ended; "
                         f"{total['dropped_empty_groups']} groups had no usable sample")
        if (d := self._ends(self.duplicates)) and d[0] >= DUPLICATES_NOTED:  # early: not convergence
            lines.append(f"  duplicates: {d[0]:.0%} of a group's completions repeated another one in {d[1]} "
                         f"({d[2]:.0%} in {d[3]}): a group then holds fewer distinct samples. A policy sure of its "
                         "answers (a warm start, e.g. after molt sft) repeats itself; otherwise, do the engines sample "
                         "streams of their own? (docs/engines.md, seeds)")
        if trainer.logger is not None:  # (not trainer.log_dir: a collective, and only rank 0 is here)
            lines += _held_out(trainer.logger.log_dir)
            lines.append(f"  run folder: {trainer.logger.log_dir}{_written(trainer.logger.log_dir)}")
            if os.path.exists(os.path.join(trainer.logger.log_dir or "", "trace.jsonl.gz")):  # callbacks.trace
                lines.append(f"  see every step and sample: molt view {trainer.logger.log_dir}")
        return "\n".join(lines)


def _written(log_dir: str | None) -> str:
    """The files of ``WRITTEN`` that are in ``log_dir``, as " (a, b)"."""
    there = [name for name in WRITTEN if os.path.exists(os.path.join(log_dir or "", name))]
    return f" ({', '.join(there)})" if there else ""


def _held_out(log_dir: str | None) -> list[str]:
    """A line per held-out source of the run's evaluation (``Evaluate``): avg@k at its first and last round."""
    path = os.path.join(log_dir or "", "eval.jsonl")
    if not os.path.exists(path):
        return []
    rounds = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    first, last, lines = rounds[0], rounds[-1], []
    for source, m in last["metrics"].items():
        name = f"avg@{last['k']}"
        before = first["metrics"].get(source, {}).get(name)
        was = f"{before:.2f} (version {first['version']}) -> " if before is not None and len(rounds) > 1 else ""
        label = name if source == "heldout" else f"{source} {name}"  # "heldout": a plain tasks(seed) stream
        lines.append(f"  held-out {label}: {was}{m[name]:.2f} [{m[name + '_lo']:.2f}, {m[name + '_hi']:.2f}]"
                     f" (version {last['version']}; {int(m['prompts'])} prompts, eval.jsonl)")
    return lines


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes else f"{seconds:.1f} s"
