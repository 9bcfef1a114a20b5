"""``AtomicCheckpointIO``: each checkpoint written beside its final path and renamed into place; a full disk named.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives in the system's
temp folder; committing it to another filesystem is a copy over the destination, so a disk that fills up mid-copy
leaves a truncated checkpoint under the final name (an existing ``last.ckpt`` is overwritten in place), and a full
``/tmp`` fails a save to a roomy disk. Here the bytes go to a hidden ``.NAME.partial`` in the checkpoint's own folder,
are flushed to the disk, and replace the final path in one ``os.replace``: a failed write removes its partial file
and leaves every earlier checkpoint as it was. A full disk (or quota) raises ``DiskFull`` (an ``OSError``) naming
the folder, the checkpoint's size, the space left and the fixes; the run stops there (``molt fit``: that one line,
exit 1).

``molt fit`` installs it unless the recipe brings its own ``CheckpointIO``; a Trainer built in Python takes
``plugins=[AtomicCheckpointIO()]``. Remote paths (``s3://``...) go through Lightning's writer; FSDP2's sharded
checkpoints (a folder written by ``torch.distributed.checkpoint``) do not pass through a ``CheckpointIO``.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path

import torch
from lightning.pytorch.plugins import TorchCheckpointIO

MiB = 2**20


class DiskFull(OSError):
    """No space (or quota) left for a checkpoint; ``strerror`` says where, how much and what to do."""


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = io.BytesIO()
        torch.save(checkpoint, data)
        partial = path.with_name(f".{path.name}.partial")
        try:
            with open(partial, "wb") as f:
                f.write(data.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except OSError as e:
            partial.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(e.errno, disk_full(path, data.getbuffer().nbytes)) from e
            raise


def disk_full(path: Path, size: int) -> str:
    """What a user reads when ``path`` did not fit: where, how much, what is left, what to do."""
    free = shutil.disk_usage(path.parent).free
    kept = sorted(path.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    last = f"; the newest complete one is {kept[-1]} (resume with --ckpt_path {kept[-1]})" if kept else ""
    return (f"no space left in {path.parent} for checkpoint {path.name} ({size / MiB:.1f} MiB; "
            f"{free / MiB:.1f} MiB free there). Free space there, point the checkpoints at a larger disk "
            f"(ModelCheckpoint's dirpath, or trainer.default_root_dir), or keep fewer of them (save_top_k, "
            f"every_n_train_steps). Earlier checkpoints are untouched{last}")
