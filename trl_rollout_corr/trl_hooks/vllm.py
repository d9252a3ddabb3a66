"""What this package assumes about TRL's vLLM pieces (``trl.generation.vllm_generation``), each checked where used.

* While ``GRPOTrainer.__init__`` builds its vLLM generation, :func:`constructing_vllm_generation` swaps, and restores
  after:

  - ``VLLMClient.init_communicator`` for a no-op (TRL's communicator is vLLM's NCCL engine, CUDA only; a CPU
    server is synced through files instead);
  - ``requests.Session`` for a session class of this package's (TRL's ``VLLMClient`` builds its session then, so
    the server's control token rides on every request it sends);
  - the module's ``LLM`` for ``LLM`` with engine keyword arguments (TRL passes no ``dtype`` to a colocated engine).
* :func:`named_parameters` reads the parameters TRL's weight sync pushes (``VLLMGeneration._iter_named_params``,
  gathered collectively under ZeRO-3/FSDP).

A failed check raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged`, naming the installed TRL
version.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from .base import TrlInternalsChanged

_TRL_MODULE = "trl.generation.vllm_generation"


def import_trl_vllm() -> Any:
    """TRL's vLLM generation module (imported by the caller before vLLM's CPU fixes, as it always was)."""
    import importlib

    return importlib.import_module(_TRL_MODULE)


@contextlib.contextmanager
def constructing_vllm_generation(*, skip_communicator: bool = False, session_class: type | None = None,
                                 engine_kwargs: dict[str, Any] | None = None) -> Iterator[None]:
    """Context for ``GRPOTrainer.__init__``: TRL's vLLM client without its NCCL communicator (``skip_communicator``),
    ``requests.Session`` replaced by ``session_class``, the colocated ``LLM`` built with ``engine_kwargs``."""
    trl_vllm = import_trl_vllm()
    saved: list[tuple[Any, str, Any]] = []
    if skip_communicator:
        client = getattr(trl_vllm, "VLLMClient", None)
        if not callable(getattr(client, "init_communicator", None)):
            raise TrlInternalsChanged(f"{_TRL_MODULE}.VLLMClient.init_communicator is gone: a CPU vLLM server is "
                                      "synced without it")
        saved.append((client, "init_communicator", client.init_communicator))
        client.init_communicator = lambda self, device=0: None
    if session_class is not None:
        import requests

        saved.append((requests, "Session", requests.Session))
        requests.Session = session_class
    if engine_kwargs:
        llm_class = getattr(trl_vllm, "LLM", None)
        if not callable(llm_class):
            raise TrlInternalsChanged(f"{_TRL_MODULE}.LLM is gone: the colocated engine's keyword arguments "
                                      f"({', '.join(engine_kwargs)}) are passed through it")
        saved.append((trl_vllm, "LLM", llm_class))
        trl_vllm.LLM = functools.partial(llm_class, **engine_kwargs)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def named_parameters(gen: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every parameter TRL's ``VLLMGeneration`` pushes to the engine (collective under
    ZeRO-3/FSDP: every process iterates)."""
    iterate = getattr(gen, "_iter_named_params", None)
    if not callable(iterate):
        raise TrlInternalsChanged(f"{type(gen).__name__}._iter_named_params is gone: the CPU server weight sync "
                                  "reads the parameters through it")
    return iterate()
