"""Gossip (D-PSGD, CHOCO-SGD) over Flower's Grid: the server relays, it never averages.

Flower has no client-to-client channel, so the ServerApp is a relay. The arithmetic is
:mod:`fededge.algorithms.gossip` and the graph :mod:`fededge.topology` (both pure); this
module only moves messages. docs/topology.md ("How gossip runs on Flower") has the design.

**Nodes.** Every connected node takes part (``clients-per-round`` must be 1.0). Node i of
the topology is the i-th node id in increasing order: deterministic for a set of node ids,
known before round 1 (partition ids are only learnt from the replies). The set is fixed
at the start; ``min-available-nodes`` waits for N of them.

**A round t, in order.** The server sends node i one train message with

- ``config``: the train config, ``server-round = t``, ``gossip-index = i``, the algorithm
  and gamma, and the nonzero entries of row i of W(t-1) (``gossip-row-nodes`` /
  ``gossip-row-weights``), the weights of the mixing it must finish;
- ``gossip/<j>`` for each in-neighbour j whose round t-1 message arrived: D-PSGD, j's
  trained model (an ArrayRecord); CHOCO, j's compressed difference q_j (one uint8 bundle
  of fededge wire payloads, :func:`fededge.protocol.bundle_record`; raw float arrays
  when ``compressor="none"``);
- ``arrays`` in round 1 only (the seeded initial model every node starts from), and to a
  node that has never completed a round;
- ``gossip-hat/<j>`` (CHOCO only) to a node whose previous message failed: the public
  estimates x̂_j of itself and its neighbours as the relay holds them, so that its
  copies agree with everyone's again.

The node first finishes round t-1's gossip (D-PSGD: ``x_i = sum_j W_ij y_j``; CHOCO: apply
every q_j to x̂_j and step ``x_i += gamma sum_j W_ij (x̂_j - x̂_i)``), then runs its K local
SGD steps, giving y_i, and replies with its round-t message (D-PSGD: y_i; CHOCO:
``q_i = Q(y_i - x̂_i)``) and its metrics. That is train-then-mix per round, as Lian et al.
(2017) and the pure code (:func:`~fededge.algorithms.gossip.mix`,
:func:`~fededge.algorithms.gossip.choco_step`) write it; the mix of round t just happens
at the start of message t+1, where the neighbours' messages arrive.

**What the server keeps.** The round's messages, until it has relayed them. For
metrics it forms each node's mixed model x_i itself, with the node's own arithmetic: for
D-PSGD from the messages it relays (bit for bit what node i computes next); for CHOCO
from the node's trained y_i, which the node sends in a separate ``gossip-eval`` record
(evaluation traffic, counted apart as ``bytes_eval_up``), and the public estimates x̂_j,
which the relay updates with every q_j it forwards. The average of the x_i is only
evaluated, never sent.

**Failures.** A node whose reply fails sends no message that round. D-PSGD: its
neighbours mix without it, its weight moved to their own model
(:func:`~fededge.algorithms.gossip.effective_row`). CHOCO: a missing q_j is a zero
update, so every copy of x̂_j stays the same without renormalising; the failed node is
resynchronised (``gossip-hat/*``). The failed node itself keeps its last trained model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fededge import keys
from fededge._flwr_internals import sample_nodes, wire_size
from fededge.algorithms.gossip import (
    ChocoConfig,
    GossipConfig,
    ChocoNode,
    TIME_VARYING_CHOCO,
    Weights,
    GossipTimeline,
    GossipWork,
    consensus_distance,
    effective_row,
    mean_model,
    mix_row,
    mixing_row,
)
from fededge.errors import ConfigError
from fededge.protocol import decode_update_record
from fededge.strategies._replies import reported_partition
from fededge.strategies.report import RoundReport
from fededge.strategies.ownloop import OwnLoop
from fededge.strategies.resume import ResumeError, arrays_from_state, arrays_to_state, check_nodes, to_plain
from fededge.topology import Topology, build_topology

__all__ = ["Gossip", "GossipNode", "GossipRoundInfo"]

log = logging.getLogger("fededge")


@dataclass
class GossipNode:
    """One node's part of a round, for the clock and the metrics."""

    index: int
    node_id: int
    partition_id: int | None  # its client (link) on the clock: reported, or by node id
    compute_s: float | None  # reported; None: the clock charges its default (RunClock.compute_s)
    bytes_up: int  # its gossip message (what each out-neighbour receives)
    bytes_down: int  # what the relay sent it this round apart from neighbours' messages
    train_loss: float | None = None
    steps: int | None = None  # local steps it ran (the clock's sim-step-s)


@dataclass
class GossipRoundInfo:
    """What a gossip round did, for metrics.jsonl and the simulated clock."""

    algorithm: str
    nodes: list[GossipNode] = field(default_factory=list)  # those that replied
    edges: list[tuple[int, int]] = field(default_factory=list)  # (sender, receiver) indices
    models: dict[int, Weights] = field(default_factory=dict)  # index -> mixed model x_i
    consensus_distance: float = 0.0
    bytes_p2p: int = 0  # each message once per logical out-edge
    bytes_eval_up: int = 0  # the CHOCO nodes' models sent for evaluation only
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # indices whose reply was an error


class Gossip(OwnLoop):
    """Decentralized training (D-PSGD or CHOCO-SGD) with the server as a relay.

    See the module docstring for the messages and the order of operations.

    Parameters
    ----------
    topology, mixing, algorithm
        :class:`fededge.algorithms.gossip.GossipConfig`'s knobs (defaults, checks and
        meaning declared there). The graph is built when the run starts, for the number
        of connected nodes (a :class:`~fededge.topology.TopologyError` then stops the run
        before any training).
    topology_params : dict
        The family's own parameters (``k``, ``p``, ``path``), as
        :meth:`GossipConfig.topology_params` gives them.
    gamma : float
        CHOCO's consensus step size, :attr:`fededge.algorithms.gossip.ChocoConfig.gamma`
        (ignored by D-PSGD).
    seed : int
        Seeds the random graph families.
    **fedavg
        Flower's FedAvg arguments (record keys, ``min_available_nodes``).

    Examples
    --------
    >>> s = Gossip(topology="ring", algorithm="choco", gamma=0.05)
    """

    label = "gossip"
    #: A checkpoint of another algorithm or topology is refused by name.
    # (the graph, its weights and CHOCO's step: another seed or topology parameter makes
    # another random graph, which the saved estimates and nodes do not belong to)
    resume_settings = ("algorithm", "topology_name", "topology_params", "mixing_rule", "seed", "choco.gamma")
    #: Who holds a model (completed a round), who must be resynchronised (CHOCO), and
    #: each node index's partition on the clock.
    state_attrs = ("_synced", "_resync", "_partition")
    compressed_form = ("Gossip(algorithm=\"choco\", ...) beside the clients' GossipMod(update=update): "
                       "CHOCO-SGD compresses each node's message itself (its estimates keep what Q drops)")

    def __init__(self, *, topology: str = GossipConfig.topology, topology_params: dict[str, Any] | None = None,
                 mixing: str = GossipConfig.mixing, algorithm: str = GossipConfig.algorithm,
                 gamma: float = ChocoConfig.gamma, seed: int = 0, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        GossipConfig(algorithm=algorithm, topology=topology, mixing=mixing,
                     topology_file=str((topology_params or {}).get("path", "")))  # the names, checked
        self.topology_name = topology
        self.topology_params = dict(topology_params or {})
        self.mixing_rule = mixing
        self.algorithm = algorithm
        self.choco = ChocoConfig(gamma=gamma)
        self.seed = seed
        self.topology: Topology | None = None
        self.nodes: list[int] = []  # index -> node id
        self._info: dict[int, GossipRoundInfo] = {}
        self._timeline: GossipTimeline | None = None  # attach_clock: rounds timed edge by edge
        self._wait_s: float | None = None

    def summary(self) -> None:
        log.info("Gossip: %s on %s (%s mixing)", self.algorithm, self.topology_name, self.mixing_rule)

    def take_round_info(self, rnd: int) -> GossipRoundInfo | None:
        """The round's :class:`GossipRoundInfo` (once; the experiment records it)."""
        return self._info.pop(rnd, None)

    def round_report(self, server_round: int) -> RoundReport:
        """Round ``server_round``: every node's mixed model (evaluated by the caller), their
        spread, what the relay carried, and the round on the clock (round 0: the topology)."""
        info = self.take_round_info(server_round)
        if info is None:
            return RoundReport()
        metrics: dict[str, Any] = {"consensus_distance": info.consensus_distance, "bytes_p2p": info.bytes_p2p,
                                   "bytes_eval_up": info.bytes_eval_up, "gossip_failed": sorted(info.failed)}
        if server_round == 0:  # every node holds the initial model
            described = self.describe()
            initial = self._initial.to_torch_state_dict()
            return RoundReport(sim_s=0.0, metrics=described | metrics,
                               node_models={i: initial for i in range(len(self.nodes))},
                               notes=[f"gossip: {described['topology_summary']}"])
        sim_s = self._round_sim_s(info, server_round)
        return RoundReport(
            sim_s=sim_s, num_clients=len(info.nodes), rejected=info.rejected,
            reasons=[f"a gossip message was rejected and left out: {r}" for r in info.reasons],
            # The CHOCO nodes' models sent only so that the server can evaluate them.
            bytes_up_excluded=info.bytes_eval_up, node_models=info.models,
            metrics={"spectral_gap": round(self.spectral_gap(), 6), **metrics,
                     "wait_s": None if self._wait_s is None else round(self._wait_s, 6)})

    def _round_sim_s(self, info: GossipRoundInfo, t: int) -> float | None:
        """Round t on the clock: nodes by partition id (by node id for a ClientApp that
        reports none), edges as relayed; None without a clock (the caller then times it
        as a synchronous round)."""
        if self._clock is None:
            return None
        part = self._partition
        work = [GossipWork(part[x.index], self._clock.compute_s(x.compute_s, x.steps), x.bytes_up, x.bytes_down)
                for x in info.nodes if x.index in part]
        if self._timeline is None and work:
            self._timeline = GossipTimeline(self._clock.build(max(max(part.values()) + 1, len(part))))
        if self._timeline is None:
            return 0.0
        tl = self._timeline
        before = tl.end.get(t - 1, max(tl.end.values()))
        edges = [(part[s], part[r]) for s, r in info.edges if s in part and r in part]
        end = tl.run_round(t, work, edges)
        waits = [tl.waited[(t, w.client)] for w in work]
        self._wait_s = sum(waits) / len(waits) if waits else None
        return end - before

    def spectral_gap(self) -> float:
        assert self.topology is not None
        return self.topology.spectral_gap(rule=self.mixing_rule)

    def describe(self) -> dict[str, Any]:
        """The topology for the first line of metrics.jsonl (after :meth:`start` built it)."""
        assert self.topology is not None
        return {"topology": self.topology.name, "topology_n": self.topology.n,
                "topology_edges": len(self.topology.edges), "mixing": self.mixing_rule,
                "gossip_algorithm": self.algorithm,
                "gossip_gamma": self.choco.gamma if self.algorithm == "choco" else None,
                "spectral_gap": round(self.spectral_gap(), 6),
                "topology_summary": self.topology.summary(rule=self.mixing_rule)}

    # ----------------------------------------------------------------- checkpoints
    # OwnLoop.attach_checkpoint: rounds run in lock-step, so nothing is out between two.
    def _extra_state(self) -> dict[str, Any]:
        """Besides the settings, rounds done, who holds a model, who must be
        resynchronised and the nodes' places on the clock (OwnLoop's): the nodes (index
        -> node id), the initial model (sent to a node that never completed a round), the
        messages to relay in the next round, CHOCO's public estimates and the gossip
        timeline."""
        tl = self._timeline
        return {
            "nodes": list(self.nodes), "initial": arrays_to_state(self._initial),
            "graph": None if self.topology is None else self.topology.digest(),
            "result": arrays_to_state(self._result.arrays),
            "last": {int(i): arrays_to_state(a) for i, a in self._last.items()},
            "hats": [{k: v.detach().clone() for k, v in h.items()} for h in self._hats],
            "timeline": None if tl is None else {
                "free": {int(c): float(v) for c, v in tl.free.items()},
                "ready": {int(c): float(v) for c, v in tl.ready.items()},
                "end": {int(r): float(v) for r, v in tl.end.items()}},
        }

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of fededge before OwnLoop: its ``algorithm``, ``topology``,
        ``synced``, ``resync`` and ``partition`` keys."""
        return {**state, "settings": {"algorithm": state["algorithm"], "topology_name": state["topology"]},
                "attrs": {"_synced": to_plain({int(i) for i in state["synced"]}),
                          "_resync": to_plain({int(i) for i in state["resync"]}),
                          "_partition": {int(i): int(p) for i, p in state["partition"].items()}}}

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        """The same nodes (:class:`~fededge.strategies.resume.ResumeError` if the grid
        lacks one), their models, estimates and timeline; the rounds done."""
        check_nodes(state["nodes"], grid, "gossip")
        self._initial = arrays_from_state(state["initial"])
        self._result.arrays = arrays_from_state(state["result"])
        self._last = {int(i): arrays_from_state(a) for i, a in state["last"].items()}
        self._hats = [dict(h) for h in state["hats"]]
        tl = state["timeline"]
        if tl is not None:
            if self._clock is None or self._clock.clock is None:
                raise ResumeError("gossip: the checkpoint has the gossip timeline on the simulated clock, "
                                  "but this run's clock was not restored first")
            self._timeline = GossipTimeline(self._clock.clock)
            self._timeline.free = {int(c): float(v) for c, v in tl["free"].items()}
            self._timeline.ready = {int(c): float(v) for c, v in tl["ready"].items()}
            self._timeline.end = {int(r): float(v) for r, v in tl["end"].items()}
        return int(state["round"])

    # ----------------------------------------------------------------- the run
    def _prepare(self, grid: Grid, initial_arrays: ArrayRecord, resume: dict[str, Any] | None) -> None:
        if resume is None:
            _, nodes = sample_nodes(grid, self.min_available_nodes, 0)  # waits, samples nothing
            self.nodes = sorted(int(n) for n in nodes)
        else:  # node i is the saved i-th node id
            self.nodes = [int(n) for n in resume["nodes"]]
        n = len(self.nodes)
        # Before any training: a graph these nodes cannot form stops the run here.
        self.topology = build_topology(self.topology_name, n, seed=self.seed, **self.topology_params)
        if resume is not None and resume.get("graph") not in (None, self.topology.digest()):
            # The settings name a topology file, not what it holds: one edited since the
            # checkpoint would mix other neighbours' models (CHOCO: from nodes whose
            # estimates no one holds).
            raise ResumeError(f"gossip: topology {self.topology_name!r} {self.topology_params or ''} now builds "
                              "another graph than the checkpoint's (a topology file edited since?); resume "
                              "with the graph the run was made with")
        if self.algorithm == "choco" and self.topology.time_varying:
            raise ValueError(f"topology {self.topology_name!r}: {TIME_VARYING_CHOCO}")
        for t in range(self.topology.period):
            self.topology.mixing(t, rule=self.mixing_rule)  # validated now, not in round t
        log.info("Gossip: %s, %d nodes (node i = the i-th node id in increasing order); %s",
                 self.algorithm, n, self.topology.summary(rule=self.mixing_rule))
        self._initial = initial_arrays
        self._float_keys = [k for k, v in initial_arrays.to_torch_state_dict().items() if v.is_floating_point()]
        self._max_elements = max((v.numel() for v in initial_arrays.to_torch_state_dict().values()), default=1)
        self._shapes = {k: v for k, v in initial_arrays.to_torch_state_dict().items()}  # (shapes, dtypes)
        self._last: dict[int, ArrayRecord] = {}  # index -> its message of the previous round
        self._synced: set[int] = set()  # nodes that completed a round (hold a model)
        self._resync: set[int] = set()  # CHOCO nodes whose estimates must be resent
        init = {k: v.detach().clone() for k, v in initial_arrays.to_torch_state_dict().items()}
        self._hats: list[Weights] = [{k: init[k].clone() for k in self._float_keys} for _ in range(n)]
        self._result.arrays = initial_arrays
        self._partition: dict[int, int] = {}
        if resume is None and self._evaluate_fn:  # round 0's report: every node holds the initial model
            self._info[0] = GossipRoundInfo(algorithm=self.algorithm, models={})

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        for t in range(done + 1, num_rounds + 1):
            messages = [self._message(t, i) for i in range(len(self.nodes))]
            down = {i: m[1] for i, m in enumerate(messages)}
            replies = list(grid.send_and_receive([m[0] for m in messages], timeout=timeout))
            self._finish_round(t, replies, down)
            self._evaluate(t)
            self._round_done(t)

    # ----------------------------------------------------------------- messages
    def _row(self, t: int, i: int) -> dict[int, float]:
        assert self.topology is not None
        return mixing_row(self.topology.mixing(t, rule=self.mixing_rule), i)

    def _message(self, t: int, i: int) -> tuple[Message, int]:
        """Round t's message to node i, and its bytes apart from the neighbours' messages."""
        assert self.topology is not None
        config = ConfigRecord(dict(self._train_config))
        config[keys.SERVER_ROUND] = t
        config[keys.GOSSIP_INDEX] = i
        config[keys.GOSSIP_ALGORITHM] = self.algorithm
        config[keys.GOSSIP_GAMMA] = self.choco.gamma
        config[keys.GOSSIP_EVAL] = self.algorithm == "choco"
        own = RecordDict({self.configrecord_key: config})
        # The mixing of round t-1 (W of that round); in round 1 W(0)'s row only tells
        # a CHOCO node whose estimates to keep.
        row = self._row(max(t - 2, 0), i)
        config[keys.GOSSIP_ROW_NODES] = list(row)
        config[keys.GOSSIP_ROW_WEIGHTS] = list(row.values())
        if i not in self._synced:
            own[self.arrayrecord_key] = self._initial
        if self.algorithm == "choco" and i in self._resync:
            for j in sorted({i, *self.topology.in_neighbours(i)}):
                own[f"{keys.GOSSIP_HAT}{j}"] = ArrayRecord(
                    {k: Array(v.numpy()) for k, v in self._hats[j].items()})
        # What the node receives apart from its neighbours' messages (config, first
        # model, resync), measured without them: a few bytes of framing per relayed
        # record are left out of it, not double-counted.
        own_bytes = wire_size(own)
        content = RecordDict({name: own[name] for name in own.keys()})
        if t > 1:
            for j in self.topology.in_neighbours(i, t - 2):
                if j in self._last:
                    content[f"{keys.GOSSIP_FROM}{j}"] = self._last[j]
        msg = Message(content, dst_node_id=self.nodes[i], message_type=MessageType.TRAIN, group_id=str(t))
        return msg, own_bytes

    # ----------------------------------------------------------------- replies
    def _usable(self, reply: Message) -> str | None:
        c = reply.content
        if keys.GOSSIP_MESSAGE not in c.array_records:
            return (f"reply has no '{keys.GOSSIP_MESSAGE}' ArrayRecord (has {list(c.keys())}): its ClientApp "
                    "runs no GossipMod; add GossipMod(...) to its mods (fededge.api)")
        if self.algorithm == "choco" and keys.GOSSIP_EVAL_ARRAYS not in c.array_records:
            return f"CHOCO reply has no '{keys.GOSSIP_EVAL_ARRAYS}' ArrayRecord"
        if keys.METRICS not in c.metric_records:
            return f"reply has no '{keys.METRICS}' MetricRecord"
        return None

    def _finish_round(self, t: int, replies: list[Message], down: dict[int, int]) -> None:
        assert self.topology is not None
        index = {node: i for i, node in enumerate(self.nodes)}
        info = GossipRoundInfo(algorithm=self.algorithm)
        sent: dict[int, ArrayRecord] = {}
        trained: dict[int, Weights] = {}
        for r in replies:
            i = index.get(r.metadata.src_node_id)
            if i is None:
                continue
            why = r.error.reason if r.has_error() else self._usable(r)
            eval_bytes = 0
            if why is None:
                try:
                    rec = r.content[keys.GOSSIP_MESSAGE]
                    if self.algorithm == "choco":
                        q = decode_update_record(rec, max_elements=self._max_elements)
                        if sorted(q) != sorted(self._float_keys):
                            raise ValueError(f"its message has tensors {sorted(q)[:5]}, the model "
                                             f"{sorted(self._float_keys)[:5]}")
                        _check_shapes(q, self._hats[i], "its message")
                        trained[i] = dict(r.content[keys.GOSSIP_EVAL_ARRAYS].to_torch_state_dict())
                        _check_shapes(trained[i], self._shapes, "its model")
                        eval_bytes = wire_size(r.content[keys.GOSSIP_EVAL_ARRAYS])
                        # in the estimate's dtype, as the node and its neighbours add it
                        self._hats[i] = {k: v + q[k].to(v.dtype) for k, v in self._hats[i].items()}
                    else:
                        trained[i] = dict(rec.to_torch_state_dict())
                        if set(trained[i]) != set(self._initial.keys()):
                            raise ValueError(f"its model has tensors {sorted(trained[i])[:5]}, not the "
                                             f"model's")
                        # (mixed at the relay and by the neighbours: a tensor of another shape
                        # stopped the run here, or broadcast into them)
                        _check_shapes(trained[i], self._shapes, "its model")
                except Exception as err:  # a malformed message must not poison the neighbours
                    trained.pop(i, None)
                    why = f"{type(err).__name__}: {err}"
            if why is not None:
                info.failed.append(i)
                if not r.has_error():
                    info.rejected += 1
                    info.reasons.append(f"node {r.metadata.src_node_id} (gossip index {i}): {why}")
                # Reported once by the caller: errors from the grid's metering, rejections
                # from take_round_info().reasons.
                log.debug("gossip round %d: node %d (index %d) left out: %s", t, r.metadata.src_node_id, i, why)
                continue
            sent[i] = rec
            metrics = r.content[keys.METRICS]
            # The node's client (link) on the clock: the partition id it reports, or, from a
            # ClientApp that reports none, its node id's index among the run's (RunClock.place).
            reported = reported_partition(r)
            placed = reported if self._clock is None else self._clock.place(r.metadata.src_node_id, reported)
            if placed is not None:
                self._partition[i] = placed
            eval_bytes = eval_bytes if self.algorithm == "choco" else 0
            info.bytes_eval_up += eval_bytes
            reply_bytes = wire_size(r) - eval_bytes
            info.nodes.append(GossipNode(
                index=i, node_id=r.metadata.src_node_id, partition_id=self._partition.get(i),
                compute_s=float(metrics[keys.COMPUTE_S]) if keys.COMPUTE_S in metrics else None,
                bytes_up=reply_bytes,
                bytes_down=down.get(i, 0), train_loss=float(metrics.get(keys.TRAIN_LOSS, float("nan"))),
                steps=int(metrics[keys.LOCAL_STEPS_DONE]) if keys.LOCAL_STEPS_DONE in metrics else None))
        no_mod = [x for x in info.reasons if "runs no GossipMod" in x]
        if not sent and no_mod and len(no_mod) == len(info.reasons):
            # No node runs GossipMod: every later round would be refused the same way.
            raise ConfigError(f"gossip round {t}: no reply is a gossip message: {no_mod[0]}")
        missing = sorted(set(range(len(self.nodes))) - set(sent) - set(info.failed))
        info.failed.extend(missing)  # no reply within the timeout
        for i in info.failed:
            self._resync.add(i)
            # Its next message brings a model too: a node that lost its state (a SuperNode
            # restarted) starts from it (one that kept its own uses that); without it the
            # node failed every later round.
            self._synced.discard(i)
        for i in sent:
            self._synced.add(i)
            self._resync.discard(i)
        # Who receives each message (the relay sends it in round t+1): the p2p figure.
        for j, rec in sent.items():
            outs = self.topology.out_neighbours(j, t - 1)
            info.bytes_p2p += wire_size(rec) * len(outs)
            info.edges.extend((j, k) for k in outs)
        info.models = self._mixed_models(t, trained, set(sent))
        if info.models:
            models = [info.models[i] for i in sorted(info.models)]
            info.consensus_distance = consensus_distance(models)
            avg = mean_model(models)
            self._result.arrays = ArrayRecord({k: avg[k] for k in self._initial.keys()})
        self._last = sent
        self._info[t] = info

    def _mixed_models(self, t: int, trained: dict[int, Weights], delivered: set[int]) -> dict[int, Weights]:
        """x_i after round t's gossip, for each node that replied: what node i computes at
        the start of its next message, with the same function and the same inputs."""
        assert self.topology is not None
        out = {}
        for i, y in trained.items():
            row = self._row(t - 1, i)
            if self.algorithm == "dpsgd":
                avail = set(self.topology.in_neighbours(i, t - 1)) & delivered
                w = effective_row(row, avail, own=i)
                out[i] = mix_row({j: trained[j] for j in w}, w, own=i)
            else:
                node = ChocoNode.from_estimates(self.choco, i, {j: self._hats[j] for j in row})
                out[i] = node.mix(y, row)
        return out

    # Flower's per-round hooks are not how gossip runs: start() drives it.
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        raise NotImplementedError("Gossip runs its own round loop: call start()")


def _check_shapes(got: Weights, model: Mapping[str, Any], what: str) -> None:
    """Every tensor of ``got`` of its tensor's shape in ``model``, floating where it is."""
    for k, v in got.items():
        ref = model.get(k)
        if ref is None:
            continue
        if tuple(v.shape) != tuple(ref.shape) or v.is_floating_point() != ref.is_floating_point():
            raise ValueError(f"{what}: tensor {k!r} is {v.dtype} {tuple(v.shape)}, the model's "
                             f"{ref.dtype} {tuple(ref.shape)}")
