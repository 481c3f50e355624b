"""``Compressed(strategy)``: decode compressed client updates for any Flower strategy.

The client's :func:`fededge.clients.mods.compression_mod` sends, instead of its weights,
one wire payload per tensor (the delta from the weights it received). This wrapper keeps
the global arrays it sent each round, decodes every reply back into full weights
(sent + decoded delta), and hands the inner strategy ordinary replies. So
``Compressed(FedAvg(...))`` and ``Compressed(FedAdam(...))`` both work unchanged.

A reply that does not decode (truncated, unknown version or codec, shape mismatch, index
out of range, NaN/Inf) is rejected. It is counted, with the node and the reason, in
:meth:`Compressed.take_stats` (fededge's runner reports it, one line, and writes it to
``metrics.jsonl``; here it is logged at DEBUG only), and the round goes on without it:
nothing is lost but that one client's update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fededge import keys
from fededge.clients.mods import (
    BUNDLE, COMPRESSED, COMPRESSED_DOWN, UNCOMPRESSED, bundle_payloads, bundle_record, decode_downlink,
)
from fededge.compress import MalformedPayloadError, build_codec
from fededge.compress.update import decode_update

__all__ = ["Compressed", "CompressionStats", "DOWNLINK", "cast_downlink", "decode_compressed"]

#: Downlink codecs: stateless casts of the broadcast model. Delta-coded downlinks would
#: need per-client state kept in step for clients that sat rounds out; not built.
DOWNLINK = ("none", "fp16", "bf16")

log = logging.getLogger(__name__)


@dataclass
class CompressionStats:
    """Per round: how many updates came compressed, how many were rejected, and sizes."""

    decoded: int = 0
    rejected: int = 0
    payload_bytes: int = 0  # the payloads' own bytes
    dense_bytes: int = 0  # what the same tensors weigh as float32
    reasons: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else None


class Compressed(Strategy):
    """Wrap a strategy so that it receives decoded, full-weight client updates.

    Parameters
    ----------
    inner : Strategy
        Any ``flwr.serverapp.strategy`` strategy, configured as usual.
    downlink : str
        ``none``, ``fp16`` or ``bf16``: cast the model the server broadcasts for training
        (halves ``bytes_down``). Evaluation messages go uncompressed.

    Examples
    --------
    >>> strategy = Compressed(FedAvg(fraction_train=1.0))
    """

    def __init__(self, inner: Strategy, *, downlink: str = "none") -> None:
        if downlink not in DOWNLINK:
            raise ValueError(f"downlink must be one of {', '.join(DOWNLINK)}, got {downlink!r}")
        self.inner = inner
        self.downlink = downlink
        # round -> the weights sent that round, as tensors: converted once per round, not
        # once per reply (each conversion deserialises the whole model)
        self._sent: dict[int, dict[str, torch.Tensor]] = {}
        self._stats = CompressionStats()

    def take_stats(self) -> CompressionStats:
        """The counts since the previous call (one round, when called once a round)."""
        s, self._stats = self._stats, CompressionStats()
        return s

    # -- Strategy ------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        if self.downlink == "none":
            self._sent = {server_round: arrays.to_torch_state_dict()}  # only this round's base
            return messages
        # Cast the broadcast model once; the base for decoding the replies is the model
        # the clients actually received (the rounded one, decoded as they decode it), so
        # deltas rebuild exactly.
        down = cast_downlink(arrays, self.downlink)
        self._sent = {server_round: decode_downlink(RecordDict(down))[keys.ARRAYS].to_torch_state_dict()}
        for m in messages:
            content = RecordDict(down)
            for name in m.content.keys():
                if name != keys.ARRAYS:
                    content[name] = m.content[name]
            m.content = content
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # noqa: ANN201
        base = self._sent.get(server_round)
        kept = []
        for r in replies:
            if r.has_error() or COMPRESSED not in r.content:
                kept.append(r)  # errors and uncompressed replies: the inner strategy decides
                continue
            if base is None:
                raise RuntimeError(f"round {server_round}: compressed replies but no arrays were sent")
            try:
                r.content = decode_compressed(r.content, base, self._stats)
                kept.append(r)
            except MalformedPayloadError as err:
                reason = f"node {r.metadata.src_node_id}: {err}"
                self._stats.rejected += 1
                self._stats.reasons.append(reason)
                log.debug("round %d: rejected a client update: %s", server_round, reason)
        return self.inner.aggregate_train(server_round, kept)

    def configure_evaluate(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):  # noqa: ANN001, ANN201
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.inner.summary()


def decode_compressed(content: RecordDict, sent: dict[str, torch.Tensor], stats: CompressionStats) -> RecordDict:
    """A reply whose ``compressed`` record holds the update's payloads -> the same reply
    with full weights in ``arrays``: ``sent`` (the weights the update is a delta from) plus
    the decoded delta. Counts it in ``stats``. Raises MalformedPayloadError for anything
    that does not decode or does not fit the model."""
    rec = content[COMPRESSED]
    largest = max((math.prod(v.shape) for v in sent.values()), default=1)
    if list(rec.keys()) != [BUNDLE]:
        raise MalformedPayloadError(f"compressed record must hold one array '{BUNDLE}', has {list(rec.keys())[:5]}")
    payloads = bundle_payloads(rec)
    raw = content[UNCOMPRESSED].to_torch_state_dict() if UNCOMPRESSED in content else {}
    deltas = decode_update(payloads, max_elements=largest)
    full: dict[str, np.ndarray] = {}
    for name, old in sent.items():
        if name in deltas:
            d = deltas[name]
            if tuple(d.shape) != tuple(old.shape):
                raise MalformedPayloadError(
                    f"tensor {name!r}: decoded shape {tuple(d.shape)} != model shape {tuple(old.shape)}")
            full[name] = (old.float() + d).to(old.dtype).numpy()
        elif name in raw:
            full[name] = raw[name].numpy()
        else:
            raise MalformedPayloadError(f"tensor {name!r} of the model is missing from the update")
    extra = set(deltas) - set(sent)
    if extra:
        raise MalformedPayloadError(f"update has tensors the model lacks: {sorted(extra)[:5]}")
    stats.payload_bytes += sum(len(p) for p in payloads.values())
    stats.dense_bytes += sum(4 * d.numel() for d in deltas.values())
    stats.decoded += 1
    metrics = content[keys.METRICS] if keys.METRICS in content else MetricRecord()
    return RecordDict({keys.ARRAYS: ArrayRecord({k: Array(v) for k, v in full.items()}),
                       keys.METRICS: metrics})


def cast_downlink(arrays: ArrayRecord, downlink: str) -> dict[str, ArrayRecord]:
    """A model cast by the ``downlink`` codec, as the records a message carries instead of
    ``arrays``: the bundle of its float tensors' payloads (``compressed-down``) and its
    other tensors as they are (``arrays-uncompressed``, only if there are any).
    :func:`fededge.clients.mods.decode_downlink` turns them back into ``arrays``."""
    codec = build_codec(downlink)
    payloads, raw = {}, {}
    for name, t in arrays.to_torch_state_dict().items():
        if t.is_floating_point():
            payloads[name] = codec.encode(t)
        else:
            raw[name] = Array(t.numpy())
    records = {COMPRESSED_DOWN: bundle_record(payloads)}
    if raw:
        records[UNCOMPRESSED] = ArrayRecord(raw)
    return records
