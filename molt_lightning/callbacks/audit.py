"""``SampleAudit``: an append-only record of every process of a run and of which prompts each training step trained
on, that survives SIGKILL at any instant.

One JSON line per event, written with one ``write`` on an ``O_APPEND`` descriptor and fsynced, in ``path``:
- ``{"event": "launch", "pid": p}`` when a process's ``fit`` starts (before a checkpoint's training state is
  restored): every process that reaches Lightning is on record, even one killed before it trains;
- ``{"event": "start", "step": s, "version": v, "pid": p}`` when training starts (s > 0: resumed from a checkpoint
  taken after step s). A process that resumes a run that is already complete never starts training (Lightning skips
  the loop and its ``on_train_start``); it writes its start at the end of ``fit`` with ``"complete": true``;
- ``{"event": "train", "step": s, "version": v, "samples": [...], "members": n, "reward": r, "loss/total": l,
  "grad_norm": g}`` after each training step: the prompts (sample ids) whose groups it trained on, how many agent
  runs, their mean reward, the step's loss and gradient norm;
- ``{"event": "checkpoint", "step": s}`` when a checkpoint is written;
- ``{"event": "end", "step": s, "pid": p}`` when ``fit`` returns.

A kill can cut a line short (in practice the kernel appends the one ``write`` whole, but nothing promises it). The
next writer finds the file not ending in a newline and ends the torn line first, so it stands alone; ``read`` returns
it as ``{"event": "torn", "line": n, "text": ...}`` (and warns), never skips it. ``replay(lines)`` applies the
restarts: a process that resumed from step s undoes every ``train`` line after s that an earlier process wrote
(those steps are retrained), and returns the steps that count, in order. The kill-and-resume tests check that every
prompt appears there once and that the values match an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os

import lightning as L

log = logging.getLogger(__name__)


class SampleAudit(L.Callback):
    def __init__(self, path: str = "runs/audit.jsonl"):
        self.path = path
        self.started = False

    def _write(self, trainer, record: dict) -> None:
        if trainer.global_rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            data = (json.dumps(record) + "\n").encode()
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a kill: end it, so it stands alone
                data = b"\n" + data
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _start(self, trainer, pl_module, **extra) -> None:
        self.started = True
        self._write(trainer, {"event": "start", "step": trainer.global_step, "version": pl_module.policy_version,
                              "pid": os.getpid(), **extra})

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = False
        self._write(trainer, {"event": "launch", "pid": os.getpid()})

    def on_train_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trajectories = outputs["record"].batch.trajectories
        metric = trainer.callback_metrics.get
        self._write(trainer, {
            "event": "train", "step": trainer.global_step, "version": pl_module.policy_version,
            "samples": sorted({t.sample_id for t in trajectories}), "members": len(trajectories),
            "reward": sum(t.reward for t in trajectories) / len(trajectories),
            **{k: float(metric(k)) for k in ("loss/total", "grad_norm") if metric(k) is not None}})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._write(trainer, {"event": "checkpoint", "step": trainer.global_step})

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.started:  # resumed a complete run: the loop was skipped, on_train_start never came
            self._start(trainer, pl_module, complete=True)
        self._write(trainer, {"event": "end", "step": trainer.global_step, "pid": os.getpid()})


def replay(lines: list[dict]) -> list[dict]:
    """The ``train`` records that stand after every restart undid what its checkpoint did not hold."""
    kept: list[dict] = []
    for rec in lines:
        if rec["event"] == "start":
            kept = [r for r in kept if r["step"] <= rec["step"]]
        elif rec["event"] == "train":
            kept.append(rec)
    return kept


def read(path: str) -> list[dict]:
    """The audit's records, in order; a line a kill cut short is a ``torn`` record (with a warning), not skipped."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                out.append(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError):
                text = raw.decode(errors="replace").rstrip("\n")
                log.warning("%s line %d was cut short by a kill: %r", path, n, text[:200])
                out.append({"event": "torn", "line": n, "text": text})
    return out
