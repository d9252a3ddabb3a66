"""RolloutCorrectionMonitor: a TrainerCallback that warns (and optionally stops) before a run collapses.

``callback`` the callback; ``rules`` the alert rules and their thresholds; ``args`` the CLI/YAML switch
(``MonitorArguments``); ``replay`` feeds recorded metric rows through the callback.
"""

from .callback import RolloutCorrectionMonitor

__all__ = ["RolloutCorrectionMonitor"]
