"""What the monitor advises after a policy collapse: only the remedies the mismatch benchmark measured to help.

The benchmark (``benchmarks/mismatch_bench.py``; its results in ``benchmarks/results/mismatch_results.csv`` and the
table in docs/benchmarks.md) trains every method on each kind of sampler/trainer mismatch.
Each remedy below names the scenario whose rows back it; ``tests/test_mismatch_benchmark.py`` checks every one against
that file (significantly above TRL's default and above every collapsing method there). The monitor tells the kinds
apart by what it is told about the engine (``rollout_lag``): a lag > 0 is a stale engine, 0 a synchronous engine whose
mismatch persists (quantized / low-precision), ``None`` unknown (both remedies are named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.stats import METRIC_PREFIX


@dataclass(frozen=True)
class Remedy:
    """What trained best for one kind of mismatch: the benchmark's method (its row) and how to switch to it."""

    kind: str  # the kind of mismatch, as the message says it
    method: str  # the benchmark's method name (its row in the scenario)
    setting: str  # how to ask for it in RolloutCorrGRPOConfig / YAML / CLI
    scenario: str  # the benchmark scenario whose rows back it

    def config(self) -> Any:
        """The resolved ``RolloutCorrectionConfig`` of the remedy (to tell whether a run already uses it)."""
        from ..config import RolloutCorrectionConfig
        from ..trl_names import TRL_MODES, translate_trl_correction

        key, _, value = self.setting.partition("=")
        if key == "vllm_importance_sampling_mode" and value in TRL_MODES:
            return RolloutCorrectionConfig(**translate_trl_correction(True, value))
        return RolloutCorrectionConfig.from_preset(value)


REMEDIES = {
    "stale": Remedy("a stale engine", "ppo_is_bypass", "rollout_correction_preset=ppo_is_bypass", "stale4"),
    "persistent": Remedy("a persistent precision gap", "trl_token_truncate",
                         "vllm_importance_sampling_mode=token_truncate", "wq3"),
}


def remedies_for(rollout_lag: int | None) -> list[Remedy]:
    """The remedies for what is known about the engine: stale (lag > 0), persistent (lag 0) or both (unknown)."""
    if rollout_lag is None:
        return [REMEDIES["stale"], REMEDIES["persistent"]]
    return [REMEDIES["stale"] if rollout_lag > 0 else REMEDIES["persistent"]]


def collapse_advice(correction: Any, rollout_lag: int | None, corrected: bool | None, has_metrics: bool) -> str:
    """The advice after ``policy_collapse``: the measured remedy for the kind of mismatch, or, where the run already
    uses it (``correction``: the run's resolved config), what remains: the learning rate, the mismatch at its source."""
    if not has_metrics:
        lead = f"No {METRIC_PREFIX}* metrics are logged: enable a rollout correction."
    elif corrected is False:
        lead = "No rollout correction is active (preset disabled)."
    elif rollout_lag is None:
        lead = "The engine's lag is unknown (pass rollout_lag to the monitor to narrow this down)."
    elif rollout_lag > 0:
        lead = f"The engine is known to lag {rollout_lag} optimizer step(s)."
    else:
        lead = "The engine is synchronous, so its mismatch persists (quantization / precision)."
    parts = []
    for remedy in remedies_for(rollout_lag):
        where = f"the mismatch benchmark's {remedy.scenario} scenario"
        if correction is not None and correction == remedy.config():
            parts.append(f"For {remedy.kind} this run already uses what trained best in {where} ({remedy.setting}): "
                         "lower the learning rate, or reduce the mismatch at its source (sync more often / a more "
                         "precise engine).")
        else:
            parts.append(f"For {remedy.kind}, {remedy.method} trained best in {where}: {remedy.setting}.")
    return " ".join([lead, *parts])
