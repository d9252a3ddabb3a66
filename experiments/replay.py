"""Replay recorded log rows into a RolloutCorrectionMonitor (tuning its thresholds offline, seeded tests).

``aggregate(rows, every)`` turns per-step rows into the rows a run with ``logging_steps=every`` would log: the
trainer logs, at step k * every, the mean of the steps since the last log (TRL averages its per-step metric
lists; the ``rollout_corr/*`` statistics are pooled sums, i.e. token-weighted means, which the plain mean
approximates for equal-sized batches), the minimum of ``*_min`` and the maximum of ``*_max`` columns.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any


def aggregate(rows: list[dict[str, float]], every: int) -> list[dict[str, float]]:
    """Per-step rows (each with ``step``) -> one row per ``every`` optimizer steps, logged at the window's end."""
    if every <= 1:
        return [dict(r) for r in rows]
    out, window = [], []
    for r in rows:
        window.append(r)
        if int(r["step"]) % every == 0:
            out.append(_merge(window))
            window = []
    if window:  # the final, partial window (the trainer logs at the last step too)
        out.append(_merge(window))
    return out


def _merge(window: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*window)
    merged = {}
    for k in keys:
        values = [r[k] for r in window if k in r]
        if k == "step":
            merged[k] = max(values)
        elif k.endswith("_min"):
            merged[k] = min(values)
        elif k.endswith("_max") or k.endswith("_max_deviation"):
            merged[k] = max(values)
        else:
            merged[k] = statistics.fmean(values)
    return merged


def replay(rows: Iterable[dict[str, float]], monitor: Any = None, bypass: bool = False, output_dir: str = ".",
           correction: Any = None, **monitor_kwargs: Any) -> Any:
    """Feed rows (each with ``step``) through ``monitor.on_log`` as the Trainer would; returns the monitor.

    ``correction``: the run's ``RolloutCorrectionConfig`` (its ``bypass_mode`` wins over ``bypass``); without it the
    monitor knows only whether the run was in bypass mode.

    Stops feeding when the monitor asks the run to stop (``stop_on_alert``), as the Trainer would.
    """
    from transformers import TrainerControl, TrainerState

    from trl_rollout_corr.monitor.callback import RolloutCorrectionMonitor

    if monitor is None:
        monitor = RolloutCorrectionMonitor(**{"write_csv": False, "write_plot": False, **monitor_kwargs})
    correction = correction if correction is not None else SimpleNamespace(bypass_mode=bypass)
    args = SimpleNamespace(output_dir=output_dir, rollout_correction=correction)
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    for r in rows:
        state.global_step = int(r["step"])
        monitor.on_log(args, state, control, logs={k: v for k, v in r.items() if k != "step"})
        if control.should_training_stop:
            break
    return monitor
