"""Helpers the fededge strategies with their own round loops share (DGA, async, backup),
and the checks of a reply before it is aggregated (:func:`usable_reply`,
:func:`screen_replies`: the metering applies the latter to Flower's round loop)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, Message
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import sample_nodes

__all__ = ["DROPOUT_REASON", "array_problem", "dropout_partition", "dropout_reason", "fixed_participants",
           "is_dropout", "metrics_problem", "reply_metrics", "reported_partition", "screen_replies",
           "screen_for", "usable_reply", "weight_problem"]

#: Start of the error reason of a reply the client marked as a simulated dropout
#: (``dropout`` in the run config); :class:`fededge.server.metering.MeteredGrid` turns
#: such replies into error replies, so that every strategy leaves them out.
DROPOUT_REASON = "dropped out (never answers)"


_DROPOUT_RE = re.compile(r"partition (\d+) of (\d+)")


def dropout_reason(partition_id: int, num_partitions: int) -> str:
    """The error reason standing for a dropped client (parsed by :func:`dropout_partition`)."""
    return (f"{DROPOUT_REASON}: partition {partition_id} of {num_partitions} is one of the clients "
            "the run config's dropout fraction takes out")


def dropout_partition(reply: Message) -> tuple[int, int] | None:
    """``(partition id, number of partitions)`` of a dropout reply, else None."""
    if not is_dropout(reply):
        return None
    m = _DROPOUT_RE.search(reply.error.reason)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_dropout(reply: Message) -> bool:
    """Whether ``reply`` stands for a client that never answered (simulated dropout)."""
    return reply.has_error() and reply.error.reason.startswith(DROPOUT_REASON)


def fixed_participants(grid: Grid, *, fraction: float, min_nodes: int, min_available: int) -> list[int]:
    """The clients of a run whose strategy needs the same ones throughout (DGA, async).

    All connected nodes, or a seeded sample of ``max(int(n * fraction), min_nodes)``
    (Flower's own sample size), drawn once with Flower's sampling.
    """
    # Wait for min_available first, then size the sample from the nodes there then: sized
    # before the wait, it took every node connected by the end of it (10 of 10 with
    # fraction 0.5 where one node was connected at first, 5 where all were).
    _, connected = sample_nodes(grid, min_available, 0)  # waits, samples nothing
    size = max(int(len(connected) * fraction), min_nodes)
    if size >= len(connected):
        return list(connected)
    nodes, _ = sample_nodes(grid, min_available, size)
    return sorted(nodes)


def reply_metrics(reply: Message) -> Any:
    """A reply's (first) metric record, empty when it has none."""
    return next(iter(reply.content.metric_records.values()), {})


def reported_partition(reply: Message) -> int | None:
    """The partition id a reply's metrics report (fededge's ClientApp sends ``partition-id``),
    else None: a user's own ClientApp reports none. Give it to
    :meth:`RunClock.place <fededge.netem.runclock.RunClock.place>`, which then places the
    node by its node id, the same way every round and for every strategy."""
    if reply.has_error():
        return None
    metrics = reply_metrics(reply)
    return int(metrics[keys.REPLY_PARTITION_ID]) if keys.REPLY_PARTITION_ID in metrics else None


def usable_reply(reply: Message, *, arrays_key: str, model_keys: set[str], weight_key: str,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> str | None:
    """Why a (non-error) train reply cannot be aggregated by a loop of fededge's own, or
    None: no ``arrays_key`` record, arrays other than the model's (names; ``shapes`` where
    given), an array not numeric or holding NaN/Inf, or no finite weight > 0 in its
    (first) metric record."""
    c = reply.content
    if arrays_key not in c.array_records:
        return f"reply has no '{arrays_key}' ArrayRecord (has {list(c.keys())})"
    if set(c[arrays_key].keys()) != model_keys:
        return f"reply's arrays {sorted(c[arrays_key].keys())} are not the model's {sorted(model_keys)}"
    for name, arr in c[arrays_key].items():
        why = array_problem(name, arr, None if shapes is None else shapes.get(name))
        if why is not None:
            return why
    return weight_problem(reply_metrics(reply), weight_key, zero_ok=False)


def array_problem(name: str, arr: Array, shape: tuple[int, ...] | None = None) -> str | None:
    """Why a reply's array cannot be averaged into the model, or None: another ``shape``
    than the model's (Flower's average broadcast a (1,) array into a (2,) one), not a
    number, or NaN/Inf in it (one NaN made the model NaN, and FedAdam's moments for good)."""
    got = tuple(int(d) for d in arr.shape)
    if shape is not None and got != tuple(shape):
        return f"array '{name}' has shape {got}, the model's {tuple(shape)}"
    dtype = str(arr.dtype)
    try:
        kind = np.dtype(dtype).kind
    except TypeError:  # (a torch dtype numpy lacks: bfloat16)
        kind = "f" if "float" in dtype else "?"
    if kind not in "fiubc":
        return f"array '{name}' has dtype {dtype}, not a number"
    if kind in "fc" and not _finite(arr):
        return f"array '{name}' holds NaN or Inf"
    return None


def _finite(arr: Array) -> bool:
    """Whether every element is finite: its float64 sum first (no copy, and NaN/Inf carry
    through a sum), confirmed element by element where the sum is not."""
    from fededge.arrays import TensorArray, to_numpy

    tensor = arr.tensor if isinstance(arr, TensorArray) else None
    if tensor is not None:  # a reply kept on its device: checked there
        import torch

        total = tensor.sum() if tensor.is_complex() else tensor.sum(dtype=torch.float64)
        return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())
    nd = to_numpy(arr, copy=False)
    total = nd.sum() if nd.dtype.kind == "c" else nd.sum(dtype=np.float64)
    return bool(np.isfinite(total)) or bool(np.isfinite(nd).all())


def weight_problem(metrics: Any, weight_key: str, *, zero_ok: bool) -> str | None:
    """Why ``metrics[weight_key]`` cannot weight a reply, or None: missing, or not a
    finite number > 0 (>= 0 where ``zero_ok``: Flower's average weighs a 0 as nothing)."""
    if weight_key not in metrics:
        return f"reply has no '{weight_key}' metric to weight it by"
    w = metrics[weight_key]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not (
            w >= 0 if zero_ok else w > 0):
        return f"reply's '{weight_key}' is {w!r}, not a finite number {'>= 0' if zero_ok else '> 0'}"
    return None


def metrics_problem(reply: Message, weight_key: str) -> str | None:
    """Why a reply's metrics cannot be aggregated by Flower's FedAvg family, or None: not
    one MetricRecord (Flower refuses the whole round then), or its ``weight_key`` missing
    or not a finite number >= 0 (:func:`weight_problem`)."""
    records = reply.content.metric_records
    if len(records) != 1:
        return f"reply has {len(records)} MetricRecords ({sorted(records)}), not one"
    return weight_problem(next(iter(records.values())), weight_key, zero_ok=True)


def screen_replies(replies: list[Message], *, weight_key: str, train: bool = False,
                   shapes: Callable[[Message], Mapping[str, tuple[int, ...]] | None] | None = None,
                   compressed_decoded: bool = True, metric_kinds: bool = True) -> list[str | None]:
    """Why each of one round's replies cannot be aggregated by Flower's FedAvg family
    (None: it can; an error reply is left to the strategy).

    Each reply alone: its metrics (:func:`metrics_problem`) and, for ``train`` replies,
    its one ArrayRecord (Flower averages one, whatever its name): a compressed reply is
    left to a :class:`~fededge.strategies.compressed.Compressed` (which decodes and checks
    it) where ``compressed_decoded``, and refused where not (Flower's strategy averaged the
    payload's bytes into the model); otherwise the names and shapes of what was sent to
    its node (``shapes(reply)``, where known) and finite numbers (:func:`array_problem`).
    Then together: Flower refuses a whole round whose replies' metric names differ (and,
    with its own metric aggregation, ``metric_kinds``, whose lists differ in length), so
    the replies that differ from most replies' are refused (on a tie, from the first
    usable reply's); and where every usable reply weighs 0, so are they (Flower's average
    divided by zero).
    """
    why: list[str | None] = []
    for r in replies:
        if r.has_error():
            why.append(None)
            continue
        problem = metrics_problem(r, weight_key)
        c = r.content
        if problem is None and train:
            if keys.COMPRESSED in c:
                if not compressed_decoded:
                    problem = ("reply is compressed (the client's CompressionMod) but the strategy does not decode "
                               "it: wrap the strategy in Compressed(strategy, update=<the clients' UpdateConfig>)")
            elif len(c.array_records) != 1:
                problem = f"reply has {len(c.array_records)} ArrayRecords ({sorted(c.array_records)}), not one"
            else:
                rec = next(iter(c.array_records.values()))
                sent = None if shapes is None else shapes(r)
                if sent is not None and set(rec.keys()) != set(sent):
                    problem = f"reply's arrays {sorted(rec.keys())[:8]} are not the model's {sorted(sent)[:8]}"
                for name, arr in rec.items():
                    if problem is None:
                        problem = array_problem(name, arr, None if sent is None else sent.get(name))
        why.append(problem)
    usable = [i for i, r in enumerate(replies) if not r.has_error() and why[i] is None]
    kinds = {i: _metric_kinds(next(iter(replies[i].content.metric_records.values())), lengths=metric_kinds)
             for i in usable}
    if len(set(kinds.values())) > 1:
        counts = Counter(kinds.values())
        top = max(counts.values())
        common = next(n for n in kinds.values() if counts[n] == top)  # (dicts keep the replies' order)
        for i, n in kinds.items():
            if n != common:
                why[i] = (f"reply's metrics {_kinds_text(n)} are not the round's other replies' "
                          f"{_kinds_text(common)} (Flower averages replies whose metrics have the same "
                          "names" + (", each a number or a list of one length)" if metric_kinds else ")"))
    usable = [i for i in usable if why[i] is None]
    if usable and all(next(iter(replies[i].content.metric_records.values()))[weight_key] == 0 for i in usable):
        for i in usable:
            why[i] = f"every usable reply of the round has '{weight_key}' 0: there is nothing to average"
    return why


def _metric_kinds(metrics: Any, *, lengths: bool = True) -> tuple[tuple[str, int], ...]:
    """Each metric's name and kind (-1: a number; n: a list of n numbers; without
    ``lengths``, -1 for all), sorted."""
    return tuple(sorted((k, len(v) if lengths and isinstance(v, list) else -1) for k, v in metrics.items()))


def _kinds_text(kinds: tuple[tuple[str, int], ...]) -> str:
    return "[" + ", ".join(k if n < 0 else f"{k} (a list of {n})" for k, n in kinds) + "]"


def screen_for(strategy: Any) -> tuple[str, bool, bool] | None:
    """:attr:`MeteredGrid.screen <fededge.server.metering.MeteredGrid.screen>` for a
    strategy on Flower's round loop: ``(weight_key, decodes, metric_kinds)`` of the Flower
    FedAvg-family strategy it is or wraps (through ``inner``, and ``strategy`` as Flower's
    DP wrappers keep it), or None (nothing is screened) where it wraps none, or one that
    does not average arrays by name (FedXgb*). ``decodes``: a wrapper on the way decodes
    compressed replies (``Compressed``, or one declaring ``decodes_compressed``);
    ``metric_kinds``: the strategy averages the metrics with Flower's own function, which
    needs lists of one length."""
    from flwr.serverapp.strategy import FedAvg

    from fededge._flwr_internals import aggregate_metricrecords

    seen: set[int] = set()
    s: Any = strategy
    decodes = False
    while s is not None and id(s) not in seen:
        seen.add(id(s))
        decodes = decodes or hasattr(type(s), "take_stats") or bool(getattr(s, "decodes_compressed", False))
        if isinstance(s, FedAvg):
            if type(s).__name__.startswith("FedXgb"):
                return None
            return (str(s.weighted_by_key), decodes, s.train_metrics_aggr_fn is aggregate_metricrecords)
        inner = vars(s).get("inner")
        s = inner if inner is not None else vars(s).get("strategy")
    return None
