"""RolloutCorrectionMonitor: a TrainerCallback that warns (and optionally stops) before a run collapses.

``callback`` the callback; ``rules`` the alert rules and their thresholds; ``args`` the CLI/YAML switch
(``MonitorArguments``). Recorded metric rows are fed through the callback by ``experiments/replay.py``.
"""

from .callback import RolloutCorrectionMonitor

__all__ = ["RolloutCorrectionMonitor"]
