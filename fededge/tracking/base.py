"""What a metric sink is (:class:`MetricSink`), and the fan-out that keeps a run going when
one fails (:class:`Sinks`). Pure: no Flower, no tool imported here."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricSink", "Sinks", "check_sinks", "numeric_items"]

log = logging.getLogger("fededge")


def numeric_items(line: Mapping[str, Any]) -> dict[str, float]:
    """The figures of one ``metrics.jsonl`` line a tool can plot: numbers (booleans as 0/1),
    not ``round`` (the step), not None or text, not NaN or infinite values."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key == "round" or value is None or isinstance(value, str):
            continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run config as flat ``key: scalar`` pairs (nested mappings joined with ``.``), the
    hyperparameter form every tool takes."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, prefix=f"{name}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


class MetricSink:
    """A place a run's rounds also go. Subclasses implement the three calls.

    ``open`` is called once the run directory exists (``config.json`` written), with the
    run config; for a resumed run, ``resume_after`` is the checkpoint's round and ``kept``
    the ``metrics.jsonl`` lines up to it (a sink that has not seen this run yet, added on
    resume, logs them first). ``log_round`` gets each new ``metrics.jsonl`` line, in
    order. ``close`` gets ``summary.json``'s figures, the run's status and its files.
    """

    #: The sink's name in ``log-to`` and in messages.
    name: str = "sink"

    def open(self, run_dir: Path, run_id: str, config: Mapping[str, Any], *,
             resume_after: int | None = None, kept: Sequence[Mapping[str, Any]] = ()) -> None:
        raise NotImplementedError

    def log_round(self, line: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self, summary: Mapping[str, Any], *, status: str, artifacts: Sequence[Path] = ()) -> None:
        raise NotImplementedError


def check_sinks(sinks: Iterable[Any]) -> list[MetricSink]:
    """``sinks`` as a list, each checked to be a metric sink (``TypeError`` naming what it lacks)."""
    out = list(sinks)
    for sink in out:
        for method in ("open", "log_round", "close"):
            if not callable(getattr(sink, method, None)):
                raise TypeError(f"{sink!r} is not a metric sink: it has no {method}() "
                                "(see fededge.tracking.MetricSink)")
    return out


class Sinks:
    """Every sink of a run, called in turn. A sink that raises is logged once, with the
    reason, and dropped for the rest of the run: ``metrics.jsonl`` is the source of
    truth, and no sink stops the training."""

    def __init__(self, sinks: Iterable[MetricSink] = ()) -> None:
        self.sinks: list[MetricSink] = check_sinks(sinks)
        self.dropped: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def _each(self, call: str, *args: Any, **kwargs: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, call)(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a sink never stops the run
                name = getattr(sink, "name", type(sink).__name__)
                self.sinks.remove(sink)
                self.dropped[name] = f"{type(err).__name__}: {err}"
                log.warning("metric sink %s failed in %s (%s: %s); it is dropped for the rest of the run, "
                            "metrics.jsonl has every round", name, call, type(err).__name__, err)

    def open(self, run_dir: Path, run_id: str, config: Mapping[str, Any], *,
             resume_after: int | None = None, kept: Sequence[Mapping[str, Any]] = ()) -> None:
        self._each("open", run_dir, run_id, config, resume_after=resume_after, kept=kept)

    def log_round(self, line: Mapping[str, Any]) -> None:
        self._each("log_round", line)

    def close(self, summary: Mapping[str, Any], *, status: str, artifacts: Sequence[Path] = ()) -> None:
        self._each("close", summary, status=status, artifacts=artifacts)
