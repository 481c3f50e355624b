"""The sparse codecs: top-k, random-k and threshold, each with its wire layout.

Split from :mod:`fededge.compress.codecs` along its seam: every codec here sends an
index set (a bitmap or varint gaps, whichever is smaller: :func:`encode_index_set`) and
the kept values, or their signs (Threshold, a quantizer whose body is an index set).
:mod:`fededge.compress.codecs` re-exports every name, for existing imports;
docs/wire-format.md gives the layouts byte by byte.

Pure: no Flower.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from fededge.compress._bits import (
    as_output, bf16_bytes, bf16_values, check_body_size, codec_header, finite_f32s, flat32,
    local_generator, pack_bools, pack_varints, read_params, read_varint, read_varints,
    signed_scalars, unpack_bools, varint_lengths,
)
from fededge.compress.codec import CodecConfig, ConfiguredCodec, register
from fededge.compress.wire import Header, MalformedPayloadError, pack

__all__ = [
    "ThresholdConfig", "SparsifyConfig", "SPARSE_VALUES", "Threshold", "TopK", "RandK",
    "encode_index_set", "decode_index_set", "topk_payload", "keep_count", "TAG_BITMAP", "TAG_VARINT",
]


# --------------------------------------------------------------------------- configs

@dataclass(frozen=True, kw_only=True)
class ThresholdConfig(CodecConfig):
    """Threshold quantization.

    Parameters
    ----------
    tau : float
        Both the threshold and the reconstruction value: elements with |x| >= tau are
        sent as sign * tau. Must be tuned to the gradient scale (Strom 2015); too large
        and nothing is sent (the residual then carries everything).
    """

    tau: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool):
            raise ValueError(f"tau must be a positive number, got {self.tau!r}")
        t32 = float(np.float32(self.tau))
        if not (math.isfinite(t32) and t32 > 0):
            raise ValueError(f"tau must be positive and finite in float32, got {self.tau!r}")


@dataclass(frozen=True, kw_only=True)
class SparsifyConfig(CodecConfig):
    """Top-k and random-k.

    Parameters
    ----------
    ratio : float
        Fraction of elements kept, in (0, 1]: k = max(1, ceil(ratio * d)). 0.01 sends
        about 1 % of the values (plus their indices).
    values : {"fp32", "fp16", "bf16"}
        Precision of the kept values on the wire. ``fp16`` halves the value bytes, which
        dominate at densities of a few percent (an index costs a few bits, a value 32);
        the rounding is one more compression error, which error feedback (or CHOCO's
        public estimates) carries like any other. ``fp16`` refuses values beyond 65504.
    """

    ratio: float = 0.01
    values: str = "fp32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool) or not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        if self.values not in SPARSE_VALUES:
            raise ValueError(f"values must be one of {', '.join(SPARSE_VALUES)}, got {self.values!r}")
        if np.float32(self.ratio) <= 0:
            raise ValueError(f"ratio {self.ratio!r} rounds to 0 in float32; use at least 1e-38")

    def k(self, d: int) -> int:
        """The number of elements kept of a tensor of ``d`` elements."""
        return keep_count(self.ratio, d)


#: Value precisions of the sparse formats, by their wire code (params byte 5).
SPARSE_VALUES: tuple[str, ...] = ("fp32", "fp16", "bf16")


def keep_count(ratio: float, d: int) -> int:
    """k = max(1, ceil(ratio * d)), at most d; ratio * d is first rounded to 6 decimals so
    that float noise (1 - 0.99 = 0.010000000000000009) does not add an element."""
    return min(d, max(1, math.ceil(round(ratio * d, 6))))


# --------------------------------------------------------------------------- index sets


TAG_BITMAP = 0
TAG_VARINT = 1


def encode_index_set(idx: np.ndarray, d: int) -> bytes:
    """The index block for sorted distinct indices ``idx`` of a tensor of ``d`` elements.

    A 1-byte tag, then either (tag 0) a bitmap of ceil(d/8) bytes, bit i set iff index i
    is in the set, or (tag 1) a varint count k and k varint gaps
    ``idx[0], idx[1] - idx[0] - 1, ...``. Whichever is shorter; a tie goes to the bitmap.
    """
    idx = np.asarray(idx, dtype=np.int64)
    gaps = np.diff(idx, prepend=-1) - 1
    bitmap_len = (d + 7) // 8
    varint_len = int(varint_lengths(np.array([idx.size]))[0] + varint_lengths(gaps).sum())
    if varint_len < bitmap_len:
        return bytes([TAG_VARINT]) + pack_varints(np.array([idx.size])) + pack_varints(gaps)
    mask = np.zeros(d, dtype=np.bool_)
    mask[idx] = True
    return bytes([TAG_BITMAP]) + pack_bools(mask)


def decode_index_set(body: bytes, d: int, what: str) -> tuple[np.ndarray, int]:
    """Parse an index block at the start of ``body`` -> (sorted int64 indices, bytes used)."""
    if len(body) < 1:
        raise MalformedPayloadError(f"{what}: body too short for the index-encoding tag")
    tag = body[0]
    if tag == TAG_BITMAP:
        nb = (d + 7) // 8
        if len(body) < 1 + nb:
            raise MalformedPayloadError(f"{what}: bitmap needs {nb} bytes, body has {len(body) - 1}")
        mask = unpack_bools(body[1:1 + nb], d, f"{what} bitmap")
        return np.flatnonzero(mask).astype(np.int64), 1 + nb
    if tag == TAG_VARINT:
        k, off = read_varint(body, 1, f"{what} index count")
        if k > d:
            raise MalformedPayloadError(f"{what}: {k} indices for a tensor of {d} elements")
        gaps, off = read_varints(body, off, k, f"{what} index gaps")
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if k and idx[-1] >= d:
            raise MalformedPayloadError(f"{what}: index {int(idx[-1])} out of range for {d} elements")
        return idx, off
    raise MalformedPayloadError(f"{what}: unknown index-encoding tag {tag} (0 = bitmap, 1 = varint gaps)")


# --------------------------------------------------------------------------- codecs


@register
class Threshold(ConfiguredCodec):
    """Threshold quantization (Strom, 2015, "Scalable Distributed DNN Training Using
    Commodity GPU Cloud Computing").

    Elements with |x_i| >= tau are sent as an index and a sign and reconstructed as
    ±tau; the rest are not sent. Biased: the error accumulates in
    :class:`~fededge.compress.feedback.ErrorFeedback` and is sent once it reaches tau.

    Params: ``<f`` tau. Body: an index block (see :func:`encode_index_set`), then
    ceil(k / 8) sign bits (1 = negative) for the k indices in increasing order.
    """

    name = "threshold"
    biased = True
    output_finite_by_construction = True  # tau is checked finite; every output is one of them
    Config = ThresholdConfig

    def encode(self, x, *, generator=None):
        f = flat32(x)
        tau = np.float32(self.config.tau)
        fn = f.numpy()
        idx = np.flatnonzero(np.abs(fn) >= tau)
        body = encode_index_set(idx, fn.size) + pack_bools(fn[idx] < 0)
        return pack(codec_header(self.name, x, struct.pack("<f", tau), self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        (tau,) = read_params(header, "<f")
        if not (math.isfinite(tau) and tau > 0):
            raise MalformedPayloadError(f"threshold tau must be positive and finite, got {tau}")
        d = header.numel
        idx, off = decode_index_set(body, d, "threshold")
        check_body_size(header, body, off + (idx.size + 7) // 8)
        out = np.zeros(d, dtype=np.float32)
        out[idx] = signed_scalars(body[off:], idx.size, tau, "threshold signs")
        return as_output(out, header)


def _value_bytes(values: torch.Tensor, precision: str) -> bytes:
    if precision == "fp32":
        return values.numpy().astype("<f4").tobytes()
    if precision == "bf16":
        return bf16_bytes(values)
    h = values.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError("a kept value overflows float16 (|x| > 65504); use values='bf16' or 'fp32'")
    return h.numpy().astype("<f2").tobytes()


def topk_payload(x: torch.Tensor, flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                 ratio: float, lossless: bool, codec: str = "topk", precision: str = "fp32") -> bytes:
    """The top-k / random-k payload of the (sorted) indices ``idx`` and their ``values``.

    Shared with DGC, whose payload is the top-k wire format. Params are ``<f`` ratio for
    float32 values (the original 4-byte form), ``<fB`` ratio and the value code
    (:data:`SPARSE_VALUES` index: 1 fp16, 2 bf16) otherwise.
    """
    code = SPARSE_VALUES.index(precision)
    params = struct.pack("<f", ratio) if code == 0 else struct.pack("<fB", ratio, code)
    body = encode_index_set(idx.numpy(), flat.numel()) + _value_bytes(values, precision)
    return pack(Header(codec, x.dtype, tuple(int(s) for s in x.shape), params, lossless), body)


def _sparse_decode(header: Header, body: bytes) -> torch.Tensor:
    if len(header.params) == 5:
        ratio, code = read_params(header, "<fB")
        if code >= len(SPARSE_VALUES):
            raise MalformedPayloadError(
                f"{header.codec} value code {code} is unknown (0 fp32, 1 fp16, 2 bf16)")
    else:
        (ratio,), code = read_params(header, "<f"), 0
    if not (0 < ratio <= 1):
        raise MalformedPayloadError(f"{header.codec} ratio must be in (0, 1], got {ratio}")
    d = header.numel
    idx, off = decode_index_set(body, d, header.codec)
    width = 4 if code == 0 else 2
    check_body_size(header, body, off + width * idx.size)
    label = f"{header.codec} values"
    if code == 0:
        vals = finite_f32s(body[off:], label)
    elif code == 1:
        vals = np.frombuffer(body[off:], dtype="<f2").astype(np.float32)
    else:
        vals = bf16_values(body[off:])
    out = np.zeros(d, dtype=np.float32)
    out[idx] = vals
    return as_output(out, header)


@register
class TopK(ConfiguredCodec):
    """Top-k sparsification: the k = max(1, ceil(ratio d)) largest-magnitude elements
    (as in Aji & Heafield, 2017; Stich et al., 2018, "Sparsified SGD with Memory").

    Biased: wrap in :class:`~fededge.compress.feedback.ErrorFeedback`. Ties in |x| are
    broken by torch.topk.

    Params: ``<f`` ratio (informational; k is in the body), or ``<fB`` ratio and a value
    code (1 fp16, 2 bf16; ``values=``). Body: an index block (see
    :func:`encode_index_set`), then k values in increasing index order.
    """

    name = "topk"
    biased = True
    Config = SparsifyConfig

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Sorted int64 indices of the kept elements of a flat float32 tensor."""
        k = self.config.k(flat.numel())
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values

    def encode(self, x, *, generator=None):
        f = flat32(x)
        idx = self.select(f)
        return topk_payload(x, f, idx, f[idx], self.config.ratio, self.config.lossless,
                            precision=self.config.values)

    @classmethod
    def decode_body(cls, header, body):
        return _sparse_decode(header, body)


@register
class RandK(ConfiguredCodec):
    """Random-k sparsification: k = max(1, ceil(ratio d)) indices drawn uniformly without
    replacement, values scaled by d / k so the estimate is unbiased (Stich et al., 2018,
    "Sparsified SGD with Memory"; Wangni et al., 2018).

    Params and body as :class:`TopK` (the values already carry the d / k factor).
    """

    name = "randk"
    biased = False
    Config = SparsifyConfig

    def encode(self, x, *, generator=None):
        f = flat32(x)
        d = f.numel()
        k = self.config.k(d)
        idx = torch.randperm(d, generator=local_generator(generator))[:k].sort().values
        vals = f[idx] * (d / k) if k else f[idx]
        if not bool(torch.isfinite(vals).all()):  # (the decoder would refuse the payload)
            raise ValueError(f"random-k's d / k = {d / k:.3g} scaling overflows float32 for values this large; "
                             "use topk (no scaling)")
        return topk_payload(x, f, idx, vals, self.config.ratio, self.config.lossless, "randk",
                            precision=self.config.values)

    @classmethod
    def decode_body(cls, header, body):
        return _sparse_decode(header, body)
