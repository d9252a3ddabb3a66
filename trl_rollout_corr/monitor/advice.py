"""What the monitor advises after a policy collapse: only remedies that survive the mismatch benchmark's analysis.

The benchmark (``benchmarks/mismatch_bench.py``; its results in ``benchmarks/results/mismatch_results.csv`` and the
table in docs/benchmarks.md) trains every method on each kind of sampler/trainer mismatch. A remedy is listed in
``REMEDIES`` only where the benchmark's ``recommended()`` names it for that kind's scenario (``SCENARIOS``): above TRL's
default after a paired, Holm-corrected analysis of the whole table. ``tests/test_mismatch_benchmark.py`` checks that
``REMEDIES`` is exactly that. Today no remedy survives (the old benchmark: T <= 9 tokens, per-token KL 0.14-0.30, 5
seeds, no held-out seeds), so the advice names the metrics to watch and points to the benchmark page without
recommending a preset. The monitor tells the kinds apart by what it is told about the engine (``rollout_lag``): a
lag > 0 is a stale engine, 0 a synchronous engine whose mismatch persists (quantized / low precision), ``None``
unknown (both kinds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX

# the kinds of mismatch the monitor tells apart: how a message says it, and the benchmark scenario that stands for it
KINDS = {"stale": "a stale engine", "persistent": "a persistent precision gap"}
SCENARIOS = {"stale": "stale4", "persistent": "wq3"}
BENCHMARK_PAGE = 'docs/benchmarks.md, "Which preset for which mismatch"'


@dataclass(frozen=True)
class Remedy:
    """What trained best for one kind of mismatch: the benchmark's method (its row) and how to switch to it."""

    kind: str  # the kind of mismatch, as the message says it
    method: str  # the benchmark's method name (its row in the scenario)
    setting: str  # how to ask for it in RolloutCorrGRPOConfig / YAML / CLI
    scenario: str  # the benchmark scenario whose rows back it

    def config(self) -> Any:
        """The resolved ``RolloutCorrectionConfig`` of the remedy (to tell whether a run already uses it)."""
        from ..config.correction import RolloutCorrectionConfig
        from ..config.trl_names import TRL_MODES, translate_trl_correction

        key, _, value = self.setting.partition("=")
        if key == "vllm_importance_sampling_mode" and value in TRL_MODES:
            return RolloutCorrectionConfig(**translate_trl_correction(True, value))
        return RolloutCorrectionConfig.from_preset(value)


# kind -> Remedy, only where the benchmark's paired Holm analysis supports one (none does: the old stale-engine remedy
# ppo_is_bypass has Holm p 0.054 on stale4, the persistent-gap one, TRL's token_truncate, 0.23 on wq3)
REMEDIES: dict[str, Remedy] = {}


def kinds_for(rollout_lag: int | None) -> list[str]:
    """The kinds of mismatch what is known about the engine allows: stale (lag > 0), persistent (0) or both."""
    if rollout_lag is None:
        return ["stale", "persistent"]
    return ["stale" if rollout_lag > 0 else "persistent"]


def remedies_for(rollout_lag: int | None) -> list[Remedy]:
    """The supported remedies for what is known about the engine (possibly none)."""
    return [REMEDIES[kind] for kind in kinds_for(rollout_lag) if kind in REMEDIES]


def collapse_advice(correction: Any, rollout_lag: int | None, corrected: bool | None, has_metrics: bool) -> str:
    """The advice after ``policy_collapse``: a remedy the benchmark supports for the kind of mismatch, or, where the
    run already uses it (``correction``: the run's resolved config), what remains; for a kind without one, the metrics
    to watch and the benchmark page, no preset."""
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
    parts, unsupported = [], []
    for kind in kinds_for(rollout_lag):
        remedy = REMEDIES.get(kind)
        if remedy is None:
            unsupported.append(kind)
            continue
        where = f"the mismatch benchmark's {remedy.scenario} scenario"
        if correction is not None and correction == remedy.config():
            parts.append(f"For {remedy.kind} this run already uses what trained best in {where} ({remedy.setting}): "
                         "lower the learning rate, or reduce the mismatch at its source (sync more often / a more "
                         "precise engine).")
        else:
            parts.append(f"For {remedy.kind}, {remedy.method} trained best in {where}: {remedy.setting}.")
    if unsupported:
        parts.append(
            f"No correction is confirmed to help with {' or '.join(KINDS[k] for k in unsupported)}: the mismatch "
            f"benchmark's {' and '.join(SCENARIOS[k] for k in unsupported)} rows single none out after a paired, "
            f"Holm-corrected analysis, and none was checked on held-out seeds. Watch {metric('kl')} (the mismatch) "
            f"and {metric('rollout_is_eff_sample_size')}, see {BENCHMARK_PAGE} for your regime (T * per-token KL), "
            "and act on the cause: a lower learning rate, or less mismatch at its source (sync more often / a more "
            "precise engine).")
    return " ".join([lead, *parts])
