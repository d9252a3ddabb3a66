"""The layer both trainers share: what ``RolloutCorrGRPOTrainer`` and ``RolloutCorrAsyncGRPOTrainer`` do alike.

* the args check (:func:`require_correction_config`) and the freeze of the correction once the trainer is built;
* the loss's micro-batch counts (:func:`micro_batch_counts`) and, at each log, the ``rollout_corr/*`` metrics with the
  all-rejected count and warning (:meth:`CorrectionTrainerMixin._rc_metrics`);
* saving the resolved correction next to the model (``save_model``).

The rule that says which anchor TRL's loss gets and whether the IS weight multiplies the advantage is
:func:`trl_rollout_corr.core.losses.loss_anchor`, a pure function both trainers call. What differs stays in each
trainer:
the synchronous one corrects a (B, T) generation batch and plans where pi_old comes from; the asynchronous one maps
TRL's flat loss terms to rows and carries each sample's policy version.

No private TRL name is used here (those live in :mod:`trl_rollout_corr.trl_hooks`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config.correction import RolloutCorrectionConfig
from ..config.fields import freeze_correction, resolve_correction
from ..core.criterion import stat_key
from ..core.metric_names import metric
from ..core.stats import STAT_DTYPE, RolloutStats, process_all_reduce, summed
from ..trl_hooks.grpo_forwards import check_forward_mismatch

logger = logging.getLogger(__name__)

ALL_REJECTED = metric("all_rejected_micro_batches")
"""Micro-batches since the last log whose every token the correction rejected (their loss is 0)."""
_EMPTY = stat_key("loss.empty_micro_batches", __name__)
"""Micro-batches whose every token the correction rejected (summed)."""
_MICRO_BATCHES = stat_key("loss.micro_batches", __name__)
"""Micro-batches the loss ran on (summed)."""


def require_correction_config(args: Any, config_class: type, trainer_name: str) -> None:
    """``args`` must be a ``config_class`` (TRL's config plus the correction fields), and its correction is resolved
    and checked now, before TRL's trainer reads ``args`` (a field assigned since the config was built takes effect
    here; an invalid one raises here).

    Raises:
        TypeError: ``args`` is not a ``config_class``, naming the fix.
        ValueError: an invalid correction field, naming the field and the fix.
    """
    if not isinstance(args, config_class):
        trl_name, name = config_class._RC_TRL_CONFIG.__name__, config_class.__name__
        article = "an" if trl_name[0] in "AEIOU" else "a"
        raise TypeError(f"{trainer_name} needs args={name}(...) ({article} {trl_name} subclass with the "
                        f"rollout-correction fields), got {type(args).__name__}. Replace {trl_name} by {name} with "
                        "the same arguments.")
    resolve_correction(args)


def micro_batch_counts(n_kept: torch.Tensor, counted: float | torch.Tensor = 1.0) -> RolloutStats:
    """One micro-batch of the loss:  ``loss.micro_batches`` += c,  ``loss.empty_micro_batches`` += c * [n_kept == 0].

    ``n_kept`` (0-dim): the tokens the correction kept in it; ``counted`` (c): 1 where each process counts its own
    micro-batches, 1 on one process and 0 elsewhere where a micro-batch spans every process.
    """
    c = torch.as_tensor(counted, dtype=STAT_DTYPE, device=n_kept.device)  # ()
    return RolloutStats(sums={_EMPTY: (n_kept == 0).to(STAT_DTYPE) * c, _MICRO_BATCHES: c.clone()})


class CorrectionTrainerMixin:
    """Mixed in before TRL's trainer: ``class RolloutCorrGRPOTrainer(CorrectionTrainerMixin, GRPOTrainer)``.

    A trainer calls :meth:`_rc_freeze` once ``super().__init__`` has run, adds :func:`micro_batch_counts` to its
    statistics in ``compute_loss`` and turns them into metrics with :meth:`_rc_metrics` in ``log``.
    """

    rollout_correction: RolloutCorrectionConfig
    _RC_ALL_REJECTED_REMEDY = "Loosen rollout_rs_threshold / rollout_token_veto_threshold or check the sampler."

    def _rc_freeze(self) -> None:
        """Hold a frozen copy of the resolved correction (``self.rollout_correction``, from
        :func:`~trl_rollout_corr.config.fields.freeze_correction`); a later change to an input of the correction in
        ``args`` raises, naming this trainer."""
        self.rollout_correction = freeze_correction(self.args, type(self).__name__)

    def _rc_metrics(self, stats: RolloutStats) -> dict[str, float]:
        """The ``rollout_corr/*`` metrics of everything every process saw since the last log (one host sync), with
        ``all_rejected_micro_batches`` where the loss counted micro-batches; warns (main process) if any was empty."""
        from ..core.metrics import finalize_floats

        floats = stats.all_reduce(process_all_reduce).to_floats()  # the one host sync of this logging step
        check_forward_mismatch(floats)  # the trainer's deferred check of TRL's forward request (trl_hooks)
        metrics = finalize_floats(floats)
        counts = summed(floats, "loss.")
        if _MICRO_BATCHES in counts:  # entropy, clip_ratio/*, kl, aux_loss, ...: TRL's own (_metrics)
            empty = counts[_EMPTY]
            metrics[ALL_REJECTED] = empty
            if empty > 0 and self.accelerator.is_main_process:
                logger.warning(
                    "Rollout correction rejected every token of %d of %d micro-batches since the last log "
                    "(rejected_token_fraction=%.3f); their loss is 0. %s", int(empty), int(counts[_MICRO_BATCHES]),
                    metrics.get(metric("rejected_token_fraction"), 1.0), self._RC_ALL_REJECTED_REMEDY)
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """TRL's ``save_model``, plus the resolved correction (``rollout_correction.json``) next to the weights."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            self.rollout_correction.save_pretrained(output_dir or self.args.output_dir)
