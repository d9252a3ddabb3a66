"""What every TRL hook shares: the error a broken assumption raises, and the method a trainer really inherits."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

TESTED_TRL = "1.16"


class TrlInternalsChanged(RuntimeError):
    """TRL no longer behaves as this package assumes (see :mod:`trl_rollout_corr.trl_hooks`)."""

    def __init__(self, what: str) -> None:
        import trl

        super().__init__(f"{what} (installed TRL {trl.__version__}; trl_rollout_corr was written against TRL "
                         f"{TESTED_TRL}: pin trl to {TESTED_TRL}.x or report this).")


def inherited_method(owner: type, name: str, cls: type | None = None) -> Callable:
    """The function ``super(owner, self).<name>`` calls for ``type(self) = cls`` (default ``owner``): the first
    definition of ``name`` after ``owner`` in ``cls``'s MRO."""
    return inspect.unwrap(vars(_defining_class(owner, name, cls))[name])


def _defining_class(owner: type, name: str, cls: type | None) -> type:
    mro = (cls or owner).__mro__
    for klass in mro[mro.index(owner) + 1:]:
        if name in vars(klass):
            return klass
    raise TrlInternalsChanged(f"no base class of {owner.__name__} defines {name}")


@functools.lru_cache(maxsize=32)
def _parameters(method: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(method).parameters)


def require_parameters(owner: type, name: str, cls: type, expected: tuple[str, ...]) -> None:
    """Check that the ``name`` ``cls`` inherits past ``owner`` takes exactly ``expected`` (read once per method)."""
    params = _parameters(inherited_method(owner, name, cls))
    if params != expected:
        raise TrlInternalsChanged(f"{_defining_class(owner, name, cls).__name__}.{name} takes {list(params)}; "
                                  f"{owner.__name__}.{name} was written for {list(expected)}")


def require_hooks(owner: type, cls: type, names: tuple[str, ...]) -> None:
    """Each of ``names`` (private methods ``owner`` overrides) is still defined by a base class: a hook TRL renamed
    would otherwise never be called, silently."""
    for name in names:
        _defining_class(owner, name, cls)
