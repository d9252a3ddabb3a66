"""RolloutCorrectionMonitor: warn (and optionally stop) when the off-policy diagnostics precede a collapse.

A ``transformers.TrainerCallback`` that reads the logged ``rollout_corr/*`` metrics. Alerts (each warns once per
episode, i.e. until its condition clears; every threshold can be set to ``None`` to switch the alert off):

* ``k3_kl``, ``chi2_token``, ``chi2_seq``, ``rejected_token_fraction`` above a threshold;
* ``negative_kl``: ``rollout_corr/kl`` < 0 for ``negative_kl_patience`` consecutive logs (pi_rollout assigns
  more mass to its own samples than the trainer: the usual signature of a broken log-prob hand-over);
* ``entropy_up_reward_down``: over the last ``trend_window`` logs, ``entropy`` rose and ``reward`` fell;
* ``bypass_persistent_mismatch``: a bypass preset runs while ``rollout_corr/kl`` stays >= ``bypass_kl_threshold``
  for ``bypass_patience`` logs. PPO clipped against pi_rollout anchors on the sampler: under a mismatch that never
  shrinks (a quantized engine), it was measured to collapse (entropy 0.5 -> 1.27 nats/token at kl 0.01-0.08),
  while it is the best fix for a stale sampler. Switch to a decoupled preset.

With ``stop_on_alert`` (True, or a list of alert names) the run stops cleanly at the alerting step and a
checkpoint is saved. Every log row goes
to ``<output_dir>/rollout_corr_metrics.csv`` and a plot to ``<output_dir>/rollout_corr_metrics.png`` (needs
matplotlib). The monitor's state (open episodes, alert history, windows) is saved with each checkpoint and
restored on resume, so a resumed run does not warn again about an episode it already reported.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

logger = logging.getLogger(__name__)
CSV_NAME = "rollout_corr_metrics.csv"
PNG_NAME = "rollout_corr_metrics.png"
_PLOTTED = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/rejected_token_fraction",
            "entropy", "reward")
ALERTS = ("k3_kl", "chi2_token", "chi2_seq", "rejected_fraction", "negative_kl", "entropy_up_reward_down",
          "bypass_persistent_mismatch")
_DECOUPLED_ADVICE = ("switch to a decoupled preset (rollout_correction_preset=decoupled_token_is or decoupled_geo_rs), "
                     "which anchors the trust region on pi_old instead of the mismatched sampler")


class RolloutCorrectionMonitor(TrainerCallback, ExportableState):
    """Watch the rollout-correction diagnostics; warn once per episode, optionally stop, write CSV and PNG."""

    def __init__(self, k3_kl_threshold: float | None = 0.05, chi2_token_threshold: float | None = 1.0,
                 chi2_seq_threshold: float | None = 100.0, rejected_fraction_threshold: float | None = 0.5,
                 negative_kl_patience: int | None = 5, trend_window: int | None = 5,
                 bypass_kl_threshold: float | None = 0.01, bypass_patience: int = 5,
                 stop_on_alert: bool | list[str] = False,
                 write_csv: bool = True, write_plot: bool = True) -> None:
        self.config = dict(
            k3_kl_threshold=k3_kl_threshold, chi2_token_threshold=chi2_token_threshold,
            chi2_seq_threshold=chi2_seq_threshold, rejected_fraction_threshold=rejected_fraction_threshold,
            negative_kl_patience=negative_kl_patience, trend_window=trend_window,
            bypass_kl_threshold=bypass_kl_threshold, bypass_patience=bypass_patience, stop_on_alert=stop_on_alert,
            write_csv=write_csv, write_plot=write_plot)
        for name in ("k3_kl_threshold", "chi2_token_threshold", "chi2_seq_threshold", "rejected_fraction_threshold",
                     "bypass_kl_threshold"):
            value = self.config[name]
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
                raise ValueError(f"RolloutCorrectionMonitor({name}={value!r}): use a finite number >= 0, or None to "
                                 "switch the alert off.")
        for name in ("negative_kl_patience", "trend_window", "bypass_patience"):
            value = self.config[name]
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RolloutCorrectionMonitor({name}={value!r}): use an integer >= 1 (or None).")
        if not isinstance(stop_on_alert, bool):
            unknown = sorted(set(stop_on_alert) - set(ALERTS))
            if unknown:
                raise ValueError(f"RolloutCorrectionMonitor(stop_on_alert=...) has unknown alerts {unknown}; use True, "
                                 f"False or a list of: {', '.join(ALERTS)}.")
            self.config["stop_on_alert"] = list(stop_on_alert)
        self._bypass = False
        self.open_episodes: list[str] = []  # alerts whose condition still holds (warned already)
        self.alerts: list[dict[str, Any]] = []  # history: step, alert, message
        self.history: list[dict[str, float]] = []  # recent logs: kl, entropy, reward (bounded)
        self.rows: list[dict[str, float]] = []  # every logged row, for the CSV / PNG

    # ------------------------------------------------------------------ ExportableState (saved in checkpoints)
    def state(self) -> dict:
        return {"args": self.config, "attributes": {
            "open_episodes": list(self.open_episodes), "alerts": list(self.alerts), "history": list(self.history)}}

    def _restore(self, saved: Any) -> None:
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if isinstance(saved, dict) and "attributes" in saved:
            attributes = saved["attributes"]
            self.open_episodes = list(attributes.get("open_episodes", []))
            self.alerts = list(attributes.get("alerts", []))
            self.history = list(attributes.get("history", []))

    # ------------------------------------------------------------------ callback hooks
    def on_train_begin(self, args, state, control, **kwargs):
        # on resume, TrainerState (and our saved state inside it) is already loaded from the checkpoint
        self._restore((state.stateful_callbacks or {}).get(type(self).__name__))
        self.rows = self._read_csv(args, state.global_step) if state.global_step > 0 else []
        self._bypass = bool(getattr(getattr(args, "rollout_correction", None), "bypass_mode", False))
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "rollout_corr/kl" not in logs:  # train-end summaries, eval logs
            return control
        row = {"step": float(state.global_step)}
        row.update({k: float(v) for k, v in logs.items()
                    if (k.startswith("rollout_corr/") or k in ("entropy", "reward", "loss")) and _is_number(v)})
        self.rows.append(row)
        self.history = (self.history + [{k: row[k] for k in ("rollout_corr/kl", "entropy", "reward") if k in row}])[-64:]
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
        if state.is_world_process_zero and self.config["write_plot"] and self.rows:
            self._write_plot(args)
        return control

    # ------------------------------------------------------------------ the alerts
    def conditions(self, row: dict[str, float]) -> dict[str, str]:
        """Alert name -> message for every condition that holds on this row (and the recent history)."""
        c, out = self.config, {}
        for alert, key, threshold in (("k3_kl", "rollout_corr/k3_kl", c["k3_kl_threshold"]),
                                      ("chi2_token", "rollout_corr/chi2_token", c["chi2_token_threshold"]),
                                      ("chi2_seq", "rollout_corr/chi2_seq", c["chi2_seq_threshold"]),
                                      ("rejected_fraction", "rollout_corr/rejected_token_fraction",
                                       c["rejected_fraction_threshold"])):
            if threshold is not None and key in row and row[key] > threshold:
                out[alert] = (f"{key}={row[key]:.4g} > {threshold:g}: the sampler and the trainer disagree beyond what "
                              "the correction handles well; check the weight sync / precision of the rollout engine.")
        kls = [h["rollout_corr/kl"] for h in self.history if "rollout_corr/kl" in h]
        n = c["negative_kl_patience"]
        if n is not None and len(kls) >= n and all(k < 0 for k in kls[-n:]):
            out["negative_kl"] = (f"rollout_corr/kl < 0 for {n} logs ({', '.join(f'{k:.3g}' for k in kls[-n:])}): "
                                  "pi_rollout log-probs look inconsistent (temperature / processed log-probs?).")
        w = c["trend_window"]
        recent = [h for h in self.history if "entropy" in h and "reward" in h][-w:] if w else []
        if w is not None and len(recent) >= max(w, 2):
            d_entropy = recent[-1]["entropy"] - recent[0]["entropy"]
            d_reward = recent[-1]["reward"] - recent[0]["reward"]
            if d_entropy > 0 and d_reward < 0:
                out["entropy_up_reward_down"] = (
                    f"over the last {len(recent)} logs entropy rose by {d_entropy:.3g} while reward fell by "
                    f"{-d_reward:.3g}: a typical precursor of off-policy collapse.")
        p, kl_min = c["bypass_patience"], c["bypass_kl_threshold"]
        if getattr(self, "_bypass", False) and kl_min is not None and len(kls) >= p and all(k >= kl_min for k in kls[-p:]):
            out["bypass_persistent_mismatch"] = (
                f"a bypass preset (pi_old := pi_rollout) runs under a persistent mismatch: rollout_corr/kl >= {kl_min:g} "
                f"for {p} logs ({', '.join(f'{k:.3g}' for k in kls[-p:])}). PPO clipped against a persistently "
                f"mismatched sampler was measured to collapse; {_DECOUPLED_ADVICE}.")
        return out

    def _check(self, row: dict[str, float], step: int, speak: bool = True) -> list[str]:
        holding = self.conditions(row)
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
            ax.set_ylabel(key.replace("rollout_corr/", ""), fontsize=8)
            for alert in self.alerts:
                ax.axvline(alert["step"], color="red", alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("rollout correction diagnostics (red: monitor alerts)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.output_dir, PNG_NAME), dpi=90)
        plt.close(fig)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
