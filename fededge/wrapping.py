"""How fededge follows a wrapper to what it wraps: one declared protocol, read here only.

fededge wraps in the one way Flower's and torch's wrappers do (``Compressed(strategy)``,
``FromRound(strategy, done)``, ``MeteredGrid(grid)``): the wrapper keeps what it wraps
as ``inner``. Code that needs the wrapped object, or the first object in the chain with
some capability (``attach_clock``), asks this module instead of walking ``inner`` by
hand, so that the rule lives in one place.

Pure: no Flower.

Examples
--------
>>> class A: pass
>>> class W:
...     def __init__(self, inner): self.inner = inner
>>> a = A()
>>> innermost(W(W(a))) is a
True
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

__all__ = ["Wrapper", "chain", "first_with", "innermost"]


@runtime_checkable
class Wrapper(Protocol):
    """Anything that wraps another object and keeps it as ``inner``."""

    inner: Any


def chain(obj: Any) -> Iterator[Any]:
    """``obj``, then what it wraps, then what that wraps, ... (each once)."""
    seen: set[int] = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        if not isinstance(obj, Wrapper):
            return
        obj = obj.inner


def innermost(obj: Any) -> Any:
    """The object at the end of ``obj``'s chain of wrappers (``obj`` itself if it wraps nothing)."""
    last = obj
    for last in chain(obj):
        pass
    return last


def first_with(obj: Any, attr: str) -> Any | None:
    """The first object of ``obj``'s chain with its own ``attr`` (looked up on the object
    and its class, not through a wrapper's delegation), else None."""
    for x in chain(obj):
        if hasattr(type(x), attr) or attr in getattr(x, "__dict__", {}):
            return x
    return None
