"""Helpers the fededge strategies with their own round loops share (DGA, async, backup)."""

from __future__ import annotations

import re
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import sample_nodes

__all__ = ["DROPOUT_REASON", "dropout_partition", "dropout_reason", "fixed_participants", "is_dropout",
           "reply_metrics", "reported_partition", "usable_reply"]

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


def usable_reply(reply: Message, *, arrays_key: str, model_keys: set[str], weight_key: str) -> str | None:
    """Why a (non-error) train reply cannot be aggregated, or None."""
    c = reply.content
    if arrays_key not in c.array_records:
        return f"reply has no '{arrays_key}' ArrayRecord (has {list(c.keys())})"
    if set(c[arrays_key].keys()) != model_keys:
        return f"reply's arrays {sorted(c[arrays_key].keys())} are not the model's {sorted(model_keys)}"
    metrics = next(iter(c.metric_records.values()), None)
    if metrics is None or weight_key not in metrics:
        return f"reply has no '{weight_key}' metric to weight it by"
    if not float(metrics[weight_key]) > 0:
        return f"reply's '{weight_key}' is {metrics[weight_key]}, not > 0"
    return None
