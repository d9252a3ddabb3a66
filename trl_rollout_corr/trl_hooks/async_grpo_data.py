"""Every sample's policy version, carried from TRL's rollout queue to ``compute_loss`` (TRL 1.16 drops it there).

TRL's ``get_train_dataloader`` builds a ``RolloutQueueDataset`` (which reads ``RolloutSample.model_version`` only to
drop samples older than ``max_staleness``) and a ``DataCollatorForRollout`` (which packs the samples of each rank
into one row of flat loss terms). While it runs, :func:`carrying_sample_versions` puts two subclasses in their place:

* the dataset tags each sample dict it yields with ``rc_model_version`` (read from the queue's last sample, checked to
  be the one yielded) and, while it waits on an empty queue, also calls ``probe.probe()`` (a
  :class:`~trl_rollout_corr.async_grpo.server_probe.ServerProbe`: a vLLM server that has not answered for its timeout
  stops training with an error naming it);
* the collator adds ``rc_sample_version`` (num_processes, M): the version of the sample of every loss term, -1 on
  padding, aligned with TRL's ``token_index`` / ``segment_id``; and the terms' (B, T) layout, computed on the CPU
  (``rc_term_col``, ``rc_row_mask``: :func:`_term_layout`), so that the trainer lays them out with no host sync.

Only these names and their call signatures are assumed; each is checked, and a change raises
:class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..core.flat import term_columns
from .base import TrlInternalsChanged

_TRL_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
# the micro-batch keys the collator adds
ADDED_KEYS = ("rc_sample_version", "rc_term_col", "rc_row_mask")


class _LastSampleQueue:
    """The rollout queue, remembering the last sample ``get`` returned."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self.last = None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._queue.get(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _dataset_class(base: type, probe: Any) -> type:
    class VersionedRolloutQueueDataset(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "rollout_queue" not in kwargs or "check_health_fn" not in kwargs:
                raise TrlInternalsChanged("AsyncGRPOTrainer.get_train_dataloader no longer builds RolloutQueueDataset "
                                          "with rollout_queue= and check_health_fn= keywords")
            kwargs["rollout_queue"] = _LastSampleQueue(kwargs["rollout_queue"])
            if probe is not None:
                check_health = kwargs["check_health_fn"]

                def check_health_and_server(*a: Any, **k: Any) -> Any:
                    result = check_health(*a, **k)
                    probe.probe()
                    return result

                kwargs["check_health_fn"] = check_health_and_server
            super().__init__(*args, **kwargs)

        def __iter__(self) -> Iterator[dict]:
            for item in super().__iter__():
                sample = self.queue.last
                if sample is None or item.get("input_ids") is not getattr(sample, "input_ids", None):
                    raise TrlInternalsChanged("RolloutQueueDataset yielded a sample other than the last one it took "
                                              "from the rollout queue")
                item["rc_model_version"] = int(sample.model_version)
                yield item

    return VersionedRolloutQueueDataset


def _collator_class(base: type) -> type:
    class VersionedCollator(base):
        def torch_call(self, examples: list[Any]) -> dict[str, Any]:
            batch = super().torch_call(examples)
            (rows,) = examples
            token_index, segment_id = batch.get("token_index"), batch.get("segment_id")
            if token_index is None or segment_id is None or token_index.shape != segment_id.shape:
                raise TrlInternalsChanged("DataCollatorForRollout no longer returns token_index / segment_id of one "
                                          "shape")
            versions = []
            for r, row in enumerate(rows):
                try:
                    row_versions = torch.tensor([s["rc_model_version"] for s in row.samples], dtype=torch.long)  # (S,)
                except KeyError:
                    raise TrlInternalsChanged("a packed sample lost rc_model_version between RolloutQueueDataset and "
                                              "DataCollatorForRollout") from None
                valid = token_index[r] >= 0  # (M,)
                if row_versions.numel() == 0:
                    versions.append(torch.full_like(token_index[r], -1))
                    continue
                index = segment_id[r].clamp(0, row_versions.numel() - 1)  # (M,) padding points at sample 0
                versions.append(torch.where(valid, row_versions[index], torch.full_like(index, -1)))
            batch["rc_sample_version"] = torch.stack(versions)  # (num_processes, M)
            batch.update(_term_layout(token_index, segment_id))
            return batch

    return VersionedCollator


def _term_layout(token_index: torch.Tensor, segment_id: torch.Tensor) -> dict[str, torch.Tensor]:
    """The (B, T) layout of every rank's loss terms, computed here on the CPU so that the trainer needs no host
    sync for it: ``rc_term_col`` (num_processes, M), each term's position among its sample's terms (-1 on
    padding), and ``rc_row_mask`` (num_processes, B, T) bool, the trained positions, B and T the largest over the
    ranks (every rank gets the same shape; a rank's extra rows and columns are False)."""
    cols, sizes = [], []
    for r in range(token_index.size(0)):
        valid = token_index[r] >= 0  # (M,)
        col, num_rows, width = term_columns(segment_id[r][valid])  # (M_r,)
        cols.append(torch.full_like(segment_id[r], -1).masked_scatter(valid, col))  # (M,)
        sizes.append((segment_id[r][valid], col, num_rows, width))
    num_rows = max((n for _, _, n, _ in sizes), default=0)
    width = max((w for _, _, _, w in sizes), default=0)
    mask = torch.zeros(token_index.size(0), num_rows, width, dtype=torch.bool)  # (num_processes, B, T)
    for r, (rows, col, _, _) in enumerate(sizes):
        mask[r, rows, col] = True
    return {"rc_term_col": torch.stack(cols) if cols else segment_id.clone(), "rc_row_mask": mask}


@contextlib.contextmanager
def carrying_sample_versions(probe: Any = None) -> Iterator[None]:
    """While TRL builds its dataloader, its dataset and collator carry every sample's policy version."""
    import importlib

    module = importlib.import_module(_TRL_MODULE)
    originals = {}
    for name in ("RolloutQueueDataset", "DataCollatorForRollout"):
        if not isinstance(getattr(module, name, None), type):
            raise TrlInternalsChanged(f"{_TRL_MODULE}.{name} is gone: the rollout-correction trainer carries the "
                                      "samples' policy versions through it")
        originals[name] = getattr(module, name)
    module.RolloutQueueDataset = _dataset_class(originals["RolloutQueueDataset"], probe)
    module.DataCollatorForRollout = _collator_class(originals["DataCollatorForRollout"])
    try:
        yield
    finally:
        for name, cls in originals.items():
            setattr(module, name, cls)

