"""Lightning callbacks: behaviour around the loop lives here, never as a branch inside it."""

from .audit import SampleAudit
from .evaluate import Evaluate
from .monitor import RolloutMonitor
from .plot import RewardPlot
from .progress import StepProgressBar
from .runlog import script_terminal
from .samples import RolloutSamples
from .trace import RunTrace
from .update_kl import UpdateKL
from .weight_sync import WeightSync

__all__ = ["Evaluate", "RewardPlot", "RolloutMonitor", "RolloutSamples", "RunTrace", "SampleAudit", "StepProgressBar",
           "UpdateKL", "WeightSync", "script_terminal"]
