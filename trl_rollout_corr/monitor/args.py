"""The monitor's switch and settings for ``trl-rollout-corr train`` (YAML recipe or command line).

    trl-rollout-corr train --config recipes/ppo_is_bypass.yaml --rollout_corr_monitor true \
        --rollout_corr_monitor_stop_on_alert policy_collapse,all_rejected

In YAML, ``rollout_corr_monitor_stop_on_alert`` may also be a list, and a threshold ``null`` switches its alert off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .rules import ALERTS, DEFAULTS, validate, validate_stop_on_alert

_PREFIX = "rollout_corr_monitor_"
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off", "")


@dataclass
class MonitorArguments:
    """``RolloutCorrectionMonitor`` from the command line: off unless ``rollout_corr_monitor`` is true."""

    rollout_corr_monitor: bool = field(default=False, metadata={"help": "Attach RolloutCorrectionMonitor (alerts on "
                                       "policy collapse and on the correction failing; CSV/PNG in output_dir)."})
    rollout_corr_monitor_stop_on_alert: str = field(default="false", metadata={
        "help": "Stop (with a checkpoint) on an alert: true, false, or a comma-separated list of "
                f"{', '.join(ALERTS)}."})
    rollout_corr_monitor_lag: int | None = field(default=None, metadata={
        "help": "Optimizer steps the rollout engine lags behind (0 = synchronous); default: known for an emulated "
                "engine (rollout_engine), otherwise unknown. Decides whether a collapse under bypass is blamed on it."})
    rollout_corr_monitor_smoothing_steps: int = field(default=DEFAULTS["smoothing_steps"], metadata={
        "help": "Half-life (optimizer steps) of the exponential smoothing of every signal."})
    rollout_corr_monitor_warmup_steps: int = field(default=DEFAULTS["warmup_steps"], metadata={
        "help": "Optimizer steps before any alert is judged."})
    rollout_corr_monitor_patience_steps: int = field(default=DEFAULTS["patience_steps"], metadata={
        "help": "Optimizer steps a condition must hold before it alerts."})
    rollout_corr_monitor_collapse_window: int = field(default=DEFAULTS["collapse_window"], metadata={
        "help": "Optimizer steps over which the run's recent best smoothed reward is taken."})
    rollout_corr_monitor_reward_drop: float | None = field(default=DEFAULTS["reward_drop"], metadata={
        "help": "policy_collapse: fall of the smoothed reward below its recent best, as a fraction of "
                "max(|best|, reward_scale)."})
    rollout_corr_monitor_severe_reward_drop: float | None = field(default=DEFAULTS["severe_reward_drop"], metadata={
        "help": "policy_collapse: a fall this large (same units as reward_drop) alerts without entropy / ESS "
                "evidence."})
    rollout_corr_monitor_reward_scale: float = field(default=DEFAULTS["reward_scale"], metadata={
        "help": "policy_collapse: smallest reward magnitude the drop is relative to."})
    rollout_corr_monitor_entropy_rise: float | None = field(default=DEFAULTS["entropy_rise"], metadata={
        "help": "policy_collapse: relative rise of the smoothed entropy over its value at the best."})
    rollout_corr_monitor_ess_threshold: float | None = field(default=DEFAULTS["ess_threshold"], metadata={
        "help": "ess_collapse: smoothed rollout_is_eff_sample_size at or below this fraction."})
    rollout_corr_monitor_rejected_fraction_threshold: float | None = field(
        default=DEFAULTS["rejected_fraction_threshold"], metadata={
            "help": "all_rejected: smoothed rejected_token_fraction at or above this."})
    rollout_corr_monitor_pinned_fraction_threshold: float | None = field(
        default=DEFAULTS["pinned_fraction_threshold"], metadata={
            "help": "weights_pinned: smoothed fraction of tokens with rho above the truncation bound C."})
    rollout_corr_monitor_negative_kl_tolerance: float | None = field(
        default=DEFAULTS["negative_kl_tolerance"], metadata={"help": "negative_kl: smoothed kl at or below -this."})

    def __post_init__(self) -> None:
        self.rollout_corr_monitor_stop_on_alert = parse_stop_on_alert(self.rollout_corr_monitor_stop_on_alert)
        validate(self.rules(), where="trl-rollout-corr train", prefix=_PREFIX)
        lag = self.rollout_corr_monitor_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ValueError(f"rollout_corr_monitor_lag={lag!r}: use an integer >= 0 (0 = synchronous engine).")

    def rules(self) -> dict[str, Any]:
        return {name: getattr(self, _PREFIX + name) for name in DEFAULTS}

    def build(self, rollout_engine: str | None = None, rollout_engine_lag: int | None = None):
        """The configured monitor, or None when switched off; the lag of an emulated engine is known."""
        if not self.rollout_corr_monitor:
            return None
        from .callback import RolloutCorrectionMonitor

        lag = self.rollout_corr_monitor_lag
        if lag is None and rollout_engine:
            lag = rollout_engine_lag if rollout_engine == "stale" else 0
        return RolloutCorrectionMonitor(**self.rules(), rollout_lag=lag,
                                        stop_on_alert=self.rollout_corr_monitor_stop_on_alert)


def parse_stop_on_alert(value: Any) -> bool | list[str]:
    """true / false / "a,b" / [a, b] (YAML or command line) -> bool or a list of alert names.

    Bad input raises ``ValueError`` naming the field."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        value = [v.strip() for v in value.split(",") if v.strip()]
    return validate_stop_on_alert(value, "rollout_corr_monitor_stop_on_alert")
