"""``molt``: the command line, LightningCLI over ``AsyncRLModule`` (``molt fit --config recipes/X.yaml``).

Every Trainer flag works (``--trainer.max_steps 3``); ``--trainer.strategy`` is ``auto``, ``ddp`` or ``fsdp2``
(two CPU processes: ``--trainer.devices 2``). vLLM is imported only when an engine starts, so ``--help`` answers at
once. The progress bar counts optimizer steps (``StepProgressBar``) unless the recipe brings its own or
``--trainer.enable_progress_bar false``.
"""

from __future__ import annotations

import sys


def main(args: list[str] | None = None) -> None:
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningCLI

    from .callbacks import StepProgressBar
    from .module import AsyncRLModule
    from .parallel import STRATEGIES, SUPPORTED

    class MoltCLI(LightningCLI):
        def instantiate_trainer(self, **kwargs):
            trainer = self._get(self.config_init, "trainer", default={})
            strategy = trainer.get("strategy")
            if isinstance(strategy, str) and strategy not in STRATEGIES:
                hint = " (FSDP1 needs a GPU; FSDP2 runs on the CPU too)" if strategy.startswith("fsdp") else ""
                raise ValueError(f"--trainer.strategy {strategy!r} is not supported: use {SUPPORTED}{hint}")
            callbacks = list(trainer.get("callbacks") or [])
            if trainer.get("enable_progress_bar") is not False \
                    and not any(isinstance(c, ProgressBar) for c in callbacks):
                kwargs["callbacks"] = [*callbacks, StepProgressBar()]
            return super().instantiate_trainer(**kwargs)

    MoltCLI(
        AsyncRLModule,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # vLLM's engine core starts with spawn: keep the entry point guarded
    main(sys.argv[1:])
