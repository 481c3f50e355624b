"""Client mods: fededge's client side as Flower mods for any ClientApp.

A Flower mod wraps the ClientApp's train function: it may change the message on the way
in and the reply on the way out (Flower's ``LocalDpMod`` is one). Each mod here is
configured by its constructor and keeps its state in ``context.state``; none reads the
run config, so a user's app keeps its own run-config keys. The user's train function
stays plain local training: load ``arrays``, train, reply ``arrays`` and ``metrics``
with ``num-examples``.

- :class:`CompressionMod`: decodes a cast downlink model; replaces the train reply's
  weights by the compressed delta from the weights received (record ``compressed``).
  Server side: :class:`fededge.strategies.compressed.Compressed`.
- :class:`DGAMod`: the client of Delayed Gradient Averaging (Zhu et al., 2021). Server
  side: :class:`fededge.strategies.dga.DGA`.
- :class:`GossipMod`: a node of D-PSGD (Lian et al., 2017) or CHOCO-SGD (Koloskova et
  al., 2019). Server side (a relay): :class:`fededge.strategies.gossip.Gossip`.
- :func:`config_error_mod`: a configuration error of the client becomes a named error
  reply, on which fededge's server stops the run.

**Order.** Flower runs ``mods=[a, b]`` as ``a(b(train))``: the first is outermost.
Put :class:`CompressionMod` before :class:`DGAMod` and :class:`GossipMod`::

    ClientApp(mods=[config_error_mod, CompressionMod(update), DGAMod(), GossipMod(update)])

CompressionMod must see the downlink before DGA reads ``G(g)`` from it, and DGA's reply
after DGA made it: it then encodes DGA's own in-flight Δ(t), which the server rebuilds on
its exact ``G(g)``. A gossip reply carries no ``arrays`` (GossipMod encodes CHOCO's ``q``
itself), so CompressionMod leaves it alone. DGAMod and GossipMod act on their own
strategy's messages only and pass any other message through untouched, so both may be
registered at once. A mod in the wrong order fails at the first message, by name.

The record formats are :mod:`fededge.protocol`; the arithmetic is pure torch
(:mod:`fededge.compress.update`, :mod:`fededge.algorithms.dga`,
:mod:`fededge.algorithms.gossip`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from fededge import keys
from fededge._flwr_internals import ClientAppCallable
from fededge.algorithms.dga import DGAClient, DGAConfig, inflight_prefix, round_delta
from fededge.algorithms.gossip import (
    ChocoConfig, ChocoNode, GossipError, Weights, check_choco_codec, effective_row, mix_row,
)
from fededge.arrays import record_from_torch, record_to_torch, to_numpy
from fededge.clients.cohort import encode_update
from fededge.compress.roles import is_counter, is_statistic, server_keeps
from fededge.compress.update import UpdateConfig, UpdateEncoder, decode_update
from fededge.data.partition import PartitionError
from fededge.errors import ConfigError
from fededge.protocol import (
    CLIENT_APP_RAISED_EXCEPTION, bundle_record, config_error_reason, decode_downlink, decode_update_record,
)

__all__ = ["CompressionMod", "DGAMod", "GossipMod", "ModOrderError", "config_error_mod", "offer_norm_statistics"]

log = logging.getLogger(__name__)

#: whether this process has logged a client's DGC warm-up (once at INFO, then DEBUG)
_warmup_logged: list[bool] = []


class ModOrderError(RuntimeError):
    """Mods registered in an order in which they cannot work (see the module docstring)."""


def _train_config(msg: Message) -> ConfigRecord | None:
    """The config record of a train message (the one that carries ``server-round``, under
    whatever name its strategy gives it: Flower's ``configrecord_key``; else ``config``);
    None for other messages. Read only under ``config``, a strategy's ``train-config`` left
    every round round 1: random-k's coordinates the same each round, DGC's warm-up stuck."""
    if not msg.metadata.message_type.startswith("train"):
        return None
    records = msg.content.config_records
    for name, record in records.items():
        if keys.SERVER_ROUND in record:
            return record
    return records[keys.CONFIG] if keys.CONFIG in records else None


def _with_arrays(content: RecordDict, arrays: Weights, *, drop: tuple[str, ...] = ()) -> RecordDict:
    """``content`` with ``arrays`` replaced, and records whose name starts with one of
    ``drop`` left out: the message a user's train function sees."""
    out = RecordDict({keys.ARRAYS: record_from_torch(arrays)})
    for name in content.keys():
        if name != keys.ARRAYS and not any(name.startswith(prefix) for prefix in drop):
            out[name] = content[name]
    return out


def _trained(reply: Message, mod: str) -> dict[str, torch.Tensor] | None:
    """The weights a train function replied with; None for an error reply or a reply
    without ``arrays`` (fededge's dropout reply), which the mod passes back as it is."""
    if reply.has_error():
        return None
    if keys.COMPRESSED in reply.content:
        raise ModOrderError(f"{mod} got a compressed reply: CompressionMod runs inside it. Register "
                            f"CompressionMod before {mod} (mods=[CompressionMod(...), {mod}(...)])")
    if keys.ARRAYS not in reply.content:
        return None
    return dict(record_to_torch(reply.content[keys.ARRAYS]))


def _reply_metrics(reply: Message) -> MetricRecord | None:
    """The reply's MetricRecord: ``metrics``, else its one under another name (Flower's
    strategies take a reply's first and want exactly one), else None."""
    records = reply.content.metric_records
    if keys.METRICS in records:
        return records[keys.METRICS]
    return next(iter(records.values()), None)


def _metrics(reply: Message) -> MetricRecord:
    """The reply's MetricRecord (:func:`_reply_metrics`), made as ``metrics`` only where it
    has none: a second one made Flower's FedAvg refuse every reply."""
    found = _reply_metrics(reply)
    if found is None:
        found = reply.content[keys.METRICS] = MetricRecord()
    return found


def _add_compute(reply: Message, seconds: float) -> None:
    # A mod's encoding is the client's work too: it counts in the compute the clock sees.
    metrics = _reply_metrics(reply)
    if metrics is not None and keys.COMPUTE_S in metrics:
        metrics[keys.COMPUTE_S] = float(metrics[keys.COMPUTE_S]) + seconds


def _stream(context: Context) -> int:
    """Separates this client's random streams from the others': its partition id, else
    its node id (in 31 bits, as the encoders' seeds take it)."""
    return int(context.node_config.get(keys.PARTITION_ID, context.node_id % 2**31))


#: What the train function running inside a CompressionMod offers for recomputing its
#: model's normalisation statistics (see :func:`offer_norm_statistics`).
_NORM_STATS: ContextVar[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None] = ContextVar(
    "fededge_norm_statistics", default=None)
_warned_norm_stats = False


def offer_norm_statistics(fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Called by a train function: how to compute its model's normalisation statistics
    for given weights, so that :class:`CompressionMod` sends statistics that describe the
    model the server will hold.

    ``fn(weights)`` gets a full state dict (the received model plus this client's
    update as the server will decode it) and returns ``running_mean``/``running_var``
    tensors by name, e.g. :func:`fededge.clients.train.norm_statistics` on a copy of the
    model loaded with ``weights`` and a few local batches. fededge's own ClientApp offers
    it; a train function that does not keeps the statistics it trained with.

    Examples
    --------
    >>> from fededge.clients.train import norm_statistics
    >>> def train(msg, context):  # doctest: +SKIP
    ...     ...  # train model on x
    ...     offer_norm_statistics(lambda w: norm_statistics(
    ...         load_copy(model, w), x, batches=8, batch_size=32, seed=round))
    ...     return reply
    """
    _NORM_STATS.set(fn)


def _count(value: Any) -> int | None:
    """``value`` as a count of at least 1 (an int, or a float that is a whole number),
    else None: what a user's app put in its metrics or config is not trusted to be one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value >= 1 else None


def _encoder(update: UpdateConfig, stream: int, state: ArrayRecord | None) -> UpdateEncoder:
    encoder = UpdateEncoder(update, stream=stream)
    if state is not None:
        encoder.load_state_dict(record_to_torch(state))
    return encoder


class CompressionMod:
    """Compress a client's train reply: the delta from the weights it received, encoded
    tensor by tensor (docs/compression.md).

    On the way in it decodes a cast downlink model (``compressed-down``, from
    ``Compressed(strategy, downlink="fp16")``) into ``arrays``. On the way out, for a
    train reply with ``arrays``, it sends instead one ``compressed`` record, the bundle
    of every floating-point tensor's wire payload, each naming its codec in its header;
    other tensors (BatchNorm's counters) go as they are in ``arrays-uncompressed``
    (under ``norm-stats = global`` the counters are not sent: the server keeps its own). The
    encoder's state (error-feedback residuals, PowerSGD's Q, DGC's buffers) stays in
    ``context.state`` between rounds. For a DGA message it encodes the client's own Δ(t)
    of that round (:class:`DGAMod` must run inside it). Error replies, gossip replies
    and replies without ``arrays`` pass through.

    The server must wrap its strategy in :class:`fededge.strategies.compressed.Compressed`
    (give it the same ``UpdateConfig`` to have a mismatch refused by name): a plain
    strategy finds no ``arrays`` in the reply and fails loudly rather than averaging
    bytes.

    Parameters
    ----------
    update : UpdateConfig, optional
        The codec and its knobs (:class:`fededge.compress.update.UpdateConfig`: ``topk``
        with ``topk_ratio``, ``qsgd`` with ``qsgd_levels``, ``error_feedback``, ...).
        ``compressor="none"`` only decodes the downlink. ``seed`` seeds the stochastic
        codecs, per client (partition id, else node id) and round.
    **kwargs
        Instead of ``update``: its fields, e.g. ``compressor="topk", topk_ratio=0.1``.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp(mods=[CompressionMod(compressor="signsgd", error_feedback=True)])
    """

    def __init__(self, update: UpdateConfig | None = None, **kwargs: Any) -> None:
        if update is not None and kwargs:
            raise ValueError(f"give CompressionMod an UpdateConfig or its fields, not both (got update and "
                             f"{sorted(kwargs)})")
        self.update = update if update is not None else UpdateConfig(**kwargs)

    def __repr__(self) -> str:
        return f"CompressionMod({self.update!r})"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if keys.COMPRESSED_DOWN in msg.content:
            msg.content = decode_downlink(msg.content)
        conf = _train_config(msg)
        # The weights received, before an inner mod (DGAMod, GossipMod) swaps the message's.
        received = msg.content[keys.ARRAYS] if keys.ARRAYS in msg.content else None
        token = _NORM_STATS.set(None)
        try:
            reply = call_next(msg, context)
            stats_fn = _NORM_STATS.get()
        finally:
            _NORM_STATS.reset(token)
        if (self.update.compressor == "none" or not msg.metadata.message_type.startswith("train")
                or reply.has_error() or keys.ARRAYS not in reply.content):
            # No weights in the reply (a gossip message, already encoded by GossipMod; a
            # dropout): nothing to take a delta of.
            return reply
        rnd = int(conf.get(keys.SERVER_ROUND, 1)) if conf is not None else 1
        if not self.update.compresses(rnd):
            # compress-warmup-rounds: this round's weights go as they are; the encoder's
            # state is not touched (it starts at the first compressed round).
            return reply
        t0 = time.perf_counter()
        own = self._dga_delta(conf, context, rnd)
        if own is None and received is None:
            raise ValueError(f"CompressionMod: the train message brought no '{keys.ARRAYS}' record to take "
                             f"the delta from (it has {list(msg.content.keys())})")
        base = record_to_torch(received) if own is None else {}
        delta, raw = {}, {}
        for name, new in record_to_torch(reply.content[keys.ARRAYS]).items():
            if is_counter(name) and server_keeps(name, self.update):  # norm-stats=global: the server's own
                continue
            if not new.is_floating_point() or is_counter(name):  # the plan's integers: as they are
                raw[name] = new
            elif own is not None:  # DGA: its own K-step change; the reply is G(g) + own
                delta[name] = own[name].float()
            else:
                delta[name] = new.float() - base[name].float()
        state = context.state[keys.STATE_COMPRESS] if keys.STATE_COMPRESS in context.state else None
        encoder = _encoder(self._for_client(conf, reply), _stream(context), state)
        # In a cohort (fededge.clients.cohort) the round's clients are encoded as one batch,
        # to the same bytes; `waited` is the time this call spent on the others' work.
        payloads, waited = encode_update(encoder, delta, round=self.update.encoder_round(rnd))
        t0 += waited
        if own is None and self.update.norm_stats == "decoded":
            self._decoded_statistics(payloads, base, raw, encoder, stats_fn)
        kept = encoder.state_dict()
        if kept:
            context.state[keys.STATE_COMPRESS] = record_from_torch(kept)
        content = RecordDict({keys.COMPRESSED: bundle_record(payloads)})
        if raw:
            content[keys.UNCOMPRESSED] = record_from_torch(raw)
        for name in reply.content.keys():
            if name != keys.ARRAYS:
                content[name] = reply.content[name]
        reply.content = content
        _add_compute(reply, time.perf_counter() - t0)
        return reply

    @staticmethod
    def _decoded_statistics(payloads: dict[str, bytes], base: dict[str, torch.Tensor], raw: dict[str, torch.Tensor],
                            encoder: UpdateEncoder, stats_fn: Callable | None) -> None:
        """``norm-stats = decoded``: replace the statistics' payloads by the statistics of
        the model the server will hold from this client, the received model plus the
        update as it decodes, computed by the train function's ``stats_fn``.

        A lossy uplink delivers part of the update this round and keeps the rest in the
        residual, while the statistics a client trained with describe its whole local
        model: averaged, they describe a model the server does not hold. On the digits
        CNN with BatchNorm under PowerSGD rank 2 that mismatch, not the weights, made the
        accuracy swing by up to 11 points between rounds (BENCHMARKS.md, issue 36)."""
        global _warned_norm_stats
        names = [n for n in payloads if is_statistic(n)]
        if not names:
            return
        if stats_fn is None:
            if not _warned_norm_stats:
                _warned_norm_stats = True
                log.warning("CompressionMod: the train function offered no way to recompute its normalisation "
                            "statistics, so they go as trained (they describe the client's local model, not the "
                            "one the server will hold); call fededge.clients.mods.offer_norm_statistics in it "
                            "(docs/compression.md), or set norm-stats=trained to silence this")
            return
        decoded = decode_update(payloads, max_elements=max(math.prod(v.shape) for v in base.values()))
        weights = {n: (base[n].float() + d).to(base[n].dtype) for n, d in decoded.items()}
        weights.update(raw)
        fresh = stats_fn(weights)
        for n in names:
            if n in fresh:
                payloads[n] = encoder.raw.encode(fresh[n].float().cpu() - base[n].float())

    def _for_client(self, conf: ConfigRecord | None, reply: Message) -> UpdateConfig:
        """This client's UpdateConfig: DGC's sparsity warm-up in rounds is the larger of
        ``dgc_warmup_rounds`` and ``dgc_warmup_epochs`` of this client's data
        (:meth:`~fededge.compress.update.UpdateConfig.dgc_warmup_for`), its examples from
        the reply's ``num-examples`` and a round's from the train config's local steps
        and batch size (the rounds alone where one is missing)."""
        update = self.update
        if update.compressor != "dgc" or update.dgc_warmup_epochs <= 0:
            return update
        metrics = _reply_metrics(reply) or {}
        examples = _count(metrics.get(keys.NUM_EXAMPLES))
        steps = _count(conf.get(keys.LOCAL_STEPS)) if conf is not None else None
        batch = _count(conf.get(keys.BATCH_SIZE)) if conf is not None else None
        per_round = steps * batch if steps and batch else None
        rounds = update.dgc_warmup_for(examples, per_round)
        if rounds == update.dgc_warmup_rounds:
            return update
        log.log(logging.DEBUG if _warmup_logged else logging.INFO,
                "DGC sparsity warm-up per client: the larger of dgc-warmup-rounds=%d and dgc-warmup-epochs=%g "
                "epochs of its data; here %d rounds for %d examples at %d a round%s", update.dgc_warmup_rounds,
                update.dgc_warmup_epochs, rounds, examples, per_round,
                "" if _warmup_logged else " (logged once a process, where the epochs make it longer)")
        _warmup_logged.append(True)
        return replace(update, dgc_warmup_rounds=rounds)

    @staticmethod
    def _dga_delta(conf: ConfigRecord | None, context: Context, rnd: int) -> dict[str, torch.Tensor] | None:
        """For a DGA train message: the client's change Δ(t) over this round's steps, from
        the DGA state DGAMod has just written. None for any other message."""
        if conf is None or keys.DGA_GLOBAL_ROUND not in conf:
            return None
        own = round_delta(context.state[keys.STATE_DGA], rnd) if keys.STATE_DGA in context.state else {}
        if not own:
            raise ModOrderError(f"CompressionMod got a reply to DGA round {rnd}, but the DGA state holds no "
                                f"update of that round: register DGAMod inside CompressionMod "
                                f"(mods=[CompressionMod(...), DGAMod()])")
        return {k: torch.from_numpy(to_numpy(v)) for k, v in own.items()}


class DGAMod:
    """The client side of Delayed Gradient Averaging (Zhu et al., NeurIPS 2021), for any
    train function.

    A DGA train message (its config has ``dga-global-round``; from
    :class:`fededge.strategies.dga.DGA`) carries the global model ``G(g)``, or nothing when
    the client already holds it. The mod brings the client's DGA state (kept in
    ``context.state``) up to ``G(g)`` and hands the train function a message whose
    ``arrays`` is the client's current model ``G(g) + (own updates in flight)``. The
    train function trains it as usual and replies; the mod turns the reply into DGA's,
    ``G(g) + Δ(t)`` (:meth:`fededge.algorithms.dga.DGAClient.train_round`), and adds the
    ``dga-staleness`` metric (its own rounds still in flight). Every knob (delay,
    correction, warm-up) is the server's: the correction travels in the message.

    Any other message passes through untouched. An error reply leaves the state as it
    was. Put :class:`CompressionMod`, if any, before it.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp(mods=[DGAMod()])
    """

    def __repr__(self) -> str:
        return "DGAMod()"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        conf = _train_config(msg)
        if conf is None or keys.DGA_GLOBAL_ROUND not in conf:
            return call_next(msg, context)
        config = DGAConfig(correction=bool(conf.get(keys.DGA_CORRECTION, True)))
        kept = context.state[keys.STATE_DGA] if keys.STATE_DGA in context.state else None
        if kept is not None:
            dga = DGAClient.from_state_dict(config, record_to_torch(kept))
        else:
            dga = DGAClient(config, {}, global_round=-1)  # holds nothing yet: the first message must bring G(g)
        arrays = msg.content[keys.ARRAYS] if keys.ARRAYS in msg.content else ArrayRecord()
        dga.sync(int(conf[keys.DGA_GLOBAL_ROUND]), record_to_torch(arrays) if len(arrays) else None)
        staleness = dga.staleness()  # before this round: its own rounds still in flight
        original = msg.content
        msg.content = _with_arrays(original, dga.model)
        try:
            reply = call_next(msg, context)
        finally:
            msg.content = original  # the outer mods see the message as it came
        if reply.has_error():
            return reply
        trained = _trained(reply, "DGAMod")
        fresh = None
        if trained is not None:
            fresh = int(conf[keys.SERVER_ROUND])
            reply.content[keys.ARRAYS] = record_from_torch(dga.train_round(fresh, trained))
            _metrics(reply)[keys.DGA_STALENESS] = staleness
        # Also after a reply without weights (a dropout): the client did receive G(g).
        context.state[keys.STATE_DGA] = record_from_torch(_unchanged_kept(dga, kept, fresh))
        return reply


def _unchanged_kept(dga: DGAClient, kept: ArrayRecord | None, fresh: int | None) -> dict[str, Any]:
    """``dga``'s state, with each update in flight but round ``fresh``'s (just trained)
    taken as the ``Array`` that ``kept`` (the stored state) already holds: an update
    never changes once recorded, so only the model, the new update and the counter are
    encoded again, not D + 1 models a message. The record's bytes are the same."""
    state = dga.state_dict()
    if kept is None:
        return state
    stored = tuple(inflight_prefix(r) for r in dga.in_flight if r != fresh)
    return {k: kept[k] if k.startswith(stored) and k in kept else v for k, v in state.items()}


@dataclass
class _GossipRound:
    """A gossip node's round: who it is, the model it trains from, its CHOCO state."""

    index: int
    round: int
    algorithm: str
    x: Weights
    node: ChocoNode | None = None


class GossipMod:
    """A node of decentralized training, D-PSGD (Lian et al., 2017) or CHOCO-SGD
    (Koloskova, Stich & Jaggi, ICML 2019), for any train function.

    A gossip train message (its config has ``gossip-index``; from
    :class:`fededge.strategies.gossip.Gossip`, which only relays) brings the neighbours'
    messages of the previous round. The mod first finishes that round's mixing (D-PSGD:
    ``x_i = sum_j W_ij y_j``; CHOCO: apply each ``q_j`` to the estimates and take the
    consensus step, with :class:`fededge.algorithms.gossip.ChocoNode`), hands the train
    function a message whose ``arrays`` is ``x_i``, and turns the trained ``y_i`` into the
    node's gossip message (D-PSGD: ``y_i``; CHOCO: ``q_i = Q(scale * (y_i - x̂_i))``
    encoded with ``update``'s codec). The algorithm, gamma and the mixing row come from the
    server; the codec is the node's. State (``y_i``, the estimates, its own ``q``) stays in
    ``context.state`` and is written only when the round succeeds.

    Any other message passes through untouched.

    Parameters
    ----------
    update : UpdateConfig, optional
        CHOCO's compressor ``Q`` (``compressor="none"``, the default, sends ``y_i - x̂_i``
        uncompressed; the scaled sign ``signsgd`` is about 1 bit per weight). Stateless
        codecs only, without error feedback: CHOCO's estimates already carry what ``Q``
        dropped. D-PSGD ignores it.
    choco_scale : float
        What the difference is scaled by before it is encoded:
        :attr:`fededge.algorithms.gossip.ChocoConfig.scale` (0, the default, is automatic).

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> from fededge.compress.update import UpdateConfig
    >>> app = ClientApp(mods=[GossipMod(UpdateConfig(compressor="signsgd"))])
    """

    def __init__(self, update: UpdateConfig | None = None, *, choco_scale: float = ChocoConfig.scale) -> None:
        update = update if update is not None else UpdateConfig()
        try:
            check_choco_codec(update.compressor, update.error_feedback)
            ChocoConfig(scale=choco_scale)
            if update.warmup_rounds:
                raise ValueError(f"warmup_rounds={update.warmup_rounds}: CHOCO's public estimates are kept from "
                                 "the first round on, there is no uncompressed warm-up in gossip; set it to 0")
        except ValueError as err:
            raise ValueError(f"GossipMod: {err}") from None
        self.update = update
        self.choco_scale = choco_scale

    def __repr__(self) -> str:
        return f"GossipMod({self.update!r}, choco_scale={self.choco_scale})"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        conf = _train_config(msg)
        if conf is None or keys.GOSSIP_INDEX not in conf:
            return call_next(msg, context)
        rnd = self._start(msg, context, conf)
        original = msg.content
        msg.content = _with_arrays(original, rnd.x, drop=(keys.GOSSIP_FROM, keys.GOSSIP_HAT))
        try:
            reply = call_next(msg, context)
        finally:
            msg.content = original
        trained = _trained(reply, "GossipMod")
        if trained is None:
            return reply
        return self._reply(reply, context, conf, rnd, trained)

    def _start(self, msg: Message, context: Context, conf: ConfigRecord) -> _GossipRound:
        """Finish the previous round's gossip with the neighbours' messages this one brings.

        The node's own trained model (and, for CHOCO, its estimates and its own last q) are
        in ``context.state``; a node that holds none starts from the message's ``arrays``.
        See :mod:`fededge.strategies.gossip` for the message layout.
        """
        i, t = int(conf[keys.GOSSIP_INDEX]), int(conf[keys.SERVER_ROUND])
        algorithm = str(conf[keys.GOSSIP_ALGORITHM])
        if algorithm == "dpsgd" and self.update is not None and self.update.compressor != "none":
            # D-PSGD sends whole models: the codec was ignored and every message went dense.
            raise ConfigError(f"GossipMod(UpdateConfig(compressor={self.update.compressor!r})) but the relay runs "
                              "D-PSGD, which sends whole models: compressed gossip is CHOCO-SGD, "
                              "Gossip(algorithm='choco', ...) on the server (or drop the GossipMod's update)")
        row = {int(j): float(w) for j, w in zip(conf.get(keys.GOSSIP_ROW_NODES, []),
                                                 conf.get(keys.GOSSIP_ROW_WEIGHTS, []))}
        state = (record_to_torch(context.state[keys.STATE_GOSSIP])
                 if keys.STATE_GOSSIP in context.state else {})
        y = {k[2:]: v for k, v in state.items() if k.startswith("x/")}
        if not y:
            if keys.ARRAYS not in msg.content:
                raise GossipError(f"gossip node {i} holds no model and round {t}'s message brings none; "
                                  f"the relay sends '{keys.ARRAYS}' until a node has completed a round")
            y = dict(record_to_torch(msg.content[keys.ARRAYS]))
        c = msg.content
        received = {int(name[len(keys.GOSSIP_FROM):]): c[name] for name in c.keys()
                    if name.startswith(keys.GOSSIP_FROM)}
        if algorithm == "dpsgd":
            if t == 1:
                return _GossipRound(i, t, algorithm, y)
            w = effective_row(row, received, own=i)
            models = {j: dict(record_to_torch(received[j])) for j in w if j != i}
            models[i] = y
            return _GossipRound(i, t, algorithm, mix_row(models, w, own=i))

        config = ChocoConfig(gamma=float(conf[keys.GOSSIP_GAMMA]))
        resync = {int(name[len(keys.GOSSIP_HAT):]): dict(record_to_torch(c[name])) for name in c.keys()
                  if name.startswith(keys.GOSSIP_HAT)}
        if resync:  # the relay's estimates already hold every q up to the last round
            node = ChocoNode.from_estimates(config, i, resync)
        elif any(k.startswith("hat/") for k in state):
            node = ChocoNode.from_state_dict(config, i, {k: v for k, v in state.items() if k.startswith("hat/")})
            limit = max(v.numel() for v in y.values())
            messages = {j: decode_update_record(rec, max_elements=limit) for j, rec in received.items()}
            own_q = {k[2:]: v for k, v in state.items() if k.startswith("q/")}
            if own_q:
                messages[i] = own_q
            node.receive(messages)
        else:  # round 1: every estimate starts at the common initial model
            node = ChocoNode(config, index=i, neighbours=list(row), init=y)
        return _GossipRound(i, t, algorithm, y if t == 1 else node.mix(y, row), node)

    def _reply(self, reply: Message, context: Context, conf: ConfigRecord, rnd: _GossipRound,
               trained: Weights) -> Message:
        """The node's round message (D-PSGD: its model; CHOCO: its encoded q); the state is
        written only now, so a failed message leaves the node as it was."""
        t0 = time.perf_counter()
        y = {k: v.detach().clone() for k, v in trained.items()}
        state = {f"x/{k}": v for k, v in y.items()}
        content = RecordDict()
        if rnd.node is None:
            content[keys.GOSSIP_MESSAGE] = record_from_torch(y)
        else:
            delta = {k: d * self._scale(k, tuple(d.shape)) for k, d in rnd.node.difference(y).items()}
            if self.update.compressor == "none":
                q = delta
                content[keys.GOSSIP_MESSAGE] = record_from_torch(q)
            else:
                payloads = UpdateEncoder(self.update, stream=rnd.index).encode(delta, round=rnd.round - 1)
                content[keys.GOSSIP_MESSAGE] = bundle_record(payloads)
                # What the neighbours will add to their x̂_i, decoded exactly as they decode it.
                q = decode_update(payloads, max_elements=max(v.numel() for v in delta.values()))
                q = {k: v.to(dtype=delta[k].dtype) for k, v in q.items()}
            state |= rnd.node.state_dict()
            state |= {f"q/{k}": v for k, v in q.items()}
        if bool(conf.get(keys.GOSSIP_EVAL, False)):  # for the server's evaluation only
            content[keys.GOSSIP_EVAL_ARRAYS] = record_from_torch(y)
        for name in reply.content.keys():
            if name != keys.ARRAYS:
                content[name] = reply.content[name]
        reply.content = content
        _add_compute(reply, time.perf_counter() - t0)
        context.state[keys.STATE_GOSSIP] = record_from_torch(state)
        return reply

    def _scale(self, name: str, shape: tuple[int, ...]) -> float:
        """What a CHOCO node scales a tensor's difference by before compressing it."""
        if self.choco_scale > 0:
            return self.choco_scale
        return 1.0 / (1.0 + self.update.variance_factor(math.prod(shape), name=name, shape=shape))


def config_error_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Turn a configuration error of this client into an error reply the server recognises.

    A :class:`~fededge.errors.ConfigError` (a run config, node config or data split that
    cannot work) or the partitioner's :class:`~fededge.data.PartitionError` raised while
    handling ``msg`` becomes an error reply whose reason starts with
    ``keys.CONFIG_ERROR`` (:func:`fededge.protocol.config_error_reason`).
    fededge's :class:`~fededge.server.metering.MeteredGrid` stops the run on it with the
    client's message: every later round would fail the same way, so counting it as one
    more failed client per round would only delay the news. Any other exception passes
    through, and the runtime turns it into an ordinary failure. A user's app raises
    ``ConfigError`` for its own settings to get the same.

    No traceback is logged (a configuration error is not a bug) and the client logs it
    at DEBUG only: the server reports it, naming the node.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp(mods=[config_error_mod])
    """
    try:
        return call_next(msg, context)
    except (ConfigError, PartitionError) as err:
        log.debug("configuration error, replied to the server: %s", err)
        return Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=config_error_reason(err)), reply_to=msg)
