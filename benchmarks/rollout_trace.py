"""When the rollout source admits groups, when they finish, when the trainer asks for and gets a batch, and when each
weight load starts and ends: a timeline of one run, to see where the trainer and the engine wait for each other.

Wraps ``RolloutSource.next_batch``/``_run_group`` and ``RolloutEngine.commit_weights`` (seconds since start), then runs
``molt`` with the given arguments and writes one event per line to ``--out``:

    python benchmarks/rollout_trace.py --out trace.txt fit --config recipes/smollm2_addition.yaml --trainer.max_steps 12

Result on this machine: ``benchmarks/results/smollm2_rollout_trace_cpu2.txt``.
"""

from __future__ import annotations

import sys
import time

T0 = time.perf_counter()
EVENTS: list[tuple] = []


def event(*what) -> None:
    EVENTS.append((round(time.perf_counter() - T0, 2), *what))


def instrument() -> None:
    from molt_lightning import rollout
    from molt_lightning.engines import base

    next_batch, run_group, commit = (rollout.RolloutSource.next_batch, rollout.RolloutSource._run_group,
                                     base.RolloutEngine.commit_weights)

    def traced_next_batch(self, version):
        event("want", version)
        out = next_batch(self, version)
        event("got", version, "engine_v", self.engine.version)
        return out

    async def traced_run_group(self, order, sample_id, sample):
        event("admit", order, "engine_v", self.engine.version, "consumed", self.admission.consumed)
        await run_group(self, order, sample_id, sample)
        event("group_done", order)

    async def traced_commit(self, version):
        event("commit_start", version)
        await commit(self, version)
        event("commit_end", version)

    rollout.RolloutSource.next_batch, rollout.RolloutSource._run_group = traced_next_batch, traced_run_group
    base.RolloutEngine.commit_weights = traced_commit


if __name__ == "__main__":  # vLLM's engine process re-imports this script
    if len(sys.argv) < 3 or sys.argv[1] != "--out":
        sys.exit(__doc__)
    out, args = sys.argv[2], sys.argv[3:]
    instrument()
    from molt_lightning.commands.cli import main

    try:
        main(args)
    finally:
        with open(out, "w") as f:
            f.writelines(" ".join(map(str, e)) + "\n" for e in EVENTS)
