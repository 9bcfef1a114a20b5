"""Tasks from data (``sources``) and graders as rewards (``graders``); the one-turn agent that joins them is
``molt_lightning.agents.Answer``."""

from .graders import Verdict, VerifierFailed, verify
from .judge import Judge, JudgeFailed, JudgeVerdict
from .sources import Source, Tasks

__all__ = ["Judge", "JudgeFailed", "JudgeVerdict", "Source", "Tasks", "Verdict", "VerifierFailed", "verify"]


def __getattr__(name: str):
    if name == "Answer":
        raise AttributeError("molt_lightning.data.Answer moved to molt_lightning.agents.Answer: name it so")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
