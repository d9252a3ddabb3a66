"""What TRL 1.16's ``AsyncGRPOTrainer`` needs to train on a CPU, installed only when there is no CUDA device.

- **Tree attention**: TRL packs a rank's samples into a prefix trie and runs attention with the Hub kernel
  ``kernels-community/flash-attn3`` (CUDA only, downloaded at first use). On CPU,
  ``packing._flash_attn`` returns :mod:`trl_rollout_corr.trl_hooks.tree_attention`'s PyTorch stand-in (same
  signature, same result; tested against a plain forward per sample).
- **MFU probe**: ``get_peak_flops_per_device`` asks ``torch.cuda.get_device_name``, an error on a CPU build of
  torch; on a non-CUDA device it returns None (TRL then disables MFU metrics, as for an unknown GPU).

On a CUDA machine nothing is replaced. Each replacement checks that the TRL function it wraps is still there and
raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged` naming TRL's version if not.
"""

from __future__ import annotations

import functools

import torch

from .base import TrlInternalsChanged


def _require(module, name: str):
    if not callable(getattr(module, name, None)):
        raise TrlInternalsChanged(f"{module.__name__}.{name} is gone: the CPU support of the async GRPO trainer "
                                  "wraps it")
    return getattr(module, name)


def install_cpu_support() -> bool:
    """Install the CPU replacements (idempotent); returns whether anything applies (False with CUDA)."""
    if torch.cuda.is_available():
        return False
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    from .tree_attention import KERNEL

    flash_attn = _require(packing, "_flash_attn")
    if not getattr(flash_attn, "_trl_rollout_corr", False):
        @functools.wraps(flash_attn)
        def cpu_flash_attn():
            return KERNEL

        cpu_flash_attn._trl_rollout_corr = True
        packing._flash_attn = cpu_flash_attn

    peak_flops = _require(async_grpo_trainer, "get_peak_flops_per_device")
    if not getattr(peak_flops, "_trl_rollout_corr", False):
        @functools.wraps(peak_flops)
        def peak_flops_or_none(accelerator, dtype):
            return peak_flops(accelerator, dtype) if accelerator.device.type == "cuda" else None

        peak_flops_or_none._trl_rollout_corr = True
        async_grpo_trainer.get_peak_flops_per_device = peak_flops_or_none
    return True


KERNELS_EXTRA = "trl-rollout-corr[kernels]"


def require_kernels() -> None:
    """On a CUDA/ROCm machine (no CPU support installed), TRL's tree attention imports the ``kernels`` package at the
    first forward and downloads ``kernels-community/flash-attn3`` (``aiter-flash-attn`` on ROCm) from the Hugging Face
    Hub (``packing._flash_attn``): without the package that is an ImportError deep inside the first training step.
    Raise it at construction instead, naming the extra that installs it."""
    import importlib.util

    if importlib.util.find_spec("kernels") is None:
        raise ImportError(
            "TRL's asynchronous GRPO trainer on a GPU runs its packed attention with the Hub kernel "
            "kernels-community/flash-attn3 (aiter-flash-attn on ROCm) through the `kernels` package, which is not "
            f"installed. Install it: pip install \"{KERNELS_EXTRA}\" (TRL's `kernels` extra). The kernel itself is "
            "downloaded from the Hugging Face Hub at the first forward: a machine without network needs it in its "
            "Hugging Face cache beforehand.")
