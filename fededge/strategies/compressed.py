"""``Compressed(strategy)``: decode compressed client updates for any Flower strategy.

The client's :class:`fededge.clients.mods.CompressionMod` sends, instead of its weights,
one wire payload per tensor (the delta from the weights it received). This wrapper keeps
the global arrays it sent each round, decodes every reply back into full weights
(sent + decoded delta), and hands the inner strategy ordinary replies. So
``Compressed(FedAvg(...))`` and ``Compressed(FedAdam(...))`` both work unchanged.

A reply that does not decode (truncated, unknown version or codec, shape mismatch, index
out of range, NaN/Inf) is rejected. So is, when the wrapper is given the clients'
:class:`~fededge.compress.update.UpdateConfig`, a reply in another codec
(:class:`CodecMismatchError`: "client sent codec 'topk', this server expects
'signsgd'"), or uncompressed. A rejected update is counted, with the node and the
reason, in :meth:`Compressed.take_stats`, and the round goes on without it: nothing is
lost but that one client's update. A caller that takes the stats (fededge's runner)
reports them, one line each; otherwise the wrapper logs each rejection as a warning. A
round in which every update was refused for a codec mismatch stops the run with the
:class:`CodecMismatchError`: every later round would be refused the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fededge import keys
from fededge.arrays import from_torch, record_from_torch, record_to_torch
from fededge.compress import MalformedPayloadError
from fededge.compress.plan import PlanMismatchError, UpdatePlan
from fededge.compress.roles import SERVER, is_counter, is_statistic, server_keeps
from fededge.compress.update import DOWNLINK, DownlinkConfig, UpdateConfig, decode_update
from fededge.compress.wire import peek_codec
from fededge.errors import ConfigError
from fededge.protocol import bundle_payloads, cast_downlink, decode_downlink
from fededge.strategies.delegate import DelegatesEvaluation
from fededge.strategies.report import RoundReport, report_of

__all__ = ["CodecMismatchError", "Compressed", "CompressionStats", "DOWNLINK", "check_uncompressed",
           "decode_compressed"]

# Downlink codecs (DOWNLINK, declared with the uplink's in fededge.compress.update): stateless
# casts of the broadcast model. Delta-coded downlinks would need per-client state kept in
# step for clients that sat rounds out; not built.

log = logging.getLogger(__name__)


class CodecMismatchError(ValueError):
    """A client's update is in another codec than the server expects: the client's
    compression mod and the server's wrapper are configured differently."""


@dataclass
class CompressionStats:
    """Per round: how many updates came compressed, how many were rejected, and sizes."""

    decoded: int = 0
    rejected: int = 0
    payload_bytes: int = 0  # the payloads' own bytes
    dense_bytes: int = 0  # what the same tensors weigh as float32
    reasons: list[str] = field(default_factory=list)
    mismatched: int = 0  # of the rejected: in another codec than expected

    @property
    def ratio(self) -> float | None:
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else None


class Compressed(DelegatesEvaluation):
    """Wrap a strategy so that it receives decoded, full-weight client updates.

    Pair it with :class:`fededge.clients.mods.CompressionMod` on the clients.

    Parameters
    ----------
    inner : Strategy
        Any strategy on Flower's own round loop (``Strategy.start``, which calls
        ``configure_train``/``aggregate_train``): every ``flwr.serverapp.strategy``
        class, ``FedAvgOuter``, a user's subclass. A strategy that runs its own loop is
        refused here with the form it supports (``DGA(..., update=...)``; CHOCO's own
        compressor for ``Gossip``; none yet for the asynchronous ones).
    downlink : str
        ``none``, ``fp16`` or ``bf16``: cast the model the server broadcasts for training
        (halves ``bytes_down``). Evaluation messages go uncompressed.
    update : UpdateConfig, optional
        The clients' compression, to check their updates against: a tensor whose payload
        names another codec than the per-tensor plan of the model under ``update`` gives
        it (:class:`fededge.compress.plan.UpdatePlan`), or an uncompressed reply when
        ``update`` compresses, is rejected with a :class:`CodecMismatchError` that names
        the tensor and both codecs. None (default) accepts any codec the decoder knows.

    Examples
    --------
    >>> from flwr.serverapp.strategy import FedAdam
    >>> strategy = Compressed(FedAdam(), update=UpdateConfig(compressor="topk", topk_ratio=0.1))
    """

    def __init__(self, inner: Strategy, *, downlink: str = DownlinkConfig.downlink,
                 update: UpdateConfig | None = None) -> None:
        DownlinkConfig(downlink=downlink)  # checks the name
        if not isinstance(inner, Strategy):
            raise TypeError(f"Compressed wraps a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        form = getattr(inner, "compressed_form", None)
        if form is not None:
            # fededge's strategies with a round loop of their own declare how compression
            # goes with them: that loop never calls configure_train/aggregate_train, where
            # this wrapper decodes, so wrapping one would only fail at round 1.
            raise ValueError(f"Compressed wraps strategies that run on Flower's round loop (Strategy.start); "
                             f"{type(inner).__name__} runs its own. With compression: {form}")
        self.inner = inner
        self.downlink = downlink
        self.update = update
        # round -> the weights sent that round, as tensors: converted once per round, not
        # once per reply (each conversion deserialises the whole model)
        self._sent: dict[int, dict[str, torch.Tensor]] = {}
        self._stats = CompressionStats()
        self._reported = False  # someone takes the stats (and reports the rejections)
        # name -> the integer dtype of a tensor the clients hold as integers (BatchNorm's
        # counters, a user's integer buffers): Flower's average makes it a float64, which
        # the plan would then give a codec (the clients' as-is tensor refused from round
        # 2) and a cast downlink would round (and overflow, under fp16). Kept an integer.
        self._integers: dict[str, torch.dtype] = {}
        #: set by a NormCalibrated around this wrapper: the server recalibrates the
        #: statistics, so a reply without them (``norm-stats=global`` clients) keeps the
        #: server's where ``update`` is not given to say so
        self.server_sets_statistics = False

    def take_stats(self) -> CompressionStats:
        """The counts since the previous call (one round, when called once a round). A
        caller of this reports the rejections itself: the wrapper then logs them at DEBUG."""
        self._reported = True
        s, self._stats = self._stats, CompressionStats()
        return s

    def round_report(self, server_round: int) -> RoundReport:
        """The inner strategy's report with this round's decoded and rejected updates
        merged in (:class:`~fededge.strategies.report.MeasuredStrategy`)."""
        stats = self.take_stats()
        return report_of(self.inner, server_round).merge(RoundReport(
            rejected=stats.rejected, mismatched=stats.mismatched,
            payload_bytes=stats.payload_bytes, dense_bytes=stats.dense_bytes,
            reasons=[f"a compressed update was rejected and left out: {r}" for r in stats.reasons]))

    # -- Strategy ------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.update is not None and self.update.norm_stats == "global" and not self.server_sets_statistics:
            # The clients send no statistics: without the server's own, the model's stayed
            # as they were in round 0, without a word.
            raise ConfigError("Compressed(..., update=UpdateConfig(norm_stats='global')): the clients send no "
                              "normalisation statistics, and nothing here computes the server's: wrap it in "
                              "NormCalibrated(Compressed(...)), or give both sides norm_stats='decoded'")
        self._integers.update(integer_dtypes(arrays))
        arrays = with_integers(arrays, self._integers)
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        if self.downlink == "none":
            self._sent = {server_round: record_to_torch(arrays)}  # only this round's base
            return messages
        # Cast the broadcast model once; the base for decoding the replies is the model
        # the clients actually received (the rounded one, decoded as they decode it), so
        # deltas rebuild exactly.
        down = cast_downlink(arrays, self.downlink)
        self._sent = {server_round: record_to_torch(decode_downlink(RecordDict(down))[keys.ARRAYS])}
        for m in messages:
            content = RecordDict(down)
            for name in m.content.keys():
                if name != keys.ARRAYS:
                    content[name] = m.content[name]
            m.content = content
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # noqa: ANN201
        base = self._sent.get(server_round)
        kept, mismatches = [], []
        for r in replies:
            if r.has_error():
                kept.append(r)  # errors: the inner strategy leaves them out
                continue
            try:
                if keys.COMPRESSED in r.content:
                    if base is None:
                        raise RuntimeError(f"round {server_round}: compressed replies but no arrays were sent")
                    r.content = decode_compressed(r.content, base, self._stats, expect=self.update,
                                                  server_round=server_round,
                                                  keep_statistics=self.server_sets_statistics)
                else:
                    check_uncompressed(self.update, server_round)
                if keys.ARRAYS in r.content:
                    self._integers.update(integer_dtypes(r.content[keys.ARRAYS]))
                kept.append(r)
            except (MalformedPayloadError, CodecMismatchError) as err:
                reason = f"node {r.metadata.src_node_id}: {err}"
                self._stats.rejected += 1
                self._stats.reasons.append(reason)
                if isinstance(err, CodecMismatchError):
                    self._stats.mismatched += 1
                    mismatches.append(err)
                log.log(logging.DEBUG if self._reported else logging.WARNING,
                        "round %d: rejected a client update: %s", server_round, reason)
        if mismatches and not any(not r.has_error() for r in kept):
            raise CodecMismatchError(
                f"round {server_round}: every client update was refused: {mismatches[0]}. Give the "
                f"clients' CompressionMod and the server's Compressed(..., update=...) the same UpdateConfig")
        arrays, metrics = self.inner.aggregate_train(server_round, kept)
        return (None if arrays is None else with_integers(arrays, self._integers)), metrics


def integer_dtypes(arrays: ArrayRecord) -> dict[str, torch.dtype]:
    """name -> torch dtype of each integer (or bool) array of ``arrays``, read from the
    arrays' headers (nothing is deserialised)."""
    out = {}
    for name, a in arrays.items():
        dtype = _TORCH_DTYPES.get(str(getattr(a, "dtype", "")))
        if dtype is not None:
            out[name] = dtype
    return out


_TORCH_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
                 "int64": torch.int64, "bool": torch.bool}


def with_integers(arrays: ArrayRecord, dtypes: dict[str, torch.dtype]) -> ArrayRecord:
    """``arrays`` with each tensor named in ``dtypes`` that came as a float (Flower's
    average of an integer buffer is a float64) rounded back to its integer dtype; the
    same record where there is none."""
    floats = [n for n, d in dtypes.items() if n in arrays and _TORCH_DTYPES.get(str(arrays[n].dtype)) is not d]
    if not floats:
        return arrays
    out = ArrayRecord()
    for name in arrays.keys():
        if name in floats:
            t = record_to_torch(ArrayRecord({name: arrays[name]}))[name]
            out[name] = from_torch((t != 0) if dtypes[name] == torch.bool else t.round().to(dtypes[name]))
        else:
            out[name] = arrays[name]
    return out



def decode_compressed(content: RecordDict, sent: dict[str, torch.Tensor], stats: CompressionStats, *,
                      expect: UpdateConfig | None = None, server_round: int | None = None,
                      keep_statistics: bool = False) -> RecordDict:
    """A reply whose ``compressed`` record holds the update's payloads -> the same reply
    with full weights in ``arrays``: ``sent`` (the weights the update is a delta from) plus
    the decoded delta. Counts it in ``stats``. Raises MalformedPayloadError for anything
    that does not decode or does not fit the model, and :class:`CodecMismatchError` for
    a payload in a codec ``expect`` does not send (None: any codec), or a compressed reply
    in one of ``expect``'s warm-up rounds (``server_round`` given). ``keep_statistics``:
    the server recalibrates the normalisation statistics (a NormCalibrated around the
    wrapper), so a reply may leave them and their counters out where ``expect`` is None."""
    if expect is not None and server_round is not None and not expect.compresses(server_round):
        raise CodecMismatchError(
            f"client sent a compressed update in round {server_round}, a warm-up round of this server "
            f"(compress-warmup-rounds={expect.warmup_rounds}: uncompressed until round {expect.warmup_rounds}); "
            "give the clients' CompressionMod the same UpdateConfig")
    rec = content[keys.COMPRESSED]
    largest = max((math.prod(v.shape) for v in sent.values()), default=1)
    if list(rec.keys()) != [keys.BUNDLE]:
        raise MalformedPayloadError(f"compressed record must hold one array '{keys.BUNDLE}', has "
                                    f"{list(rec.keys())[:5]}")
    payloads = bundle_payloads(rec)
    raw = record_to_torch(content[keys.UNCOMPRESSED]) if keys.UNCOMPRESSED in content else {}
    for name, t in raw.items():
        if name in sent and tuple(t.shape) != tuple(sent[name].shape):
            raise MalformedPayloadError(
                f"tensor {name!r} (sent as it is): shape {tuple(t.shape)} != model shape {tuple(sent[name].shape)}")
    if expect is not None:
        _check_codecs(payloads, expect)
        _check_plan(payloads, raw, sent, expect)
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
        elif (server_keeps(name, expect) if expect is not None
              else keep_statistics and (is_statistic(name) or is_counter(name))):
            full[name] = old.numpy()  # not sent: the server recalibrates it (NormCalibrated), keeps its counter
        else:
            raise MalformedPayloadError(f"tensor {name!r} of the model is missing from the update")
    extra = set(deltas) - set(sent)
    if extra:
        raise MalformedPayloadError(f"update has tensors the model lacks: {sorted(extra)[:5]}")
    stats.payload_bytes += sum(len(p) for p in payloads.values())
    stats.dense_bytes += sum(4 * d.numel() for d in deltas.values())
    stats.decoded += 1
    out = RecordDict({keys.ARRAYS: record_from_torch(full)})
    for name in content.keys():  # anything else the client replied with, as it came (its metrics
        if name not in out and name not in (keys.COMPRESSED, keys.UNCOMPRESSED):  # under its own name:
            out[name] = content[name]  # an empty 'metrics' beside them made Flower's FedAvg refuse the reply)
    if not out.metric_records:
        out[keys.METRICS] = MetricRecord()
    return out


def _expected(update: UpdateConfig) -> str:
    codecs = update.wire_codecs()
    if not codecs:
        return "uncompressed updates (compressor 'none')"
    more = f" ({codecs[1]!r} for tensors under {update.min_numel} elements)" if len(codecs) > 1 else ""
    return f"{codecs[0]!r}{more}"


def _check_codecs(payloads: dict[str, bytes], expect: UpdateConfig) -> None:
    allowed = expect.wire_codecs()
    for name, payload in payloads.items():
        codec = peek_codec(payload)
        if codec not in allowed:
            raise CodecMismatchError(f"client sent codec {codec!r} (tensor {name!r}), this server expects "
                                     f"{_expected(expect)}")


def _check_plan(payloads: dict[str, bytes], raw: dict[str, torch.Tensor], sent: dict[str, torch.Tensor],
                expect: UpdateConfig) -> None:
    """Every tensor in the codec the plan of ``sent`` under ``expect`` gives it, and the
    tensors sent as they are only those the plan sends so (its integers)."""
    # A tensor the client holds as an integer and sends as it is, which a strategy's
    # average (in an earlier round, or a run resumed from its checkpoint) made a float
    # here, is the integer the client's plan sees.
    plan = UpdatePlan.build(expect, {n: raw[n] if n in raw and not raw[n].is_floating_point() else t
                                     for n, t in sent.items()}, with_bytes=False)
    codecs = {name: peek_codec(p) for name, p in payloads.items()}
    codecs.update({name: "as-is" for name in raw if name not in codecs})
    try:
        plan.check({n: c for n, c in codecs.items() if c != "as-is"})
        for e in plan.entries:
            if e.codec not in (None, SERVER) and e.name not in codecs:
                raise PlanMismatchError(
                    f"tensor {e.name!r} ({e.role}) is missing; this server's plan gives it codec {e.codec!r}"
                    + (" (a client with norm-stats=global sends no statistics)" if e.role == "statistic" else ""))
        for name in (n for n, c in codecs.items() if c == "as-is" and n in sent):
            if plan.codec_of(name) == SERVER:
                raise PlanMismatchError(f"tensor {name!r} came as it is (uncompressed); this server's plan sends it "
                                        "not at all (norm-stats=global: the server keeps its own)")
            if plan.codec_of(name) is not None:
                raise PlanMismatchError(f"tensor {name!r} came as it is (uncompressed); this server's plan gives "
                                        f"it codec {plan.codec_of(name)!r}")
    except PlanMismatchError as err:
        raise CodecMismatchError(str(err)) from None


def check_uncompressed(expect: UpdateConfig | None, server_round: int | None = None) -> None:
    """Raise :class:`CodecMismatchError` for an uncompressed reply when ``expect``, the
    clients' compression, says they compress (None: anything goes), in ``server_round``
    (None: any round past the warm-up)."""
    if expect is not None and expect.wire_codecs() and (server_round is None or expect.compresses(server_round)):
        raise CodecMismatchError(f"client sent an uncompressed update ('{keys.ARRAYS}'), this server expects "
                                 f"{_expected(expect)}; add CompressionMod to the ClientApp")
