"""The stateless codecs: casts, quantizers and sparsifiers, each with its wire layout.

The casts and the dense quantizers are here; the sparse codecs (top-k, random-k,
threshold: an index set and values) are :mod:`fededge.compress.sparsify`, re-exported
below so that every codec is still importable from this module.

Every codec here is a :class:`~fededge.compress.codec.Codec` configured by a frozen,
validated config dataclass; ``encode`` uses only the ``torch.Generator`` it is handed
(or a freshly seeded local one), never the global RNG. docs/wire-format.md gives each
codec's parameter and body layout byte by byte; the layouts below must agree with it.

All floats on the wire are IEEE-754 little-endian; all bit fields are packed least
significant bit first (numpy ``bitorder='little'``), with zero padding bits, which a
decoder checks. Every ``decode_body`` checks the body length against the header's shape
*before* it allocates anything proportional to that shape.

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
    local_generator, pack_bools, pack_uints, read_params,
    signed_scalars, unpack_bools, unpack_uints,
)
from fededge.compress.codec import CodecConfig, ConfiguredCodec, register
from fededge.compress.wire import MalformedPayloadError, pack

__all__ = [
    "CodecConfig", "Int8Config", "QSGDConfig", "ThresholdConfig", "SparsifyConfig",
    "Raw", "FP16", "BF16", "Int8", "QSGD", "TernGrad", "OneBit", "SignSGD", "Threshold",
    "TopK", "RandK", "encode_index_set", "decode_index_set", "topk_payload", "keep_count",
    "SPARSE_VALUES", "TAG_BITMAP", "TAG_VARINT",
]


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True, kw_only=True)
class Int8Config(CodecConfig):
    """Uniform symmetric int8.

    Parameters
    ----------
    block : int
        0 for one scale per tensor; otherwise one float32 scale per run of ``block``
        consecutive elements (256 is a good start: 1.6 % overhead, robust to outliers).
    stochastic : bool
        Stochastic rounding (unbiased) instead of round-half-to-even (biased, lower
        variance).
    """

    block: int = 0
    stochastic: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.block, int) or isinstance(self.block, bool) or not 0 <= self.block < 2**32:
            raise ValueError(f"block must be 0 (per-tensor scale) or a positive element count, got {self.block!r}")
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic must be True or False, got {self.stochastic!r}")


@dataclass(frozen=True, kw_only=True)
class QSGDConfig(CodecConfig):
    """QSGD.

    Parameters
    ----------
    levels : int
        The number s of quantization levels (1..65535). Each element costs
        ceil(log2(s+1)) bits plus a sign bit; the variance bound min(b/s^2, sqrt(b)/s)
        (b = bucket) shrinks as s grows. 16 (5 bits) is close to full-precision accuracy
        in the paper.
    bucket : int
        Elements per bucket, each bucket quantized with its own L2 norm (one float32 per
        bucket on the wire). Default 512, the bucket size of the paper's experiments: it
        costs 32 bits per 512 elements (1/16 bit each) and keeps the error of a large
        tensor near that of a 512-element one, since the variance bound grows with b,
        not with the tensor size d. 0 means one bucket for the whole tensor (one norm;
        the variance bound then grows with sqrt(d) / s, huge for large tensors).
    """

    levels: int = 16
    bucket: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.levels, int) or isinstance(self.levels, bool) or not 1 <= self.levels <= 65535:
            raise ValueError(f"levels must be an integer in 1..65535, got {self.levels!r}")
        if not isinstance(self.bucket, int) or isinstance(self.bucket, bool) or not 0 <= self.bucket < 2**32:
            raise ValueError(f"bucket must be a positive element count below 2**32 (512 is the usual "
                             f"choice) or 0 for one bucket per tensor, got {self.bucket!r}")


# --------------------------------------------------------------------------- casts


@register
class Raw(ConfiguredCodec):
    """float32 as is (lossless). Body: d float32. With ``lossless=True`` a zlib stage follows.

    Examples
    --------
    >>> Raw().decode(Raw().encode(torch.ones(3))).tolist()
    [1.0, 1.0, 1.0]
    """

    name = "raw"
    biased = False

    def encode(self, x, *, generator=None):
        f = flat32(x)
        return pack(codec_header(self.name, x, b"", self.config), f.numpy().astype("<f4").tobytes())

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        check_body_size(header, body, 4 * header.numel)
        return as_output(np.frombuffer(body, dtype="<f4"), header)


@register
class FP16(ConfiguredCodec):
    """IEEE half precision (round to nearest even). Body: d float16. Overflow (|x| > 65504)
    becomes Inf, which the decoder rejects, so encode refuses it up front."""

    name = "fp16"
    biased = True

    def encode(self, x, *, generator=None):
        h = flat32(x).to(torch.float16)
        if not torch.isfinite(h).all():
            raise ValueError("tensor overflows float16 (|x| > 65504); use bf16 or int8 instead")
        return pack(codec_header(self.name, x, b"", self.config), h.numpy().astype("<f2").tobytes())

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        check_body_size(header, body, 2 * header.numel)
        return as_output(np.frombuffer(body, dtype="<f2"), header)


@register
class BF16(ConfiguredCodec):
    """bfloat16 (the top 16 bits of float32, rounded to nearest even). Body: d uint16."""

    name = "bf16"
    biased = True

    def encode(self, x, *, generator=None):
        return pack(codec_header(self.name, x, b"", self.config), bf16_bytes(flat32(x)))

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        check_body_size(header, body, 2 * header.numel)
        return as_output(bf16_values(body), header)


# --------------------------------------------------------------------------- quantizers


@register
class Int8(ConfiguredCodec):
    """Uniform symmetric int8 with a per-tensor or per-block scale.

    scale = max|x| / 127 over the tensor (``block=0``) or over each run of ``block``
    elements; q = round(x / scale) in [-127, 127] (round half to even, biased) or
    floor(x / scale + u), u ~ U[0, 1) (``stochastic=True``, unbiased). Decoded value:
    float32(q) * scale.

    Params: ``<I`` block, ``<B`` flags (bit 0 = stochastic; informational).
    Body: nblocks float32 scales (nblocks = 1 if block == 0 else ceil(d / block)), then d
    int8. The decoder rejects -128 and negative or non-finite scales.
    """

    name = "int8"
    biased = True
    Config = Int8Config

    def __init__(self, config=None, /, **kwargs):
        super().__init__(config, **kwargs)
        self.biased = not self.config.stochastic

    def encode(self, x, *, generator=None):
        f = flat32(x)
        d = f.numel()
        block = min(self.config.block, d) if self.config.block else d
        block = max(block, 1)
        nblocks = 1 if self.config.block == 0 else -(-d // block)
        padded = torch.zeros(nblocks * block)
        padded[:d] = f
        blocks = padded.view(nblocks, block)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        r = blocks / safe[:, None]
        if self.config.stochastic:
            r = torch.floor(r + torch.rand(r.shape, generator=local_generator(generator)))
        else:
            r = torch.round(r)
        q = r.clamp_(-127, 127).to(torch.int8).reshape(-1)[:d]
        params = struct.pack("<IB", self.config.block, int(self.config.stochastic))
        body = scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()
        return pack(codec_header(self.name, x, params, self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        block, flags = read_params(header, "<IB")
        if flags & ~1:
            raise MalformedPayloadError(f"int8 flags 0x{flags:02x} has unknown bits")
        d = header.numel
        nblocks = 1 if block == 0 else -(-d // block)
        check_body_size(header, body, 4 * nblocks + d)
        scale = finite_f32s(body[: 4 * nblocks], "int8 scales")
        if (scale < 0).any():
            raise MalformedPayloadError("int8 scales must be >= 0")
        q = np.frombuffer(body, dtype=np.int8, offset=4 * nblocks)
        if (q == -128).any():
            raise MalformedPayloadError("int8 value -128 is outside the symmetric range [-127, 127]")
        per = scale[np.arange(d) // block] if block else np.full(d, scale[0], dtype=np.float32)
        return as_output(q.astype(np.float32) * per, header)


@register
class QSGD(ConfiguredCodec):
    """QSGD: stochastic quantization to s levels of |x_i| / ||x_B||_2 per bucket B of
    ``bucket`` consecutive elements (Alistarh et al., 2017, "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding"). The default is bucket = 512, as in the
    paper's experiments; bucket = 0 quantizes the whole tensor with one norm.

    level_i = floor(s |x_i| / ||x_B|| + u_i), u_i ~ U[0, 1), so E[level_i] = s |x_i| / ||x_B||
    and the estimate ||x_B|| sign(x_i) level_i / s is unbiased with, per bucket,
    E||Q(x_B) - x_B||^2 <= min(b / s^2, sqrt(b) / s) ||x_B||^2 (b = bucket, or d when
    bucket = 0); summed over the buckets, E||Q(x) - x||^2 <= min(b / s^2, sqrt(b) / s) ||x||^2.

    Params: ``<H`` s, ``<I`` bucket (6 bytes). Body: n float32 bucket norms ||x_B||_2
    (n = 1 if bucket == 0 else ceil(d / bucket); bucket j covers elements j*bucket ..
    (j+1)*bucket - 1, the last one possibly shorter); d sign bits (1 = negative); d level
    indices of b = ceil(log2(s + 1)) bits each, bit-packed LSB first. Decoded value:
    ±(norm[i // bucket] * (float32(level) / float32(s))). The decoder rejects level > s,
    s = 0 and a negative or non-finite norm.

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> payload = QSGD(levels=16).encode(torch.randn(1000), generator=g)
    >>> len(payload)  # 23 header + 2 x 4 norms + 125 sign + 625 level bytes
    781
    """

    name = "qsgd"
    biased = False
    Config = QSGDConfig

    @staticmethod
    def level_bits(s: int) -> int:
        return max(1, math.ceil(math.log2(s + 1)))

    @staticmethod
    def num_buckets(d: int, bucket: int) -> int:
        """Norms on the wire for ``d`` elements: 1 if bucket == 0, else ceil(d / bucket)."""
        return 1 if bucket == 0 else -(-d // bucket)

    @classmethod
    def body_size(cls, d: int, bucket: int, s: int) -> int:
        """Body bytes: 4 per norm, ceil(d / 8) of signs, ceil(d * b / 8) of levels."""
        return 4 * cls.num_buckets(d, bucket) + (d + 7) // 8 + (d * cls.level_bits(s) + 7) // 8

    def encode(self, x, *, generator=None):
        f = flat32(x)
        d = f.numel()
        s, bucket = self.config.levels, self.config.bucket
        nb = self.num_buckets(d, bucket)
        width = max(1, d if bucket == 0 or bucket > d else bucket)  # never pad past d
        padded = torch.zeros(nb * width, dtype=torch.float64)
        padded[:d] = f
        norms = torch.linalg.vector_norm(padded.view(nb, width), dim=1).float()
        if not torch.isfinite(norms).all():
            raise ValueError("the L2 norm of a bucket overflows float32; scale the update down first")
        per = norms.repeat_interleave(width)[:d]  # each element's bucket norm
        live = per > 0
        r = f.abs() / torch.where(live, per, torch.ones_like(per)) * s
        lv = torch.floor(r + torch.rand(f.shape, generator=local_generator(generator))).clamp_(0, s)
        lv = torch.where(live, lv, torch.zeros_like(lv))
        body = (norms.numpy().astype("<f4").tobytes() + pack_bools((f < 0).numpy())
                + pack_uints(lv.to(torch.int64).numpy(), self.level_bits(s)))
        params = struct.pack("<HI", s, bucket)
        return pack(codec_header(self.name, x, params, self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        s, bucket = read_params(header, "<HI")
        if s < 1:
            raise MalformedPayloadError("qsgd levels must be >= 1, got 0")
        d, b = header.numel, cls.level_bits(s)
        nb = cls.num_buckets(d, bucket)
        nsign = (d + 7) // 8
        size = cls.body_size(d, bucket, s)
        if len(body) != size:
            raise MalformedPayloadError(
                f"qsgd body of shape {header.shape} (d = {d}) with bucket = {bucket} and s = {s} must be "
                f"{size} bytes ({nb} norms x 4 + {nsign} sign + {(d * b + 7) // 8} level), got {len(body)}"
            )
        norms = finite_f32s(body[: 4 * nb], "qsgd norms")
        if (norms < 0).any():
            raise MalformedPayloadError(f"qsgd norm {float(norms.min())} is negative")
        neg = unpack_bools(body[4 * nb:4 * nb + nsign], d, "qsgd signs")
        lv = unpack_uints(body[4 * nb + nsign:], d, b, "qsgd levels")
        if (lv > s).any():
            raise MalformedPayloadError(f"qsgd level {int(lv.max())} exceeds s = {s}")
        # min(): a forged huge bucket must not allocate more than d elements
        per = np.repeat(norms, min(bucket, d))[:d] if bucket else np.full(d, norms[0], dtype=np.float32)
        mag = per * (lv.astype(np.float32) / np.float32(s))
        return as_output(np.where(neg, -mag, mag), header)


@register
class TernGrad(ConfiguredCodec):
    """TernGrad: stochastic ternary quantization with max scaling (Wen et al., 2017,
    "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning").

    s = max|x|; t_i = sign(x_i) with probability |x_i| / s, else 0; s * t_i is unbiased.
    (The paper's optional 2.5-sigma gradient clipping is left to the caller.)

    Params: none. Body: s as float32, then d 2-bit codes (0 -> 0, 1 -> +1, 2 -> -1;
    3 is rejected), element i at bits 2i..2i+1, LSB first. Decoded value: s * t.
    """

    name = "terngrad"
    biased = False

    def encode(self, x, *, generator=None):
        f = flat32(x)
        s = f.abs().max() if f.numel() else torch.tensor(0.0)
        if s > 0:
            keep = torch.rand(f.shape, generator=local_generator(generator)) < f.abs() / s
        else:
            keep = torch.zeros(f.shape, dtype=torch.bool)
        code = torch.where(keep, torch.where(f < 0, 2, 1), 0)
        body = s.numpy().astype("<f4").tobytes() + pack_uints(code.numpy(), 2)
        return pack(codec_header(self.name, x, b"", self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        d = header.numel
        check_body_size(header, body, 4 + (2 * d + 7) // 8)
        s = finite_f32s(body[:4], "terngrad scale")[0]
        if s < 0:
            raise MalformedPayloadError(f"terngrad scale {s} is negative")
        code = unpack_uints(body[4:], d, 2, "terngrad codes")
        if (code == 3).any():
            raise MalformedPayloadError("terngrad code 3 is not a ternary value (0, 1 = +1, 2 = -1)")
        t = np.where(code == 2, -1.0, code.astype(np.float64)).astype(np.float32)
        return as_output(np.float32(s) * t, header)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns): dim 0 rows and the rest flattened; a 1-D tensor is one column."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return shape[0], math.prod(shape[1:])


@register
class OneBit(ConfiguredCodec):
    """1-bit SGD with per-column reconstruction values (Seide et al., 2014, "1-Bit
    Stochastic Gradient Descent and its Application to Data-Parallel Distributed Training
    of Speech DNNs").

    The tensor is viewed as a matrix (dim 0 rows, the other dims flattened to columns; a
    1-D tensor is one column). Each element sends its sign (bit 1 = x < 0); each column
    sends the mean of its non-negative elements and the mean of its negative elements,
    which minimise the squared error given the signs. Biased: wrap in
    :class:`~fededge.compress.feedback.ErrorFeedback` ("quantization error feedback").

    Params: none. Body: c float32 positive means, c float32 negative means (0 for an empty
    group), then d sign bits in row-major order.
    """

    name = "onebit"
    biased = True
    output_finite_by_construction = True  # the two means per column are checked finite; every output is one of them

    def encode(self, x, *, generator=None):
        f = flat32(x)
        rows, cols = _matrix_shape(tuple(x.shape))
        m = f.view(rows, cols).double()
        neg = m < 0
        npos = (~neg).sum(0)
        nneg = neg.sum(0)
        pos_mean = torch.where(~neg, m, 0).sum(0) / npos.clamp(min=1)
        neg_mean = torch.where(neg, m, 0).sum(0) / nneg.clamp(min=1)
        body = (pos_mean.float().numpy().astype("<f4").tobytes()
                + neg_mean.float().numpy().astype("<f4").tobytes() + pack_bools(neg.numpy()))
        return pack(codec_header(self.name, x, b"", self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        rows, cols = _matrix_shape(header.shape)
        d = header.numel
        check_body_size(header, body, 8 * cols + (d + 7) // 8)
        pos = finite_f32s(body[: 4 * cols], "onebit positive means")
        negm = finite_f32s(body[4 * cols: 8 * cols], "onebit negative means")
        neg = unpack_bools(body[8 * cols:], d, "onebit signs").reshape(rows, cols)
        return as_output(np.where(neg, negm[None, :], pos[None, :]), header)


@register
class SignSGD(ConfiguredCodec):
    """Scaled sign, as in EF-signSGD (Karimireddy et al., 2019, "Error Feedback Fixes
    SignSGD and other Gradient Compression Schemes").

    Sends scale = ||x||_1 / d and sign(x) (zero counts as +). Biased: use with
    :class:`~fededge.compress.feedback.ErrorFeedback`, which is what makes it converge.

    Params: none. Body: scale as float32, then d sign bits (1 = negative).
    """

    name = "signsgd"
    biased = True
    output_finite_by_construction = True  # the scale is checked finite; every output is one of them

    def encode(self, x, *, generator=None):
        f = flat32(x)
        scale = (f.double().abs().sum() / max(f.numel(), 1)).float()
        body = scale.numpy().astype("<f4").tobytes() + pack_bools((f < 0).numpy())
        return pack(codec_header(self.name, x, b"", self.config), body)

    @classmethod
    def decode_body(cls, header, body):
        read_params(header, "")
        d = header.numel
        check_body_size(header, body, 4 + (d + 7) // 8)
        s = finite_f32s(body[:4], "signsgd scale")[0]
        if s < 0:
            raise MalformedPayloadError(f"signsgd scale {s} is negative")
        return as_output(signed_scalars(body[4:], d, s, "signsgd signs"), header)


# The sparse codecs, split along the seam (index sets + values); imported last, and named
# here, so that importing this module registers every stateless codec, as before.
from fededge.compress.sparsify import (  # noqa: E402
    SPARSE_VALUES, TAG_BITMAP, TAG_VARINT, RandK, SparsifyConfig, Threshold, ThresholdConfig, TopK,
    decode_index_set, encode_index_set, keep_count, topk_payload,
)
