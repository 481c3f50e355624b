"""Run one experiment on whatever Grid the ServerApp is given.

The round loop is Flower's own ``Strategy.start``; fededge adds around it a
:class:`~fededge.server.metering.MeteredGrid` (bytes on the wire), centralised
evaluation on the held-out test set (Flower's ``evaluate_fn``, called after every
round) and the :class:`~fededge.server.results.RunRecorder`. Any strategy from
``flwr.serverapp.strategy`` can therefore be swapped in.

Before round 1, in simulation, the server makes the clients' data split once itself
(:func:`check_data_split`): a split that cannot work stops the run with one
:class:`~fededge.config.ConfigError` instead of failing every client of every round.

Each client problem of a round is reported once, in one line: "a client failed" (its
ClientApp raised; an error reply) or "... was rejected" (its reply arrived but did not
decode into a usable update). The strategies record the reasons; this module reports
them. Flower's own strategies also log each error reply ("Received error in reply from
node ..."), a line fededge cannot turn off through Flower's public API.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.clients.device import resolve_device
from fededge.clients.train import evaluate
from fededge.config import RunConfig
from fededge.models.zoo import count_parameters
from fededge.netem.assign import assign_links
from fededge.algorithms.dga import DGAConfig, DGATimeline
from fededge.algorithms.gossip import GossipTimeline, GossipWork
from fededge.netem.clock import ClientRound, SimClock, clock_compute_s, synchronous_round
from fededge.server.inprocess import InProcessGrid
from fededge.server.metering import MeteredGrid, RoundTraffic
from fededge.server.results import Progress, RunRecorder, new_run_id
from fededge.strategies.compressed import Compressed
from fededge.strategies.asyncfl import AsyncFL, AsyncRoundInfo, BackupWorkers
from fededge.strategies.dga import DGA
from fededge.strategies.gossip import Gossip, GossipRoundInfo
from fededge.strategies.registry import build_strategy
from fededge.workload import check_partition, dataset_for, model_for

__all__ = [
    "ExperimentResult", "NotEnoughNodesError", "RoundFailedError", "check_data_split", "run_experiment",
    "simulated_data_splits", "train_config", "wait_for_nodes",
]

log = logging.getLogger("fededge")


class RoundFailedError(RuntimeError):
    """No client update of a round could be used: every reply was an error (or none came).

    A run that carried on would report a model nobody trained; it stops instead, with
    the first client error in the message.
    """


class NotEnoughNodesError(RuntimeError):
    """Fewer nodes connected than the run needs, within ``round-timeout`` seconds."""


def wait_for_nodes(grid: Grid, needed: int, timeout_s: float, *, poll_s: float = 1.0) -> int:
    """Wait until ``needed`` nodes are connected; raise :class:`NotEnoughNodesError`.

    Flower's own sampling waits for nodes forever; a count of ``clients-per-round`` above
    the number of nodes that will ever connect would hang the run with no message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        n = len(list(grid.get_node_ids()))
        if n >= needed:
            return n
        if time.monotonic() >= deadline:
            raise NotEnoughNodesError(
                f"the run needs {needed} connected nodes (clients-per-round / "
                f"min-available-nodes) but only {n} connected within round-timeout="
                f"{timeout_s:g} s; lower clients-per-round, use a fraction such as 1.0, "
                "or start more SuperNodes (num-supernodes in simulation)"
            )
        time.sleep(poll_s)


def simulated_data_splits(grid: Grid, timeout_s: float) -> list[tuple[int, str | None]]:
    """The ``(num-partitions, data-dir)`` splits a simulation's clients will make; [] elsewhere.

    fededge's in-process grid holds every node's config. Flower's simulation hands the
    ServerApp no node configs, and its nodes register while the ServerApp starts, so
    counting them could come too early: one node is asked instead, with a ``query``
    message to fededge's ClientApp (:func:`fededge.clients.app.node_info`; not metered,
    it is no part of training). No answer, or a ClientApp without that handler, leaves
    the check to the clients. In a deployment each node has its own node config and
    may have its own data, so the server does not guess: a client that cannot make its
    split replies with a named configuration error, which stops the run
    (:func:`fededge.clients.mods.config_error_mod`).
    """
    inner = grid
    while hasattr(inner, "inner"):
        inner = inner.inner
    if isinstance(inner, InProcessGrid):
        return inner.data_splits()
    if not fi.is_flower_simulation(inner):
        return []
    node = next(iter(inner.get_node_ids()), None)
    if node is None:
        return []
    msg = Message(RecordDict(), node, MessageType.QUERY, group_id="fededge-node-info")
    replies = list(inner.send_and_receive([msg], timeout=timeout_s))
    if not replies or replies[0].has_error() or keys.METRICS not in replies[0].content:
        log.debug("no node config from node %d (%s); the clients check their own split", node,
                  replies[0].error.reason if replies and replies[0].has_error() else "no usable reply")
        return []
    metrics = replies[0].content[keys.METRICS]
    if keys.REPLY_NUM_PARTITIONS not in metrics:
        return []
    return [(int(metrics[keys.REPLY_NUM_PARTITIONS]), None)]


def check_data_split(grid: Grid, cfg: RunConfig) -> float:
    """In simulation, make the clients' data split once on the server; return its seconds.

    Raises :class:`~fededge.config.ConfigError` (naming ``min-partition-size``, ``alpha``,
    the sample count and the number of clients) when the clients could not make it:
    exactly when, since it is the clients' own seeded partition
    (:func:`fededge.workload.check_partition`). Without this, every client of round 1
    would compute the same split only to fail, and the run would stop on a generic
    "no client update could be used".
    """
    t0 = time.perf_counter()
    for num_partitions, data_dir in simulated_data_splits(grid, cfg.round_timeout):
        check_partition(cfg, num_partitions, data_dir)
    return time.perf_counter() - t0


class RoundClock:
    """Turns each round's metered traffic into its duration on the simulated clock.

    Clients are placed on their links (``netem``, ``netem-file``, ``compute-speed``) by
    partition id, which they report in their replies. The clock is built at the first
    round, once the number of partitions is known; the assignment is written to
    ``<run-dir>/netem.json``.

    Rounds are synchronous (download, compute, upload; the slowest client decides),
    except with ``dga``: a DGA round overlaps the previous ones as far as its delay
    allows (:class:`fededge.algorithms.dga.DGATimeline`); and with ``gossip``, where each
    node waits only for its own compute and its in-neighbours' messages, edge by edge
    (:class:`fededge.algorithms.gossip.GossipTimeline`).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, dga: DGAConfig | None = None,
                 gossip: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.dga = dga
        self.gossip = gossip
        self.clock: SimClock | None = None
        self.timeline: DGATimeline | None = None
        self.gossip_timeline: GossipTimeline | None = None
        self._partition: dict[int, int] = {}  # gossip: topology index -> partition id
        self.last_wait_s: float | None = None  # DGA: mean time a client waited for its message

    def build(self, num_partitions: int) -> SimClock:
        """The run's clock for ``num_partitions`` clients (built once; later calls return it).

        The asynchronous strategies call this themselves (``attach_clock``): they order
        replies on the clock as they come.
        """
        if self.clock is None:
            self.clock = self._build(num_partitions)
        return self.clock

    def compute_s(self, measured_s: float) -> float:
        """What a client's compute takes on the clock: measured, or ``sim-step-s`` per step."""
        return clock_compute_s(measured_s, self.cfg.local_steps, self.cfg.sim_step_s)

    def _build(self, num_partitions: int) -> SimClock:
        cfg = self.cfg
        links = assign_links(cfg.netem, num_partitions, seed=cfg.seed, netem_file=cfg.netem_file,
                             speed=cfg.compute_speed)
        (self.run_dir / "netem.json").write_text(json.dumps({
            "netem": cfg.netem, "netem-file": cfg.netem_file, "compute-speed": cfg.compute_speed,
            "clients": [{"partition-id": i, "profile": link.profile.name if link.profile else None,
                         "speed": link.speed} for i, link in enumerate(links)],
        }, indent=2) + "\n")
        return SimClock(links, seed=cfg.seed)

    def gossip_round_duration(self, info: GossipRoundInfo, rnd: int) -> float:
        """A gossip round on the clock: nodes by partition id, edges as relayed."""
        for node in info.nodes:
            if node.partition_id is not None:
                self._partition[node.index] = node.partition_id
        work = [GossipWork(self._partition[x.index], self.compute_s(x.compute_s), x.bytes_up, x.bytes_down)
                for x in info.nodes if x.index in self._partition]
        if self.clock is None and work:
            self.clock = self._build(max(max(self._partition.values()) + 1, len(self._partition)))
            self.gossip_timeline = GossipTimeline(self.clock)
        if self.gossip_timeline is None:
            return 0.0
        tl = self.gossip_timeline
        before = tl.end.get(rnd - 1, max(tl.end.values()))
        edges = [(self._partition[s], self._partition[r]) for s, r in info.edges
                 if s in self._partition and r in self._partition]
        end = tl.run_round(rnd, work, edges)
        waits = [tl.waited[(rnd, w.client)] for w in work]
        self.last_wait_s = sum(waits) / len(waits) if waits else None
        return end - before

    def round_duration(self, traffic: RoundTraffic, rnd: int = 0) -> float:
        replied = [n for n in traffic.nodes.values() if n.replied and n.partition_id is not None]
        rounds = [ClientRound(x.partition_id, x.bytes_down, self.compute_s(x.compute_s), x.bytes_up)
                  for x in replied]
        if self.clock is None and replied:
            n = max((x.num_partitions or 0) for x in replied)
            self.clock = self._build(max(n, 1 + max(x.partition_id for x in replied)))
            if self.dga is not None:
                self.timeline = DGATimeline(self.clock, self.dga, clients=range(len(self.clock.clients)))
                for s in range(1, rnd):  # rounds before the first reply: nothing on the clock
                    self.timeline.run_round(s, [])
        if self.clock is None:
            return 0.0
        if self.timeline is None:
            duration = synchronous_round(self.clock, rounds).duration if replied else 0.0
            # A node that never answered held the round until the server's timeout.
            return max(duration, self.cfg.round_timeout) if traffic.dropped else duration
        before = self.timeline.ready[rnd - 1]
        end = self.timeline.run_round(rnd, rounds)
        waits = [self.timeline.blocked[(rnd, c.client)] for c in rounds]
        self.last_wait_s = sum(waits) / len(waits) if waits else None
        return end - before


@dataclass
class ExperimentResult:
    run_dir: Path
    summary: dict[str, Any]
    flower_result: Result


def train_config(cfg: RunConfig) -> ConfigRecord:
    """What the server sends with every train message (the strategy adds the round)."""
    return ConfigRecord({
        keys.LOCAL_STEPS: cfg.local_steps,
        keys.LOCAL_LR: cfg.local_lr,
        keys.MOMENTUM: cfg.momentum,
        keys.WEIGHT_DECAY: cfg.weight_decay,
        keys.BATCH_SIZE: cfg.batch_size,
    })


@contextmanager
def seeded_sampling(seed: int) -> Iterator[None]:
    """Seed the module-level ``random`` for the run, then restore it.

    Flower's strategies sample nodes with ``random.sample`` (``strategy_utils.
    sample_nodes``), the global RNG. Seeding it makes client selection reproducible;
    restoring it keeps the in-process runtime from changing its caller's RNG.
    """
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def run_experiment(
    grid: Grid,
    cfg: RunConfig,
    *,
    run_id: str | None = None,
    runtime: str = "flower",
    strategy: Strategy | None = None,
) -> ExperimentResult:
    """Train for ``cfg.num_rounds`` rounds and write ``<results-dir>/<run-id>/``.

    Parameters
    ----------
    grid : Grid
        Flower's grid (simulation or deployment) or fededge's in-process grid.
    cfg : RunConfig
        The validated run config.
    run_id : str, optional
        Name of the run directory (default: timestamp and pid).
    runtime : str
        Recorded in config.json (``flower-simulation``, ``inprocess``, ...).
    strategy : Strategy, optional
        A strategy to use instead of the one ``cfg.strategy`` names.
    """
    device = resolve_device(cfg.server_device)
    ds = dataset_for(cfg)
    x_test, y_test = ds.x_test.to(device), ds.y_test.to(device)
    model = model_for(cfg, ds).to(device)
    initial = ArrayRecord(model.state_dict())
    strategy = strategy or build_strategy(cfg)
    # Gossip compresses its own messages (CHOCO): the Compressed wrapper would look for
    # uplink updates of a global model that gossip does not have. DGA runs its own loop and
    # decodes its replies' Δ(t) against G(g) itself.
    if ((cfg.compressor != "none" or cfg.downlink_compressor != "none")
            and not isinstance(strategy, (Compressed, Gossip, DGA))):
        strategy = Compressed(strategy, downlink=cfg.downlink_compressor)
    metered = MeteredGrid(grid)
    recorder = RunRecorder(
        cfg.results_dir, run_id or new_run_id(cfg.run_name), cfg.to_mapping(),
        target_accuracy=cfg.target_accuracy,
        extra={
            "device": str(device),
            "runtime": runtime,
            "strategy_class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "model_parameters": count_parameters(model),
            "train_examples": len(ds.x_train),
            "test_examples": len(ds.x_test),
        },
    )
    progress = Progress(cfg.progress, cfg.num_rounds)
    progress.note(
        f"run {recorder.run_id}: {cfg.strategy}, {cfg.model} on {cfg.dataset} "
        f"({cfg.partition}), device {device}; results in {recorder.run_dir.resolve()}"
    )

    final = {"arrays": initial}
    dga = strategy.config if isinstance(strategy, DGA) else None
    gossip = strategy if isinstance(strategy, Gossip) else None
    round_clock = RoundClock(cfg, recorder.run_dir, dga=dga, gossip=gossip is not None)
    asyn = strategy if isinstance(strategy, (AsyncFL, BackupWorkers)) else None
    if asyn is not None:
        asyn.attach_clock(round_clock.build, sim_step_s=cfg.sim_step_s)
    tally = {"staleness": Counter(), "contributions": Counter(), "dropped": Counter(), "late": Counter(),
             "sim_s": 0.0}

    def async_metrics(ainfo: AsyncRoundInfo) -> dict[str, Any]:
        """A version's staleness, who made it and who dropped; the run's tallies."""
        tally["staleness"].update(ainfo.staleness)
        tally["contributions"].update(ainfo.contributors)
        tally["dropped"].update(ainfo.dropped)
        tally["late"].update(ainfo.late)
        st = ainfo.staleness
        return {
            "staleness": sum(st) / len(st) if st else None,
            "staleness_max": max(st, default=None),
            "staleness_hist": {str(k): v for k, v in sorted(Counter(st).items())},
            "contributors": sorted(ainfo.contributors),
            "late": sorted(ainfo.late),
            "dropped": sorted(ainfo.dropped),
            "ssp_ahead": ainfo.ahead,
            "async_order": ainfo.order,
        }

    def gossip_metrics(rnd: int, ginfo: GossipRoundInfo, avg_acc: float, avg_loss: float) -> dict[str, Any]:
        """Every node's model on the test set, their spread, and the relay's accounting."""
        assert gossip is not None
        out: dict[str, Any] = {}
        if rnd == 0:  # every node holds the initial model
            out |= gossip.describe()
            accs, losses = [avg_acc] * len(gossip.nodes), [avg_loss] * len(gossip.nodes)
            progress.note(f"gossip: {out['topology_summary']}")
        else:
            accs, losses = [], []
            for i in sorted(ginfo.models):
                model.load_state_dict(ginfo.models[i])
                nl, na = evaluate(model, x_test, y_test)
                accs.append(na)
                losses.append(nl)
            out["spectral_gap"] = round(gossip.spectral_gap(), 6)
        out |= {
            "node_accuracy_mean": sum(accs) / len(accs) if accs else None,
            "node_accuracy_min": min(accs, default=None),
            "node_accuracy_max": max(accs, default=None),
            "node_loss_mean": sum(losses) / len(losses) if losses else None,
            "consensus_distance": ginfo.consensus_distance,
            "bytes_p2p": ginfo.bytes_p2p,
            "bytes_eval_up": ginfo.bytes_eval_up,
            "gossip_failed": sorted(ginfo.failed),
        }
        return out

    def report(text: str) -> None:
        """One line per client problem: on the progress stream, or logged when it is off."""
        if progress.mode == "off":
            log.warning(text)
        else:
            progress.note(text)

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        final["arrays"] = arrays
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, x_test, y_test)
        ainfo = asyn.take_round_info(rnd) if asyn is not None and rnd else None
        if asyn is not None:  # the messages this version used (others are still in flight)
            traffic = RoundTraffic()
            for group in ainfo.groups if ainfo else []:
                traffic.merge(metered.take(group))
        else:  # DGA keeps rounds in flight: take this round's messages only (its group id).
            traffic = metered.take(str(rnd) if dga is not None else None)
        comp = strategy.take_stats() if isinstance(strategy, (Compressed, DGA)) else None
        info = strategy.take_round_info(rnd) if isinstance(strategy, DGA) else None
        ginfo = gossip.take_round_info(rnd) if gossip is not None else None
        extra: dict[str, Any] = {}
        for err in traffic.errors:  # error replies: the ClientApp raised (dropouts are not errors)
            report(f"round {rnd}: a client failed: {err}")
        for reason in info.reasons if info else []:
            report(f"round {rnd}: a client update was rejected and left out: {reason}")
        if ginfo is not None:
            round_sim_s = round_clock.gossip_round_duration(ginfo, rnd) if rnd else 0.0
            extra |= gossip_metrics(rnd, ginfo, acc, loss)
            for reason in ginfo.reasons:
                report(f"round {rnd}: a gossip message was rejected and left out: {reason}")
            if rnd:
                extra["wait_s"] = None if round_clock.last_wait_s is None else round(round_clock.last_wait_s, 6)
        elif asyn is not None:
            round_sim_s = (ainfo.sim_s - tally["sim_s"]) if ainfo else 0.0
            tally["sim_s"] = ainfo.sim_s if ainfo else tally["sim_s"]
            if ainfo:
                extra |= async_metrics(ainfo)
                for reason in ainfo.reasons:
                    report(f"round {rnd}: a client update was rejected and left out: {reason}")
        else:
            round_sim_s = round_clock.round_duration(traffic, rnd)
            if traffic.dropped:
                extra["dropped"] = sorted(metered.partition_of.get(n, n) for n in traffic.dropped)
        # What each client did, so that the run can be re-timed under another network
        # (fededge.server.replay) without training again.
        extra["clients"] = [
            {"partition": n.partition_id, "compute_s": round(n.compute_s, 6),
             "bytes_down": n.bytes_down, "bytes_up": n.bytes_up}
            for n in sorted((n for n in traffic.nodes.values() if n.replied and n.partition_id is not None),
                            key=lambda n: n.partition_id)]
        if info is not None:
            extra |= {"dga_delay": info.delay, "dga_global_round": info.global_round,
                     "staleness": info.staleness_mean, "staleness_max": info.staleness_max,
                     "staleness_steps": (None if info.staleness_mean is None
                                         else info.staleness_mean * cfg.local_steps),
                     "wait_s": (None if round_clock.last_wait_s is None
                                else round(round_clock.last_wait_s, 6)),
                     "pipelined": info.pipelined}
        for reason in comp.reasons if comp else []:
            report(f"round {rnd}: a compressed update was rejected and left out: {reason}")
        # Gossip: what the relay carried for gossip; the CHOCO nodes' models sent only so
        # that the server can evaluate them are counted apart (bytes_eval_up).
        rec = recorder.record_round(
            rnd, accuracy=acc, loss=loss,
            bytes_up=traffic.bytes_up - (ginfo.bytes_eval_up if ginfo else 0),
            bytes_down=traffic.bytes_down,
            # The round on the simulated clock: download, compute (scaled by the client's
            # speed) and upload on each client's link (RoundClock).
            round_sim_s=round_sim_s,
            num_clients=(len(ginfo.nodes) if ginfo and rnd else len(ainfo.contributors) if ainfo else
                         0 if asyn is not None else
                         traffic.train_replies - (comp.rejected if comp else 0) - (info.rejected if info else 0)),
            failures=traffic.failures,
            rejected=((comp.rejected if comp else 0) + (info.rejected if info else 0)
                      + (ginfo.rejected if ginfo else 0) + (ainfo.rejected if ainfo else 0)),
            compression_ratio=comp.ratio if comp else None,
            extra=extra,
        )
        progress.update(rec)
        dropped_out = bool(traffic.dropped or (ainfo and ainfo.dropped))
        if rnd >= 1 and rec.num_clients == 0 and dropped_out and not traffic.errors:
            # Dropouts (no answer) are not errors: the model stays as it was and the run
            # goes on; a run whose clients all fail (errors, rejected updates) stops.
            progress.note(f"round {rnd}: no update: every selected client dropped out; the model is unchanged")
        elif rnd >= 1 and rec.num_clients == 0:
            first = (traffic.errors or (comp.reasons if comp else []) or ["no reply arrived within round-timeout"])[0]
            raise RoundFailedError(
                f"round {rnd}: no client update could be used ({traffic.failures} of "
                f"{traffic.replies} replies failed, {rec.rejected} rejected); first error: {first}"
            )
        return MetricRecord({"accuracy": acc, "loss": loss})

    try:
        needed = cfg.clients_per_round if isinstance(cfg.clients_per_round, int) else 1
        connected = wait_for_nodes(grid, max(needed, cfg.min_available_nodes), cfg.round_timeout)
        # Resolve the network assignment now, so that an unknown profile or a bad
        # netem-file stops the run before any training.
        assign_links(cfg.netem, max(connected, 1), seed=cfg.seed, netem_file=cfg.netem_file,
                     speed=cfg.compute_speed)
        split_s = check_data_split(grid, cfg)
        log.debug("the clients' data split checked in %.3f s", split_s)
        with seeded_sampling(cfg.seed):
            result = strategy.start(
                grid=metered, initial_arrays=initial, num_rounds=cfg.num_rounds,
                timeout=cfg.round_timeout, train_config=train_config(cfg),
                evaluate_fn=evaluate_fn,
            )
    except BaseException as err:
        progress.close()
        recorder.close(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    progress.close()
    if cfg.save_model:
        torch.save(final["arrays"].to_torch_state_dict(), recorder.run_dir / "model.pt")
    run_extra: dict[str, Any] = {}
    if asyn is not None:  # who contributed how often: the bias toward fast clients
        run_extra = {
            "staleness_hist": {str(k): v for k, v in sorted(tally["staleness"].items())},
            "contributions": {str(k): v for k, v in sorted(tally["contributions"].items())},
            "dropped_messages": {str(k): v for k, v in sorted(tally["dropped"].items())},
            "late_replies": {str(k): v for k, v in sorted(tally["late"].items())},
        }
    summary = recorder.close(extra=run_extra)
    progress.note(
        f"final accuracy {summary['final_accuracy']:.4f}; target {cfg.target_accuracy} "
        f"reached at round {summary['rounds_to_target']} (sim {summary['sim_s_to_target']} s); "
        f"results in {recorder.run_dir.resolve()}"
    )
    return ExperimentResult(recorder.run_dir, summary, result)
