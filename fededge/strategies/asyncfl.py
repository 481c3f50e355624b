"""Asynchronous and straggler-tolerant strategies on Flower's Grid: FedAsync, FedBuff,
bounded staleness (SSP) and backup workers.

The rules are :mod:`fededge.algorithms.asyncfl` (pure); this module moves messages.

**Events, not rounds.** :class:`AsyncFL` keeps every participant busy (or
``concurrency`` of them): each gets the current model, trains, replies; its update is
used when it *arrives* and the client is sent the model then current. Which update
arrives first depends on the clients' speeds and links, so the loop orders arrivals in
one of two ways:

- ``order="clock"`` (simulation: fededge's in-process runtime and Flower's Ray
  simulation): by **simulated** arrival time. A reply's arrival is computed from the
  time its message left the server, the client's link profile and speed factor
  (``netem``, ``compute-speed``) and what it measured or reported (bytes both ways, the
  local steps it ran, its compute time or ``sim-step-s`` per step). An arrival at time
  ``T`` is used only once no message still running left the server before ``T``, so the
  order is exactly that of the simulated clock, whatever order the runtime finished the
  work in, and a seed makes the run deterministic (with ``sim-step-s``, which replaces
  the measured compute time). At most one message per node is in flight, which is what
  Flower's Ray simulation needs.
- ``order="arrival"`` (a real SuperLink deployment): replies are used in the order they
  really arrive; the asynchrony is real. The simulated clock still stamps each version
  (``sim_s``), in that order.

``order="auto"`` picks ``arrival`` on a SuperLink and ``clock`` elsewhere.

Every new server model is a *version*; the experiment records one line of
``metrics.jsonl`` per version (FedAsync and SSP: one per update; FedBuff: one per
buffer). ``num-rounds`` counts versions.

**Dropouts.** A message with no usable reply within ``round-timeout`` (a simulated
dropout, an error, or no reply at all) is written off at ``departure + round-timeout``
on the clock (an unusable update: at its arrival); the client is asked again with the
current model then, and SSP stops waiting for it until it answers again. Nothing
stalls. If more than three messages per participant in a row are written off, nobody
is answering and the run stops with an error that says so.

:class:`BackupWorkers` is synchronous: each round samples ``m + e`` clients like FedAvg
and aggregates the first ``m`` replies (by simulated arrival, or real arrival on a
SuperLink); with ``e = 0`` it is FedAvg bit for bit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fededge import keys
from fededge._flwr_internals import runs_messages_in_order, wire_size
from fededge.algorithms.asyncfl import (
    AsyncConfig, AsyncScheduler, AsyncServer, Dispatch, Event, EventQueue, first_arrivals,
)
from fededge.netem.clock import SimClock, clock_compute_s
from fededge.strategies._replies import (
    dropout_partition, fixed_participants, is_dropout, usable_reply,
)

__all__ = ["ASYNC_ORDERS", "AsyncFL", "AsyncRoundInfo", "BackupWorkers", "Puller", "ReplyTiming"]

log = logging.getLogger("fededge")

ASYNC_ORDERS = ("auto", "clock", "arrival")


@dataclass
class AsyncRoundInfo:
    """What one server version (or backup-workers round) was made of, for metrics.jsonl."""

    version: int
    sim_s: float  # when it was made, on the simulated clock (absolute)
    staleness: list[int] = field(default_factory=list)  # tau (versions) of each update in it
    contributors: list[int] = field(default_factory=list)  # partition ids (node ids if unknown)
    late: list[int] = field(default_factory=list)  # backup workers: replies not waited for
    dropped: list[int] = field(default_factory=list)  # written off since the previous version
    groups: list[str] = field(default_factory=list)  # message group ids used (metering)
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)
    ahead: int | None = None  # SSP: fastest minus slowest active client's round
    order: str = "clock"


class ReplyTiming:
    """Puts one node's message on the simulated clock, once its reply is in.

    The clock comes from the experiment (:meth:`attach`: a factory taking the number of
    partitions, so that the links are those of ``netem`` / ``compute-speed``); without
    one the network is ideal and compute is as measured. Nodes are known by the
    partition id their replies carry.
    """

    def __init__(self) -> None:
        self.factory: Callable[[int], SimClock] | None = None
        self.sim_step_s = 0.0
        self.clock: SimClock | None = None
        self.partition: dict[int, int] = {}

    def attach(self, factory: Callable[[int], SimClock] | None, *, sim_step_s: float = 0.0) -> None:
        self.factory = factory
        self.sim_step_s = sim_step_s

    def learn(self, reply: Message) -> int | None:
        node = reply.metadata.src_node_id
        if reply.has_error():
            pid = dropout_partition(reply)
            if pid is not None:
                self.partition[node] = pid[0]
            return self.partition.get(node)
        metrics = next(iter(reply.content.metric_records.values()), {})
        if keys.REPLY_PARTITION_ID in metrics:
            pid = int(metrics[keys.REPLY_PARTITION_ID])
            self.partition[node] = pid
            n = int(metrics.get(keys.REPLY_NUM_PARTITIONS, pid + 1))
            if self.clock is None and self.factory is not None:
                self.clock = self.factory(max(n, pid + 1))
        return self.partition.get(node)

    def name(self, node: int) -> int:
        """The partition id of ``node`` where known (what users assign), else its node id."""
        return self.partition.get(node, node)

    def compute_s(self, reply: Message) -> float:
        metrics = next(iter(reply.content.metric_records.values()), {})
        measured = float(metrics.get(keys.COMPUTE_S, 0.0))
        if keys.LOCAL_STEPS_DONE not in metrics:  # no step count: the measured compute
            return measured
        return clock_compute_s(measured, int(metrics[keys.LOCAL_STEPS_DONE]), self.sim_step_s)

    def arrival(self, node: int, sent_at: float, bytes_down: int, reply: Message) -> float:
        """When ``reply`` reached the server: download, compute, upload on the node's link."""
        pid = self.partition.get(node)
        compute = 0.0 if reply.has_error() else self.compute_s(reply)
        if self.clock is None or pid is None or pid >= len(self.clock.clients):
            return sent_at + compute
        down = self.clock.send_down(pid, bytes_down, sent_at)
        done = self.clock.compute(pid, compute, down)
        return self.clock.send_up(pid, wire_size(reply), done)


def _on_superlink(grid: Grid) -> bool:
    inner = grid
    while hasattr(inner, "inner"):
        inner = inner.inner
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
    except ImportError:  # pragma: no cover - a changed Flower
        return False
    return isinstance(inner, HttpGrid)


def _order(requested: str, grid: Grid) -> str:
    if requested not in ASYNC_ORDERS:
        raise ValueError(f"async-order must be one of {', '.join(ASYNC_ORDERS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "arrival" if _on_superlink(grid) else "clock"


class Puller:
    """Pulls replies without one slow upload holding up the others.

    On a SuperLink, Flower's ``HttpGrid.pull_messages`` returns a reply as soon as its
    message is registered and then waits (retrying, up to two hours) until all of its
    objects have been uploaded: a client on a slow uplink would hold every other
    reply pulled in the same call, and the whole loop, until its upload is done. That
    is head-of-line blocking, the opposite of asynchrony (seen in the deployment test:
    a fast node's reply waited behind a 20 s upload). So on a SuperLink each message is
    pulled on its own, in a daemon thread (one per message still out, so that a
    ServerApp never waits at exit for an upload nobody needs), and :meth:`poll`
    returns whatever has fully arrived. Other grids (in-process, Ray) deliver a reply
    whole and are pulled directly.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.threaded = _on_superlink(grid)
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._done: dict[str, list[Message]] = {}
        self._errors: list[BaseException] = []

    def _pull(self, mid: str) -> None:
        try:
            got = list(self.grid.pull_messages([mid]))
        except BaseException as err:  # noqa: BLE001 - re-raised in poll()
            with self._lock:
                self._errors.append(err)
                self._running.discard(mid)
            return
        with self._lock:
            self._running.discard(mid)
            self._done[mid] = got

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        ids = list(message_ids)
        if not self.threaded:
            return list(self.grid.pull_messages(ids)) if ids else []
        out: list[Message] = []
        with self._lock:
            if self._errors:
                raise self._errors[0]
            for mid in ids:
                if mid in self._done:
                    out.extend(self._done.pop(mid))  # [] while no reply: asked again
                elif mid not in self._running:
                    self._running.add(mid)
                    threading.Thread(target=self._pull, args=(mid,), daemon=True,
                                     name=f"fededge-pull-{mid[:8]}").start()
        return out

    def forget(self, message_id: str) -> None:
        """Stop waiting for a message (written off); a pull in progress ends alone."""
        with self._lock:
            self._done.pop(message_id, None)


class _Loop(FedAvg):
    """What :class:`AsyncFL` and :class:`BackupWorkers` share: the clock, the infos."""

    def __init__(self, *, order: str = "auto", poll_s: float = 0.5, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        if order not in ASYNC_ORDERS:
            raise ValueError(f"async-order must be one of {', '.join(ASYNC_ORDERS)}, got {order!r}")
        self.order = order
        self.poll_s = poll_s
        self.timing = ReplyTiming()
        self._info: dict[int, AsyncRoundInfo] = {}
        self.participants: list[int] = []

    def attach_clock(self, factory: Callable[[int], SimClock] | None, *, sim_step_s: float = 0.0) -> None:
        """Order and stamp replies on this clock (the experiment's; see ReplyTiming)."""
        self.timing.attach(factory, sim_step_s=sim_step_s)

    def take_round_info(self, rnd: int) -> AsyncRoundInfo | None:
        return self._info.pop(rnd, None)

    def _why_unusable(self, reply: Message) -> str | None:
        if reply.has_error():
            return reply.error.reason
        return usable_reply(reply, arrays_key=self.arrayrecord_key, model_keys=self._keys,
                            weight_key=self.weighted_by_key)

    def _weight(self, reply: Message) -> float:
        return float(next(iter(reply.content.metric_records.values()))[self.weighted_by_key])

    def _evaluate(self, v: int, arrays: ArrayRecord, evaluate_fn: Callable | None) -> None:
        if evaluate_fn:
            res = evaluate_fn(v, arrays)
            if res is not None:
                self._result.evaluate_metrics_serverapp[v] = res

    # Flower's per-round hooks are not how these run: start() drives them.
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []


class AsyncFL(_Loop):
    """FedAsync, FedBuff or bounded-staleness (SSP) aggregation, event by event.

    Parameters
    ----------
    config : AsyncConfig
        The mode and its knobs (:class:`fededge.algorithms.asyncfl.AsyncConfig`).
    order : str
        ``auto``, ``clock`` or ``arrival`` (see the module docstring).
    seed : int
        Seeds the choice of idle clients when ``concurrency`` is below the participants.
    poll_s : float
        How often to pull replies from a real SuperLink when none is ready.
    **fedavg
        Flower's FedAvg arguments (sampling of the participants, record keys, weights).

    Example
    -------
    ``flwr run . --run-config 'strategy="fedbuff" buffer-size=5 staleness="polynomial"'``
    """

    def __init__(self, *, config: AsyncConfig, order: str = "auto", seed: int = 0, poll_s: float = 0.5,
                 **fedavg: Any) -> None:
        super().__init__(order=order, poll_s=poll_s, **fedavg)
        self.config = config
        self.seed = seed

    def summary(self) -> None:
        log.info("%s: %s", self.config.mode, self.config)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        order = _order(self.order, grid)
        if order == "arrival" and runs_messages_in_order(grid) is False:
            log.info("%s: replies used in real arrival order on a grid that may run two messages "
                     "of one node at once; this loop keeps one message per node", self.config.mode)
        train_config = ConfigRecord() if train_config is None else train_config
        self._result = Result()
        self._keys = set(initial_arrays.keys())
        self._evaluate(0, initial_arrays, evaluate_fn)
        self.participants = fixed_participants(
            grid, fraction=self.fraction_train, min_nodes=self.min_train_nodes,
            min_available=self.min_available_nodes)
        server = AsyncServer(self.config, initial_arrays.to_torch_state_dict(),
                             num_clients=len(self.participants))
        sched = AsyncScheduler(self.participants, concurrency=self.config.concurrency,
                               ssp_bound=self.config.ssp_bound if self.config.mode == "ssp" else None,
                               seed=self.seed)
        log.info("%s: %d participants, %d training at once, replies used in %s order%s",
                 self.config.mode, len(self.participants), sched.concurrency,
                 "simulated-clock" if order == "clock" else "real arrival",
                 f", SSP bound {self.config.ssp_bound}" if self.config.mode == "ssp" else "")
        arrays = {0: initial_arrays}  # versions being sent
        queue = EventQueue()
        inflight: dict[str, tuple[Dispatch, float, int]] = {}  # msg id -> (dispatch, real t0, bytes down)
        pending = AsyncRoundInfo(version=1, sim_s=0.0, order=order)
        now = 0.0
        streak = {"n": 0}  # messages written off since an update was last used

        def dispatch() -> None:
            starts = sched.startable()
            if not starts:
                return
            v = server.version
            if v not in arrays:
                arrays[v] = ArrayRecord({k: t for k, t in server.model.items()})
            msgs, ds = [], []
            for node in starts:
                d = sched.start(node, version=v, at=now)
                config = ConfigRecord(dict(train_config))
                config[keys.SERVER_ROUND] = v + 1
                msgs.append(Message(RecordDict({self.arrayrecord_key: arrays[v], self.configrecord_key: config}),
                                    dst_node_id=node, message_type=MessageType.TRAIN, group_id=f"a{d.seq}"))
                ds.append(d)
            cache: dict[str, int] = {}
            sizes = [wire_size(m, cache) for m in msgs]
            t0 = time.monotonic()
            for mid, d, size in zip(grid.push_messages(msgs), ds, sizes):
                inflight[mid] = (d, t0, size)

        def use(ev: Event) -> None:
            nonlocal pending, now
            now = max(now, ev.time)
            d = sched.running[ev.client]
            pending.groups.append(f"a{d.seq}")
            reply: Message | None = ev.payload
            why = "no reply within round-timeout" if reply is None else self._why_unusable(reply)
            if why is not None:
                sched.write_off(ev.client)
                streak["n"] += 1
                if streak["n"] > 3 * len(self.participants):
                    raise RuntimeError(
                        f"{self.config.mode}: {streak['n']} messages in a row got no usable reply "
                        f"(last: node {ev.client}: {why}); no client is answering. Check the "
                        "SuperNodes' logs, the dropout fraction and round-timeout")
                pending.dropped.append(self.timing.name(ev.client))
                if reply is not None and not reply.has_error():
                    pending.rejected += 1
                    pending.reasons.append(f"node {ev.client}: {why}")
                # An error or a rejected reply is reported once by the caller (the grid's
                # metering, take_round_info().reasons); only a missing reply is logged here.
                if reply is None:
                    log.warning("%s: node %d written off at sim %.1f s: %s", self.config.mode, ev.client,
                                ev.time, why)
                elif not is_dropout(reply):
                    log.debug("%s: node %d written off at sim %.1f s: %s", self.config.mode, ev.client,
                              ev.time, why)
                return
            sched.finish(ev.client)
            streak["n"] = 0
            pending.contributors.append(self.timing.name(ev.client))
            pending.staleness.append(server.version - d.version)
            new = server.receive(reply.content[self.arrayrecord_key].to_torch_state_dict(),
                                 base_version=d.version, num_examples=self._weight(reply))
            if not new:
                return
            v = server.version
            pending.version, pending.sim_s = v, now
            pending.ahead = sched.ahead() if self.config.mode == "ssp" else None
            self._info[v] = pending
            pending = AsyncRoundInfo(version=v + 1, sim_s=now, order=order)
            self._result.arrays = ArrayRecord({k: t for k, t in server.model.items()})
            arrays.clear()
            arrays[v] = self._result.arrays
            # A reply waiting in the queue still counts as running until it is used.
            server.keep({x.version for x in sched.running.values()})
            self._evaluate(v, self._result.arrays, evaluate_fn)

        puller = Puller(grid)
        dispatch()
        while server.version < num_rounds:
            pulled = puller.poll(list(inflight)) if inflight else []
            for reply in pulled:
                mid = reply.metadata.reply_to_message_id
                if mid not in inflight:
                    continue  # written off already: its late reply is not used
                d, _, size = inflight.pop(mid)
                self.timing.learn(reply)
                if reply.has_error():
                    # A dropout: the server learns only when its timeout expires. An
                    # error is retried no sooner either, or a client that always fails
                    # would be asked again and again at the same simulated instant.
                    t = d.at + timeout
                else:
                    t = self.timing.arrival(d.client, d.at, size, reply)
                queue.push(Event(t, d.seq, d.client, payload=reply))
            clock_now = time.monotonic()
            for mid, (d, t0, _) in list(inflight.items()):
                if clock_now - t0 >= timeout:
                    del inflight[mid]
                    puller.forget(mid)
                    queue.push(Event(d.at + timeout, d.seq, d.client, dropped=True))
            # Clock order: an arrival at T is safe once no message still out left before T.
            bound = min((d.at for d, _, _ in inflight.values()), default=math.inf) \
                if order == "clock" else math.inf
            used = False
            while len(queue) and queue.peek().time <= bound and server.version < num_rounds:
                ev = queue.pop()
                use(ev)
                used = True
                nxt = queue.peek()
                if nxt is None or nxt.time > now:
                    break  # use every arrival at the same instant before sending again
            if used:
                dispatch()
                continue
            if not inflight and not len(queue):
                dispatch()
                if not inflight:
                    raise RuntimeError(f"{self.config.mode}: no client may start and none is running "
                                       f"(scheduler state: done={sched.done}, lagging={sched.lagging})")
                continue
            if not pulled:
                time.sleep(self.poll_s)
        return self._result


class BackupWorkers(_Loop):
    """Synchronous rounds that aggregate the first ``m`` of ``m + e`` replies.

    Each round samples clients exactly as FedAvg does (``clients-per-round``: the
    ``m + e``) and aggregates, with FedAvg's own aggregation, the ``m`` replies that
    arrive first: first on the simulated clock in simulation, first in real time on a
    SuperLink (where the round then stops waiting). The replies not waited for are
    recorded as ``late`` in metrics.jsonl, so that the bias toward fast clients shows in
    the per-client contribution counts (Chen et al., 2016). ``backup = 0`` is FedAvg,
    bit for bit.

    Parameters
    ----------
    backup : int or float
        ``e``: a count, or a fraction of the sampled clients (``0.1``: 10%, rounded).
    order : str
        ``auto``, ``clock`` or ``arrival``.
    """

    def __init__(self, *, backup: int | float = 0, order: str = "auto", poll_s: float = 0.5,
                 **fedavg: Any) -> None:
        super().__init__(order=order, poll_s=poll_s, **fedavg)
        if isinstance(backup, bool) or not isinstance(backup, (int, float)) or backup < 0:
            raise ValueError(f"backup-workers must be a count >= 0 or a fraction in [0, 1), got {backup!r}")
        if isinstance(backup, float) and backup >= 1:
            raise ValueError(f"backup-workers as a fraction must be < 1, got {backup}")
        self.backup = backup
        self.contributions: dict[int, int] = {}

    def backups_for(self, sampled: int) -> int:
        """e for a round of ``sampled`` clients (at least one is always aggregated)."""
        e = round(self.backup * sampled) if isinstance(self.backup, float) else int(self.backup)
        return min(e, sampled - 1)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        order = _order(self.order, grid)
        train_config = ConfigRecord() if train_config is None else train_config
        self._result = Result()
        self._keys = set(initial_arrays.keys())
        self._evaluate(0, initial_arrays, evaluate_fn)
        arrays, now = initial_arrays, 0.0
        for rnd in range(1, num_rounds + 1):
            msgs = list(self.configure_train(rnd, arrays, train_config, grid))
            for m in msgs:
                m.metadata.group_id = str(rnd)
            cache: dict[str, int] = {}
            sizes = [wire_size(m, cache) for m in msgs]
            m_needed = len(msgs) - self.backups_for(len(msgs))
            ids = list(grid.push_messages(msgs))
            node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs)}
            size_of = dict(zip(ids, sizes))
            replies = self._collect(grid, ids, m_needed, timeout, order)
            info = AsyncRoundInfo(version=rnd, sim_s=now, order=order, groups=[str(rnd)])
            arrival: dict[str, float] = {}
            for mid, r in replies.items():
                self.timing.learn(r)
                why = self._why_unusable(r)
                if why is None:
                    arrival[mid] = self.timing.arrival(node_of[mid], now, size_of[mid], r)
                    continue
                info.dropped.append(self.timing.name(node_of[mid]))
                if not r.has_error():
                    info.rejected += 1
                    info.reasons.append(f"node {node_of[mid]}: {why}")
            first = set(first_arrivals(arrival, m_needed)) if arrival else set()
            # Keep FedAvg's reply order (the order of the sampled messages): bit for bit.
            chosen = [replies[mid] for mid in ids if mid in first]
            # No reply: a dropout, unless the round had its m and stopped waiting for it.
            stopped_early = order == "arrival" and len(first) >= m_needed
            missing = [self.timing.name(node_of[mid]) for mid in ids if mid not in replies]
            info.late = [self.timing.name(node_of[mid]) for mid in ids if mid in arrival and mid not in first]
            if stopped_early:
                info.late += missing
            else:
                info.dropped += missing
            info.contributors = [self.timing.name(node_of[mid]) for mid in ids if mid in first]
            for c in info.contributors:
                self.contributions[c] = self.contributions.get(c, 0) + 1
            if len(first) >= m_needed:
                end = max(arrival[mid] for mid in first)
            else:  # fewer than m answered: the round waited for its timeout
                end = max([now + timeout] + [arrival[mid] for mid in first])
            now = info.sim_s = end
            info.staleness = [0] * len(chosen)
            new_arrays, metrics = self.aggregate_train(rnd, chosen) if chosen else (None, None)
            if new_arrays is not None:
                arrays = new_arrays
                self._result.arrays = arrays
                if metrics is not None:
                    self._result.train_metrics_clientapp[rnd] = metrics
            self._info[rnd] = info
            self._evaluate(rnd, arrays, evaluate_fn)
        if self._result.arrays is None:
            self._result.arrays = arrays
        return self._result

    def _collect(self, grid: Grid, ids: list[str], m_needed: int, timeout: float, order: str) -> dict[str, Message]:
        """The round's replies: all of them (clock order; the first m are picked on the
        clock), or the first ``m`` usable ones in real time (arrival order)."""
        got: dict[str, Message] = {}
        t0 = time.monotonic()
        puller = Puller(grid)
        while True:
            left = [mid for mid in ids if mid not in got]
            if left:
                for r in puller.poll(left):
                    got[r.metadata.reply_to_message_id] = r
            usable = sum(1 for r in got.values() if not r.has_error())
            if len(got) == len(ids) or (order == "arrival" and usable >= m_needed):
                return got
            if time.monotonic() - t0 >= timeout:
                return got
            time.sleep(self.poll_s)
