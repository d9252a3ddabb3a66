"""Every sample's policy version, carried from TRL's rollout queue to ``compute_loss`` (TRL 1.16 drops it there).

TRL's ``get_train_dataloader`` builds a ``RolloutQueueDataset`` (which reads ``RolloutSample.model_version`` only to
drop samples older than ``max_staleness``) and a ``DataCollatorForRollout`` (which packs the samples of each rank
into one row of flat loss terms). While it runs, :func:`carrying_sample_versions` puts two subclasses in their place:

* the dataset tags each sample dict it yields with ``rc_model_version`` (read from the queue's last sample, checked to
  be the one yielded) and, while it waits on an empty queue, also calls ``probe.probe()`` (a
  :class:`~trl_rollout_corr.async_grpo.server_probe.ServerProbe`: a vLLM server that has not answered for its timeout
  stops training with an error naming it);
* the collator adds ``rc_sample_version`` (num_processes, M): the version of the sample of every loss term, -1 on
  padding, aligned with TRL's ``token_index`` / ``segment_id``; the terms' (B, T) layout, computed on the CPU
  (``rc_term_col``, ``rc_row_mask``: :func:`_term_layout`), so that the trainer lays them out with no host sync; and
  every rank's packed-row sizes (``rc_packed_sizes``: :func:`_packed_sizes`), so that the trainer cuts its row out of
  the padded batch with slices instead of TRL's boolean masks (a host sync each on a GPU). They travel as the shapes
  of empty tensors: a shape reaches every rank with the batch (accelerate's dispatcher broadcasts the batch's
  structure) and reading it on the device is free, where reading a value would block.

TRL's collator pads each row at its end (``attention_mask`` 1 then 0, the tree tensors >= 0 then -1): the slices
equal TRL's masks only then, so :func:`_packed_sizes` checks it on the CPU batch, every micro-batch.

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
ADDED_KEYS = ("rc_sample_version", "rc_term_col", "rc_row_mask", "rc_packed_sizes")
# the packed row's sizes rc_packed_sizes carries, in order: its tokens (TRL's attention_mask), the lengths of its tree
# tensors (TRL's ``>= 0``) and its tree_max_seqlens (TRL's tree_max_seqlen_q / _k)
PACKED_SIZES = ("input_ids", "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlen_q",
                "tree_max_seqlen_k")
_TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


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
            batch["rc_packed_sizes"] = _packed_sizes(batch)
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


def _prefix_length(valid: torch.Tensor, what: str) -> int:
    """The length n of a CPU mask that is True on exactly its first n entries; TrlInternalsChanged otherwise."""
    n = int(valid.sum())
    if not bool(valid[:n].all()):
        raise TrlInternalsChanged(f"DataCollatorForRollout no longer pads {what} at the end of a row: the "
                                  "rollout-correction trainer slices the row where TRL indexes it with a mask")
    return n


def _packed_sizes(batch: dict[str, Any]) -> list[torch.Tensor]:
    """Every rank's packed-row sizes (:data:`PACKED_SIZES`) as the shapes of empty tensors: entry r is
    (num_processes, 0, *sizes of row r), so after accelerate hands rank r its slice of dim 0, every rank still reads
    row r's sizes from ``rc_packed_sizes[r].shape[2:]`` (host integers, no device read). Read here on the CPU batch,
    with the check that TRL's padding is at each row's end (its masks are then prefixes)."""
    try:
        mask, max_seqlens = batch["attention_mask"], batch["tree_max_seqlens"]  # (P, N_pad), (P, 2)
        tree = [batch[key] for key in _TREE_KEYS]  # (P, L_pad) each
    except KeyError as missing:
        raise TrlInternalsChanged(f"DataCollatorForRollout no longer returns {missing}") from None
    if max_seqlens.dim() != 2 or max_seqlens.size(1) != 2:
        raise TrlInternalsChanged(f"DataCollatorForRollout's tree_max_seqlens has shape {tuple(max_seqlens.shape)}, "
                                  "not (num_processes, 2)")
    carriers = []
    for r in range(mask.size(0)):
        sizes = [_prefix_length(mask[r].bool(), "attention_mask")]
        sizes += [_prefix_length(values[r] >= 0, key) for key, values in zip(_TREE_KEYS, tree)]
        sizes += [int(v) for v in max_seqlens[r].tolist()]
        carriers.append(torch.empty(mask.size(0), 0, *sizes, dtype=torch.bool))  # (P, 0, *sizes): no elements
    return carriers


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

