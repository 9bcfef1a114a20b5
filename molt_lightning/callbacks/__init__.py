"""Lightning callbacks: behaviour around the loop lives here, never as a branch inside it."""

from .monitor import RolloutMonitor
from .plot import RewardPlot
from .weight_sync import WeightSync

__all__ = ["RewardPlot", "RolloutMonitor", "WeightSync"]
