"""Lightning callbacks: behaviour around the loop lives here, never as a branch inside it."""

from .audit import SampleAudit
from .monitor import RolloutMonitor
from .plot import RewardPlot
from .progress import StepProgressBar
from .samples import RolloutSamples
from .weight_sync import WeightSync

__all__ = ["RewardPlot", "RolloutMonitor", "RolloutSamples", "SampleAudit", "StepProgressBar", "WeightSync"]
