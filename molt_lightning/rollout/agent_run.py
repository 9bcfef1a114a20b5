"""One agent run on a trajectory, as training and held-out evaluation both run it (``run_agent``), and the seed of its
requests (``request_seed``: turn ``k`` of member ``j`` of prompt ``i`` samples with its own seed, derived from
(``task_seed``, ``i``, ``j``) plus ``k``, so what a prompt's agents sample does not depend on which requests the engine
batched together)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from ..agents.client import AgentResult
from ..agents.sessions import AgentSessions
from ..engines.base import derive_seed
from ..trajectory import Trajectory


async def run_agent(agent: Callable, sessions: AgentSessions, traj: Trajectory, seed: int, timeout_s: float,
                    counter: Callable[[str, int], None] | None = None, temperature: float | None = None) -> str | None:
    """Run ``agent`` once on ``traj.sample`` (training's runs and held-out ones alike): its reward, info and per-turn
    lists land on ``traj``; returns why the run failed (it raised, timed out, returned no float or a non-finite one,
    or per-turn lists of the wrong shape), or None."""
    async with sessions.client(traj, seed, counter, temperature) as client:
        try:
            result = await asyncio.wait_for(agent(client, traj.sample), timeout_s)
        except asyncio.TimeoutError:
            return f"timed out after {timeout_s}s"
        except Exception as e:
            return f"agent raised {type(e).__name__}: {e}"
    reward = result.reward if isinstance(result, AgentResult) else result
    try:
        traj.reward = float(reward)
    except (TypeError, ValueError):
        return f"agent returned {reward!r}, not a float or AgentResult"
    if not math.isfinite(traj.reward):
        return f"non-finite reward {traj.reward}"
    if isinstance(result, AgentResult):
        traj.info.update(result.info)
        problem = _check_turns(result, traj.turns)
        if problem:
            return problem
        traj.turn_rewards = None if result.turn_rewards is None else [float(r) for r in result.turn_rewards]
        traj.turn_keys = None if result.turn_keys is None else list(result.turn_keys)
    return None


def _check_turns(result: AgentResult, turns: int) -> str | None:
    """Why ``result``'s per-turn lists cannot be used (one entry per engine call, finite rewards, hashable keys)."""
    for name, given in (("turn_rewards", result.turn_rewards), ("turn_keys", result.turn_keys)):
        if given is not None and len(given) != turns:
            return f"AgentResult.{name} has {len(given)} entries for {turns} turns (one per engine call)"
    try:
        if result.turn_rewards is not None and not all(math.isfinite(float(r)) for r in result.turn_rewards):
            return f"AgentResult.turn_rewards holds a non-finite reward: {result.turn_rewards}"
        for key in result.turn_keys or []:
            hash(key)
    except (TypeError, ValueError) as e:
        return f"AgentResult turn_rewards must be floats and turn_keys hashable: {e}"
    return None


def request_seed(task_seed: int, sample_id: int, member: int) -> int:
    """The base seed of one agent run; its k-th request samples with ``base + k`` (see the module docstring)."""
    return derive_seed(task_seed, sample_id, member)  # 62 bits: room for + k below 2**63
