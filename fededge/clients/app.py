"""fededge's ClientApp: local SGD on the node's partition, as a thin Flower wrapper.

It answers the messages of Flower's own strategies (records ``arrays`` / ``config``,
weight ``num-examples``), so ``flwr.serverapp.strategy.FedAdam`` and friends work
unchanged. The arithmetic is :func:`fededge.clients.train.local_sgd`.

Node config (set by Flower's simulation, or per SuperNode with
``flower-supernode --node-config 'partition-id=3 num-partitions=10 data-dir="/data"'``;
Flower parses the values as TOML, so strings are quoted): ``partition-id``,
``num-partitions`` and optionally ``data-dir``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fededge import keys
from fededge.algorithms.dga import DGAClient, DGAConfig
from fededge.algorithms.gossip import (
    ChocoConfig, ChocoNode, GossipError, Weights, _apply, _choco_update, effective_row, mix_row,
)
from fededge.clients.device import resolve_device
from fededge.clients.mods import bundle_record, compression_mod, config_error_mod, decode_update_record
from fededge.compress.update import UpdateEncoder, decode_update
from fededge.clients.train import BatchSampler, evaluate, local_sgd
from fededge.config import RunConfig
from fededge.netem.assign import dropped_partitions
from fededge.models.zoo import build_model
from fededge.workload import client_data, dataset_for

__all__ = ["app", "ClientWorkload", "client_workload"]

# A configuration error (say, a data split that cannot give this node min-partition-size
# samples) comes back to the server as a named error that stops the run.
app = ClientApp(mods=[config_error_mod])


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
    cfg = RunConfig.from_mapping(context.run_config)
    nc = context.node_config
    missing = [k for k in (keys.PARTITION_ID, keys.NUM_PARTITIONS) if k not in nc]
    if missing:
        raise KeyError(
            f"node config lacks {', '.join(missing)}: start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        )
    data_dir = str(nc.get(keys.DATA_DIR, "")) or cfg.data_dir or None
    pid, n = int(nc[keys.PARTITION_ID]), int(nc[keys.NUM_PARTITIONS])
    device = resolve_device(cfg.device)
    x, y = client_data(cfg, pid, n, device, data_dir)  # cached on the data's own key
    ds = dataset_for(cfg, data_dir)
    model = _model(cfg.model, ds.input_shape, ds.num_classes, str(device))
    return ClientWorkload(cfg, pid, n, device, x, y, model)


@lru_cache(maxsize=4)
def _model(name: str, input_shape: tuple[int, ...], num_classes: int, device: str) -> nn.Module:
    # One model object per process and architecture: each message loads the received
    # weights into it, so its initial values never matter. A process runs one message
    # at a time (Ray actor, flwr-clientapp process, in-process grid): sharing is safe.
    model = build_model(name, input_shape=input_shape, num_classes=num_classes, seed=0).to(device)
    # Warm up once, outside the timed region: torch's first optimizer step in a process
    # imports and initialises its machinery (1.45 s here, 0.1 ms afterwards), which is not
    # per-round compute and would otherwise inflate round 1 of the simulated clock.
    # lr=0 leaves the weights as they are; every message loads its own anyway.
    x = torch.zeros((2, *input_shape), device=device)
    model(x).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9).step()
    model.zero_grad(set_to_none=True)
    return model


def _sampler(work: ClientWorkload, context: Context, batch_size: int) -> BatchSampler:
    sampler = BatchSampler(len(work.x), batch_size, seed=work.cfg.seed, stream=work.partition_id)
    if keys.STATE_SAMPLER in context.state:
        rec = context.state[keys.STATE_SAMPLER]
        sampler.load_state_dict({"epoch": int(rec["epoch"]), "cursor": int(rec["cursor"])})
    return sampler


def _received_arrays(msg: Message) -> ArrayRecord:
    if keys.ARRAYS not in msg.content:
        raise KeyError(
            f"train/evaluate message has no '{keys.ARRAYS}' record (it has "
            f"{list(msg.content.keys())}); is the server strategy's arrayrecord_key "
            f"'{keys.ARRAYS}'?"
        )
    return msg.content[keys.ARRAYS]


def _is_gossip(msg: Message) -> bool:
    return keys.CONFIG in msg.content and keys.GOSSIP_INDEX in msg.content[keys.CONFIG]


@app.train(mods=[compression_mod])
def train(msg: Message, context: Context) -> Message:
    """Load the received weights, run K local SGD steps, reply with the new weights."""
    work = client_workload(context)
    cfg = work.cfg
    if work.partition_id in dropped_partitions(work.num_partitions, cfg.dropout, seed=cfg.seed):
        return _dropped_reply(msg, work)
    conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content else ConfigRecord()
    gossip = _gossip_start(msg, context, conf, work) if _is_gossip(msg) else None
    dga = None if gossip is not None else _dga_start(msg, context, conf, work)
    if gossip is not None:
        work.model.load_state_dict(gossip.x)
    elif dga is None:
        work.model.load_state_dict(_received_arrays(msg).to_torch_state_dict())
    else:
        work.model.load_state_dict(dga.model)
        staleness = dga.staleness()  # before this round: its own rounds still in flight
    sampler = _sampler(work, context, int(conf.get(keys.BATCH_SIZE, cfg.batch_size)))

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
            lr=float(conf.get(keys.LOCAL_LR, cfg.local_lr)),
            momentum=float(conf.get(keys.MOMENTUM, cfg.momentum)),
            weight_decay=float(conf.get(keys.WEIGHT_DECAY, cfg.weight_decay)),
            sampler=sampler,
            proximal_mu=float(conf.get(keys.PROXIMAL_MU, 0.0)),
        )
        if work.device.type == "cuda":
            torch.cuda.synchronize(work.device)
        compute_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)  # the process may be shared (in-process runtime)

    if gossip is not None:
        return _gossip_reply(msg, context, conf, work, gossip, result.mean_loss, compute_s, result.steps,
                             sampler)
    context.state[keys.STATE_SAMPLER] = ConfigRecord(sampler.state_dict())
    if dga is None:
        arrays = ArrayRecord(work.model.state_dict())
    else:
        after = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
        arrays = ArrayRecord(dga.train_round(int(conf[keys.SERVER_ROUND]), after))
        context.state[keys.STATE_DGA] = ArrayRecord(dga.state_dict())
    metrics = MetricRecord({
        keys.NUM_EXAMPLES: len(work.x),
        keys.TRAIN_LOSS: result.mean_loss,
        keys.COMPUTE_S: compute_s,
        keys.LOCAL_STEPS_DONE: result.steps,
        keys.REPLY_PARTITION_ID: work.partition_id,
        keys.REPLY_NUM_PARTITIONS: work.num_partitions,
    })
    if dga is not None:
        metrics[keys.DGA_STALENESS] = staleness
    content = RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})
    return Message(content=content, reply_to=msg)


def _dropped_reply(msg: Message, work: ClientWorkload) -> Message:
    """A client the ``dropout`` fraction takes out: it does no work and stands for a node
    that never answers. The reply only says so (and who it is); the server's grid turns
    it into a missing reply and the simulated clock charges the round-timeout."""
    return Message(content=RecordDict({keys.METRICS: MetricRecord({
        keys.DROPPED_OUT: 1, keys.REPLY_PARTITION_ID: work.partition_id,
        keys.REPLY_NUM_PARTITIONS: work.num_partitions})}), reply_to=msg)


def _dga_start(msg: Message, context: Context, conf: ConfigRecord, work: ClientWorkload) -> DGAClient | None:
    """For a DGA message (``dga-global-round`` in its config): the client's DGA state,
    brought up to the global model the message carries or names. None otherwise."""
    if keys.DGA_GLOBAL_ROUND not in conf:
        return None
    config = DGAConfig(correction=bool(conf.get(keys.DGA_CORRECTION, True)))
    if keys.STATE_DGA in context.state:
        state = context.state[keys.STATE_DGA].to_torch_state_dict()
        dga = DGAClient.from_state_dict(config, state)
    else:
        dga = DGAClient(config, {}, global_round=-1)  # holds nothing yet: the first message must bring G(g)
    arrays = _received_arrays(msg)
    dga.sync(int(conf[keys.DGA_GLOBAL_ROUND]), arrays.to_torch_state_dict() if len(arrays) else None)
    return dga


@dataclass
class _GossipStep:
    """A gossip node's round: who it is, the model it trains from, its CHOCO estimates."""

    index: int
    round: int
    algorithm: str
    x: Weights
    hats: dict[int, Weights] = field(default_factory=dict)


def _gossip_start(msg: Message, context: Context, conf: ConfigRecord, work: ClientWorkload) -> _GossipStep:
    """Finish the previous round's gossip with the neighbours' messages this one brings.

    The node's own trained model (and, for CHOCO, its estimates and its own last q) are
    in ``context.state``; a node that holds none starts from the message's ``arrays``.
    See :mod:`fededge.strategies.gossip` for the message layout.
    """
    i, t = int(conf[keys.GOSSIP_INDEX]), int(conf[keys.SERVER_ROUND])
    algorithm = str(conf[keys.GOSSIP_ALGORITHM])
    row = {int(j): float(w) for j, w in zip(conf.get(keys.GOSSIP_ROW_NODES, []),
                                             conf.get(keys.GOSSIP_ROW_WEIGHTS, []))}
    state = context.state[keys.STATE_GOSSIP].to_torch_state_dict() if keys.STATE_GOSSIP in context.state else {}
    y = {k[2:]: v for k, v in state.items() if k.startswith("x/")}
    if not y:
        if keys.ARRAYS not in msg.content:
            raise GossipError(f"gossip node {i} holds no model and round {t}'s message brings none; "
                              f"the relay sends 'arrays' until a node has completed a round")
        y = dict(_received_arrays(msg).to_torch_state_dict())
    c = msg.content
    received = {int(name[len(keys.GOSSIP_FROM):]): c[name] for name in c.keys()
                if name.startswith(keys.GOSSIP_FROM)}
    if algorithm == "dpsgd":
        if t == 1:
            return _GossipStep(i, t, algorithm, y)
        w = effective_row(row, received, own=i)
        models = {j: dict(received[j].to_torch_state_dict()) for j in w if j != i}
        models[i] = y
        return _GossipStep(i, t, algorithm, mix_row(models, w, own=i))

    limit = max(v.numel() for v in y.values())
    resync = {int(name[len(keys.GOSSIP_HAT):]): dict(c[name].to_torch_state_dict()) for name in c.keys()
              if name.startswith(keys.GOSSIP_HAT)}
    if resync:  # the relay's estimates already hold every q up to the last round
        hats = resync
    elif any(k.startswith("hat/") for k in state):
        node = ChocoNode.from_state_dict(ChocoConfig(gamma=1.0), i, {k: v for k, v in state.items()
                                                                      if k.startswith("hat/")})
        hats = node.hats
        own_q = {k[2:]: v for k, v in state.items() if k.startswith("q/")}
        if own_q:
            hats[i] = _apply(hats[i], own_q)
        for j, rec in received.items():
            if j not in hats:
                raise GossipError(f"gossip node {i} got a message from {j}, which it does not hear")
            hats[j] = _apply(hats[j], decode_update_record(rec, max_elements=limit))
    else:  # round 1: every estimate starts at the common initial model
        start = {k: v.clone() for k, v in y.items() if v.is_floating_point()}
        hats = {j: {k: v.clone() for k, v in start.items()} for j in sorted({i, *row})}
    x = y if t == 1 else _choco_update(y, hats, row, i, float(conf[keys.GOSSIP_GAMMA]))
    return _GossipStep(i, t, algorithm, x, hats)


def _gossip_reply(msg: Message, context: Context, conf: ConfigRecord, work: ClientWorkload,
                  step: _GossipStep, loss: float, compute_s: float, steps: int,
                  sampler: BatchSampler) -> Message:
    """The node's round message (D-PSGD: its model; CHOCO: q = Q(y - x̂_i)); the state is
    written only now, so a failed message leaves the node as it was."""
    t0 = time.perf_counter()
    y = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
    state = {f"x/{k}": v for k, v in y.items()}
    content = RecordDict()
    if step.algorithm == "dpsgd":
        content[keys.GOSSIP_MESSAGE] = ArrayRecord(y)
    else:
        mine = step.hats[step.index]
        delta = {k: (y[k] - v) * _choco_scale(work.cfg, v.numel()) for k, v in mine.items()}
        if work.cfg.compressor == "none":
            q = delta
            content[keys.GOSSIP_MESSAGE] = ArrayRecord(q)
        else:
            payloads = UpdateEncoder(work.cfg.update_config(), stream=step.index).encode(delta, round=step.round - 1)
            content[keys.GOSSIP_MESSAGE] = bundle_record(payloads)
            # What the neighbours will add to their x̂_i, decoded exactly as they decode it.
            q = decode_update(payloads, max_elements=max(v.numel() for v in delta.values()))
            q = {k: v.to(dtype=delta[k].dtype) for k, v in q.items()}
        state |= {f"hat/{j}/{k}": v for j, h in step.hats.items() for k, v in h.items()}
        state |= {f"q/{k}": v for k, v in q.items()}
    if bool(conf.get(keys.GOSSIP_EVAL, False)):  # for the server's evaluation only
        content[keys.GOSSIP_EVAL_ARRAYS] = ArrayRecord(y)
    compute_s += time.perf_counter() - t0  # encoding is the node's work too
    content[keys.METRICS] = MetricRecord({
        keys.NUM_EXAMPLES: len(work.x),
        keys.TRAIN_LOSS: loss,
        keys.COMPUTE_S: compute_s,
        keys.LOCAL_STEPS_DONE: steps,
        keys.REPLY_PARTITION_ID: work.partition_id,
        keys.REPLY_NUM_PARTITIONS: work.num_partitions,
    })
    context.state[keys.STATE_GOSSIP] = ArrayRecord(state)
    context.state[keys.STATE_SAMPLER] = ConfigRecord(sampler.state_dict())
    return Message(content=content, reply_to=msg)


def _choco_scale(cfg: RunConfig, numel: int) -> float:
    """What a CHOCO node scales a tensor's difference by before compressing it
    (``choco-scale``; 0: ``1 / (1 + omega)`` of the tensor's codec)."""
    if cfg.choco_scale > 0:
        return cfg.choco_scale
    return 1.0 / (1.0 + cfg.update_config().variance_factor(numel))


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


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Federated evaluation: the received model on this node's local training data.

    The held-out test set is evaluated centrally by the server every round; this
    reports how well the global model fits each client's own (possibly skewed) data.
    """
    work = client_workload(context)
    if work.partition_id in dropped_partitions(work.num_partitions, work.cfg.dropout, seed=work.cfg.seed):
        return _dropped_reply(msg, work)
    work.model.load_state_dict(_received_arrays(msg).to_torch_state_dict())
    loss, acc = evaluate(work.model, work.x, work.y)
    metrics = MetricRecord({keys.NUM_EXAMPLES: len(work.x), "eval-loss": loss, "eval-acc": acc})
    return Message(content=RecordDict({keys.METRICS: metrics}), reply_to=msg)
