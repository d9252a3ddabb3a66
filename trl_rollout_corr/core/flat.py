"""Flat loss terms <-> (B, T) rows: TRL's asynchronous trainer packs every rank's samples into one row and lists its
loss terms flat, each with the index of the sample it came from (``segment_id``); the correction works on (B, T).

Pure PyTorch: no TRL import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowLayout(NamedTuple):
    """Where each of M flat terms sits in a (B, T) layout: term m -> (row[m], col[m])."""

    row: torch.Tensor  # (M,) sample index
    col: torch.Tensor  # (M,) position among that sample's terms, in term order
    num_rows: int  # B = max(segment_id) + 1 (0 when M = 0)
    width: int  # T = the most terms of one sample


def rows_from_segments(segment_id: torch.Tensor) -> RowLayout:
    """Lay out terms by sample: row b holds sample b's terms in their flat order, left-aligned.

    Samples without terms (nothing trained) are empty rows. One host sync (B and T).
    """
    segment_id = segment_id.long()  # (M,)
    if segment_id.numel() == 0:
        empty = segment_id.new_zeros(0)
        return RowLayout(empty, empty, 0, 0)
    num_rows = int(segment_id.max()) + 1
    counts = torch.bincount(segment_id, minlength=num_rows)  # (B,)
    order = torch.argsort(segment_id, stable=True)  # (M,) terms grouped by sample, flat order kept
    starts = torch.cumsum(counts, 0) - counts  # (B,) first sorted slot of each sample
    col = torch.empty_like(segment_id)  # (M,)
    col[order] = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
    return RowLayout(segment_id, col, num_rows, int(counts.max()))


def to_rows(values: torch.Tensor, layout: RowLayout, fill: float | bool = 0.0) -> torch.Tensor:
    """(M,) flat values -> (B, T), ``fill`` where a sample has fewer terms than T."""
    rows = values.new_full((layout.num_rows, layout.width), fill)  # (B, T)
    rows[layout.row, layout.col] = values
    return rows


def to_terms(rows: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """(B, T) -> (M,) flat values, in term order (the inverse of :func:`to_rows` on the terms' positions)."""
    return rows[layout.row, layout.col]


def per_row(values: torch.Tensor, layout: RowLayout, fill: int = -1) -> torch.Tensor:
    """A per-term value that is constant within each sample (e.g. its policy version) -> (B,), ``fill`` for
    samples without terms."""
    out = values.new_full((layout.num_rows,), fill)  # (B,)
    out[layout.row] = values
    return out
