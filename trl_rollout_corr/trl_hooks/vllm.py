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
* On the trainer's ``VLLMGeneration`` instance (after ``GRPOTrainer.__init__``), :func:`replace_vllm_generation_method`
  and :func:`wrap_vllm_generation_method` replace ``sync_weights`` (TRL calls it with no argument) and wrap
  ``generate``; each first checks that the method is there (and, for ``sync_weights``, still takes no argument).
* What is read of ``trainer.vllm_generation``: :func:`vllm_generation` (its ``mode``), :func:`colocated_llm` (the
  colocated vLLM ``LLM``) and :func:`server_client` (the server's ``VLLMClient`` and its ``base_url``).
* On its ``VLLMClient`` (server mode), :func:`client_session` is the ``requests.Session`` every request of the client
  goes through (the package sends its own requests to the server on it), and :func:`mount_client_adapter` mounts a
  transport adapter on it for ``http://`` and ``https://`` (in place of the retrying one TRL mounts).
* :func:`weights_sleeping` reads whether TRL's colocated engine sleeps with its weights discarded
  (``_llm_weights_sleeping``, sleep mode), so the sync schedule lets TRL's own re-push through.
* TRL's asynchronous client (``trl.experimental.async_grpo.vllm_client``) sends module-level ``requests.get/post``:
  :func:`route_async_client_requests` rebinds that module's ``requests`` to a stand-in that routes the requests to
  one server (the control token) and passes every other request to ``requests``.

A failed check raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged`, naming the installed TRL
version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
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


# The methods of TRL's ``VLLMGeneration`` this package replaces on the trainer's instance, each with the parameters
# TRL's bound method takes (None: not checked; ``generate`` is only ever wrapped by a pass-through of every argument).
# TRL calls ``sync_weights()`` with none, and so do the replacements.
_REPLACEABLE_METHODS: dict[str, tuple[str, ...] | None] = {"sync_weights": (), "generate": None}


def _generation_method(gen: Any, name: str) -> Callable:
    """``gen.<name>`` (TRL's method or what already replaced it), checked to exist and to take what TRL passes."""
    if name not in _REPLACEABLE_METHODS:
        raise ValueError(f"{name!r} is not one of the VLLMGeneration methods this package replaces "
                         f"({', '.join(_REPLACEABLE_METHODS)})")
    method = getattr(gen, name, None)
    if not callable(method):
        raise TrlInternalsChanged(f"{type(gen).__name__}.{name} is gone: this package replaces it on the trainer's "
                                  "vLLM generation")
    expected = _REPLACEABLE_METHODS[name]
    if expected is not None:
        try:
            params = tuple(inspect.signature(method).parameters)
        except (TypeError, ValueError):  # no signature to read (a builtin): nothing to check
            params = expected
        if params != expected:
            raise TrlInternalsChanged(f"{type(gen).__name__}.{name} takes {list(params)}; its replacement was "
                                      f"written for {list(expected)}")
    return method


def replace_vllm_generation_method(gen: Any, name: str, fn: Callable) -> None:
    """Set ``gen.<name> = fn`` on TRL's ``VLLMGeneration`` instance ``gen``, once the method it replaces is checked
    (``name``: ``sync_weights`` or ``generate``)."""
    _generation_method(gen, name)
    setattr(gen, name, fn)


def wrap_vllm_generation_method(gen: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Set ``gen.<name> = wrap(gen.<name>)`` on TRL's ``VLLMGeneration`` instance ``gen``, the current method checked
    first (``name``: ``sync_weights`` or ``generate``)."""
    setattr(gen, name, wrap(_generation_method(gen, name)))


def client_session(client: Any) -> Any:
    """The ``requests.Session`` TRL's ``VLLMClient`` sends every request through (``client.session``), checked."""
    import requests

    session = getattr(client, "session", None)
    if not isinstance(session, requests.Session):
        raise TrlInternalsChanged(f"{type(client).__name__}.session is {type(session).__name__}, not a "
                                  "requests.Session: this package's requests to the vLLM server, its control token "
                                  "and its timeouts go through it")
    return session


def mount_client_adapter(client: Any, adapter: Any) -> None:
    """Mount ``adapter`` (a ``requests`` transport adapter) on TRL's client session for ``http://`` and ``https://``,
    replacing the retrying adapter TRL mounts there."""
    session = client_session(client)
    session.mount("http://", adapter)
    session.mount("https://", adapter)


# What this package reads of TRL's ``VLLMGeneration`` (``trainer.vllm_generation``, TRL 1.16): its ``mode``, and in
# colocate mode the vLLM ``LLM`` it built (``llm``), in server mode its ``VLLMClient`` (``vllm_client``, whose
# ``base_url`` names the server).
GENERATION_MODES = ("colocate", "server")


def vllm_generation(trainer: Any) -> Any:
    """TRL's ``VLLMGeneration`` of a trainer built with ``use_vllm=True``, checked to have a known ``mode``."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) not in GENERATION_MODES:
        raise TrlInternalsChanged(f"GRPOTrainer.vllm_generation is {type(gen).__name__} with mode "
                                  f"{getattr(gen, 'mode', None)!r}: expected TRL's VLLMGeneration with a mode in "
                                  f"{GENERATION_MODES}")
    return gen


def colocated_llm(gen: Any) -> Any:
    """The vLLM ``LLM`` TRL's ``VLLMGeneration`` runs in colocate mode (``gen.llm``)."""
    llm = getattr(gen, "llm", None)
    if llm is None or not hasattr(llm, "llm_engine"):
        raise TrlInternalsChanged(f"{type(gen).__name__}.llm is {type(llm).__name__}, not vLLM's LLM: the colocated "
                                  "engine's dtype is read from it")
    return llm


def server_client(gen: Any) -> Any:
    """TRL's ``VLLMClient`` of a ``VLLMGeneration`` in server mode (``gen.vllm_client``), checked to name its server
    (``base_url``)."""
    client = getattr(gen, "vllm_client", None)
    if not isinstance(getattr(client, "base_url", None), str):
        raise TrlInternalsChanged(f"{type(gen).__name__}.vllm_client is {type(client).__name__} without a base_url: "
                                  "this package sends its own requests to the vLLM server through TRL's client")
    return client


def weights_sleeping(gen: Any) -> bool:
    """Whether TRL's colocated engine sleeps at level 2 with its weights discarded (``vllm_enable_sleep_mode``):
    ``gen._llm_weights_sleeping``, which TRL 1.16 sets after each generation and clears in ``sync_weights``; its
    ``generate`` then calls ``sync_weights()`` to re-push them. False when sleep mode is off."""
    if gen.mode != "colocate" or not getattr(gen, "enable_sleep_mode", False):
        return False
    if not hasattr(gen, "_llm_weights_sleeping"):
        raise TrlInternalsChanged(f"{type(gen).__name__}._llm_weights_sleeping is gone: with vllm_enable_sleep_mode "
                                  "the sync schedule lets TRL's re-push of discarded weights through by it")
    return bool(gen._llm_weights_sleeping)


# TRL 1.16's asynchronous GRPO client (``trl.experimental.async_grpo.vllm_client.VLLMClient``) sends every request with
# the module-level ``requests.get`` / ``requests.post`` (no session, no headers): the control token reaches it only
# through that module's ``requests`` name.
_ASYNC_CLIENT_MODULE = "trl.experimental.async_grpo.vllm_client"


class _RoutedRequests:
    """Stands for the ``requests`` module in TRL's async client module: a request to a URL under one of ``routes``'
    prefixes goes through ``routes[prefix](method, url, kwargs, send)``; everything else is ``requests`` itself."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.routes: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        for prefix, route in self.routes.items():
            if str(url).startswith(prefix):
                return route(method, url, kwargs, self._real.request)
        return self._real.request(method, url, **kwargs)

    def get(self, url: str, params: Any = None, **kwargs: Any) -> Any:
        return self.request("GET", url, params=params, **kwargs)

    def post(self, url: str, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", url, data=data, json=json, **kwargs)

    def put(self, url: str, data: Any = None, **kwargs: Any) -> Any:
        return self.request("PUT", url, data=data, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> Any:
        return self.request("DELETE", url, **kwargs)


def route_async_client_requests(base_url: str, route: Callable) -> None:
    """From now on, every request TRL's asynchronous ``VLLMClient`` sends to ``base_url`` goes through
    ``route(method, url, kwargs, send)`` (``send(method, url, **kwargs)`` is ``requests.request``): the control token
    rides on it. Requests to other URLs are untouched."""
    import importlib

    module = importlib.import_module(_ASYNC_CLIENT_MODULE)
    current = getattr(module, "requests", None)
    if not isinstance(current, _RoutedRequests):
        if not callable(getattr(current, "get", None)) or not callable(getattr(current, "post", None)):
            raise TrlInternalsChanged(f"{_ASYNC_CLIENT_MODULE} no longer sends its requests through the requests "
                                      "module: the vLLM server's control token cannot reach TRL's async client")
        current = _RoutedRequests(current)
        module.requests = current
    current.routes[base_url.rstrip("/")] = route
