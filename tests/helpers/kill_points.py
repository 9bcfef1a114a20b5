"""Events a subprocess test waits on, and points where it holds a run (tests/test_reliability.py).

``Marks`` (in the reliability recipe's callbacks; inactive unless ``MOLT_MARKS`` names a folder):
- ``batch-<s>``: written when the step after ``s`` optimizer steps starts, i.e. just before the training step asks the
  rollout source for its batch (a signal from then on reaches the trainer inside that wait);
- with ``MOLT_HOLD=1``: ``held-<pid>`` after the process's second step (its first step's checkpoint is written by
  then); the process then waits for ``release-<pid>``. After its fourth step it writes ``fenced-<pid>`` and waits to
  be killed, so a kill that lands late still leaves the run steps to resume.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L

DEADLINE_S = 600


class Marks(L.Callback):
    def __init__(self):
        folder = os.environ.get("MOLT_MARKS")
        self.folder = Path(folder) if folder else None
        self.hold = os.environ.get("MOLT_HOLD") == "1"
        self.first = 0

    def _mark(self, name: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / name).touch()

    def on_train_start(self, trainer, pl_module) -> None:
        self.first = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.folder is not None:
            self._mark(f"batch-{trainer.global_step}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.folder is None or not self.hold:
            return
        done, pid = trainer.global_step - self.first, os.getpid()
        if done == 2:
            self._mark(f"held-{pid}")
            self._wait_for(self.folder / f"release-{pid}")
        elif done == 4:
            self._mark(f"fenced-{pid}")
            self._wait_for(self.folder / "never")

    @staticmethod
    def _wait_for(path: Path) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {DEADLINE_S} s")
            time.sleep(0.01)
