"""What a checkpoint carries beyond TRL's, so that a resumed run corrects as an uninterrupted one would.

Saved next to ``rollout_correction_config.json`` in every checkpoint (``rollout_corr_state.pt``):

* the emulated engine's state: a stale engine's snapshots of earlier policies, up to ``lag + 1`` full state dicts
  of the policy as CPU tensors, so the file is up to ``lag + 1`` times the model's size (without them a resumed
  stale engine would sample from the checkpoint's own policy, lag 0, for ``lag`` steps); the other emulated kinds
  save their kind only;
* the global steps at which a vLLM engine was synced (``vllm_sync_interval``): the schedule continues from the last
  one. The engine's *weights* at that sync are not saved (a second copy of the model): where the uninterrupted run
  would not sync at the checkpoint's step, the resumed engine starts from the checkpoint's weights and says so.

On resume, a correction other than the checkpoint's is allowed (changing the correction mid-run is a choice) but
warned, naming the fields. The monitor's state is TRL/transformers' ``ExportableState`` (``trainer_state.json``);
the asynchronous trainer's policy version is TRL's own ``rollout_state.json``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

STATE_NAME = "rollout_corr_state.pt"


def resolve_checkpoint(resume_from_checkpoint: Any, output_dir: str) -> str | None:
    """The checkpoint directory ``Trainer.train(resume_from_checkpoint=...)`` resumes from (None: a fresh run)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(output_dir)  # None: transformers raises its own error
    return str(resume_from_checkpoint)


def save_rollout_state(directory: str, sampler: Any, vllm_sync_steps: list[int] | None) -> None:
    """Write ``rollout_corr_state.pt`` into the checkpoint ``directory`` (the main process only)."""
    state = {"sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
             "vllm_sync_steps": list(vllm_sync_steps) if vllm_sync_steps is not None else None}
    torch.save(state, os.path.join(directory, STATE_NAME))


def load_rollout_state(checkpoint: str) -> dict[str, Any] | None:
    """What :func:`save_rollout_state` wrote (on the CPU; tensors, lists, ints and strings only), or None."""
    path = os.path.join(checkpoint, STATE_NAME)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_step(checkpoint: str) -> int | None:
    """The checkpoint's optimizer step, from transformers' ``trainer_state.json``."""
    path = os.path.join(checkpoint, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(json.load(f)["global_step"])


def correction_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint's value, this run's value)} for every correction field that differs."""
    return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)}


def vllm_weights_lost_at_resume(sync_steps: list[int], step: int, interval: int) -> bool:
    """Whether the uninterrupted run's engine would still hold weights a resumed engine cannot have.

    At the first generation after ``step`` the uninterrupted engine holds the weights of step ``sync_steps[-1]``
    unless it syncs there (``step - sync_steps[-1] >= interval``). Those weights are not in the checkpoint: the
    resumed engine then loads the checkpoint's once, and the schedule (the phase of later syncs) stays the same."""
    return bool(sync_steps) and step - sync_steps[-1] < interval


def restore_rollout_state(trainer: Any, checkpoint: str) -> None:
    """Before ``Trainer.train`` resumes from ``checkpoint``: the engine's state back, the correction compared."""
    from ..config.correction import CONFIG_NAME, RolloutCorrectionConfig

    config_path = os.path.join(checkpoint, CONFIG_NAME)
    if os.path.isfile(config_path) and trainer.accelerator.is_main_process:
        changes = correction_changes(RolloutCorrectionConfig.from_file(config_path).to_dict(),
                                     trainer.rollout_correction.to_dict())
        if changes:
            listed = ", ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changes.items())
            logger.warning("Resuming from %s with a correction other than the checkpoint's: %s. Intended if you "
                           "changed it; pass rollout_correction_config=%r to continue with the checkpoint's.",
                           checkpoint, listed, config_path)
    state = load_rollout_state(checkpoint) or {}
    main = trainer.accelerator.is_main_process
    takes_state = hasattr(trainer.rollout_sampler, "load_state_dict")
    if takes_state and state.get("sampler") is not None:
        trainer.rollout_sampler.load_state_dict(state["sampler"])
    elif takes_state and main:
        logger.warning("%s has no rollout engine state (%s): the engine restarts from the checkpoint's policy, so its "
                       "lag differs from an uninterrupted run's for a few steps.", checkpoint, STATE_NAME)
    elif state.get("sampler") is not None and main:
        logger.warning("%s holds the state of a rollout engine (%s) but this trainer has no rollout_sampler: it is "
                       "not used. Pass the engine the checkpoint was trained with to continue its lag.", checkpoint,
                       STATE_NAME)
    if trainer.use_vllm and state.get("vllm_sync_steps") is not None:
        step, interval = checkpoint_step(checkpoint), int(trainer.args.vllm_sync_interval or 1)
        if step is None:  # no trainer_state.json: transformers' own resume error follows
            return
        trainer.vllm_sync_steps = list(state["vllm_sync_steps"])  # read by the sync schedule (vllm.engine)
        if vllm_weights_lost_at_resume(trainer.vllm_sync_steps, step, interval):
            trainer.vllm_refresh_pending = True
            if trainer.accelerator.is_main_process:
                logger.warning(
                    "%s (step %d) is not at a vLLM weight sync (last sync at step %d, vllm_sync_interval=%d): the "
                    "engine's weights of step %d are not saved, so it starts from the checkpoint's and lags less than "
                    "in an uninterrupted run until its next scheduled sync (step %d). Save at multiples of "
                    "vllm_sync_interval (save_steps=%d) for the same engine weights.", checkpoint, step,
                    trainer.vllm_sync_steps[-1], interval, trainer.vllm_sync_steps[-1],
                    trainer.vllm_sync_steps[-1] + interval, interval)
