"""The rollout side: the source that runs agent groups on the engine's loop (``source``), which groups may start and
which may still be trained on (``admission``), and held-out rounds on the same engine (``heldout``)."""

from .agent_run import request_seed
from .source import RolloutCounts, RolloutFailures, RolloutSource, RolloutStopped

__all__ = ["RolloutCounts", "RolloutFailures", "RolloutSource", "RolloutStopped", "request_seed"]
