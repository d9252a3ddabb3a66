"""Counting host synchronizations requested by trl_rollout_corr's code (a measuring tool for bench_step.py and
tests/test_host_syncs.py; it patches ``torch.Tensor`` methods while open, so it lives outside the library).

On a GPU, ``Tensor.item``/``cpu``/``numpy``/``tolist``/``bool``/``float``/``int`` of a device tensor blocks until
the device catches up. :func:`count_host_syncs` wraps them and counts the calls whose caller lives in
``trl_rollout_corr`` (TRL's and transformers' own syncs are not ours to remove). ``tolist`` of a CPU tensor is not
counted, so ``x.cpu().tolist()`` counts once (as on a GPU), and every ``cpu()`` counts even on a CPU-only machine:
the count is what the same code would do on a GPU. ``count_host_syncs(everywhere=True)`` counts every caller (TRL,
transformers, accelerate too): the total to compare with TRL's own trainer.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator

import torch

import trl_rollout_corr

_PACKAGE_DIR = os.path.dirname(os.path.abspath(trl_rollout_corr.__file__))
_EXCLUDED = tuple(os.path.join(_PACKAGE_DIR, name) for name in ("demo", "cli.py"))  # not the training path
_METHODS = ("item", "cpu", "numpy", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_host_syncs(everywhere: bool = False) -> Iterator[Counter]:
    """``with count_host_syncs() as syncs: ...`` then ``sum(syncs.values())``; keys are ``file:line method``.

    Only calls from this package's code unless ``everywhere``; then other callers' keys start with ``ext:``.
    """
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrap(name, original):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            filename = frame.f_code.co_filename
            ours = filename.startswith(_PACKAGE_DIR) and not filename.startswith(_EXCLUDED)
            if (everywhere or ours) and not (name == "tolist" and self.device.type == "cpu"):
                counts[f"{'' if ours else 'ext:'}{os.path.basename(filename)}:{frame.f_lineno} {name}"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
