"""Delayed Gradient Averaging as a Flower strategy: averages stay in flight for D rounds.

The arithmetic is :mod:`fededge.algorithms.dga` (pure torch); this module moves it through
Flower's Grid. Round t's message to each participant carries ``G(g)``, the global model
made of every average that has arrived by then (``g = last_arrived(t)``; no arrays when
``g`` did not change), and the train config with ``dga-global-round = g``. The client
rebuilds its model from ``G(g)`` and its own updates still in flight (kept in
``context.state``), runs K local steps and replies ``G(g) + Δ(t)``. The server averages
the replies with Flower's FedAvg aggregation and advances ``G(t)``, which is what it
evaluates.

Two ways to run the same rule, with the same result:

- **pipelined** (a real SuperLink, and fededge's in-process grid): round t is pushed as
  soon as ``G(g)`` exists, before the replies of rounds ``g+1 .. t-1`` are in. Each
  SuperNode runs its messages in order, so a client starts its next K steps as soon as
  it has replied: the overlap is real, in wall-clock time.
- **lock-step** (Flower's Ray simulation, which may run two queued messages of one node
  at once; shared/reference/flower-notes.md): at most one message per node is
  outstanding; round t is sent after round t-1's replies. The overlap is then accounted
  on the simulated clock (``DGATimeline``), which is what ``sim_s`` reports anyway.

``pipeline="auto"`` picks pipelined where the grid runs each node's messages in order.

DGA needs the same clients every round (each holds its own model and updates in
flight). The participants are chosen once, before round 1: all connected nodes, or a
seeded sample of ``clients-per-round`` of them. A participant whose reply fails or times
out is left out of that round's average (logged and counted); its next message carries
the global model again, so it rejoins. With ``delay = 0`` the strategy is FedAvg with K
local steps, bit for bit (same sampling order, same aggregation).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import average_arrayrecords, counted_wire_size, runs_messages_in_order, wire_sizes
from fededge.algorithms.dga import PIPELINE_MODES, DGAConfig, DGAServer, DGATimeline, last_arrived, norm_statistics
from fededge.arrays import record_from_torch, record_to_torch
from fededge.compress import MalformedPayloadError
from fededge.errors import ConfigError
from fededge.compress.update import DownlinkConfig, UpdateConfig
from fededge.protocol import cast_downlink
from fededge.settings import whole_or_keywords
from fededge.netem.clock import ClientRound
from fededge.strategies._replies import fixed_participants, is_dropout, reply_metrics, reported_partition, usable_reply
from fededge.strategies.report import RoundReport
from fededge.strategies.ownloop import OwnLoop
from fededge.strategies.resume import ResumeError, arrays_from_state, arrays_to_state, check_nodes, to_plain
from fededge.strategies.compressed import (
    CodecMismatchError, CompressionStats, check_uncompressed, decode_compressed,
)

__all__ = ["DGA", "DGARoundInfo", "PIPELINE_MODES"]

log = logging.getLogger("fededge")



@dataclass
class DGARoundInfo:
    """What a DGA round did, for metrics.jsonl."""

    delay: int
    global_round: int  # g: the global model the round's clients started from
    staleness_mean: float | None = None  # rounds of own updates in flight, per client
    staleness_max: int | None = None
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)
    pipelined: bool = False
    mismatched: int = 0  # of the rejected: in another codec than ``DGA(update=...)``


class DGA(OwnLoop):
    """Delayed Gradient Averaging (Zhu et al., NeurIPS 2021) over Flower's Grid.

    Parameters
    ----------
    delay, correction, warmup_rounds, pipeline, compute_ahead
        :class:`fededge.algorithms.dga.DGAConfig`'s knobs (their defaults, checks and
        meaning are declared there, once).
    config : DGAConfig, optional
        The same knobs as one object (``DGA(config=DGAConfig(delay=2))``), in place of the
        keywords above (giving both is refused).
    downlink : str
        ``none``, ``fp16`` or ``bf16``: cast ``G(g)`` for the messages that carry it. The
        clients then start from the rounded copy, while the server keeps the exact
        ``G(g)``; so this needs compressed uplinks (replies that are deltas, rebuilt on the
        exact ``G(g)``). A full-weight reply would carry the rounding back into ``G(t)``.
    poll_s : float
        How often the pipelined loop pulls replies from a real SuperLink (each pull
        costs the SuperLink CPU; SuperNodes themselves poll every 3 s). The in-process
        grid runs messages when pulled, so it never waits.
    update : UpdateConfig, optional
        The clients' compression (their :class:`~fededge.clients.mods.CompressionMod`'s),
        to check their updates against, as :class:`~fededge.strategies.compressed.Compressed`
        does: a reply in another codec, or uncompressed when ``update`` compresses, is
        rejected by name (:class:`~fededge.strategies.compressed.CodecMismatchError`),
        logged and counted (``rejected``, ``mismatched``), and the round goes on without
        it; a round in which every update was refused so stops the run with that error.
        None (default) accepts any codec the decoder knows.
    norm_momentum : float
        The momentum of the model's BatchNorm layers (torch's default, 0.1). Without the
        correction, the server continues the running statistics as one worker's BatchNorm
        would, decaying by ``(1 - norm_momentum)^K`` per round (:class:`DGAServer`'s
        ``statistics``); with the correction it is not used.
    **fedavg
        Flower's FedAvg arguments (sampling, record keys, weighting).
    """

    label = "DGA"
    #: A checkpoint of another delay, warm-up or correction is refused by name.
    resume_settings = ("config.delay", "config.warmup_rounds", "config.correction")
    #: Who must be sent the global model again, and the participants (node ids).
    state_attrs = ("_resync", "participants")
    compressed_form = ("DGA(..., update=update) beside the clients' CompressionMod(update): DGA decodes "
                       "each reply itself, against the global model of the round it was trained on")

    #: Whether someone takes the rounds' rejections (:meth:`take_round_info`, as
    #: :class:`~fededge.server.experiment.Experiment` does) and reports them; until then
    #: DGA logs each one as a warning itself.
    _reported = False

    def __init__(self, *, delay: int = DGAConfig.delay, correction: bool = DGAConfig.correction,
                 warmup_rounds: int = DGAConfig.warmup_rounds, pipeline: str = DGAConfig.pipeline,
                 compute_ahead: bool = DGAConfig.compute_ahead,
                 downlink: str = DownlinkConfig.downlink, poll_s: float = 0.5,
                 update: UpdateConfig | None = None, norm_momentum: float = 0.1,
                 config: DGAConfig | None = None, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        knobs = whole_or_keywords(DGAConfig, config, owner="DGA", delay=delay, correction=correction,
                                  warmup_rounds=warmup_rounds, pipeline=pipeline, compute_ahead=compute_ahead)
        if not 0.0 < norm_momentum <= 1.0:
            raise ValueError(f"norm_momentum must be in (0, 1], got {norm_momentum}")
        self.norm_momentum = norm_momentum  # the model's BatchNorm momentum (DGAServer's statistics rule)
        DownlinkConfig(downlink=downlink)  # checks the name
        self.downlink = downlink
        self._down: dict[int, dict[str, ArrayRecord]] = {}  # g -> G(g) cast for the downlink (built once)
        self.config = knobs
        self.pipeline = knobs.pipeline
        self.poll_s = poll_s
        self._info: dict[int, DGARoundInfo] = {}
        self.participants: list[int] = []
        self.pipelined = False
        self._stats = CompressionStats()
        # The simulated clock (attach_clock): each round's per-client work, on DGA's timeline.
        self._timeline: DGATimeline | None = None
        self._bytes_down: dict[int, dict[int, int]] = {}  # round -> node -> bytes of its message
        # round -> (its messages carried the next round's content, the nodes sent a reference)
        self._sent_as: dict[int, tuple[bool, set[int]]] = {}
        # round -> (pid, n, work, node id)
        self._work: dict[int, list[tuple[int, int | None, ClientRound, int]]] = {}
        self._wait_s: float | None = None
        self._sent_as_recorded: dict[str, Any] = {}  # the last timed round's sending, for its metrics line
        self._waited: dict[int, float] = {}  # round -> the timeout it waited for a participant that never answered
        self._timeout: float | None = None
        self._local_steps: int | None = None
        self.update = update

    def take_round_info(self, rnd: int) -> DGARoundInfo | None:
        """The round's :class:`DGARoundInfo` (once; the experiment records it). A caller
        of this reports the rejections itself: DGA then logs them at DEBUG."""
        self._reported = True
        return self._info.pop(rnd, None)

    def take_stats(self) -> CompressionStats:
        """Compressed replies decoded and rejected since the previous call (one round)."""
        s, self._stats = self._stats, CompressionStats()
        return s

    def round_report(self, server_round: int) -> RoundReport:
        """Round ``server_round``: its own messages (others are in flight), its duration
        on DGA's timeline, the updates left out, and the delay and staleness it ran with."""
        info = self.take_round_info(server_round)
        comp = self.take_stats()
        report = RoundReport(
            groups=(str(server_round),), sim_s=self._round_sim_s(server_round),
            rejected=comp.rejected + (info.rejected if info else 0),
            mismatched=comp.mismatched + (info.mismatched if info else 0),
            reasons=[*(f"a client update was rejected and left out: {r}" for r in (info.reasons if info else [])),
                     *(f"a compressed update was rejected and left out: {r}" for r in comp.reasons)],
            payload_bytes=comp.payload_bytes, dense_bytes=comp.dense_bytes)
        if info is not None:
            steps = None if info.staleness_mean is None or self._local_steps is None \
                else info.staleness_mean * self._local_steps
            report.metrics = {
                "dga_delay": info.delay, "dga_global_round": info.global_round,
                "staleness": info.staleness_mean, "staleness_max": info.staleness_max, "staleness_steps": steps,
                "wait_s": None if self._wait_s is None else round(self._wait_s, 6), "pipelined": info.pipelined,
                **self._sent_as_recorded}
        self._sent_as_recorded = {}
        return report

    def _round_sim_s(self, t: int) -> float | None:
        """Round t on the clock: from the previous round's average to this one's (DGA's
        rounds overlap); None without a clock (the caller times it synchronously)."""
        if self._clock is None:
            return None
        work = self._work.pop(t, [])
        ahead, referred = self._sent_as.pop(t, (False, set()))
        if self._timeline is None and work:
            # As many clients as the replies report partitions, else as the run has nodes.
            reported = max((num for _, num, _, _ in work if num is not None), default=None)
            clock = self._clock.build(max(self._clock.num_clients(reported), 1 + max(pid for pid, _, _, _ in work)))
            self._timeline = DGATimeline(clock, self.config, clients=range(len(clock.clients)))
            for s in range(1, t):  # rounds before the first reply: nothing on the clock
                self._timeline.run_round(s, [])
        if self._timeline is None or t < 1:
            return 0.0
        rounds = [w for _, _, w, _ in work]
        before = self._timeline.ready[t - 1]
        from_preview = {pid for pid, _, _, node in work if node in referred}  # the clock's clients are partitions
        waited = self._waited.pop(t, None)
        end = self._timeline.run_round(t, rounds, ahead=ahead, from_preview=from_preview, wait_s=waited)
        # (what fededge.analysis.replay needs to time the round again as it was sent)
        self._sent_as_recorded = {"dga_ahead": bool(ahead), "dga_from_preview": sorted(from_preview),
                                  **({} if waited is None else {"dga_waited_s": waited})}
        waits = [self._timeline.blocked[(t, c.client)] for c in rounds]
        self._wait_s = sum(waits) / len(waits) if waits else None
        return end - before

    def _note_work(self, t: int, replies: list[Message]) -> None:
        """Each reply's download, compute and upload, as sent and received (before any
        decoding), for the clock. A reply is placed on the client (link) its partition id
        names, or, from a ClientApp that reports none, by its node id
        (:meth:`RunClock.place <fededge.netem.runclock.RunClock.place>`, as the
        experiment's own timing and the asynchronous strategies place it)."""
        if self._clock is None:
            return
        work = self._work.setdefault(t, [])
        for r in replies:
            pid = None if r.has_error() else self._clock.place(r.metadata.src_node_id, reported_partition(r))
            if pid is None:  # an error, or a node the clock does not know
                continue
            metrics = reply_metrics(r)
            num = int(metrics[keys.REPLY_NUM_PARTITIONS]) if keys.REPLY_NUM_PARTITIONS in metrics else None
            compute = self._clock.compute_s(
                float(metrics[keys.COMPUTE_S]) if keys.COMPUTE_S in metrics else None,
                int(metrics[keys.LOCAL_STEPS_DONE]) if keys.LOCAL_STEPS_DONE in metrics else None)
            down = self._bytes_down.get(t, {}).get(r.metadata.src_node_id, 0)
            work.append((pid, num, ClientRound(pid, down, compute, counted_wire_size(r)), r.metadata.src_node_id))
        self._bytes_down.pop(t, None)

    # ----------------------------------------------------------------- checkpoints
    # OwnLoop.attach_checkpoint: a pipelined run pushes no round past a due one, so that
    # when round t is saved nothing of a later round is out: the rounds before it still
    # overlap, the pipeline refills after it.
    def _extra_state(self) -> dict[str, Any]:
        """Besides the settings, rounds done, participants and who must be sent the model
        again (OwnLoop's): the global models still needed (``DGAServer``), each as sent
        (``G(g)``), and DGA's timeline on the clock (when each client is free, when each
        average was ready). Read by ``hook.save`` between two rounds."""
        if self._work or self._bytes_down:
            raise RuntimeError(f"DGA: state_dict() at round {self._done} with rounds "
                               f"{sorted({*self._work, *self._bytes_down})} still out")
        tl = self._timeline
        return {
            "globals": {int(s): {k: v.detach().clone() for k, v in w.items()} for s, w in self._server.globals.items()},
            "arrays_of": {int(g): arrays_to_state(a) for g, a in self._arrays_of.items()},
            "timeline": None if tl is None else {
                "clients": list(tl.clients), "free": {int(j): float(v) for j, v in tl._free.items()},
                "replied": {int(j): float(v) for j, v in tl._replied.items()},
                "handled": {int(j): float(v) for j, v in tl._handled.items()},
                "ready": {int(r): float(v) for r, v in tl.ready.items()}},
        }

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of fededge before OwnLoop: its ``config``, ``resync`` and
        ``participants`` keys."""
        c = state["config"]
        return {**state, "settings": {"delay": c["delay"], "warmup_rounds": c["warmup"],
                                      "correction": c["correction"]},
                "attrs": {"_resync": to_plain({int(n) for n in state["resync"]}),
                          "participants": [int(n) for n in state["participants"]]}}

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        """Put back a loaded state (before the loop) on the same participants
        (:class:`~fededge.strategies.resume.ResumeError` if the grid lacks one); the
        rounds done."""
        check_nodes(self.participants, grid, "DGA")
        done = int(state["round"])
        self._server.globals = {int(s): dict(w) for s, w in state["globals"].items()}
        self._server.round = done
        self._arrays_of = {int(g): arrays_from_state(a) for g, a in state["arrays_of"].items()}
        self._result.arrays = self._arrays_of[done]
        self._keys = set(self._result.arrays.keys())
        tl = state["timeline"]
        if tl is not None:
            if self._clock is None or self._clock.clock is None:
                raise ResumeError("DGA: the checkpoint has DGA's timeline on the simulated clock, "
                                  "but this run's clock was not restored first")
            self._timeline = DGATimeline(self._clock.clock, self.config, clients=[int(j) for j in tl["clients"]])
            self._timeline._free = {int(j): float(v) for j, v in tl["free"].items()}
            self._timeline._replied.update({int(j): float(v) for j, v in tl.get("replied", {}).items()})
            self._timeline._handled.update({int(j): float(v) for j, v in tl.get("handled", {}).items()})
            self._timeline.ready = {int(r): float(v) for r, v in tl["ready"].items()}
        return done

    # ----------------------------------------------------------------- the run
    def _prepare(self, grid: Grid, initial_arrays: ArrayRecord, resume: dict[str, Any] | None) -> None:
        in_order = runs_messages_in_order(grid)
        if self.pipeline == "on" and not in_order:
            raise ValueError(
                "dga-pipeline=on needs a grid that runs each node's messages in order (a "
                "SuperLink deployment or fededge's in-process runtime); Flower's Ray "
                "simulation may run two messages of one node at once. Use dga-pipeline=auto")
        self.pipelined = self.pipeline == "on" or (self.pipeline == "auto" and bool(in_order))
        if self.pipelined and self.fraction_evaluate > 0:
            log.warning("DGA: federated evaluation (fraction-evaluate > 0) is skipped when rounds "
                        "are pipelined; the server evaluates the global model every round")
        train_config = self._train_config
        self._local_steps = int(train_config[keys.LOCAL_STEPS]) if keys.LOCAL_STEPS in train_config else None
        # BatchNorm's running statistics decay by (1 - norm_momentum)^K over a round's K steps;
        # without K in the train config the server takes their average.
        self._server = DGAServer(self.config, dict(record_to_torch(initial_arrays)),
                                 statistics=norm_statistics(list(initial_arrays.keys())),
                                 statistics_decay=(1 - self.norm_momentum) ** self._local_steps
                                 if self._local_steps else 0.0)
        self._keys = set(initial_arrays.keys())
        self._arrays_of: dict[int, ArrayRecord] = {0: initial_arrays}
        self._resync: set[int] = set()
        self._previewed: dict[int, int] = {}  # node -> the round whose content it got as a preview
        log.info("DGA: delay %d rounds, correction %s, warm-up %d rounds, %s%s", self.config.delay,
                 self.config.correction, self.config.warmup_rounds,
                 "pipelined (rounds pushed ahead)" if self.pipelined else "lock-step (one message per node)",
                 ", compute-ahead (messages carry the next round's content)" if self.config.compute_ahead else "")

    def _fresh(self, grid: Grid, initial_arrays: ArrayRecord) -> None:
        self._result.arrays = initial_arrays  # the model a round without updates keeps
        self.participants = fixed_participants(grid, fraction=self.fraction_train, min_nodes=self.min_train_nodes,
                                               min_available=self.min_available_nodes)

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        self._timeout = timeout
        if self.pipelined:
            self._run_pipelined(grid, num_rounds, timeout, self._train_config, done)
        else:
            self._run_lockstep(grid, num_rounds, timeout, self._train_config, self._evaluate_config, done)

    def _messages(self, t: int, train_config: ConfigRecord, *, preview: bool = False) -> list[Message]:
        """Round t's train messages, in this round's (seeded) order of participants. With
        ``preview`` (compute-ahead), each also carries round t+1's content, and a node that
        got round t's content as a preview is sent a reference to it instead."""
        config, new = self._round_config(t, train_config)
        # The same draw as FedAvg's per-round sample of all nodes, so D = 0 matches it.
        order = random.sample(self.participants, len(self.participants))
        after = self._round_config(t + 1, train_config) if preview else None
        g = int(config[keys.DGA_GLOBAL_ROUND])
        self._down = {s: a for s, a in self._down.items() if s >= g}  # g only grows
        out = []
        referred: set[int] = set()
        for node in order:
            if self._previewed.pop(node, None) == t and node not in self._resync:
                records: dict[str, Any] = {keys.PREVIEW_OF: ConfigRecord({"id": str(t)})}
                referred.add(node)
            else:
                records = self._content(t, config, send=new or node in self._resync)
            self._resync.discard(node)
            if after is not None:
                records.update({keys.PREVIEW_PREFIX + k: v
                                for k, v in self._content(t + 1, after[0], send=after[1]).items()})
                records[keys.PREVIEW_ID] = ConfigRecord({"id": str(t + 1)})
                self._previewed[node] = t + 1
            out.append(Message(RecordDict(records), dst_node_id=node, message_type=MessageType.TRAIN,
                               group_id=str(t)))
        if self._clock is not None:
            self._bytes_down[t] = {m.metadata.dst_node_id: n for m, n in zip(out, wire_sizes(out))}
            self._sent_as[t] = (preview, referred)  # for the clock: what round t's messages did
        return out

    def _round_config(self, t: int, train_config: ConfigRecord) -> tuple[ConfigRecord, bool]:
        """Round t's train config, and whether its ``G(g)`` is new (sent to every node)."""
        g = last_arrived(self.config, t)
        config = ConfigRecord(dict(train_config))
        config[keys.SERVER_ROUND] = t
        config[keys.DGA_GLOBAL_ROUND] = g
        config[keys.DGA_CORRECTION] = self.config.correction
        return config, t == 1 or g != last_arrived(self.config, t - 1)

    def _content(self, t: int, config: ConfigRecord, *, send: bool) -> dict[str, Any]:
        """The records of round t's message: ``G(g)`` (as sent, kept since round g; cast
        for the downlink) when ``send``, else no arrays, and the config."""
        g = int(config[keys.DGA_GLOBAL_ROUND])
        full = self._arrays_of[g]
        if send and self.downlink != "none":
            if g not in self._down:  # kept for g(t) and g(t+1) (a preview); _messages prunes
                self._down[g] = cast_downlink(full, self.downlink)
            return {**self._down[g], self.configrecord_key: config}
        return {self.arrayrecord_key: full if send else ArrayRecord(), self.configrecord_key: config}

    def _previews(self, t: int, stop: int) -> bool:
        """Whether round t's messages carry round t+1's content: compute-ahead, the next
        global model exists, and round t is not the last before a stop (the run's end, or
        a checkpoint, after which nothing of a later round may be out)."""
        return self.config.previews(t) and t < stop

    def _run_lockstep(self, grid: Grid, num_rounds: int, timeout: float, train_config: ConfigRecord,
                      evaluate_config: ConfigRecord, done: int = 0) -> None:
        for t in range(done + 1, num_rounds + 1):
            preview = self._previews(t, num_rounds) and not self._due(t)
            replies = list(grid.send_and_receive(self._messages(t, train_config, preview=preview), timeout=timeout))
            self._finish_round(t, replies)
            if self.fraction_evaluate > 0:
                ev_messages = list(self.configure_evaluate(t, self._result.arrays, evaluate_config, grid))
                for m in ev_messages:  # metered with round t (Flower's leave the group empty: never taken)
                    m.metadata.group_id = str(t)
                ev = grid.send_and_receive(ev_messages, timeout=timeout)
                agg = self.aggregate_evaluate(t, ev)
                if agg is not None:
                    self._result.evaluate_metrics_clientapp[t] = agg
            self._evaluate(t)
            self._round_done(t)

    def _run_pipelined(self, grid: Grid, num_rounds: int, timeout: float, train_config: ConfigRecord,
                       done: int = 0) -> None:
        pushed: dict[int, list[str]] = {}  # round -> message ids, in push order
        got: dict[str, Message] = {}
        current_since = time.monotonic()
        next_push = done + 1
        # Rounds after which a checkpoint is written: nothing is pushed past one of them
        # before it is saved (resume.py's contract).
        stops = [t for t in range(done + 1, num_rounds + 1) if self._due(t)]
        while done < num_rounds:
            # Push every round whose global model exists: up to D + 1 rounds ahead (with
            # compute-ahead, once the next round's exists too: it travels as a preview).
            stop = next((s for s in stops if s > done), num_rounds)
            while next_push <= stop:
                preview = self._previews(next_push, stop)
                if last_arrived(self.config, next_push + 1 if preview else next_push) > done:
                    break
                messages = self._messages(next_push, train_config, preview=preview)
                pushed[next_push] = list(grid.push_messages(messages))
                next_push += 1
            t = done + 1
            outstanding = [m for r in sorted(pushed) for m in pushed[r] if m not in got]
            if outstanding:
                for reply in grid.pull_messages(outstanding):
                    got[reply.metadata.reply_to_message_id] = reply
            complete = all(m in got for m in pushed[t])
            if not complete and time.monotonic() - current_since < timeout:
                time.sleep(self.poll_s)
                continue
            replies = [got.pop(m) for m in pushed.pop(t) if m in got]
            if not complete:
                log.warning("DGA round %d: %d of %d replies within round-timeout=%gs; the rest are "
                            "left out", t, len(replies), len(self.participants), timeout)
            self._finish_round(t, replies)
            self._evaluate(t)
            self._round_done(t)
            done, current_since = t, time.monotonic()

    # ----------------------------------------------------------------- aggregation
    def _finish_round(self, t: int, replies: list[Message]) -> None:
        info = DGARoundInfo(delay=self.config.delay_at(t), global_round=last_arrived(self.config, t),
                            pipelined=self.pipelined)
        self._note_work(t, replies)
        # A participant without a reply (timed out, or its message was lost) may not hold
        # the round's global model or preview: its next message carries them in full.
        answered = {r.metadata.src_node_id for r in replies}
        self._resync.update(n for n in self.participants if n not in answered)
        if self._timeout is not None and (any(is_dropout(r) for r in replies)
                                          or any(n not in answered for n in self.participants)):
            # A participant never answered: the server waited its round timeout (as the
            # synchronous clock charges it) before averaging without it.
            self._waited[t] = self._timeout
        valid = []
        for r in replies:
            node = r.metadata.src_node_id
            why = r.error.reason if r.has_error() else self._decode(r, info, t) or usable_reply(
                r, arrays_key=self.arrayrecord_key, model_keys=self._keys, weight_key=self.weighted_by_key)
            if why is None:
                valid.append(r)
                continue
            self._resync.add(node)  # its state may not have the round's global model
            if not r.has_error():  # errors are counted by the grid's metering already
                info.rejected += 1
                info.reasons.append(f"node {node}: {why}")
            # Reported once by the caller: errors from the grid's metering, rejections
            # from take_round_info().reasons; with no such caller, rejections are warned here.
            log.log(logging.WARNING if not self._reported and not r.has_error() else logging.DEBUG,
                    "DGA round %d: node %d left out: %s", t, node, why)
        # DGAMod marks its replies (their staleness): a plain ClientApp's full model passed in
        # round 1, and from round 2 its own train function failed on DGA's messages, naming
        # nothing of DGA. Left out by name; the run stops where no client runs it.
        plain = [r for r in valid if not any(keys.DGA_STALENESS in m for m in r.content.metric_records.values())]
        if plain:
            fix = ("its ClientApp runs no DGAMod: add DGAMod() to the ClientApp's mods "
                   "(fededge.api; with compute_ahead=True, PreviewMod() before it)")
            if len(plain) == len(valid):
                raise ConfigError(f"DGA round {t}: no client reply carries DGA's '{keys.DGA_STALENESS}' metric: {fix}")
            for r in plain:
                valid.remove(r)
                self._resync.add(r.metadata.src_node_id)
                info.rejected += 1
                info.reasons.append(f"node {r.metadata.src_node_id}: {fix}")
        if info.mismatched and not valid:  # every later round would be refused the same way
            first = next(r for r in info.reasons if CodecMismatchError.__name__ in r)
            raise CodecMismatchError(
                f"DGA round {t}: every client update was refused: {first}. Give the clients' "
                f"CompressionMod and the server's DGA(..., update=...) the same UpdateConfig")
        stale = [int(m[keys.DGA_STALENESS]) for r in valid
                 for m in r.content.metric_records.values() if keys.DGA_STALENESS in m]
        if stale:
            info.staleness_mean = sum(stale) / len(stale)
            info.staleness_max = max(stale)
        if valid:
            contents = [r.content for r in valid]
            ybar = average_arrayrecords(contents, self.weighted_by_key)
            new = self._server.advance(t, record_to_torch(ybar))
            # g = t - 1: G(t) is ȳ itself, FedAvg's own ArrayRecord (bit for bit)
            arrays = ybar if last_arrived(self.config, t) == t - 1 else record_from_torch(
                {k: new[k] for k in ybar.keys()})
            self._result.train_metrics_clientapp[t] = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        else:
            self._server.skip(t)
            arrays = self._result.arrays if self._result.arrays is not None else self._arrays_of[0]
        self._arrays_of = {g: a for g, a in self._arrays_of.items() if g in self._server.globals}
        self._arrays_of[t] = arrays
        self._result.arrays = arrays
        self._info[t] = info

    def _decode(self, reply: Message, info: DGARoundInfo, t: int) -> str | None:
        """A compressed reply carries Δ(t) (fededge.clients.mods.CompressionMod): rebuild G(g) + Δ(t) in
        place. Returns why it does not decode, or is not in the codec ``update`` names (the
        reply is then left out; a codec mismatch is counted in ``info.mismatched``), else None."""
        try:
            if keys.COMPRESSED not in reply.content:
                check_uncompressed(self.update, t)
                return None
            reply.content = decode_compressed(reply.content, self._server.global_model(info.global_round),
                                              self._stats, expect=self.update, server_round=t)
        except MalformedPayloadError as err:  # counted and logged with the round's other rejections
            return f"malformed compressed update: {err}"
        except CodecMismatchError as err:
            info.mismatched += 1
            return f"{type(err).__name__}: {err}"
        return None

    # Flower's per-round hooks are not how DGA runs: start() drives it.
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        raise NotImplementedError("DGA runs its own round loop: call start()")
