"""One rule for a piece that takes its settings as one object or as keywords.

fededge's pieces take a frozen, validated config object whole (``DGA(config=DGAConfig(
delay=2))``, ``Experiment(results=ResultsConfig(...), clock=ClockConfig(...))``,
``RunClock(config=...)``) or its knobs as keywords, as they always have. Both at once is
refused by name, so that no knob is silently ignored. (The codecs' own constructors,
``TopK(SparsifyConfig(...))`` or ``TopK(ratio=...)``, follow the same rule in
:class:`fededge.compress.codec.ConfiguredCodec`.)

Pure: no Flower, no torch.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["whole_or_keywords"]

T = TypeVar("T")


def whole_or_keywords(cls: type[T], given: T | None, *, owner: str, name: str = "config", **keywords: Any) -> T:
    """The ``cls`` object ``owner`` runs with: ``given`` whole, else ``cls(**keywords)``.

    The keywords are checked either way (``cls`` validates in its constructor); a
    ``given`` object beside keywords that differ from ``cls``'s defaults is refused
    (:class:`ValueError`), and one of another type too (:class:`TypeError`).

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Knobs:
    ...     k: int = 1
    >>> whole_or_keywords(Knobs, None, owner="Demo", k=2)
    Knobs(k=2)
    >>> whole_or_keywords(Knobs, Knobs(k=3), owner="Demo", k=1)
    Knobs(k=3)
    """
    from_keywords = cls(**keywords)
    if given is None:
        return from_keywords
    if not isinstance(given, cls):
        raise TypeError(f"{owner}: {name} must be a {cls.__name__}, got {type(given).__name__}")
    if from_keywords != cls():
        raise ValueError(f"{owner} takes its {cls.__name__} either as {name}={cls.__name__}(...) or as keywords, "
                         f"not both: got {name}={given} and keywords giving {from_keywords}")
    return given
