"""fededge's ClientApp: local SGD on the node's partition, and the library's mods.

It answers the messages of Flower's own strategies (records ``arrays`` / ``config``,
weight ``num-examples``), so ``flwr.serverapp.strategy.FedAdam`` and friends work
unchanged. Its train function is plain local SGD (:func:`fededge.clients.train.local_sgd`):
load the received weights, run K steps, reply the weights and the metrics. Compression,
DGA and gossip come from the same client mods any Flower app uses
(:mod:`fededge.clients.mods`), configured from the run config this app parses itself
(:func:`run_config_mods`): fededge's app is the first user of the library, not a
second path.

Node config (set by Flower's simulation, or per SuperNode with
``flower-supernode --node-config 'partition-id=3 num-partitions=10 data-dir="/data"'``;
Flower parses the values as TOML, so strings are quoted): ``partition-id``,
``num-partitions`` and optionally ``data-dir``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fededge import keys
from fededge._flwr_internals import ClientAppCallable, Mod
from fededge.arrays import record_from_torch, record_to_torch
from fededge.catalog import strategy_record
from fededge.clients.device import resolve_device, set_cuda_determinism
from fededge.clients.mods import CompressionMod, DGAMod, GossipMod, config_error_mod, offer_norm_statistics
from fededge.clients.preview import PreviewMod
from fededge.clients.statestore import StateSpillMod, StateStoreMod
from fededge.clients.cohort import local_sgd
from fededge.clients.train import BatchSampler, evaluate, norm_statistics, scheduled_lr
from fededge.config import RunConfig
from fededge.netem.assign import dropped_partitions
from fededge.protocol import norm_stats_content
from fededge.models.zoo import build_model
from fededge.workload import client_data, dataset_for

__all__ = ["app", "ClientWorkload", "client_mods", "client_workload", "round_lr", "run_config_mods", "run_config_of", "train"]

# A configuration error (say, a data split that cannot give this node min-partition-size
# samples) comes back to the server as a named error that stops the run.
app = ClientApp(mods=[config_error_mod])


@lru_cache(maxsize=8)
def client_mods(cfg: RunConfig, *, inprocess: bool = False) -> tuple[Mod, ...]:
    """The library mods a run config asks for, outermost first (their order is
    explained in :mod:`fededge.clients.mods`).

    ``client-states="disk"`` gives a :class:`StateSpillMod`, outermost, so that the mods
    that keep state find it loaded and it is saved after them (the state store's write
    included), except on a node of fededge's in-process runtime (``inprocess``: its node
    config has ``fededge-inprocess``), which keeps idle nodes' states on disk itself.
    ``compressor`` / ``downlink-compressor`` give a :class:`CompressionMod` (except with
    gossip, whose CHOCO messages :class:`GossipMod` encodes itself); ``strategy="dga"`` a
    :class:`DGAMod` (and, with ``dga-compute-ahead``, a
    :class:`~fededge.clients.preview.PreviewMod` outside the state store, so that a
    message standing for a preview is the round's content before any other mod reads
    it); ``strategy="gossip"`` a :class:`GossipMod` with the compressor and
    ``choco-scale``. Everything else about DGA and gossip travels in the server's messages.

    Examples
    --------
    >>> [type(m).__name__ for m in client_mods(RunConfig(strategy="dga", compressor="topk"))]
    ['StateStoreMod', 'CompressionMod', 'DGAMod']
    >>> [type(m).__name__ for m in client_mods(RunConfig(compressor="topk", client_states="disk"))]
    ['StateSpillMod', 'StateStoreMod', 'CompressionMod']
    """
    mods: list[Mod] = []
    record = strategy_record(cfg.strategy)  # what the strategy's record asks of the ClientApp
    side = record.client_side
    if cfg.client_states == "disk" and not inprocess:
        mods.append(StateSpillMod())
    if side == "dga" and cfg.dga_compute_ahead:
        mods.append(PreviewMod())
    if cfg.checkpoint_every > 0:  # acts only when the server asks (its runtime keeps no client state)
        mods.append(StateStoreMod())
    if side != "gossip" and (cfg.compressor != "none" or cfg.downlink_compressor != "none"):
        mods.append(CompressionMod(cfg.update_config()))
    if side == "dga":
        mods.append(DGAMod())
    if side == "gossip":
        mods.append(GossipMod(cfg.update_config(), choco_scale=cfg.choco_scale))
    mods.extend(record.mods_for(cfg))  # a registered strategy's own client mods, innermost
    return tuple(mods)


def run_config_mods(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A mod that runs :func:`client_mods` of this run's config around ``call_next``."""
    inprocess = bool(context.node_config.get(keys.INPROCESS_NODE, False))
    for mod in reversed(client_mods(run_config_of(context), inprocess=inprocess)):
        call_next = _wrap(mod, call_next)
    return call_next(msg, context)


def run_config_of(context: Context) -> RunConfig:
    """``context.run_config`` parsed (:meth:`RunConfig.from_mapping`), once per distinct
    run config in this process: every message of a run carries the same one, and parsing
    it (~0.3 ms) was paid twice per message. RunConfig is frozen, so sharing is safe."""
    items = tuple(sorted(context.run_config.items()))
    try:
        return _parsed(items)
    except TypeError:  # an unhashable value (not Flower's scalar types): parse it every time
        return RunConfig.from_mapping(context.run_config)


@lru_cache(maxsize=8)
def _parsed(items: tuple[tuple[str, Any], ...]) -> RunConfig:
    return RunConfig.from_mapping(dict(items))


def _wrap(mod: Mod, inner: ClientAppCallable) -> ClientAppCallable:
    return lambda msg, context: mod(msg, context, inner)


@dataclass
class ClientWorkload:
    """What a node keeps in memory between messages: its data and a model to load into."""

    cfg: RunConfig
    partition_id: int
    num_partitions: int
    device: torch.device
    x: torch.Tensor
    y: torch.Tensor
    model: nn.Module


def client_workload(context: Context) -> ClientWorkload:
    """Parse the run config and build (or reuse) this node's data and model."""
    cfg = run_config_of(context)
    nc = context.node_config
    missing = [k for k in (keys.PARTITION_ID, keys.NUM_PARTITIONS) if k not in nc]
    if missing:
        raise KeyError(
            f"node config lacks {', '.join(missing)}: start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        )
    data_dir = str(nc.get(keys.DATA_DIR, "")) or cfg.data_dir or None
    pid, n = int(nc[keys.PARTITION_ID]), int(nc[keys.NUM_PARTITIONS])
    # device=auto: the in-process runtime's measured choice, the same for every node.
    device = resolve_device(str(nc.get(keys.CLIENT_DEVICE, "auto")) if cfg.device == "auto" else cfg.device)
    set_cuda_determinism(device, cfg.deterministic)
    # Cached on the data's own key. A node of the in-process runtime shares its process with
    # thousands of others: its arrays are a slice of the data set in memory, not a file each.
    x, y = client_data(cfg, pid, n, device, data_dir, on_disk=not nc.get(keys.INPROCESS_NODE, False))
    ds = dataset_for(cfg, data_dir)
    model = _model(cfg.model, ds.input_shape, ds.num_classes, str(device))
    return ClientWorkload(cfg, pid, n, device, x, y, model)


@lru_cache(maxsize=4)
def _model(name: str, input_shape: tuple[int, ...], num_classes: int, device: str) -> nn.Module:
    # One model object per process and architecture: each message loads the received
    # weights into it, so its initial values never matter. A process runs one message
    # at a time (Ray actor, flwr-clientapp process, in-process grid): sharing is safe.
    model = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=0).to(device)
    # Warm up once, outside the timed region: the first forward and backward pass in a
    # process initialises torch's kernels and autograd, which is not per-round compute
    # and would otherwise inflate round 1 of the simulated clock. (The SGD step is
    # fededge's own, clients.train.sgd_step: torch.optim would import torch._dynamo.)
    x = torch.zeros((2, *input_shape), device=device)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return model


def _sampler(work: ClientWorkload, context: Context, batch_size: int) -> BatchSampler:
    sampler = BatchSampler(len(work.x), batch_size, seed=work.cfg.seed, stream=work.partition_id)
    if keys.STATE_SAMPLER in context.state:
        rec = context.state[keys.STATE_SAMPLER]
        sampler.load_state_dict({"epoch": int(rec["epoch"]), "cursor": int(rec["cursor"])})
    return sampler


def _kept_momentum(context: Context, work: ClientWorkload) -> dict[str, torch.Tensor]:
    """``keep-momentum``: the momentum buffers this node's last round ended with (empty
    before its first round), on the model's device."""
    if keys.STATE_MOMENTUM not in context.state:
        return {}
    rec = context.state[keys.STATE_MOMENTUM]
    if not isinstance(rec, ArrayRecord):
        raise TypeError(f"context.state['{keys.STATE_MOMENTUM}'] is a {type(rec).__name__}, not the ArrayRecord "
                        "of momentum buffers keep-momentum keeps there")
    return {name: t.to(work.device) for name, t in record_to_torch(rec).items()}


def _received_arrays(msg: Message) -> ArrayRecord:
    if keys.ARRAYS not in msg.content:
        raise KeyError(
            f"train/evaluate message has no '{keys.ARRAYS}' record (it has "
            f"{list(msg.content.keys())}); is the server strategy's arrayrecord_key "
            f"'{keys.ARRAYS}'?"
        )
    return msg.content[keys.ARRAYS]


@app.train(mods=[run_config_mods])
def train(msg: Message, context: Context) -> Message:
    """Load the received weights, run K local SGD steps, reply with the new weights."""
    work = client_workload(context)
    cfg = work.cfg
    if work.partition_id in dropped_partitions(work.num_partitions, cfg.dropout, seed=cfg.seed):
        return _dropped_reply(msg, work)
    conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content else ConfigRecord()
    work.model.load_state_dict(record_to_torch(_received_arrays(msg), copy=False))  # copies them
    sampler = _sampler(work, context, int(conf.get(keys.BATCH_SIZE, cfg.batch_size)))
    momentum = float(conf.get(keys.MOMENTUM, cfg.momentum))
    buffers = _kept_momentum(context, work) if cfg.keep_momentum and momentum != 0 else None

    threads = torch.get_num_threads()
    if cfg.client_threads:
        torch.set_num_threads(cfg.client_threads)
    try:
        if work.device.type == "cuda":
            torch.cuda.synchronize(work.device)
        t0 = time.perf_counter()
        result = local_sgd(
            work.model, work.x, work.y,
            steps=int(conf.get(keys.LOCAL_STEPS, cfg.local_steps)),
            lr=round_lr(conf, cfg.local_lr),
            momentum=momentum,
            weight_decay=float(conf.get(keys.WEIGHT_DECAY, cfg.weight_decay)),
            sampler=sampler,
            proximal_mu=float(conf.get(keys.PROXIMAL_MU, 0.0)),
            momentum_buffers=buffers,
        )
        if work.device.type == "cuda":
            torch.cuda.synchronize(work.device)
        # In a cohort (clients.cohort.run_together) the call also waited for the others:
        # this client is charged what one client of its group takes on its own instead.
        compute_s = time.perf_counter() - t0 if result.compute_s is None else result.compute_s
    finally:
        torch.set_num_threads(threads)  # the process may be shared (in-process runtime)

    context.state[keys.STATE_SAMPLER] = ConfigRecord(sampler.state_dict())
    if buffers:
        context.state[keys.STATE_MOMENTUM] = record_from_torch(buffers)
    metrics = MetricRecord({
        keys.NUM_EXAMPLES: len(work.x),
        keys.TRAIN_LOSS: result.mean_loss,
        keys.COMPUTE_S: compute_s,
        keys.LOCAL_STEPS_DONE: result.steps,
        keys.REPLY_PARTITION_ID: work.partition_id,
        keys.REPLY_NUM_PARTITIONS: work.num_partitions,
    })
    # on_device=None: a GPU model stays on the GPU where the reply crosses no wire (direct delivery)
    content = RecordDict({keys.ARRAYS: record_from_torch(work.model.state_dict(), on_device=None), keys.METRICS: metrics})
    if cfg.compressor != "none":
        offer_norm_statistics(partial(_statistics_of, work, batch_size=sampler.batch_size,
                                      seed=_stats_seed(cfg.seed, work.partition_id, int(conf.get(keys.SERVER_ROUND, 0)))))
    return Message(content=content, reply_to=msg)


def _stats_seed(*parts: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def _statistics_of(work: ClientWorkload, weights: dict[str, torch.Tensor], *, batch_size: int,
                   seed: int, batches: int | None = None) -> dict[str, torch.Tensor]:
    """The normalisation statistics of ``weights`` on this client's data, on a copy of the
    model, over ``batches`` mini-batches (default ``norm-stats-batches``): norm-stats =
    decoded (:class:`~fededge.clients.mods.CompressionMod`) and global (:func:`norm_stats`)."""
    model = copy.deepcopy(work.model)
    model.load_state_dict({k: v.to(work.device) for k, v in weights.items()})
    return norm_statistics(model, work.x, batches=work.cfg.norm_stats_batches if batches is None else batches,
                           batch_size=batch_size, seed=seed)


def round_lr(conf: ConfigRecord, default: float) -> float:
    """The local learning rate a train message's config asks for.

    ``local-lr`` (``default`` when absent). When the config carries ``lr-schedule`` (the
    server's :func:`~fededge.server.runner.train_config` with a schedule), the rate
    of round ``server-round`` of ``num-rounds`` under it
    (:func:`fededge.clients.train.scheduled_lr`). A ClientApp of one's own can call this
    on the config it receives to follow the same schedule.

    Raises ``ValueError`` naming the missing key when a schedule comes without
    ``server-round`` or ``num-rounds``, and the schedule's own error for a bad value.
    """
    base = float(conf.get(keys.LOCAL_LR, default))
    if keys.LR_SCHEDULE not in conf:
        return base
    missing = [k for k in (keys.SERVER_ROUND, keys.NUM_ROUNDS) if k not in conf]
    if missing:
        raise ValueError(f"the train config has '{keys.LR_SCHEDULE}' but no {' or '.join(repr(k) for k in missing)}: "
                         "the strategy must send the round (Flower's and fededge's do), and the server "
                         "fededge.server.runner.train_config's keys")
    return scheduled_lr(base, int(conf[keys.SERVER_ROUND]), int(conf[keys.NUM_ROUNDS]),
                        schedule=str(conf[keys.LR_SCHEDULE]),
                        warmup_rounds=int(conf.get(keys.LR_WARMUP_ROUNDS, 0)))


def _dropped_reply(msg: Message, work: ClientWorkload) -> Message:
    """A client the ``dropout`` fraction takes out: it does no work and stands for a node
    that never answers. The reply only says so (and who it is); the server's grid turns
    it into a missing reply and the simulated clock charges the round-timeout."""
    return Message(content=RecordDict({keys.METRICS: MetricRecord({
        keys.DROPPED_OUT: 1, keys.REPLY_PARTITION_ID: work.partition_id,
        keys.REPLY_NUM_PARTITIONS: work.num_partitions})}), reply_to=msg)


@app.query()
def node_info(msg: Message, context: Context) -> Message:
    """This node's place in the data split: ``partition-id`` and ``num-partitions``.

    In Flower's simulation the server asks one node before round 1, so that it can check
    the clients' partition (:func:`fededge.workload.check_partition`) once, itself. The
    reply holds only what the node config has; no data is loaded.
    """
    nc = context.node_config
    metrics = MetricRecord({reply: int(nc[node]) for reply, node in (
        (keys.REPLY_PARTITION_ID, keys.PARTITION_ID), (keys.REPLY_NUM_PARTITIONS, keys.NUM_PARTITIONS))
        if node in nc})
    return Message(content=RecordDict({keys.METRICS: metrics}), reply_to=msg)


@app.query(keys.NORM_STATS_ACTION)
def norm_stats(msg: Message, context: Context) -> Message:
    """norm-stats = global: the normalisation statistics of the model the message carries
    (the server's aggregated model, :class:`~fededge.strategies.normstats.NormCalibrated`)
    on ``norm-stats-batches`` of this client's mini-batches, forward only, and this
    client's data size as their pooling weight."""
    work = client_workload(context)
    cfg = work.cfg
    if work.partition_id in dropped_partitions(work.num_partitions, cfg.dropout, seed=cfg.seed):
        return _dropped_reply(msg, work)
    conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content else ConfigRecord()
    batches = int(conf.get(keys.NORM_STATS_BATCHES, cfg.norm_stats_batches))
    t0 = time.perf_counter()
    stats = _statistics_of(work, record_to_torch(_received_arrays(msg)), batch_size=cfg.batch_size, batches=batches,
                           seed=_stats_seed(cfg.seed, work.partition_id, int(conf.get(keys.SERVER_ROUND, 0)), 1))
    content = norm_stats_content(stats, num_examples=len(work.x), compute_s=time.perf_counter() - t0)
    content[keys.METRICS][keys.REPLY_PARTITION_ID] = work.partition_id
    content[keys.METRICS][keys.REPLY_NUM_PARTITIONS] = work.num_partitions
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Federated evaluation: the received model on this node's local training data.

    The held-out test set is evaluated centrally by the server every round; this
    reports how well the global model fits each client's own (possibly skewed) data.
    """
    work = client_workload(context)
    if work.partition_id in dropped_partitions(work.num_partitions, work.cfg.dropout, seed=work.cfg.seed):
        return _dropped_reply(msg, work)
    work.model.load_state_dict(record_to_torch(_received_arrays(msg), copy=False))  # copies them
    t0 = time.perf_counter()
    loss, acc = evaluate(work.model, work.x, work.y)
    # Where and how long, for the simulated clock (which times the evaluation after the
    # training): without them the node was placed on another client's link and charged
    # the round trip's real seconds.
    metrics = MetricRecord({keys.NUM_EXAMPLES: len(work.x), "eval-loss": loss, "eval-acc": acc,
                            keys.COMPUTE_S: time.perf_counter() - t0, keys.REPLY_PARTITION_ID: work.partition_id,
                            keys.REPLY_NUM_PARTITIONS: work.num_partitions})
    return Message(content=RecordDict({keys.METRICS: metrics}), reply_to=msg)
