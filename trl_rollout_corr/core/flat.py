"""Flat loss terms <-> (B, T) rows: TRL's asynchronous trainer packs every rank's samples into one row and lists its
loss terms flat, each with the index of the sample it came from (``segment_id``); the correction works on (B, T).

The layout's sizes B and T are host integers. :func:`term_columns` computes them (and each term's column) on the
CPU, where TRL's collator builds the batch, so that the trainer lays out a micro-batch on the device with no host
sync (:func:`padded_layout`); :func:`rows_from_segments` does it all from a device tensor at the cost of one host
read of B and T.

Pure PyTorch: no TRL import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowLayout(NamedTuple):
    """Where each of M flat terms sits in a (B, T) layout: term m -> (row[m], col[m]).

    ``padded``: the terms include padding, marked by ``row == num_rows`` (a dummy row that :func:`to_rows` drops);
    :func:`to_terms` gives padding terms an arbitrary entry (mask them out).
    """

    row: torch.Tensor  # (M,) sample index (num_rows on padding when padded)
    col: torch.Tensor  # (M,) position among that sample's terms, in term order
    num_rows: int  # B = max(segment_id) + 1 (0 when M = 0)
    width: int  # T = the most terms of one sample
    padded: bool = False


def term_columns(segment_id: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(col (M,), B, T): each term's position among its sample's terms (flat order kept), the number of samples
    (max(segment_id) + 1) and the most terms of one sample. Meant for CPU tensors (TRL's collator); on a device
    tensor the two sizes are host reads."""
    segment_id = segment_id.long()  # (M,)
    counts = torch.bincount(segment_id)  # (B,)
    order = torch.argsort(segment_id, stable=True)  # (M,) terms grouped by sample, flat order kept
    starts = torch.cumsum(counts, 0) - counts  # (B,) first sorted slot of each sample
    col = torch.empty_like(segment_id)  # (M,)
    col[order] = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
    return col, counts.numel(), max(counts.tolist(), default=0)


def rows_from_segments(segment_id: torch.Tensor) -> RowLayout:
    """Lay out terms by sample: row b holds sample b's terms in their flat order, left-aligned.

    Samples without terms (nothing trained) are empty rows. On a device tensor: one host sync (B and T); the
    trainer uses :func:`padded_layout` with sizes the collator computed instead.
    """
    segment_id = segment_id.long()  # (M,)
    if segment_id.numel() == 0:
        empty = segment_id.new_zeros(0)
        return RowLayout(empty, empty, 0, 0)
    col, num_rows, width = term_columns(segment_id)
    return RowLayout(segment_id, col, num_rows, width)


def padded_layout(segment_id: torch.Tensor, col: torch.Tensor, valid: torch.Tensor, num_rows: int,
                  width: int) -> RowLayout:
    """The layout of padded terms (M_pad,) from their sample index, column and validity, with B and T already
    known on the host: no host sync. Padding terms go to the dummy row ``num_rows``."""
    row = torch.where(valid, segment_id.long(), torch.full_like(segment_id, num_rows, dtype=torch.long))  # (M_pad,)
    return RowLayout(row, torch.where(valid, col.long(), torch.zeros_like(row)), num_rows, width, True)  # (M_pad,)


def to_rows(values: torch.Tensor, layout: RowLayout, fill: float | bool = 0.0) -> torch.Tensor:
    """(M,) flat values -> (B, T), ``fill`` where a sample has fewer terms than T."""
    rows = values.new_full((layout.num_rows + int(layout.padded), layout.width), fill)  # (B [+1], T)
    rows[layout.row, layout.col] = values
    return rows[:layout.num_rows]  # (B, T)


def to_terms(rows: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """(B, T) -> (M,) flat values, in term order (the inverse of :func:`to_rows` on the terms' positions)."""
    if layout.padded:  # padding terms read row 0 (any entry: masked by the caller)
        return rows[torch.where(layout.row < layout.num_rows, layout.row, 0), layout.col]  # (M_pad,)
    return rows[layout.row, layout.col]


def per_row(values: torch.Tensor, layout: RowLayout, fill: int = -1) -> torch.Tensor:
    """A per-term value that is constant within each sample (e.g. its policy version) -> (B,), ``fill`` for
    samples without terms."""
    out = values.new_full((layout.num_rows + int(layout.padded),), fill)  # (B [+1],)
    out[layout.row] = values
    return out[:layout.num_rows]  # (B,)
