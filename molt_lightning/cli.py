"""``molt``: the command line, LightningCLI over ``AsyncRLModule`` (``molt fit --config recipes/X.yaml``).

Every Trainer flag works (``--trainer.max_steps 3``). vLLM is imported only when an engine starts, so ``--help``
answers at once.
"""

from __future__ import annotations

import sys


def main(args: list[str] | None = None) -> None:
    from lightning.pytorch.cli import LightningCLI

    from .module import AsyncRLModule

    LightningCLI(
        AsyncRLModule,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # vLLM's engine core starts with spawn: keep the entry point guarded
    main(sys.argv[1:])
