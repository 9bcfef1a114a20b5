"""What the step record and the token-selection pass cost the step: A/B in one run.

The default task and policy, the torch engine in-process (the record is trainer-side: the engine only adds noise),
``max_lag=1``, 8 prompts x 8 runs a step; rounds alternate between the step as it ships ("on": ``StepRecord`` filled
in the loss pass, the selection applied before the plan) and the same step with both turned off ("off": ``fill`` a
no-op, ``selected`` the identity; what the step did before issue 59), in alternating order (off-on, then on-off, ...).
Prints the median of the trainer's own compute per step (``perf/train_compute_s``) and of the wall time per step over
the steps after the first ``--warmup`` of each round, for each variant, and on / off; then what the new pieces
themselves took per step in the "on" rounds (timed around each call): the selection pass, the record's start and
fills, and the plan (twice a step now: before and after the selection).
Usage: ``python benchmarks/step_record.py [--steps 20] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import time

from ab import alternate, fit_default  # (benchmarks/ab.py)

PIECES: dict[str, list[float]] = {"selected": [], "StepRecord.start": [], "StepRecord.fill": [], "plan (x2)": []}


def timed(name: str, fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PIECES[name].append(time.perf_counter() - t0)
    return call


def run(variant: str, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    from molt_lightning import module as loop
    from molt_lightning.trainer import plan as plans
    from molt_lightning.trainer.record import StepRecord

    fill, select, start, plan = StepRecord.fill, plans.selected, StepRecord.start, loop.plan
    if variant == "off":
        StepRecord.fill, loop.selected = (lambda *a, **k: None), (lambda batch, *a: (batch, {}))
    else:
        StepRecord.fill, loop.selected = timed("StepRecord.fill", fill), timed("selected", select)
        StepRecord.start, loop.plan = classmethod(timed("StepRecord.start", start.__func__)), timed("plan (x2)", plan)
    try:
        return fit_default(variant, steps, warmup)
    finally:
        StepRecord.fill, loop.selected, StepRecord.start, loop.plan = fill, select, start, plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    got, med = alternate(lambda variant: run(variant, args.steps, args.warmup), args.rounds)
    print("| variant | train compute s/step (median) | wall s/step (median) | steps |")
    print("|---|---|---|---|")
    for v in ("off", "on"):
        print(f"| {v} | {med[v][0]:.4f} | {med[v][1]:.4f} | {len(got[v][0])} |")
    print(f"| on / off | {med['on'][0] / med['off'][0]:.3f} | {med['on'][1] / med['off'][1]:.3f} | |")
    steps = args.rounds * args.steps
    print("\n| piece (on rounds) | ms per step | share of the train compute |\n|---|---|---|")
    for name, seconds in PIECES.items():
        print(f"| {name} | {sum(seconds) / steps * 1e3:.3f} | {sum(seconds) / steps / med['on'][0]:.2%} |")


if __name__ == "__main__":
    main()
