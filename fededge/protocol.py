"""The records fededge's client mods and server strategies exchange, built and read in one place.

Both sides of a compressed or decentralized run agree on more than names: a compressed
update is one ``uint8`` array holding a bundle of wire payloads (docs/wire-format.md), a
cast downlink model travels as such a bundle plus the tensors that were not cast, and a
client whose configuration cannot work answers with an error whose reason starts with a
marker. This module holds those record formats (and the bytes a node's
``context.state`` is stored as, :func:`recorddict_to_bytes`, which the in-process
runtime's state stores and the clients' :class:`~fededge.clients.statestore.StateSpillMod`
share): the client mods
(:mod:`fededge.clients.mods`) and the strategies (:mod:`fededge.strategies`) both import
it, and neither imports the other.

The names themselves (``compressed``, ``compressed-down``, ``bundle``, the config and
metric keys) are plain strings in :mod:`fededge.keys`, which has no Flower dependency.

Examples
--------
>>> import torch
>>> from fededge.compress import build_codec
>>> rec = bundle_record({"w": build_codec("fp16").encode(torch.ones(3))})
>>> decode_update_record(rec, max_elements=3)["w"]
tensor([1., 1., 1.])
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.arrays import from_torch, record_from_torch, record_to_torch, to_numpy
from fededge.compress import build_codec, decode_any
from fededge.compress.bundle import pack_bundle, unpack_bundle
from fededge.compress.update import decode_update

__all__ = [
    "CLIENT_APP_RAISED_EXCEPTION", "bundle_payloads", "bundle_record", "cast_downlink", "checkpoint_due",
    "checkpoint_rounds",
    "config_error_detail", "config_error_reason", "decode_downlink", "decode_update_record",
    "norm_stats_content", "read_norm_stats", "recorddict_from_bytes", "recorddict_to_bytes",
]

def checkpoint_due(server_round: int, *, every: int, resumed: int = 0) -> bool:
    """Whether a checkpoint is written after ``server_round``: after round 1 of a run (so
    that a run killed early resumes too, whatever ``every`` is) and after every
    ``every``-th round (0: never), never at or before the round a run was resumed from.
    The server writes them (:class:`~fededge.server.experiment.Experiment`); the nodes'
    state stores keep what those checkpoints need (:func:`checkpoint_rounds`)."""
    return every > 0 and server_round > resumed and (server_round == 1 or server_round % every == 0)


def checkpoint_rounds(resumed: int, every: int, t: int) -> list[int]:
    """The round a run resumed from (0: none), then each checkpoint round after it up to
    round ``t``, in order (:func:`checkpoint_due`)."""
    if every <= 0:
        return [resumed]
    firsts = [1] if resumed < 1 <= t and 1 % every else []
    return [resumed, *firsts, *range((resumed // every + 1) * every, t + 1, every)]


#: ``flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION`` (not public API): the
#: code Flower's runtimes give a reply whose ClientApp raised.
CLIENT_APP_RAISED_EXCEPTION = 2


def bundle_record(payloads: dict[str, bytes]) -> ArrayRecord:
    """Every payload in one uint8 array named ``bundle``: Flower's per-object framing is
    paid once, not once per tensor."""
    return ArrayRecord({keys.BUNDLE: Array(np.frombuffer(pack_bundle(payloads), dtype=np.uint8))})


def bundle_payloads(record: ArrayRecord) -> dict[str, bytes]:
    """The payloads :func:`bundle_record` packed."""
    return unpack_bundle(to_numpy(record[keys.BUNDLE]).tobytes())


def decode_update_record(record: ArrayRecord, *, max_elements: int) -> dict[str, torch.Tensor]:
    """An update record (a :func:`bundle_record` of wire payloads, or raw float arrays)
    -> its tensors. ``max_elements`` bounds any one decoded tensor (the receiver's
    largest), so a forged header cannot make it allocate without bound."""
    if list(record.keys()) == [keys.BUNDLE]:
        return decode_update(bundle_payloads(record), max_elements=max_elements)
    return dict(record_to_torch(record))


def cast_downlink(arrays: ArrayRecord, downlink: str) -> dict[str, ArrayRecord]:
    """A model cast by the ``downlink`` codec (``fp16``, ``bf16``), as the records a
    message carries instead of ``arrays``: the bundle of its float tensors' payloads
    (``compressed-down``) and its other tensors as they are (``arrays-uncompressed``, only
    if there are any): integers, and under ``fp16`` a float tensor with a finite value
    past its range (|x| > 65504, e.g. a running variance of unscaled inputs), which
    fp16 cannot carry. :func:`decode_downlink` turns them back into ``arrays``."""
    codec = build_codec(downlink)
    payloads, raw = {}, {}
    for name, t in record_to_torch(arrays).items():
        if not t.is_floating_point():
            raw[name] = from_torch(t)
            continue
        try:
            payloads[name] = codec.encode(t)
        except ValueError:  # fp16's overflow (its encoder refuses a value it rounds to Inf)
            if downlink != "fp16" or not bool(torch.isfinite(t).all()):
                raise
            raw[name] = from_torch(t)
    records = {keys.COMPRESSED_DOWN: bundle_record(payloads)}
    if raw:
        records[keys.UNCOMPRESSED] = ArrayRecord(raw)
    return records


def decode_downlink(content: RecordDict) -> RecordDict:
    """A message content whose model came cast (:func:`cast_downlink`) -> the same content
    with the model in ``arrays``, decoded exactly as every client decodes it."""
    payloads = bundle_payloads(content[keys.COMPRESSED_DOWN])
    arrays = {k: decode_any(p).numpy() for k, p in payloads.items()}
    if keys.UNCOMPRESSED in content:
        arrays.update({k: v.numpy() for k, v in record_to_torch(content[keys.UNCOMPRESSED]).items()})
    out = RecordDict({keys.ARRAYS: record_from_torch(arrays)})
    for name in content.keys():
        if name not in (keys.COMPRESSED_DOWN, keys.UNCOMPRESSED):
            out[name] = content[name]
    return out


def norm_stats_content(statistics: dict[str, torch.Tensor], *, num_examples: int,
                       compute_s: float | None = None) -> RecordDict:
    """A client's answer to a ``query.norm_stats`` message (norm-stats = global,
    :class:`~fededge.strategies.normstats.NormCalibrated`): the normalisation statistics
    of the model the message carried, on this client's data, as one bundle of ``raw``
    (float32, exact) payloads in the ``norm-stats`` record, and the examples they stand
    for (the client's data size: the pooling weight) in its metrics.

    A ClientApp of one's own answers with it::

        @app.query(keys.NORM_STATS_ACTION)
        def norm_stats(msg, context):
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
            stats = norm_statistics(model, x, batches=8, batch_size=32, seed=0)
            return Message(norm_stats_content(stats, num_examples=len(x)), reply_to=msg)
    """
    raw = build_codec("raw")
    metrics = {keys.NUM_EXAMPLES: int(num_examples)}
    if compute_s is not None:
        metrics[keys.COMPUTE_S] = float(compute_s)
    return RecordDict({keys.NORM_STATS: bundle_record({k: raw.encode(v.detach().float().cpu())
                                                       for k, v in statistics.items()}),
                       keys.METRICS: MetricRecord(metrics)})


def read_norm_stats(content: RecordDict, *, max_elements: int) -> tuple[int, dict[str, torch.Tensor]]:
    """``(num_examples, statistics)`` of a :func:`norm_stats_content` answer, no tensor over
    ``max_elements``; ValueError (MalformedPayloadError for a payload) naming what is wrong."""
    if keys.NORM_STATS not in content or keys.METRICS not in content:
        raise ValueError(f"a norm-stats answer holds '{keys.NORM_STATS}' and '{keys.METRICS}', this one "
                         f"{sorted(content.keys())}")
    metrics = content[keys.METRICS]
    if keys.NUM_EXAMPLES not in metrics:
        raise ValueError(f"a norm-stats answer's metrics need '{keys.NUM_EXAMPLES}'")
    return int(metrics[keys.NUM_EXAMPLES]), decode_update_record(content[keys.NORM_STATS], max_elements=max_elements)


def config_error_reason(err: Exception) -> str:
    """The error reason of a reply from a client whose configuration cannot work: the
    ``fededge-config-error`` marker, then the error's message.

    Examples
    --------
    >>> config_error_reason(ValueError("lower min-partition-size"))
    'fededge-config-error: lower min-partition-size'
    """
    return f"{keys.CONFIG_ERROR}: {err}"


def config_error_detail(reason: str) -> str | None:
    """What the client said, if ``reason`` (an error reply's) is a configuration error
    (:func:`config_error_reason`); None for any other failure.

    Examples
    --------
    >>> config_error_detail("fededge-config-error: lower min-partition-size")
    'lower min-partition-size'
    >>> config_error_detail("RuntimeError: a bug") is None
    True
    """
    if not reason.startswith(keys.CONFIG_ERROR):
        return None
    return reason.removeprefix(keys.CONFIG_ERROR).removeprefix(": ")


# -- a RecordDict (a node's context.state) as bytes ------------------------------------
_STATE_FORMAT = "fededge-state/1"


def recorddict_to_bytes(state: RecordDict) -> bytes:
    """``state`` (a node's ``context.state``) as bytes that :func:`recorddict_from_bytes`
    turns back into an equal RecordDict, bit for bit (the same object id).

    Each record's plain fields (an Array's dtype, shape, stype and bytes; a config or
    metric record's values), pickled: about a tenth of the cost of Flower's own
    serialisation, which hashes every object for its id and wraps every array in
    protobuf. A record of a kind this does not know is kept as Flower's serialised
    objects instead. Only plain values are pickled (no class is named), so reading
    needs no trust in the bytes: a value of a subclass Flower's records accept (a numpy
    float64, an IntEnum) is stored as its plain type, as Flower's own serialisation
    turns it into one (the object id is the same)."""
    items: list[tuple[str, str, Any]] = []
    for key, rec in state.items():
        if type(rec) is ArrayRecord:
            items.append((str(key), "a", [(str(k), str(a.dtype), tuple(int(n) for n in a.shape), str(a.stype),
                                           bytes(a.data)) for k, a in rec.items()]))
        elif type(rec) is ConfigRecord or type(rec) is MetricRecord:
            items.append((str(key), "c" if type(rec) is ConfigRecord else "m",
                          {str(k): _plain(v) for k, v in rec.items()}))
        else:
            return pickle.dumps(fi.recorddict_to_objects(state), protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((_STATE_FORMAT, items), protocol=pickle.HIGHEST_PROTOCOL)


_PLAIN = (bool, int, float, str, bytes)


def _plain(value: Any) -> Any:
    """A config or metric record's value as the plain type Flower serialises it as."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    for t in _PLAIN:  # bool first: it is an int too
        if isinstance(value, t):
            return t(value)
    raise TypeError(f"a record value of type {type(value).__name__} ({value!r}), which Flower's records do not hold")


class _PlainUnpickler(pickle.Unpickler):
    """Tuples, lists, dicts, strings, bytes, numbers, booleans and None; nothing that
    names a class or a function (what :func:`recorddict_to_bytes` writes)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a record dict's bytes name {module}.{name}: only plain values may be read")


def recorddict_from_bytes(blob: bytes) -> RecordDict:
    """The RecordDict :func:`recorddict_to_bytes` wrote (or a pickled dict of Flower's
    serialised objects, as the in-process runtime stored states before 2026-11-25).

    Raises ``pickle.UnpicklingError`` for bytes that name any class (not written here),
    ``ValueError`` for another format's or a malformed one's."""
    saved = _PlainUnpickler(io.BytesIO(blob)).load()
    if isinstance(saved, dict):
        return fi.recorddict_from_objects(saved)
    if not (isinstance(saved, tuple) and len(saved) == 2 and isinstance(saved[1], list)):
        raise ValueError(f"a client state's bytes hold a {type(saved).__name__}, not ({_STATE_FORMAT!r}, records)")
    fmt, items = saved
    if fmt != _STATE_FORMAT:
        raise ValueError(f"a client state in format {fmt!r}, which this fededge does not read "
                         f"(it reads {_STATE_FORMAT!r})")
    state = RecordDict()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 3 and item[1] in ("a", "c", "m")):
            raise ValueError(f"a client state's record is not (name, 'a' | 'c' | 'm', body): {str(item)[:80]}")
        key, kind, body = item
        if kind == "a":
            rec = ArrayRecord()
            for k, dtype, shape, stype, data in body:
                rec[k] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
            state[key] = rec
        else:
            if not isinstance(body, dict):
                raise ValueError(f"a client state's record {key!r} holds a {type(body).__name__}, not a dict")
            state[key] = ConfigRecord(body) if kind == "c" else MetricRecord(body)
    return state
