"""Agents and task streams for the reliability tests (tests/test_reliability.py), importable by dotted path."""

from __future__ import annotations

import asyncio

from molt_lightning.tasks import arithmetic


async def sleepy_after_4_prompts(client, sample):
    """The calculator agent for prompts 0-3 (two steps of 2 prompts); asleep for an hour on every later one."""
    if client.trajectory.sample_id >= 4:
        await asyncio.sleep(3600)
    return await arithmetic.calculator_agent(client, sample)


def no_tasks(seed: int = 0):
    """A task stream with nothing in it."""
    return iter(())
