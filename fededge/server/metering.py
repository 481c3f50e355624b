"""Measure what crosses the wire, by wrapping whatever Grid the ServerApp is given.

:class:`MeteredGrid` forwards every call to the real Grid (Flower's simulation grid,
the deployment grid, or fededge's in-process grid) and counts the serialised size of
each message pushed to a node (downlink) and each reply pulled (uplink). It also
collects what the replies report about themselves (compute time, local steps, partition
id, errors) and the real time from each message's push to its reply's pull, so the
experiment can turn them into ``bytes_up``, ``bytes_down`` and ``sim_s``
(:class:`fededge.server.experiment.Experiment`). It works on any Grid and with any
ClientApp; what a ClientApp does not report is simply not collected.

With :attr:`MeteredGrid.screen` set (the experiment sets it for strategies on Flower's
round loop), a train or evaluate reply that those strategies cannot aggregate (NaN or Inf
in its arrays, another shape, no finite weight, other metric names than the round's
other replies: :func:`fededge.strategies._replies.screen_replies`) is counted as
rejected, logged, and handed on as an error reply, which Flower's strategies leave out:
the round goes on with the rest (unchecked, one NaN made the model NaN, and a reply with
other metric names stopped the run).

A reply that carries a client's configuration error (:func:`fededge.protocol.config_error_reason`,
from :func:`fededge.clients.mods.config_error_mod`) is counted like any failure and then
stops the run: the grid raises :class:`~fededge.errors.ConfigError` with the client's
message, since every later round would fail the same way.

Sizes are those of the message's object tree as Flower sends it (see
``fededge._flwr_internals.message_objects``), per message: a model broadcast to ten
nodes counts ten times, because each node's link carries it once.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import Error, Message
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import remember_counted_size, take_noted_wire_size, wire_size, wire_sizes
from fededge.errors import ConfigError
from fededge.protocol import config_error_detail
from fededge.strategies._replies import dropout_reason, screen_for, screen_replies

__all__ = ["MeteredGrid", "NodeTraffic", "RoundTraffic", "wire_size"]

log = logging.getLogger(__name__)


@dataclass
class NodeTraffic:
    """One node's share of a round (train messages only)."""

    bytes_down: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0  # the reported compute-s (0 if none reported)
    partition_id: int | None = None
    num_partitions: int | None = None
    replied: bool = False
    reported_compute: bool = False  # whether its replies carried compute-s
    steps: int | None = None  # local-steps-done, if reported
    wall_s: float = 0.0  # real seconds from the push of its message to the pull of its reply


@dataclass
class RoundTraffic:
    """What crossed the grid since the last :meth:`MeteredGrid.take`."""

    bytes_down: int = 0
    bytes_up: int = 0
    messages_down: int = 0
    replies: int = 0
    failures: int = 0
    train_replies: int = 0
    rejected: int = 0  # train replies screened out (:attr:`MeteredGrid.screen`): arrived, not usable
    reasons: list[str] = field(default_factory=list)  # one line per screened-out reply
    compute_s: list[float] = field(default_factory=list)  # per train reply
    errors: list[str] = field(default_factory=list)
    nodes: dict[int, NodeTraffic] = field(default_factory=dict)  # train traffic per node
    # A second exchange after the round's training, per node: the norm-stats queries of
    # NormCalibrated (norm-stats = global), timed by the clock after the training's.
    followup: dict[int, NodeTraffic] = field(default_factory=dict)
    # Federated evaluation on the clients (``evaluate`` messages: Flower's loop sends them
    # after the training, fraction-evaluate > 0), per node: timed after the above.
    evaluation: dict[int, NodeTraffic] = field(default_factory=dict)
    # Nodes whose message got no answer: a simulated dropout, or no reply at all within
    # the timeout of send_and_receive (Flower's own round loop). Not in ``failures``.
    dropped: list[int] = field(default_factory=list)

    def merge(self, other: "RoundTraffic") -> None:
        """Add ``other``'s traffic to this one."""
        for name in ("bytes_down", "bytes_up", "messages_down", "replies", "failures", "train_replies", "rejected"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reasons.extend(other.reasons)
        self.compute_s.extend(other.compute_s)
        self.errors.extend(other.errors)
        self.dropped.extend(other.dropped)
        for mine_of, theirs in ((self.nodes, other.nodes), (self.followup, other.followup),
                                (self.evaluation, other.evaluation)):
            _merge_nodes(mine_of, theirs)


def _merge_nodes(into: dict[int, NodeTraffic], other: dict[int, NodeTraffic]) -> None:
    for nid, n in other.items():
        mine = into.setdefault(nid, NodeTraffic())
        mine.bytes_down += n.bytes_down
        mine.bytes_up += n.bytes_up
        mine.compute_s += n.compute_s
        mine.reported_compute = mine.reported_compute or n.reported_compute
        mine.steps = n.steps if mine.steps is None else mine.steps + (n.steps or 0)
        mine.wall_s += n.wall_s
        mine.partition_id = n.partition_id if n.partition_id is not None else mine.partition_id
        mine.num_partitions = n.num_partitions if n.num_partitions is not None else mine.num_partitions
        mine.replied = mine.replied or n.replied


def _per_node(t: RoundTraffic, message_type: str) -> dict[int, NodeTraffic] | None:
    """Where a message of ``message_type`` is counted per node: the round's training
    (``train*``), its second exchange (the norm-stats queries), the clients' evaluation
    (``evaluate*``), or nowhere."""
    if message_type.startswith("train"):
        return t.nodes
    if message_type == keys.NORM_STATS_QUERY:
        return t.followup
    if message_type.startswith("evaluate"):
        return t.evaluation
    return None


def _sizes(messages: list[Message]) -> list[int]:
    """Each message's bytes on the wire: as the grid noted them when it serialised the
    message (the in-process grid does), else serialised here (a model broadcast in one
    push once)."""
    noted = [take_noted_wire_size(m) for m in messages]
    missing = [m for m, n in zip(messages, noted) if n is None]
    counted = iter(wire_sizes(missing))
    return [next(counted) if n is None else n for n in noted]


class MeteredGrid(Grid):
    """A Grid that counts the bytes of every message it pushes and pulls.

    Traffic is kept per message ``group_id`` (a reply carries its instruction's), so a
    strategy that keeps several rounds in flight (DGA, pipelined) can take each round's
    traffic on its own; Flower's own strategies leave the group empty and take it all.
    """

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._traffic: dict[str, RoundTraffic] = {}
        self._pushed_at: dict[str, float] = {}  # message id -> when it was pushed (monotonic)
        self.partition_of: dict[int, int] = {}  # node id -> partition id, from its replies
        #: ``(weight_key, decodes, metric_kinds)`` of a strategy on Flower's round loop
        #: (:func:`fededge.strategies._replies.screen_for`): its train and evaluate replies
        #: are screened (module docstring); None: none are.
        self.screen: tuple[str, bool, bool] | None = None
        # (group, node) -> the shapes of the arrays its last train message carried
        self._shapes: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {}

    # -- accounting ----------------------------------------------------------------
    def take(self, group_id: str | None = None) -> RoundTraffic:
        """Return the traffic counted since the previous call and start afresh: of every
        group (default), or of messages whose ``group_id`` is ``group_id``."""
        with self._lock:
            if group_id is not None:
                return self._traffic.pop(group_id, RoundTraffic())
            total = RoundTraffic()
            for t in self._traffic.values():
                total.merge(t)
            self._traffic.clear()
            return total

    def state_dict(self) -> dict:
        """The traffic counted and not yet taken, per group, as plain values: a strategy
        that drained replies of later versions before a checkpoint (the asynchronous
        ones) takes their bytes after it, in the resumed run too."""
        with self._lock:
            return {g: {**asdict(t), "nodes": {int(n): asdict(v) for n, v in t.nodes.items()},
                        "followup": {int(n): asdict(v) for n, v in t.followup.items()}}
                    for g, t in self._traffic.items()}

    def load_state_dict(self, state: dict) -> None:
        """Put back what :meth:`state_dict` returned (replacing what is counted now)."""
        with self._lock:
            self._traffic = {}
            for g, t in state.items():
                fields = dict(t)
                nodes = {int(n): NodeTraffic(**v) for n, v in fields.pop("nodes").items()}
                followup = {int(n): NodeTraffic(**v) for n, v in fields.pop("followup", {}).items()}
                self._traffic[str(g)] = RoundTraffic(**fields, nodes=nodes, followup=followup)

    def _group(self, msg: Message) -> RoundTraffic:
        return self._traffic.setdefault(msg.metadata.group_id, RoundTraffic())

    def _count_down(self, messages: list[Message]) -> None:
        sizes = _sizes(messages)
        with self._lock:
            if self.screen is not None:
                for m in messages:  # what each node was sent: its reply is checked against it
                    records = m.content.array_records
                    # (a compressed downlink carries payloads, not the model's arrays: unchecked)
                    if (m.metadata.message_type.startswith("train") and len(records) == 1
                            and keys.COMPRESSED_DOWN not in records):
                        rec = next(iter(records.values()))
                        self._shapes[(m.metadata.group_id, m.metadata.dst_node_id)] = {
                            k: tuple(int(d) for d in a.shape) for k, a in rec.items()}
            for m, n in zip(messages, sizes):
                t = self._group(m)
                t.bytes_down += n
                t.messages_down += 1
                per_node = _per_node(t, m.metadata.message_type)
                if per_node is not None:
                    per_node.setdefault(m.metadata.dst_node_id, NodeTraffic()).bytes_down += n

    def _count_up(self, replies: list[Message], sent_at: float | None = None,
                  received_at: float | None = None) -> list[Message]:
        """Count the replies; return them with simulated dropouts turned into errors.
        ``sent_at``: when their messages were pushed, if not recorded per message.

        Raises :class:`~fededge.errors.ConfigError` once they are counted if any reply
        is a client's configuration error.
        """
        out = []
        config_errors: list[str] = []
        now = time.monotonic() if received_at is None else received_at
        for r, n in zip(replies, _sizes(replies)):
            remember_counted_size(r, n)  # the simulated clock's upload needs it again
            with self._lock:
                pushed = self._pushed_at.pop(r.metadata.reply_to_message_id, sent_at)
                t = self._group(r)
                metrics = r.content[keys.METRICS] if not r.has_error() and keys.METRICS in r.content else {}
                if keys.DROPPED_OUT not in metrics:  # a simulated dropout never answers: no bytes, no reply
                    t.bytes_up += n
                    t.replies += 1
                if r.has_error():
                    t.failures += 1
                    t.errors.append(f"node {r.metadata.src_node_id}: {r.error.reason}")
                    detail = config_error_detail(r.error.reason)
                    if detail is not None:
                        config_errors.append(f"a client (node {r.metadata.src_node_id}) reports: {detail}")
                    out.append(r)
                    continue
                # fededge's own metrics, where a reply holds them as numbers (a ClientApp of
                # one's own may send anything under these names: a list stopped the run here)
                pid, num_partitions, compute_s, steps = (
                    _number(metrics, k) for k in (keys.REPLY_PARTITION_ID, keys.REPLY_NUM_PARTITIONS,
                                                  keys.COMPUTE_S, keys.LOCAL_STEPS_DONE))
                if pid is not None:
                    self.partition_of[r.metadata.src_node_id] = int(pid)
                if keys.DROPPED_OUT in metrics:
                    t.dropped.append(r.metadata.src_node_id)
                    out.append(Message(error=Error(0, dropout_reason(
                        -1 if pid is None else int(pid), 0 if num_partitions is None else int(num_partitions))),
                        metadata=copy.copy(r.metadata)))
                    continue
                out.append(r)
                per_node = _per_node(t, r.metadata.message_type)
                if per_node is None:
                    continue
                train = per_node is t.nodes
                node = per_node.setdefault(r.metadata.src_node_id, NodeTraffic())
                node.bytes_up += n
                node.replied = True
                node.wall_s += 0.0 if pushed is None else now - pushed
                if train:
                    t.train_replies += 1
                if compute_s is not None:
                    if train:
                        t.compute_s.append(compute_s)
                    node.compute_s += compute_s
                    node.reported_compute = True
                if train and steps is not None:
                    node.steps = (node.steps or 0) + int(steps)
                if pid is not None:
                    node.partition_id = int(pid)
                if num_partitions is not None:
                    node.num_partitions = int(num_partitions)
        if self.screen is not None:
            out = self._screened(out)
        if config_errors:
            more = len(config_errors) - 1
            raise ConfigError(config_errors[0] + (f" ({more} more of the {len(replies)} replies "
                                                  "reported a configuration error)" if more else ""))
        return out

    def screen_for(self, strategy: Any) -> None:
        """Screen the replies of ``strategy`` (on Flower's round loop) where it aggregates
        by Flower's FedAvg rules (:func:`fededge.strategies._replies.screen_for`)."""
        self.screen = screen_for(strategy)

    def _screened(self, replies: list[Message]) -> list[Message]:
        """``replies`` with those :func:`~fededge.strategies._replies.screen_replies` refuses
        turned into error replies, counted and logged (see :attr:`screen`)."""
        assert self.screen is not None
        weight_key, decodes, metric_kinds = self.screen
        out = list(replies)
        for kind in ("train", "evaluate"):
            at = [i for i, r in enumerate(out) if r.metadata.message_type.startswith(kind)]
            if not at:
                continue
            batch = [out[i] for i in at]
            with self._lock:
                sent = {(r.metadata.group_id, r.metadata.src_node_id): self._shapes.pop(
                    (r.metadata.group_id, r.metadata.src_node_id), None) for r in batch} if kind == "train" else {}
            why = screen_replies(batch, weight_key=weight_key, train=kind == "train",
                                 shapes=lambda r: sent.get((r.metadata.group_id, r.metadata.src_node_id)),
                                 compressed_decoded=decodes, metric_kinds=metric_kinds)
            for i, r, problem in zip(at, batch, why):
                if problem is None:
                    continue
                reason = f"node {r.metadata.src_node_id}'s {kind} reply was rejected and left out: {problem}"
                log.debug("%s", reason)  # reported once, with the round (the experiment)
                with self._lock:
                    t = self._group(r)
                    t.rejected += kind == "train"
                    t.reasons.append(reason)
                out[i] = Message(error=Error(0, f"rejected: {problem}"), metadata=copy.copy(r.metadata))
        return out

    # -- Grid ----------------------------------------------------------------------
    def set_run(self, run) -> None:  # noqa: ANN001 - flwr's Run
        self.inner.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001,ANN201
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self):  # noqa: ANN201
        return self.inner.get_nodes()

    def _counts_after(self) -> bool:
        """Whether the inner grid notes the sizes of what it serialises (the in-process
        grid): then messages are counted after it pushed them, from its notes. Any other
        grid is counted before, as it may hand the messages to threads of its own (Flower's
        simulation) that must not see them serialised meanwhile."""
        return bool(getattr(self.inner, "notes_wire_sizes", False))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        after = self._counts_after()
        if not after:
            self._count_down(messages)
        ids = list(self.inner.push_messages(messages))
        now = time.monotonic()
        if after:
            self._count_down(messages)
        with self._lock:
            self._pushed_at.update((mid, now) for mid in ids)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._count_up(list(self.inner.pull_messages(message_ids)))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        after = self._counts_after()
        if not after:
            self._count_down(messages)
        sent_at = time.monotonic()
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        received_at = time.monotonic()
        if after:
            self._count_down(messages)
        replies = self._count_up(replies, sent_at, received_at)
        answered = {r.metadata.src_node_id for r in replies}
        with self._lock:  # no reply at all within the timeout: the node dropped out
            for m in messages:
                if m.metadata.dst_node_id not in answered:
                    self._group(m).dropped.append(m.metadata.dst_node_id)
        return replies


def _number(metrics: Any, key: str) -> float | None:
    """``metrics[key]`` where it is a finite number, else None (absent or not a number)."""
    v = metrics.get(key) if hasattr(metrics, "get") else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)
