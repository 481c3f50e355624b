"""Several clients' updates encoded as one batched program (issue 35's cohort).

:func:`encode_batch` gives what each :meth:`UpdateEncoder.encode
<fededge.compress.update.UpdateEncoder.encode>` call would, the same payload bytes and the
same encoder states (error-feedback residuals) bit for bit, but does the work of a
tensor for all the clients at once where the codec allows: one stacked tensor, one
comparison, one bit-packing and one residual update instead of one each per client. A
tensor whose codec has no batched form here, or whose batch would not be bit-for-bit
the per-client result (a non-finite value, a residual of another shape), is encoded
client by client with the encoder's own :meth:`~fededge.compress.update.UpdateEncoder.encode_tensor`,
which raises the per-client path's errors.

Batched forms: signSGD (``compressor = signsgd``) and top-k (``compressor = topk``,
float32 values), each with or without error feedback, and QSGD, for the matrices; raw
float32 for the tensors the plan sends raw (1-D tensors, small ones, normalisation
statistics). signSGD's arithmetic is per client elementwise except the scale
(``||x||_1 / d``), which is summed per client on a fresh copy of that client's row, as
the codec sums it; top-k selects with ``torch.topk`` row by row, as on one client, ties
included; QSGD sums each client's bucket norms as the codec does and draws each client's
rounding from that client's own generator. DGC (momentum and warm-up per client) has no
batched form.

PowerSGD (:func:`fededge.compress.powersgd.encode_many`) is the exception to "bit for
bit": its power step runs as batched matmuls and one batched QR, which round differently
from one matmul per client, so what it sends (P Q^T) and its residuals agree with the
per-client path to float32 rounding, and its payloads have the same sizes. The factors
P and Q themselves can differ by more where they are not determined by M (a rank-deficient
M: QR's extra columns come from rounding) or where the contraction check of
:func:`~fededge.compress.powersgd._contractive` sits at its threshold (the two paths may
take different branches; either keeps the residual bounded).

The residuals and Qs a batch leaves are views of one buffer per chunk of clients
(fededge's client mods keep states as copies, so a chunk lives for one message).

Pure torch and numpy: no Flower.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from fededge.compress import powersgd
from fededge.compress._bits import codec_header
from fededge.compress.codecs import QSGD, Raw, SignSGD, TopK, topk_payload
from fededge.compress.roles import server_sets_statistics, tensor_role
from fededge.compress.update import UpdateEncoder
from fededge.compress.wire import pack

__all__ = ["batchable", "encode_batch"]


def batchable(encoder: UpdateEncoder) -> bool:
    """Whether :func:`encode_batch` has a batched form for ``encoder``'s matrices."""
    if encoder.powersgd is not None:
        return True
    if encoder.dgc is not None:
        return False
    codec = encoder.codec
    return (type(codec) in (SignSGD, QSGD)) or (type(codec) is TopK and codec.config.values == "fp32")


def encode_batch(encoders: Sequence[UpdateEncoder], deltas: Sequence[dict[str, torch.Tensor]], *,
                 round: int) -> list[dict[str, bytes]]:
    """``[e.encode(d, round=round) for e, d in zip(encoders, deltas)]``, the same bytes and
    states (PowerSGD's to float32 rounding), batched per tensor where :func:`batchable`
    (else client by client).

    The encoders must share their config, and the deltas their tensors' names, shapes
    and order; otherwise (or for a single client) each is encoded on its own.

    All or nothing: when any client's tensor is refused (a NaN, a residual of another
    shape), the error is raised with every encoder's state as it was before the call, so
    that the caller can encode the clients one by one and fail only the one at fault."""
    if len(encoders) != len(deltas):
        raise ValueError(f"{len(encoders)} encoders for {len(deltas)} deltas")
    if not encoders:
        return []
    first, spec = encoders[0], _spec(deltas[0])
    # The states' tensors are replaced, never changed in place (the one encoder that adds
    # in place, PowerSGD's, is handed copies on the client-by-client paths).
    kept = [_state_dicts(e) for e in encoders]
    try:
        if (len(encoders) == 1 or not batchable(first)
                or any(e.config != first.config or _spec(d) != spec for e, d in zip(encoders, deltas))):
            for e in encoders:
                if e.powersgd is not None:
                    e.powersgd.residual = {k: v.clone() for k, v in e.powersgd.residual.items()}
            return [e.encode(d, round=round) for e, d in zip(encoders, deltas)]
        return _encode_all(encoders, deltas, spec, round)
    except BaseException:
        for e, state in zip(encoders, kept):
            for part, attr, saved in state:
                setattr(part, attr, saved)
        raise


#: DGC's state dicts (fededge/compress/dgc.py: velocity and accumulation, replaced each call)
_DGC_STATE = ("u", "v")


def _state_dicts(e: UpdateEncoder) -> list[tuple[object, str, dict]]:
    parts: list[tuple[object, str]] = [(e.feedback, "residual")] if e.feedback is not None else []
    if e.powersgd is not None:
        parts += [(e.powersgd, "q"), (e.powersgd, "residual")]
    if e.dgc is not None:  # (DGC has no batched form: its states are the early path's)
        parts += [(e.dgc, attr) for attr in _DGC_STATE]
    return [(part, attr, dict(getattr(part, attr))) for part, attr in parts]


def _encode_all(encoders: Sequence[UpdateEncoder], deltas: Sequence[dict[str, torch.Tensor]], spec: tuple,
                round: int) -> list[dict[str, bytes]]:
    first = encoders[0]
    out: list[dict[str, bytes]] = [{} for _ in encoders]
    for i, (name, shape, _) in enumerate(spec):
        payloads = None
        role = tensor_role(name, shape, True, first.config)
        xs = [d[name] for d in deltas]
        if role == "matrix" and first.powersgd is not None:
            payloads = _powersgd_batch(encoders, i, name, xs, round)
        elif role == "matrix" and type(first.codec) is QSGD:
            payloads = _qsgd_batch(encoders, i, name, xs, round)
        elif role == "matrix" and not (type(first.codec) is TopK and _per_chunk(xs) < 2):
            # (top-k of a matrix of a chunk's size or more: as fast client by client,
            # whose decode is cheaper than the batch's scatter)
            payloads = _matrix_batch(encoders, name, xs)
        elif role == "statistic" and not server_sets_statistics(first.config):
            payloads = _raw_batch(first.raw, xs)
        elif role in ("small", "vector") and type(first.small) is Raw:
            payloads = _raw_batch(first.small, xs)
        if payloads is None:  # no batched form: each client's own, as encode() makes it
            payloads = _one_by_one(encoders, i, name, xs, round)
        for c, p in enumerate(payloads):
            if p is not None:
                out[c][name] = p
    return out


def _one_by_one(encoders: Sequence[UpdateEncoder], index: int, name: str, xs: Sequence[torch.Tensor],
                round: int) -> list[bytes | None]:
    if encoders[0].powersgd is not None:
        for e in encoders:  # (PowerSGD adds x to its residual in place: to a copy here, see encode_batch)
            res = e.powersgd.residual.get(name)  # type: ignore[union-attr]
            if res is not None:
                e.powersgd.residual[name] = res.clone()  # type: ignore[union-attr]
    return [e.encode_tensor(index, name, x.detach().float().cpu(), round=round) for e, x in zip(encoders, xs)]


def _powersgd_batch(encoders: Sequence[UpdateEncoder], index: int, name: str, xs: Sequence[torch.Tensor],
                    round: int) -> list[bytes | None] | None:
    """PowerSGD (:func:`fededge.compress.powersgd.encode_many`) a chunk of clients at a
    time; None for a matrix of a chunk's size or more (one client's matmuls are then large
    enough to run at the machine's speed, and a stack of them only goes to memory: ten
    ResNet-18 clients took 3x as long batched). A chunk the batch refuses is encoded client
    by client, which raises the per-client error."""
    step = _per_chunk(xs)
    if step < 2:
        return None
    out: list[bytes | None] = []
    for lo in range(0, len(xs), step):
        part = encoders[lo:lo + step]
        done = powersgd.encode_many([e.powersgd for e in part], name, list(xs[lo:lo + step]))  # type: ignore[misc]
        out.extend(done if done is not None else _one_by_one(part, index, name, xs[lo:lo + step], round))
    return out


def _spec(delta: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, tuple(int(s) for s in t.shape), t.dtype) for n, t in delta.items())


#: Clients are batched this many float32 values at a time (1 MiB): each pass over a
#: chunk stays in the core's cache, and its buffers are reused by the allocator. One
#: stack of a 100-client cohort's tensor (16 MB for a 200 x 200 matrix) was slower than
#: the clients one by one: every pass went to memory, every fresh buffer page-faulted.
CHUNK_VALUES = 1 << 18


def _topk_rows(codec: TopK, like: torch.Tensor, flat: torch.Tensor,
               residuals: list[torch.Tensor] | None) -> list[bytes]:
    """Top-k of each row of ``flat`` (TopK.encode's payloads); appends the rows' residuals
    (the row less its kept values) to ``residuals`` when given."""
    k = codec.config.k(flat.shape[1])
    # torch.topk of each row: the per-client call's algorithm, slice by slice (ties too).
    idx = torch.topk(flat.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = flat.gather(1, idx)
    out = [topk_payload(like, flat[j], idx[j], kept[j], codec.config.ratio, codec.config.lossless)
           for j in range(flat.shape[0])]
    if residuals is not None:
        # decode(payload) is the kept values at their indices and zero elsewhere.
        decoded = torch.zeros_like(flat).scatter_(1, idx, kept)
        residuals.extend((flat - decoded).reshape((flat.shape[0], *like.shape)))
    return out


def _qsgd_batch(encoders: Sequence[UpdateEncoder], index: int, name: str, xs: Sequence[torch.Tensor],
                round: int) -> list[bytes] | None:
    """:class:`~fededge.compress.codecs.QSGD` of every client's tensor: each client's
    bucket norms summed as the codec sums them (a fresh float64 copy each) and its
    rounding draws from its own generator (:meth:`UpdateEncoder._generator`, the stream
    the per-client path draws from); the levels, signs and bit-packing over the stack."""
    codec = encoders[0].codec
    assert isinstance(codec, QSGD)
    like = xs[0].float()
    s, bucket = codec.config.levels, codec.config.bucket
    d = like.numel()
    nb = QSGD.num_buckets(d, bucket)
    width = max(1, d if bucket == 0 or bucket > d else bucket)
    bits = QSGD.level_bits(s)
    header = codec_header(QSGD.name, like, struct.pack("<HI", s, bucket), codec.config)
    payloads: list[bytes] = []
    for lo, hi, x in _chunks(xs):
        flat = x.reshape(hi - lo, -1)
        values = flat.numpy()
        if not np.isfinite(values).all():
            return None  # the per-client path refuses the client's tensor by name
        norms_rows = []
        for row in flat:
            padded = torch.zeros(nb * width, dtype=torch.float64)
            padded[:d] = row
            norms_rows.append(torch.linalg.vector_norm(padded.view(nb, width), dim=1).float())
        norms = torch.stack(norms_rows)
        if not bool(torch.isfinite(norms).all()):
            return None  # a bucket's norm overflows: the per-client path says so
        per = norms.repeat_interleave(width, dim=1)[:, :d]
        live = per > 0
        r = flat.abs() / torch.where(live, per, torch.ones_like(per)) * s
        u = torch.stack([torch.rand(d, generator=encoders[c]._generator(round, index)) for c in range(lo, hi)])
        lv = torch.floor(r + u).clamp_(0, s)
        lv = torch.where(live, lv, torch.zeros_like(lv)).to(torch.int64).numpy().astype(np.uint32)
        fields = ((lv[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.bool_)
        level_bytes = np.packbits(fields.reshape(hi - lo, -1), axis=1, bitorder="little")
        sign_bytes = np.packbits(values < 0, axis=1, bitorder="little")
        norm_bytes = norms.numpy().astype("<f4")
        payloads.extend(pack(header, norm_bytes[j].tobytes() + sign_bytes[j].tobytes() + level_bytes[j].tobytes())
                        for j in range(hi - lo))
    return payloads


def _per_chunk(xs: Sequence[torch.Tensor]) -> int:
    """Clients a chunk holds (0 or 1 for a tensor of a chunk's size or more: batching it
    gains nothing)."""
    return CHUNK_VALUES // max(xs[0].numel(), 1)


def _chunks(xs: Sequence[torch.Tensor]):  # noqa: ANN202 - yields (lo, hi, stacked float32 CPU tensor)
    step = max(1, _per_chunk(xs))
    for lo in range(0, len(xs), step):
        hi = min(lo + step, len(xs))
        yield lo, hi, torch.stack([t.detach() for t in xs[lo:hi]]).float().cpu()


def _raw_batch(codec: Raw, xs: Sequence[torch.Tensor]) -> list[bytes] | None:
    """:class:`~fededge.compress.codecs.Raw` (float32 as is) of every client's tensor."""
    header = codec_header(Raw.name, xs[0].float(), b"", codec.config)
    payloads: list[bytes] = []
    for lo, hi, x in _chunks(xs):
        values = x.reshape(hi - lo, -1).numpy().astype("<f4", copy=False)
        if not np.isfinite(values).all():
            return None  # the per-client path refuses the client's tensor by name
        payloads.extend(pack(header, row.tobytes()) for row in values)
    return payloads


def _matrix_batch(encoders: Sequence[UpdateEncoder], name: str, xs: Sequence[torch.Tensor]) -> list[bytes] | None:
    """The codec (:class:`~fededge.compress.codecs.SignSGD` or :class:`TopK`) of every
    client's tensor ``xs[c]``, with each client's error feedback when it has one; None
    where the batch would not be the per-client result bit for bit (the caller then
    encodes client by client). No state changes before every client's tensor has been
    checked."""
    feedback = encoders[0].feedback
    kept: list[torch.Tensor | None] = [None] * len(xs)
    if feedback is not None:
        kept = [e.feedback.residual.get(name) for e in encoders]  # type: ignore[union-attr]
        if any(k is not None and k.shape != xs[0].shape for k in kept):
            return None  # a residual of another shape: the per-client path names it
    codec = encoders[0].codec
    assert codec is not None
    like = xs[0].float()
    header = None if isinstance(codec, TopK) else codec_header(SignSGD.name, like, b"", codec.config)
    d = max(xs[0].numel(), 1)
    payloads: list[bytes] = []
    residuals: list[torch.Tensor] = []
    for lo, hi, x in _chunks(xs):
        part = kept[lo:hi]
        if all(k is not None for k in part):
            x = x + torch.stack(part)  # type: ignore[arg-type]
        elif any(k is not None for k in part):
            x = torch.stack([x[j] if k is None else x[j] + k for j, k in enumerate(part)])
        flat = x.reshape(hi - lo, -1)
        values = flat.numpy()  # (numpy's comparisons and arithmetic on a CPU core are the faster here)
        if not np.isfinite(values).all():
            return None  # the per-client path refuses the client's tensor by name
        if isinstance(codec, TopK):
            payloads.extend(_topk_rows(codec, like, flat, residuals if feedback is not None else None))
            continue
        # The scale as SignSGD.encode sums it: torch's float64 sum of a fresh copy of the row.
        scale = torch.stack([(row.double().abs_().sum() / d).float() for row in flat]).numpy()[:, None]
        negative = values < 0
        bits = np.packbits(negative, axis=1, bitorder="little")
        assert header is not None
        payloads.extend(pack(header, scale[j].astype("<f4").tobytes() + bits[j].tobytes()) for j in range(hi - lo))
        if feedback is not None:
            # decode(payload) is -scale where the bit is set, +scale where not: the sign
            # (+1 or -1) times the scale is exact, so the residual is the per-client one.
            decoded = (np.float32(1) - np.float32(2) * negative) * scale
            residuals.extend(torch.from_numpy(values - decoded).reshape(x.shape))
    for e, r in zip(encoders, residuals):
        e.feedback.residual[name] = r  # type: ignore[union-attr]
    return payloads
