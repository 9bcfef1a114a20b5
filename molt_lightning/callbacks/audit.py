"""``SampleAudit``: an append-only record of which prompts each training step trained on, that survives SIGKILL.

One JSON line per event, flushed and fsynced as it is written, in ``path``:
- ``{"event": "start", "step": s, "version": v, "pid": p}`` when training starts (s > 0: resumed from a checkpoint
  taken after step s);
- ``{"event": "train", "step": s, "version": v, "samples": [...], "members": n, "reward": r, "loss/total": l,
  "grad_norm": g}`` after each training step: the prompts (sample ids) whose groups it trained on, how many agent
  runs, their mean reward, the step's loss and gradient norm;
- ``{"event": "checkpoint", "step": s}`` when a checkpoint is written.

``replay(lines)`` applies the restarts: a process that resumed from step s undoes every ``train`` line after s that
an earlier process wrote (those steps are retrained), and returns the steps that count, in order. The kill-and-resume
tests check that every prompt appears there once and that the values match an uninterrupted run.
"""

from __future__ import annotations

import json
import os

import lightning as L


class SampleAudit(L.Callback):
    def __init__(self, path: str = "runs/audit.jsonl"):
        self.path = path

    def _write(self, trainer, record: dict) -> None:
        if trainer.global_rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(trainer, {"event": "start", "step": trainer.global_step, "version": pl_module.policy_version,
                              "pid": os.getpid()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trajectories = outputs["batch"].trajectories
        metric = trainer.callback_metrics.get
        self._write(trainer, {
            "event": "train", "step": trainer.global_step, "version": pl_module.policy_version,
            "samples": sorted({t.sample_id for t in trajectories}), "members": len(trajectories),
            "reward": sum(t.reward for t in trajectories) / len(trajectories),
            **{k: float(metric(k)) for k in ("loss/total", "grad_norm") if metric(k) is not None}})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._write(trainer, {"event": "checkpoint", "step": trainer.global_step})


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
    """The audit's records; a last line cut short by a kill is left out."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise
    return out
