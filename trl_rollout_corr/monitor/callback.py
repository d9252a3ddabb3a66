"""RolloutCorrectionMonitor: warn (and optionally stop) when the correction fails, not when a mismatch exists.

A ``transformers.TrainerCallback`` that reads the logged metrics. Alerts are outcomes and failure modes of the
correction (rules and formulas in :mod:`trl_rollout_corr.monitor.rules`; every window is in optimizer steps):

* ``policy_collapse``: the smoothed reward falls well below the run's own recent best while the entropy rises or
  the effective sample size collapses; the message names a remedy only where the mismatch benchmark supports one for
  the kind of mismatch the engine's known lag implies (none today: it names the metrics and the benchmark page;
  :mod:`trl_rollout_corr.monitor.advice`);
* ``all_rejected``: (nearly) every token rejected by the correction;
* ``ess_collapse``: the IS weights' effective sample size collapsed;
* ``weights_pinned``: a large fraction of tokens has rho above the truncation bound C;
* ``negative_kl``: ``rollout_corr/kl`` stays below 0 (the pi_rollout log-probs are not the sampler's).

The mismatch levels (``kl``, ``k3_kl``, ``chi2_*``) are diagnostics: they are quoted in messages, never a trigger.
Each alert warns once per episode, i.e. until its condition clears. Set a threshold to ``None`` to switch that
alert off. ``rollout_lag`` says what is known about the engine: the optimizer steps it lags behind (an
asynchronous engine), 0 for a synchronous one, None (default) for unknown.

With ``stop_on_alert`` (True, or a list of alert names) the run stops cleanly at the alerting step and a
checkpoint is saved. Every log row goes to ``<output_dir>/rollout_corr_metrics.csv`` and a plot to
``<output_dir>/rollout_corr_metrics.png`` (needs matplotlib). The monitor's state (smoothed signals, open
episodes, alert history) is saved with each checkpoint and restored on resume, so a resumed run does not warn
again about an episode it already reported.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX
from .rules import ALERTS, DEFAULTS, AlertRules, validate, validate_stop_on_alert

logger = logging.getLogger(__name__)
CSV_NAME = "rollout_corr_metrics.csv"
PNG_NAME = "rollout_corr_metrics.png"
_PLOTTED = ("reward", "entropy", metric("rollout_is_eff_sample_size"), metric("rejected_token_fraction"), metric("kl"),
            metric("k3_kl"))
__all__ = ["ALERTS", "RolloutCorrectionMonitor"]


class RolloutCorrectionMonitor(TrainerCallback, ExportableState):
    """Watch the run and the correction; warn once per episode, optionally stop, write CSV and PNG.

    The rules and their formulas are :mod:`trl_rollout_corr.monitor.rules`' (defaults: its ``DEFAULTS``); every
    window is in optimizer steps.

    Args:
        smoothing_steps: half-life H of each signal's moving average.
        warmup_steps: steps before ``policy_collapse`` is judged.
        patience_steps: steps a condition must hold before its alert fires.
        collapse_window: steps over which the best smoothed reward R* is taken.
        reward_drop: fall below R*, in units of max(|R*|, ``reward_scale``), that counts with a rising entropy or a
            collapsing ESS (``None``: off).
        severe_reward_drop: fall that counts on its own (``None``: off).
        reward_scale: the floor of the reward's scale in both falls.
        entropy_rise: relative rise of the smoothed entropy since R* (``None``: off).
        ess_threshold: ``ess_collapse`` at a smoothed ``rollout_is_eff_sample_size`` <= this (``None``: off).
        rejected_fraction_threshold: ``all_rejected`` at a smoothed ``rejected_token_fraction`` >= this.
        pinned_fraction_threshold: ``weights_pinned`` at a smoothed ``rollout_is_ratio_fraction_high`` >= this.
        negative_kl_tolerance: ``negative_kl`` at a smoothed ``kl`` <= -this.
        rollout_lag: optimizer steps the engine lags behind (0 = synchronous; ``None``: unknown); words the advice.
        stop_on_alert: stop training at any alert (``True``), at the named ones (a list), or never (``False``).
        write_csv: write every logged row to ``<output_dir>/rollout_corr_metrics.csv``.
        write_plot: plot them to ``<output_dir>/rollout_corr_metrics.png`` at the end (needs matplotlib).

    Raises:
        ValueError: naming the argument and the fix.
    """

    def __init__(self, smoothing_steps: int = DEFAULTS["smoothing_steps"], warmup_steps: int = DEFAULTS["warmup_steps"],
                 patience_steps: int = DEFAULTS["patience_steps"], collapse_window: int = DEFAULTS["collapse_window"],
                 reward_drop: float | None = DEFAULTS["reward_drop"],
                 severe_reward_drop: float | None = DEFAULTS["severe_reward_drop"],
                 reward_scale: float = DEFAULTS["reward_scale"],
                 entropy_rise: float | None = DEFAULTS["entropy_rise"],
                 ess_threshold: float | None = DEFAULTS["ess_threshold"],
                 rejected_fraction_threshold: float | None = DEFAULTS["rejected_fraction_threshold"],
                 pinned_fraction_threshold: float | None = DEFAULTS["pinned_fraction_threshold"],
                 negative_kl_tolerance: float | None = DEFAULTS["negative_kl_tolerance"],
                 rollout_lag: int | None = None, stop_on_alert: bool | list[str] = False,
                 write_csv: bool = True, write_plot: bool = True) -> None:
        rules = dict(smoothing_steps=smoothing_steps, warmup_steps=warmup_steps, patience_steps=patience_steps,
                     collapse_window=collapse_window, reward_drop=reward_drop,
                     severe_reward_drop=severe_reward_drop, reward_scale=reward_scale,
                     entropy_rise=entropy_rise, ess_threshold=ess_threshold,
                     rejected_fraction_threshold=rejected_fraction_threshold,
                     pinned_fraction_threshold=pinned_fraction_threshold, negative_kl_tolerance=negative_kl_tolerance)
        validate(rules)
        if rollout_lag is not None and (isinstance(rollout_lag, bool) or not isinstance(rollout_lag, int)
                                        or rollout_lag < 0):
            raise ValueError(f"RolloutCorrectionMonitor(rollout_lag={rollout_lag!r}): use the optimizer steps the "
                             "engine lags behind (an integer >= 0; 0 = synchronous), or None if unknown.")
        stop_on_alert = validate_stop_on_alert(stop_on_alert)
        self.config = dict(rules, rollout_lag=rollout_lag, stop_on_alert=stop_on_alert, write_csv=write_csv,
                           write_plot=write_plot)
        self.rules = AlertRules(rollout_lag=rollout_lag, **rules)
        self.open_episodes: list[str] = []  # alerts whose condition still holds (warned already)
        self.alerts: list[dict[str, Any]] = []  # history: step, alert, message
        self.rows: list[dict[str, float]] = []  # every logged row, for the CSV / PNG

    # ------------------------------------------------------------------ ExportableState (saved in checkpoints)
    def state(self) -> dict:
        """What a checkpoint saves (transformers' ``ExportableState``).

        Returns:
            ``{"args": the constructor's arguments, "attributes": open episodes, alert history, the rules' state}``.
        """
        return {"args": self.config, "attributes": {
            "open_episodes": list(self.open_episodes), "alerts": list(self.alerts), "rules": self.rules.state()}}

    def _restore(self, saved: Any) -> None:
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if isinstance(saved, dict) and "attributes" in saved:
            attributes = saved["attributes"]
            self.open_episodes = list(attributes.get("open_episodes", []))
            self.alerts = list(attributes.get("alerts", []))
            self.rules.load_state(attributes.get("rules", {}))

    # ------------------------------------------------------------------ callback hooks
    def on_train_begin(self, args, state, control, **kwargs):
        """Reset the rules for a fresh run (step 0), or restore the checkpoint's state and the CSV's rows on a resumed
        one; read the run's correction (``args.rollout_correction``) for the advice.

        Args:
            args (TrainingArguments): the trainer's config.
            state (TrainerState): the trainer's state (step, process rank, saved callback states).
            control (TrainerControl): the trainer's control flags.

        Returns:
            control (TrainerControl): the same object.
        """
        if state.global_step == 0:  # a fresh run, also when this object already watched another one
            self.rules = AlertRules(rollout_lag=self.config["rollout_lag"],
                                    **{k: self.config[k] for k in self.rules.config})
            self.open_episodes, self.alerts = [], []
        # on resume, TrainerState (and our saved state inside it) is already loaded from the checkpoint
        self._restore((state.stateful_callbacks or {}).get(type(self).__name__))
        self.rows = self._read_csv(args, state.global_step) if state.global_step > 0 else []
        rc = getattr(args, "rollout_correction", None)
        self.rules.bypass = bool(getattr(rc, "bypass_mode", False))
        self.rules.correction = rc
        enabled = getattr(rc, "is_enabled", None)
        self.rules.corrected = None if rc is None or enabled is None else bool(enabled or self.rules.bypass)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Feed one logged training row to the rules: warn at a new alert, stop (and save) where ``stop_on_alert``
        says, write the rows to the CSV (process 0). Rows with neither a reward nor ``rollout_corr/kl`` (evaluation,
        summaries) are skipped.

        Args:
            args (TrainingArguments): the trainer's config.
            state (TrainerState): the trainer's state (step, process rank, saved callback states).
            control (TrainerControl): the trainer's control flags.
            logs (dict[str, float] | None): the logged row.

        Returns:
            control (TrainerControl): the same object (``should_training_stop`` and ``should_save`` set on a
                stopping alert).
        """
        logs = logs or {}
        if "reward" not in logs and metric("kl") not in logs:  # train-end summaries, eval logs
            return control
        row = {"step": float(state.global_step)}
        row.update({k: float(v) for k, v in logs.items()
                    if (k.startswith(METRIC_PREFIX) or k in ("entropy", "reward", "reward_std", "loss"))
                    and _is_number(v)})
        self.rows.append(row)
        # every rank sees the same globally reduced metrics, so every rank takes the same decision; one rank speaks
        fired = self._check(row, state.global_step, speak=state.is_world_process_zero)
        if state.is_world_process_zero and self.config["write_csv"]:
            self._write_csv(args)
        stop_on = self.config["stop_on_alert"]
        if isinstance(stop_on, list):
            fired = [name for name in fired if name in stop_on]
        if fired and stop_on:
            if state.is_world_process_zero:
                logger.warning("RolloutCorrectionMonitor: stopping training at step %d (%s); a checkpoint is saved.",
                               state.global_step, ", ".join(fired))
            control.should_training_stop = True
            control.should_save = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        """Write the PNG (process 0, ``write_plot``).

        Args:
            args (TrainingArguments): the trainer's config.
            state (TrainerState): the trainer's state (step, process rank, saved callback states).
            control (TrainerControl): the trainer's control flags.

        Returns:
            control (TrainerControl): the same object.
        """
        if state.is_world_process_zero and self.config["write_plot"] and self.rows:
            self._write_plot(args)
        return control

    # ------------------------------------------------------------------ the alerts
    def _check(self, row: dict[str, float], step: int, speak: bool = True) -> list[str]:
        if self.rules.last_step is not None and step <= self.rules.last_step:
            return []  # the same step logged twice (a train-end summary): no new evidence
        holding = self.rules.update(step, row)
        fired = [name for name in holding if name not in self.open_episodes]
        self.open_episodes = list(holding)  # cleared conditions re-arm
        for name in fired:
            if speak:
                logger.warning("RolloutCorrectionMonitor [%s] at step %d: %s", name, step, holding[name])
            self.alerts.append({"step": step, "alert": name, "message": holding[name]})
        return fired

    # ------------------------------------------------------------------ CSV and plot
    def _csv_path(self, args) -> str:
        return os.path.join(args.output_dir, CSV_NAME)

    def _read_csv(self, args, up_to_step: int) -> list[dict[str, float]]:
        path = self._csv_path(args)
        if not os.path.isfile(path):
            return []
        with open(path, newline="") as fh:
            rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(fh)]
        return [r for r in rows if r.get("step", 0) <= up_to_step]  # drop rows past the resumed checkpoint

    def _write_csv(self, args) -> None:
        os.makedirs(args.output_dir, exist_ok=True)
        columns = ["step"] + sorted({k for r in self.rows for k in r} - {"step"})
        with open(self._csv_path(args), "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def _write_plot(self, args) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("RolloutCorrectionMonitor: matplotlib is not installed; no %s (pip install matplotlib).",
                           PNG_NAME)
            return
        keys = [k for k in _PLOTTED if any(k in r for r in self.rows)]
        fig, axes = plt.subplots(len(keys), 1, figsize=(7, 1.8 * max(len(keys), 1)), sharex=True, squeeze=False)
        for ax, key in zip(axes[:, 0], keys):
            points = [(r["step"], r[key]) for r in self.rows if key in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
            ax.set_ylabel(key.removeprefix(METRIC_PREFIX), fontsize=8)
            for alert in self.alerts:
                ax.axvline(alert["step"], color="red", alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("rollout correction diagnostics (red: monitor alerts)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.output_dir, PNG_NAME), dpi=90)
        plt.close(fig)



def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
