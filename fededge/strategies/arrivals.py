"""When a reply comes in: its place on the simulated clock, pulling it, the order rule.

Shared by the strategies that use replies as they arrive rather than round by round
(:mod:`fededge.strategies.asyncloop`: FedAsync, FedBuff, SSP; :mod:`fededge.strategies.
backup`: BackupWorkers). :class:`ReplyTiming` puts a node's message on the experiment's
simulated clock once its reply is in; :class:`Puller` pulls replies without one slow
upload holding up the others; :func:`resolve_order` picks simulated-clock or real
arrival order for a grid.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import counted_wire_size, is_deployment
from fededge.algorithms.asyncfl import LoopConfig
from fededge.netem.clock import SimClock
from fededge.netem.runclock import RunClock
from fededge.strategies._replies import dropout_partition, reply_metrics, reported_partition
from fededge.strategies.resume import ResumeError

__all__ = ["Puller", "ReplyTiming", "resolve_order"]


class ReplyTiming:
    """Puts one node's message on the simulated clock, once its reply is in.

    The clock comes from the experiment (:meth:`attach`); without one the network is
    ideal and compute is as reported (or measured). A node is named by the partition id
    its replies report, else by its node id; it is placed on a link by
    :meth:`RunClock.place <fededge.netem.runclock.RunClock.place>`.
    """

    def __init__(self) -> None:
        self.source: RunClock | None = None
        self._rules = RunClock()  # the compute rule when no clock is attached
        self.clock: SimClock | None = None
        self.partition: dict[int, int] = {}  # reported
        self.placed: dict[int, int] = {}  # reported, or by node id (a ClientApp that reports none)
        self._clock_clients: int | None = None  # loaded: the clock to time on again (resume_clock)
        self.step_s = 0.0  # > 0: seconds per reported local step where the clock would measure

    def compute_rule(self, step_s: float) -> tuple[str, bool]:
        """Charge ``step_s`` seconds per reported local step where the attached clock
        would take the measured compute time (``sim_step_s`` 0, no fixed ``compute_s``).
        Returns the rule in words, for the log, and whether it is the measured time (the
        wall clock), which the log warns of."""
        source = self.source or self._rules
        if source.sim_step_s > 0 or source.default_compute_s is not None:
            self.step_s = 0.0
            return ("compute as the clock's own rule says (sim-step-s / compute-s): the order is "
                    "deterministic"), False
        self.step_s = step_s
        if step_s > 0:
            return (f"compute charged {step_s:g} s per reported local step (async-step-s): the order is "
                    "deterministic for a config and seed; a reply reporting no steps is charged its "
                    "measured time"), False
        return ("compute as measured on the wall clock (async-step-s=0): the order follows this machine's "
                "speed and load, and two runs of one config may differ"), True

    def attach(self, source: RunClock | None) -> None:
        self.source = source

    def learn(self, reply: Message) -> int | None:
        node = reply.metadata.src_node_id
        if reply.has_error():
            pid = dropout_partition(reply)
            if pid is not None:
                self.partition[node] = self.placed[node] = pid[0]
            return self.partition.get(node)
        metrics = reply_metrics(reply)
        reported = reported_partition(reply)
        if reported is not None:
            self.partition[node] = reported
        if self.source is not None:
            pid = self.source.place(node, reported)
            if pid is not None:
                self.placed[node] = pid
                num = metrics.get(keys.REPLY_NUM_PARTITIONS, pid + 1 if reported is not None else None)
                if self.clock is None:
                    self.clock = self.source.build(max(self.source.num_clients(num), pid + 1))
        return self.partition.get(node)

    def name(self, node: int) -> int:
        """The partition id of ``node`` where known (what users assign), else its node id."""
        return self.partition.get(node, node)

    def state_dict(self) -> dict[str, Any]:
        """Who is placed where (plain values); of the clock only whether it was built: the
        clock itself is the experiment's to save."""
        return {"partition": dict(self.partition), "placed": dict(self.placed),
                "clock_clients": None if self.clock is None else len(self.clock.clients)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; :meth:`resume_clock` then finds the clock."""
        self.partition = {int(k): int(v) for k, v in state["partition"].items()}
        self.placed = {int(k): int(v) for k, v in state["placed"].items()}
        self.clock = None
        self._clock_clients = state["clock_clients"]

    def resume_clock(self) -> None:
        """After :meth:`load_state_dict`: time replies on the attached clock again, the
        one the experiment restored (:meth:`RunClock.build
        <fededge.netem.runclock.RunClock.build>` returns it)."""
        n, self._clock_clients = self._clock_clients, None
        if n is None or self.clock is not None:
            return
        if self.source is None or self.source.clock is None:
            raise ResumeError("the checkpoint's replies were timed on a simulated clock, but the clock attached "
                              "has none: load the clock's state (RunClock.load_state_dict) and attach it "
                              "(attach_clock) before start")
        self.clock = self.source.build(int(n))
        if len(self.clock.clients) != int(n):
            raise ResumeError(f"the checkpoint's clock has {n} clients, the restored one "
                              f"{len(self.clock.clients)}")

    def compute_s(self, reply: Message, measured_s: float | None = None) -> float:
        metrics = reply_metrics(reply)
        reported = float(metrics[keys.COMPUTE_S]) if keys.COMPUTE_S in metrics else None
        steps = int(metrics[keys.LOCAL_STEPS_DONE]) if keys.LOCAL_STEPS_DONE in metrics else None
        if self.step_s > 0 and steps is not None:
            return steps * self.step_s
        return (self.source or self._rules).compute_s(reported, steps, measured_s)

    def arrival(self, node: int, sent_at: float, bytes_down: int, reply: Message,
                measured_s: float | None = None) -> float:
        """When ``reply`` reached the server: download, compute, upload on the node's link.
        ``measured_s``: the real seconds from push to pull, for a reply that reports no
        compute time."""
        pid = self.placed.get(node)
        compute = 0.0 if reply.has_error() else self.compute_s(reply, measured_s)
        if self.clock is None or pid is None or pid >= len(self.clock.clients):
            return sent_at + compute
        # a device that pulls (a SuperNode, nodes-pull) takes it at its next ask, as in FedAvg's round
        down = self.clock.send_down(pid, bytes_down, self.clock.receive(pid, sent_at))
        done = self.clock.compute(pid, compute, down)
        return self.clock.send_up(pid, counted_wire_size(reply), done)  # as the meter counted it: not again


def resolve_order(requested: str, grid: Grid) -> str:
    """``clock`` or ``arrival`` for ``requested`` (``auto``: arrival on a SuperLink)."""
    LoopConfig(order=requested)  # checks the name
    if requested != "auto":
        return requested
    return "arrival" if is_deployment(grid) else "clock"


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
        self.threaded = is_deployment(grid)
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
