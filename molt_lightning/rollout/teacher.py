"""A distillation teacher on an engine, on the rollout side: the teacher's logprob of every token the policy sampled.

The trainer's distillation advantage needs, per sampled token, ``log pi_teacher(token | context)`` at the rollout
temperature. With the teacher inside the trainer (``model.teacher: <folder>``) a frozen copy computes it in the
trainer's step; with the teacher on an engine (``model.teacher: {class_path: molt_lightning.engines.Auxiliary}``) the
rollout source asks the teacher's engine here, as each group completes, and the numbers travel with the trajectory
(``Span.teacher`` -> ``Batch.teacher_logprobs``): the trainer holds no teacher and runs no extra forward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..engines.auxiliary import Auxiliary, AuxiliaryFailed
from ..trajectory import Kind, Status, Trajectory


async def scored(teacher: Auxiliary, traj: Trajectory, temperature: float,
                 failed: Callable[[Trajectory, str], Trajectory]) -> Trajectory:
    """``traj`` with the teacher's logprobs on its policy spans (``score_with``); when the teacher cannot score it,
    ``failed(traj, why)`` (the rollout source's count of failed samples). A failed trajectory is left as it is."""
    if traj.status != Status.FAILED:
        try:
            await score_with(teacher, traj, temperature)
        except AuxiliaryFailed as e:
            return failed(traj, f"the teacher could not score it: {e}")
    return traj


async def score_with(teacher: Auxiliary, traj: Trajectory, temperature: float) -> None:
    """Set ``Span.teacher`` on every policy span of ``traj``: the teacher's logprob of each token given everything
    before it in its segment (what the trainer sees), one request per segment."""

    async def segment(spans) -> None:
        ids = [x for s in spans for x in s.token_ids]
        starts = [sum(len(s.token_ids) for s in spans[:i]) for i in range(len(spans))]
        first = min((at for at, s in zip(starts, spans) if s.kind == Kind.POLICY and s.token_ids), default=None)
        if first is None:
            return
        logprobs = await teacher.score(ids, first, temperature)  # of ids[first:]
        for at, s in zip(starts, spans):
            if s.kind == Kind.POLICY:
                s.teacher = logprobs[at - first:at - first + len(s.token_ids)]

    await asyncio.gather(*[segment(spans) for spans in traj.segments])
