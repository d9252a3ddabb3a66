"""The monitor's alert rules as a pure state machine over logged rows (no transformers / TRL import).

``AlertRules.update(step, row)`` takes one logged row (a dict of floats: ``reward``, ``entropy``,
``rollout_corr/*``) at optimizer step ``step`` and returns ``{alert: message}`` for every condition that holds
*and has held long enough*. Every window is measured in optimizer steps, never in log lines, so that the same
defaults work whether a row is logged every step or every k steps (a row then holds the mean of k steps).

Smoothing: each signal x is an exponential moving average over optimizer steps with half-life H
(``smoothing_steps``): with dt = step - previous step,

    a = max(1 - 2^(-dt / H), dt / n),    x_ema <- x_ema + a * (x - x_ema)

(n = optimizer steps seen so far: the first steps are a running mean, not the first noisy row). dt and n are each
signal's own: a key logged only in some rows (the asynchronous trainer's ``lag_0/kl``) is blended by the steps since
its own last value, not since the last row.

Rules (an alert holds once its condition has been true for ``patience_steps`` optimizer steps):

* ``policy_collapse`` (outcome): the smoothed reward R is below the run's own recent best
  R* = max R over the last ``collapse_window`` steps by ``reward_drop`` * max(|R*|, reward_scale), together with
  a rising smoothed entropy H (H - H(R*) >= ``entropy_rise`` * H(R*)) or a collapsing effective sample size
  (ESS <= ``ess_threshold``), or a fall by ``severe_reward_drop`` * max(|R*|, reward_scale) on its own (the reward
  halved). Judged only after ``warmup_steps``.
* ``all_rejected``: the smoothed ``rollout_corr/rejected_token_fraction`` >= ``rejected_fraction_threshold``
  (the correction throws away nearly every token: the loss is ~0 and nothing is learned).
* ``ess_collapse``: the smoothed ``rollout_corr/rollout_is_eff_sample_size`` <= ``ess_threshold``
  (ESS = E[w]^2 / E[w^2] over tokens: a few tokens carry the whole gradient).
* ``weights_pinned``: the smoothed ``rollout_corr/rollout_is_ratio_fraction_high`` (fraction of tokens with
  rho > C, i.e. pinned at the truncation bound C) >= ``pinned_fraction_threshold``.
* ``negative_kl``: the smoothed ``rollout_corr/kl`` (k1 estimate of KL(pi_rollout || pi_train) on samples of
  pi_rollout, >= 0 in expectation) <= -``negative_kl_tolerance``: the pi_rollout log-probs are not those of the
  sampler (temperature / processing / hand-over bug).

The mismatch levels (``kl``, ``k3_kl``, ``chi2_token``) never trigger an alert; they are quoted in messages. The
smoothed ``lag_0/kl`` (logged by the asynchronous trainer) never triggers one either: it decides whether the collapse
advice may name the stale remedy (:func:`.advice.lag0_text`).
"""

from __future__ import annotations

import math
from typing import Any

from ..core.metric_names import metric
from .advice import collapse_advice

ALERTS = ("policy_collapse", "all_rejected", "ess_collapse", "weights_pinned", "negative_kl")
SIGNALS = {  # smoothed name -> logged key (TRL's own, or ours from the registry)
    "reward": "reward",
    "entropy": "entropy",
    "ess": metric("rollout_is_eff_sample_size"),
    "pinned": metric("rollout_is_ratio_fraction_high"),
    "rejected": metric("rejected_token_fraction"),
    "kl": metric("kl"),
    "k3": metric("k3_kl"),
    "chi2": metric("chi2_token"),
    "kl_lag0": metric("lag_0/kl"),  # the asynchronous trainer's gap without staleness: shapes the collapse advice
}
DEFAULTS: dict[str, Any] = dict(
    smoothing_steps=5, warmup_steps=10, patience_steps=5,
    collapse_window=50, reward_drop=0.25, severe_reward_drop=0.5, reward_scale=0.1, entropy_rise=0.2,
    ess_threshold=0.3, rejected_fraction_threshold=0.9, pinned_fraction_threshold=0.3, negative_kl_tolerance=1e-3,
)
_INT_FIELDS = ("smoothing_steps", "warmup_steps", "patience_steps", "collapse_window")


def validate_stop_on_alert(value: Any, field: str = "stop_on_alert") -> bool | list[str]:
    """``stop_on_alert``: True (any alert), False, or a list of alert names; ``ValueError`` naming ``field`` else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field}={value!r}: use true, false or a list of alert names ({', '.join(ALERTS)}).")
    unknown = sorted(set(value) - set(ALERTS))
    if unknown:
        raise ValueError(f"{field} has unknown alert(s) {unknown}; choose from {', '.join(ALERTS)} (or true / false).")
    return list(value)


def validate(config: dict[str, Any], where: str = "RolloutCorrectionMonitor", prefix: str = "") -> None:
    """Raise ``ValueError`` naming the field for a bad setting (thresholds may be None: that alert is off)."""
    for name in _INT_FIELDS:
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
            least = 0 if name == "warmup_steps" else 1
            raise ValueError(f"{where}: {prefix}{name}={value!r}: use an integer >= {least} (optimizer steps).")
    for name in ("reward_drop", "severe_reward_drop", "reward_scale", "entropy_rise", "ess_threshold",
                 "rejected_fraction_threshold", "pinned_fraction_threshold", "negative_kl_tolerance"):
        value = config[name]
        if value is None and name not in ("reward_scale",):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {prefix}{name}={value!r}: use a finite number >= 0"
                             + ("." if name == "reward_scale" else ", or None to switch the alert off."))
    for name in ("ess_threshold", "rejected_fraction_threshold", "pinned_fraction_threshold"):
        value = config[name]
        if value is not None and value > 1:
            raise ValueError(f"{where}: {prefix}{name}={value!r} is a fraction, use a number in [0, 1] (or None).")


class AlertRules:
    """Smoothed signals, the run's recent best and per-alert pending timers; ``update`` returns holding alerts."""

    def __init__(self, bypass: bool = False, rollout_lag: int | None = None, corrected: bool | None = None,
                 correction: Any = None, **config: Any) -> None:
        self.config = {**DEFAULTS, **config}
        validate(self.config)
        # what the run is: a bypass preset; the engine's known lag (None: unknown); a correction active (None: unknown)
        self.bypass, self.rollout_lag, self.corrected = bypass, rollout_lag, corrected
        self.correction = correction  # the run's resolved RolloutCorrectionConfig (None: unknown), for the advice
        self.ema: dict[str, float] = {}
        self.seen: dict[str, list[int]] = {}  # signal -> [first optimizer step its rows cover, its last row's step]
        self.last_step: int | None = None
        self.first_step: int | None = None
        self.trail: list[tuple[int, float, float | None]] = []  # (step, smoothed reward, smoothed entropy)
        self.pending: dict[str, int] = {}  # alert -> first step its raw condition held (in the current run of it)

    # ------------------------------------------------------------------ state (for checkpoints)
    def state(self) -> dict[str, Any]:
        return {"ema": dict(self.ema), "seen": {k: list(v) for k, v in self.seen.items()},
                "last_step": self.last_step, "first_step": self.first_step,
                "trail": [list(t) for t in self.trail], "pending": dict(self.pending)}

    def load_state(self, saved: dict[str, Any]) -> None:
        self.ema = dict(saved.get("ema", {}))
        self.last_step, self.first_step = saved.get("last_step"), saved.get("first_step")
        # a state saved before per-signal steps: every smoothed signal as if seen in every row
        self.seen = {k: [int(v[0]), int(v[1])] for k, v in saved.get("seen", {}).items()} or {
            k: [self.first_step, self.last_step] for k in self.ema if self.last_step is not None}
        self.trail = [tuple(t) for t in saved.get("trail", [])]
        self.pending = {k: int(v) for k, v in saved.get("pending", {}).items()}

    # ------------------------------------------------------------------ one logged row
    def update(self, step: int, row: dict[str, float]) -> dict[str, str]:
        if self.last_step is not None and step <= self.last_step:
            return {}  # a repeated / out-of-order row (e.g. the train-end summary at the same step)
        dt = step - self.last_step if self.last_step is not None else max(step, 1)  # the first row covers (0, step]
        if self.first_step is None:
            self.first_step = step - dt + 1  # the first optimizer step this row covers
        # EMA over optimizer steps, per signal from its own previous value; its first steps are a running mean (no
        # weight on a single noisy first row)
        for name, key in SIGNALS.items():
            value = row.get(key)
            if value is None or not math.isfinite(value):
                continue
            if name not in self.ema:
                self.ema[name] = value
                self.seen[name] = [step - dt + 1, step]  # this row covers (step - dt, step]
                continue
            first, last = self.seen.get(name) or [self.first_step, self.last_step]
            dt_signal = step - last
            a = max(1.0 - 0.5 ** (dt_signal / self.config["smoothing_steps"]), dt_signal / (step - first + 1))
            self.ema[name] += a * (value - self.ema[name])
            self.seen[name] = [first, step]
        self.last_step = step
        if "reward" in self.ema:
            self.trail.append((step, self.ema["reward"], self.ema.get("entropy")))
            horizon = step - self.config["collapse_window"]
            self.trail = [t for t in self.trail if t[0] >= horizon]
        raw = self._raw_conditions(step)
        holding = {}
        for name in ALERTS:
            if name not in raw:
                self.pending.pop(name, None)
                continue
            since = self.pending.setdefault(name, step - dt + 1)  # the row covers steps (step - dt, step]
            if step - since + 1 >= self.config["patience_steps"]:
                holding[name] = raw[name]
        return holding

    def _warm(self, step: int) -> bool:
        return self.first_step is not None and step - self.first_step + 1 > self.config["warmup_steps"]

    def _raw_conditions(self, step: int) -> dict[str, str]:
        c, e, out = self.config, self.ema, {}
        if not self._warm(step):
            return out
        ess_low = c["ess_threshold"] is not None and "ess" in e and e["ess"] <= c["ess_threshold"]
        if c["reward_drop"] is not None and "reward" in e and self.trail:
            best_step, best, best_entropy = max(self.trail, key=lambda t: t[1])
            drop = best - e["reward"]
            need = c["reward_drop"] * max(abs(best), c["reward_scale"])
            entropy_known = best_entropy is not None and "entropy" in e
            entropy_up = (c["entropy_rise"] is not None and entropy_known
                          and e["entropy"] - best_entropy >= c["entropy_rise"] * abs(best_entropy))
            severe = c["severe_reward_drop"] is not None and drop >= c["severe_reward_drop"] * max(abs(best),
                                                                                                    c["reward_scale"])
            if drop >= need and (entropy_up or ess_low or severe):
                evidence = []
                if entropy_up:
                    evidence.append(f"entropy rose {best_entropy:.3g} -> {e['entropy']:.3g}")
                if ess_low:
                    evidence.append(f"ESS fell to {e['ess']:.3g}")
                if evidence:
                    why = f" while {' and '.join(evidence)}"
                else:  # the severe drop on its own
                    why = f" (entropy {best_entropy:.3g} -> {e['entropy']:.3g})" if entropy_known else ""
                out["policy_collapse"] = (
                    f"the smoothed reward fell by {drop / max(abs(best), c['reward_scale']):.0%} from its recent best "
                    f"{best:.3g} (step {best_step}) to {e['reward']:.3g}{why}{self._mismatch_text()}. "
                    f"{self._collapse_advice()}")
        if c["rejected_fraction_threshold"] is not None and e.get("rejected", 0.0) >= c["rejected_fraction_threshold"]:
            out["all_rejected"] = (
                f"the correction rejects {e['rejected']:.1%} of tokens (smoothed {SIGNALS['rejected']})"
                f"{self._mismatch_text()}: almost nothing is learned. Loosen rollout_rs_threshold / "
                "rollout_token_veto_threshold, or fix the sampler mismatch.")
        if ess_low:
            out["ess_collapse"] = (
                f"the IS weights' effective sample size fell to {e['ess']:.3g} of the tokens (smoothed "
                f"{SIGNALS['ess']} <= {c['ess_threshold']:g}){self._mismatch_text()}: a few "
                "tokens carry the gradient. Lower rollout_is_threshold or reduce the mismatch at its source.")
        if c["pinned_fraction_threshold"] is not None and e.get("pinned", 0.0) >= c["pinned_fraction_threshold"]:
            out["weights_pinned"] = (
                f"{e['pinned']:.1%} of the tokens have rho above the truncation bound C (smoothed "
                f"{SIGNALS['pinned']}){self._mismatch_text()}: the weights sit at C and the "
                "correction no longer corrects. Reduce the mismatch at its source (sync / precision / lag).")
        if c["negative_kl_tolerance"] is not None and "kl" in e and e["kl"] <= -c["negative_kl_tolerance"]:
            out["negative_kl"] = (
                f"the smoothed {SIGNALS['kl']} is {e['kl']:.3g} < 0: KL(pi_rollout || pi_train) on pi_rollout's own "
                "samples cannot be negative in expectation, so the pi_rollout log-probs are not the sampler's "
                "(temperature / logits processing / log-prob hand-over).")
        return out

    def _mismatch_text(self) -> str:
        e = self.ema
        parts = [f"{label}={e[name]:.3g}" for name, label in (("kl", "kl"), ("k3", "k3_kl"), ("chi2", "chi2_token"))
                 if name in e]
        return f" (mismatch: {', '.join(parts)})" if parts else ""

    def _collapse_advice(self) -> str:
        has_metrics = "kl" in self.ema or "ess" in self.ema
        return collapse_advice(self.correction, self.rollout_lag, self.corrected, has_metrics, self.ema.get("kl_lag0"))
