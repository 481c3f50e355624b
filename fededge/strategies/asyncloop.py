"""What fededge's asynchronous and straggler-tolerant strategies share: the event loop.

The strategies themselves are one file each, as Flower's are: :class:`~fededge.
strategies.fedasync.FedAsync`, :class:`~fededge.strategies.fedbuff.FedBuff`,
:class:`~fededge.strategies.ssp.SSP` (all three this module's :class:`AsyncFL` with
their own knobs) and :class:`~fededge.strategies.backup.BackupWorkers`. The rules are
:mod:`fededge.algorithms.asyncfl` (pure); this module moves messages.

They work with any ClientApp that answers Flower's standard train messages: the reply
holds the trained model in ``arrays`` and a ``MetricRecord`` with ``num-examples``
(Flower's FedAvg defaults; the record keys are FedAvg's arguments). A ClientApp that also
reports ``compute-s``, ``local-steps-done`` and ``partition-id`` (fededge's does) is
placed and timed exactly on the simulated clock; others are placed by node id and timed
as :class:`fededge.netem.runclock.RunClock` describes.

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

``order="auto"`` picks ``arrival`` on a SuperLink and ``clock`` elsewhere. Without a
clock attached (:meth:`AsyncLoop.attach_clock`; :class:`fededge.server.experiment.
Experiment` attaches its own) the network is ideal and compute is as reported.

Every new server model is a *version*; the experiment records one line of
``metrics.jsonl`` per version (FedAsync and SSP: one per update; FedBuff: one per
buffer). ``num_rounds`` counts versions.

**Dropouts.** A message with no usable reply within ``timeout`` (a simulated dropout,
an error, or no reply at all) is written off at ``departure + timeout`` on the clock (an
unusable update: at its arrival); the client is asked again with the current model
then, and SSP stops waiting for it until it answers again. Nothing stalls. If more than
three messages per participant in a row are written off, nobody is answering and the
run stops with an error that says so.

**Checkpoints** (:mod:`fededge.strategies.resume`). After version ``v`` is made and
evaluated, a due checkpoint first pulls every reply still out onto the event queue,
unused (under clock order they are used in simulated-arrival order whenever they were
pulled, so nothing changes; under arrival order the checkpoint is a point where the loop
waits), then saves: the server, the scheduler with its generator, the queued replies,
the version being assembled and the simulated time. The other arrivals at ``v``'s
instant are then used before the clients are sent the model again, in the resumed run
too. A resumed run continues with version ``v + 1`` on the same participants.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import runs_messages_in_order, wire_sizes
from fededge.algorithms.asyncfl import (
    ASYNC_ORDERS, AsyncConfig, AsyncScheduler, AsyncServer, Dispatch, Event, EventQueue, LoopConfig,
)
from fededge.netem.runclock import RunClock
from fededge.strategies._replies import fixed_participants, is_dropout, reply_metrics, usable_reply
from fededge.strategies.arrivals import Puller, ReplyTiming, resolve_order
from fededge.strategies.ownloop import OwnLoop
from fededge.strategies.report import RoundReport
from fededge.strategies.resume import check_nodes, message_from_state, message_to_state

# Puller, ReplyTiming and resolve_order live in fededge.strategies.arrivals; named here for existing imports.
__all__ = ["ASYNC_ORDERS", "AsyncFL", "AsyncLoop", "AsyncRoundInfo", "Puller", "ReplyTiming", "resolve_order"]

log = logging.getLogger("fededge")



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


def _counts(c: Counter) -> dict[str, int]:
    return {str(k): v for k, v in sorted(c.items())}


class AsyncLoop(OwnLoop):
    """The base of fededge's asynchronous strategies: the clock, the per-version reports.

    Parameters
    ----------
    order : str
        :attr:`fededge.algorithms.asyncfl.LoopConfig.order`: ``auto``, ``clock`` or
        ``arrival`` (see the module docstring).
    poll_s : float
        How often to pull replies from a real SuperLink when none is ready.
    **fedavg
        Flower's FedAvg arguments: the participants' sampling (``fraction_train``,
        ``min_train_nodes``, ``min_available_nodes``), the record keys
        (``arrayrecord_key``, ``configrecord_key``) and the weight (``weighted_by_key``).
    """

    label = "async loop"
    compressed_form = ("not supported yet: the asynchronous strategies and BackupWorkers use each reply against the "
                       "model version its client trained on, which Compressed does not know; send "
                       "uncompressed updates")

    def __init__(self, *, order: str = LoopConfig.order, step_s: float = LoopConfig.step_s, poll_s: float = 0.5,
                 **fedavg: Any) -> None:
        super().__init__(**fedavg)
        LoopConfig(order=order, step_s=step_s)  # checks them
        self.order = order
        self.step_s = step_s
        self.poll_s = poll_s
        self.timing = ReplyTiming()
        self._info: dict[int, AsyncRoundInfo] = {}
        self._reported_sim_s = 0.0
        self.tally: dict[str, Counter] = {"staleness": Counter(), "contributions": Counter(),
                                          "dropped": Counter(), "late": Counter()}
        self.participants: list[int] = []

    def attach_clock(self, clock: RunClock) -> None:
        """Order and stamp replies on the experiment's clock (see :class:`ReplyTiming`)."""
        super().attach_clock(clock)
        self.timing.attach(clock)

    # -- checkpoints (fededge.strategies.resume) -------------------------------------
    # OwnLoop.attach_checkpoint: when a checkpoint is due after a version (round), the
    # loop first takes in every reply still out (used later, in order, as if it had
    # not been), then calls ``hook.save``.
    def _extra_state(self) -> dict[str, Any]:
        return self._loop_state()

    def _loaded(self, state: dict[str, Any]) -> None:
        self._load_loop_state(state)

    def _loop_state(self) -> dict[str, Any]:
        """What every loop keeps between versions: timing, tallies, reports not yet taken."""
        return {"participants": list(self.participants), "timing": self.timing.state_dict(),
                "tally": {k: dict(c) for k, c in self.tally.items()},
                "reported_sim_s": self._reported_sim_s,
                "info": [asdict(i) for i in self._info.values()]}

    def _load_loop_state(self, state: dict[str, Any]) -> None:
        self.participants = [int(n) for n in state["participants"]]
        self.timing.load_state_dict(state["timing"])
        self.tally = {k: Counter(dict(state["tally"][k])) for k in self.tally}
        self._reported_sim_s = float(state["reported_sim_s"])
        self._info = {int(i["version"]): AsyncRoundInfo(**i) for i in state["info"]}

    def _made(self, info: AsyncRoundInfo) -> None:
        """A version (round) is made: keep what it was made of for its report."""
        self._info[info.version] = info
        self.tally["staleness"].update(info.staleness)
        self.tally["contributions"].update(info.contributors)
        self.tally["dropped"].update(info.dropped)
        self.tally["late"].update(info.late)

    def round_report(self, server_round: int) -> RoundReport:
        """Version ``server_round``: the messages it used, when it was made on the clock,
        its staleness and contributors; the run's tallies (the bias toward fast clients)
        for summary.json."""
        summary = {"staleness_hist": _counts(self.tally["staleness"]),
                   "contributions": _counts(self.tally["contributions"]),
                   "dropped_messages": _counts(self.tally["dropped"]),
                   "late_replies": _counts(self.tally["late"])}
        info = self._info.pop(server_round, None)
        if info is None:  # version 0: nothing sent yet
            return RoundReport(groups=(), sim_s=0.0, num_clients=0, summary=summary)
        sim_s, self._reported_sim_s = info.sim_s - self._reported_sim_s, info.sim_s
        st = info.staleness
        return RoundReport(
            groups=tuple(info.groups), sim_s=sim_s, num_clients=len(info.contributors),
            rejected=info.rejected,
            reasons=[f"a client update was rejected and left out: {r}" for r in info.reasons],
            dropped=list(info.dropped), summary=summary,
            metrics={
                "staleness": sum(st) / len(st) if st else None,
                "staleness_max": max(st, default=None),
                "staleness_hist": _counts(Counter(st)),
                "contributors": sorted(info.contributors),
                "late": sorted(info.late),
                "dropped": sorted(info.dropped),
                "ssp_ahead": info.ahead,
                "async_order": info.order,
            })

    def _why_unusable(self, reply: Message) -> str | None:
        if reply.has_error():
            return reply.error.reason
        return usable_reply(reply, arrays_key=self.arrayrecord_key, model_keys=self._keys,
                            weight_key=self.weighted_by_key)

    def _weight(self, reply: Message) -> float:
        return float(reply_metrics(reply)[self.weighted_by_key])

    # Flower's per-round hooks are not how these run: start() drives them.
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []


class AsyncFL(AsyncLoop):
    """FedAsync, FedBuff or bounded-staleness (SSP) aggregation, event by event.

    :class:`~fededge.strategies.fedasync.FedAsync`, :class:`~fededge.strategies.fedbuff.
    FedBuff` and :class:`~fededge.strategies.ssp.SSP` are this loop with their own
    keyword arguments; use them. This class takes the mode and its knobs as one
    :class:`~fededge.algorithms.asyncfl.AsyncConfig` (fededge's run config builds it).

    Works with any ClientApp that answers FedAvg's train messages (``arrays``, and
    ``num-examples`` in its metrics).

    Parameters
    ----------
    config : AsyncConfig
        The mode and its knobs.
    concurrency : int, optional
        Clients training at once (0: every participant); replaces ``config``'s. Fewer
        than all draws idle clients at random, as FedBuff's paper samples a new client
        each time one finishes.
    seed : int
        Seeds the choice of idle clients when ``concurrency`` is below the participants.
    **loop
        :class:`AsyncLoop`'s arguments (``order``, ``poll_s``) and Flower's FedAvg
        arguments.

    Examples
    --------
    >>> from fededge.algorithms.asyncfl import AsyncConfig
    >>> strategy = AsyncFL(config=AsyncConfig(mode="fedbuff", buffer_size=5), seed=1)
    """

    #: A checkpoint of another mode is refused by name.
    resume_settings = ("config.mode",)

    def __init__(self, *, config: AsyncConfig, concurrency: int | None = None, seed: int = 0,
                 **loop: Any) -> None:
        super().__init__(**loop)
        self.config = config if concurrency is None else replace(config, concurrency=concurrency)
        self.seed = seed
        self._run: _AsyncRun | None = None  # the loop of a start() in progress
        self._order = "clock"

    @property
    def label(self) -> str:  # type: ignore[override]
        return self.config.mode

    def summary(self) -> None:
        log.info("%s: %s", self.config.mode, self.config)

    def _prepare(self, grid: Grid, initial_arrays: ArrayRecord, resume: dict[str, Any] | None) -> None:
        self._order = order = resolve_order(self.order, grid)
        if order == "arrival" and runs_messages_in_order(grid) is False:
            log.info("%s: replies used in real arrival order on a grid that may run two messages "
                     "of one node at once; this loop keeps one message per node", self.config.mode)
        if resume is None:
            self._keys = set(initial_arrays.keys())

    def _fresh(self, grid: Grid, initial_arrays: ArrayRecord) -> None:
        self.participants = fixed_participants(
            grid, fraction=self.fraction_train, min_nodes=self.min_train_nodes,
            min_available=self.min_available_nodes)
        self._run = _AsyncRun(self, self._server(initial_arrays.to_torch_state_dict()), self._scheduler(),
                              self._order)
        self._run.arrays = {0: initial_arrays}

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        """Continue after the checkpoint's version: no evaluation of version 0, the same
        participants."""
        check_nodes(self.participants, grid, f"{self.config.mode} resumed")
        self.timing.resume_clock()
        self._run = _AsyncRun.resumed(self, state["run"], self._order)
        self._keys = set(self._run.server.model)
        return self._run.server.version

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        run = self._run
        assert run is not None
        if self._order == "clock":
            rule, measured = self.timing.compute_rule(self.step_s)
        else:  # real asynchrony: the clock only stamps each version, with the measured compute
            self.timing.compute_rule(0.0)
            rule, measured = "the clock stamps each version with the measured compute", False
        log.log(logging.WARNING if measured else logging.INFO,
                "%s: %d participants, %d training at once, replies used in %s order (%s)%s%s",
                self.config.mode, len(self.participants), run.sched.concurrency,
                "simulated-clock" if self._order == "clock" else "real arrival", rule,
                f", SSP bound {self.config.ssp_bound}" if self.config.mode == "ssp" else "",
                "" if done == 0 else f", resumed after version {done}")
        try:
            run.loop(grid, num_rounds, timeout, self._train_config)
        finally:
            self._run = None

    def _checkpoint(self, t: int) -> None:
        assert self._run is not None
        self._run._checkpoint(t)

    def _server(self, initial: dict[str, Any]) -> AsyncServer:
        return AsyncServer(self.config, initial, num_clients=len(self.participants))

    def _scheduler(self) -> AsyncScheduler:
        return AsyncScheduler(self.participants, concurrency=self.config.concurrency,
                              ssp_bound=self.config.ssp_bound if self.config.mode == "ssp" else None,
                              seed=self.seed)

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of fededge before OwnLoop: its ``mode`` key."""
        return {**state, "settings": {"mode": state["mode"]}, "attrs": {}}

    def _extra_state(self) -> dict[str, Any]:
        """The run at a checkpoint, as plain values (:mod:`fededge.strategies.resume`): the
        server (model versions kept, FedBuff's buffer), the scheduler (messages running,
        its generator), the queue of replies not yet used, the version being assembled,
        the simulated time, who is placed where, the tallies and reports not yet taken.
        Read by ``hook.save`` while the loop stands at a checkpoint."""
        if self._run is None:
            raise RuntimeError(f"{self.config.mode}: state_dict() is read at a checkpoint (hook.save), "
                               "while start() stands between two versions")
        return {**super()._extra_state(), "run": self._run.state_dict()}


class _AsyncRun:
    """One :class:`AsyncFL` run's event loop and everything it continues from.

    The state between two events (:meth:`state_dict`) is the server, the scheduler, the
    queue of replies not yet used, the messages in flight (none at a checkpoint), the
    version being assembled (``pending``), the simulated time and the write-off streak;
    the versions' arrays being sent are the server's current model. ``bound`` and
    ``mid_instant`` place a checkpoint inside an instant: a version is made by one
    event, and the other arrivals at the same simulated instant are still used before
    the clients are sent the model again.
    """

    def __init__(self, fl: AsyncFL, server: AsyncServer, sched: AsyncScheduler, order: str) -> None:
        self.fl = fl
        self.server = server
        self.sched = sched
        self.order = order
        self.arrays: dict[int, ArrayRecord] = {}  # versions being sent
        self.queue = EventQueue()
        self.inflight: dict[str, tuple[Dispatch, float, int]] = {}  # msg id -> (dispatch, real t0, bytes down)
        self.pending = AsyncRoundInfo(version=server.version + 1, sim_s=0.0, order=order)
        self.now = 0.0
        self.streak = 0  # messages written off since an update was last used
        # Clock order: an arrival at T is used once no message still out left before T.
        self.bound = math.inf
        self.mid_instant = False  # stopped (a checkpoint) after a version made inside an instant
        # Arrival order: clients whose message failed, asked again once another client's
        # update was used (an error comes back at once: asked again at once, a client
        # that fails would be asked again and again before anyone else's reply came).
        self.cooling: set[int] = set()

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.inflight:
            raise RuntimeError(f"{len(self.inflight)} message(s) still in flight at a checkpoint")
        return {"server": self.server.state_dict(), "scheduler": self.sched.state_dict(),
                "queue": self.queue.state_dict(message_to_state), "pending": asdict(self.pending),
                "now": self.now, "streak": self.streak, "bound": self.bound, "mid_instant": self.mid_instant,
                "cooling": sorted(self.cooling),
                "result_arrays": self.fl._result.arrays is not None}

    @classmethod
    def resumed(cls, fl: AsyncFL, state: dict[str, Any], order: str) -> _AsyncRun:
        saved = state["server"]
        server = fl._server(saved["models"][saved["version"]])
        server.load_state_dict(saved)
        sched = fl._scheduler()
        sched.load_state_dict(state["scheduler"])
        run = cls(fl, server, sched, order)
        run.queue.load_state_dict(state["queue"], message_from_state)
        run.pending = AsyncRoundInfo(**state["pending"])
        run.now, run.streak, run.bound = float(state["now"]), int(state["streak"]), float(state["bound"])
        run.mid_instant = bool(state["mid_instant"])
        run.cooling = {int(c) for c in state.get("cooling", ())}
        # The version being sent is the server's current model, as the loop built it.
        current = ArrayRecord({k: t for k, t in server.model.items()})
        run.arrays = {server.version: current}
        if state["result_arrays"]:
            fl._result.arrays = current
        return run

    def _checkpoint(self, version: int) -> None:
        """Take in every reply still out (queued, not used: under clock order they are
        used in simulated-arrival order whenever they were pulled), then save."""
        while self.inflight:
            pulled = self._pull()
            self._expire()
            if self.inflight and not pulled:
                time.sleep(self.fl.poll_s)
        self.mid_instant = True
        try:
            OwnLoop._checkpoint(self.fl, version)
        finally:
            self.mid_instant = False

    # -- the loop ------------------------------------------------------------------------
    def loop(self, grid: Grid, num_rounds: int, timeout: float, train_config: ConfigRecord) -> None:
        self.grid, self.num_rounds, self.timeout = grid, num_rounds, timeout
        self.train_config = train_config
        self.puller = Puller(grid)
        if self.mid_instant:  # resumed inside the instant whose event made the checkpoint's version
            self.mid_instant = False
            self._instant(resumed=True)
        self.dispatch()
        while self.server.version < num_rounds:
            pulled = self._pull()
            self._expire()
            self.bound = min((d.at for d, _, _ in self.inflight.values()), default=math.inf) \
                if self.order == "clock" else math.inf
            if self._instant():
                self.dispatch()
                continue
            if not self.inflight and not len(self.queue):
                self.dispatch()
                if not self.inflight:
                    raise RuntimeError(f"{self.fl.config.mode}: no client may start and none is running "
                                       f"(scheduler state: done={self.sched.done}, lagging={self.sched.lagging})")
                continue
            if not pulled:
                time.sleep(self.fl.poll_s)

    def _instant(self, resumed: bool = False) -> bool:
        """Use the next arrivals due (under ``bound``): every one at the same instant
        before sending again. Whether any was used."""
        if resumed and self._instant_over():
            return True
        used = resumed
        while len(self.queue) and self.queue.peek().time <= self.bound and self.server.version < self.num_rounds:
            self.use(self.queue.pop())
            used = True
            if self._instant_over():
                break  # use every arrival at the same instant before sending again
        return used

    def _instant_over(self) -> bool:
        nxt = self.queue.peek()
        return nxt is None or nxt.time > self.now

    def _pull(self) -> list[Message]:
        """Pull the replies in; queue each at its arrival time on the clock."""
        pulled = self.puller.poll(list(self.inflight)) if self.inflight else []
        for reply in pulled:
            mid = reply.metadata.reply_to_message_id
            if mid not in self.inflight:
                continue  # written off already: its late reply is not used
            d, t0, size = self.inflight.pop(mid)
            self.fl.timing.learn(reply)
            if reply.has_error() and (self.order == "clock" or is_dropout(reply)):
                # A dropout: the server learns only when its timeout expires. An
                # error is retried no sooner either, or a client that always fails
                # would be asked again and again at the same simulated instant.
                t = d.at + self.timeout
            else:
                # (A client's error under arrival order: used as it came, stamped as it
                # came, with no compute. Stamped at d.at + timeout it waited behind every
                # later arrival, for the rest of a busy run. The client is asked again
                # after another's update: `cooling`.)
                t = self.fl.timing.arrival(d.client, d.at, size, reply, time.monotonic() - t0)
            self.queue.push(Event(t, d.seq, d.client, payload=reply))
        return pulled

    def _expire(self) -> None:
        """Write off the messages with no reply within ``timeout`` (real seconds)."""
        clock_now = time.monotonic()
        for mid, (d, t0, _) in list(self.inflight.items()):
            if clock_now - t0 >= self.timeout:
                del self.inflight[mid]
                self.puller.forget(mid)
                self.queue.push(Event(d.at + self.timeout, d.seq, d.client, dropped=True))

    def dispatch(self) -> None:
        fl, sched, server = self.fl, self.sched, self.server
        starts = sched.startable()
        if self.cooling and (self.inflight or len(self.queue)):  # (with nothing else to wait for: at once)
            starts = [c for c in starts if c not in self.cooling]
        if not starts:
            return
        v = server.version
        if v not in self.arrays:
            self.arrays[v] = ArrayRecord({k: t for k, t in server.model.items()})
        msgs, ds = [], []
        for node in starts:
            d = sched.start(node, version=v, at=self.now)
            config = ConfigRecord(dict(self.train_config))
            config[keys.SERVER_ROUND] = v + 1
            msgs.append(Message(RecordDict({fl.arrayrecord_key: self.arrays[v], fl.configrecord_key: config}),
                                dst_node_id=node, message_type=MessageType.TRAIN, group_id=f"a{d.seq}"))
            ds.append(d)
        sizes = wire_sizes(msgs)
        t0 = time.monotonic()
        for mid, d, size in zip(self.grid.push_messages(msgs), ds, sizes):
            self.inflight[mid] = (d, t0, size)

    def use(self, ev: Event) -> None:
        fl, sched, server, pending = self.fl, self.sched, self.server, self.pending
        mode = fl.config.mode
        d = sched.running[ev.client]
        pending.groups.append(f"a{d.seq}")
        reply: Message | None = ev.payload
        why = "no reply within round-timeout" if reply is None else fl._why_unusable(reply)
        if self.order == "clock" or why is None:
            # Under arrival order a write-off's d.at + round-timeout (a dropout, a real
            # silence) is no time of the run's: used when it came up, it moved the clock,
            # and every later version, past that mark.
            self.now = max(self.now, ev.time)
        if why is not None:
            sched.write_off(ev.client)
            if self.order != "clock":
                self.cooling.add(ev.client)
            self.streak += 1
            if self.streak > 3 * len(fl.participants):
                raise RuntimeError(
                    f"{mode}: {self.streak} messages in a row got no usable reply "
                    f"(last: node {ev.client}: {why}); no client is answering. Check the "
                    "SuperNodes' logs, the dropout fraction and round-timeout")
            pending.dropped.append(fl.timing.name(ev.client))
            if reply is not None and not reply.has_error():
                pending.rejected += 1
                pending.reasons.append(f"node {ev.client}: {why}")
            # An error or a rejected reply is reported once by the caller (the grid's
            # metering, round_report().reasons); only a missing reply is logged here.
            if reply is None:
                log.warning("%s: node %d written off at sim %.1f s: %s", mode, ev.client, ev.time, why)
            elif not is_dropout(reply):
                log.debug("%s: node %d written off at sim %.1f s: %s", mode, ev.client, ev.time, why)
            return
        sched.finish(ev.client)
        self.streak = 0
        self.cooling.clear()
        pending.contributors.append(fl.timing.name(ev.client))
        pending.staleness.append(server.version - d.version)
        new = server.receive(reply.content[fl.arrayrecord_key].to_torch_state_dict(),
                             base_version=d.version, num_examples=fl._weight(reply))
        if not new:
            return
        v = server.version
        pending.version, pending.sim_s = v, self.now
        pending.ahead = sched.ahead() if mode == "ssp" else None
        fl._made(pending)
        self.pending = AsyncRoundInfo(version=v + 1, sim_s=self.now, order=self.order)
        fl._result.arrays = ArrayRecord({k: t for k, t in server.model.items()})
        self.arrays.clear()
        self.arrays[v] = fl._result.arrays
        # A reply waiting in the queue still counts as running until it is used.
        server.keep({x.version for x in sched.running.values()})
        fl._evaluate(v)
        fl._round_done(v)  # a checkpoint when due: _checkpoint(v) here
