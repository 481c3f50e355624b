"""Bit fields, varints and the checks every codec body needs (private to fededge.compress).

What :mod:`fededge.compress.codecs`, :mod:`fededge.compress.powersgd` and
:mod:`fededge.compress.dgc` build their wire bodies from and read them back with: float
input flattened and checked, bit fields and LEB128 varints packed least significant bit
first, parameter and body lengths checked (as :class:`MalformedPayloadError`) before a
decoder allocates anything proportional to the header's shape. docs/wire-format.md gives
the layouts.

Pure: no Flower.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fededge.compress.codec import CodecConfig, all_finite
from fededge.compress.wire import DTYPES, Header, MalformedPayloadError

__all__ = [
    "flat32", "local_generator", "codec_header", "read_params", "check_body_size",
    "bf16_bytes", "bf16_values", "finite_f32s", "pack_uints", "unpack_uints", "unpack_bools",
    "signed_scalars", "pack_bools", "as_output", "varint_lengths", "pack_varints", "read_varint", "read_varints",
]


def flat32(x: torch.Tensor, *, check_finite: bool = True) -> torch.Tensor:
    """``x`` as a contiguous flat float32 CPU tensor; refuses non-float and non-finite input.

    ``check_finite=False`` is for encoders that check their (smaller) output instead."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        raise ValueError(f"encode needs a float tensor of dtype {sorted(map(str, DTYPES))}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    f = x.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    if check_finite and not all_finite(f):
        raise ValueError("cannot encode a tensor holding NaN or Inf (in float32); fix the update first")
    return f


def local_generator(generator: torch.Generator | None) -> torch.Generator:
    """``generator``, or a fresh local one when None (never the global RNG)."""
    if generator is None:
        generator = torch.Generator()
        generator.seed()  # local and non-deterministic; pass a seeded one to reproduce
    return generator


def codec_header(codec: str, x: torch.Tensor, params: bytes, cfg: CodecConfig) -> Header:
    """The header of ``x`` encoded by ``codec`` with ``params`` and the config's zlib stage."""
    return Header(codec, x.dtype, tuple(int(s) for s in x.shape), params, cfg.lossless)


def read_params(header: Header, fmt: str) -> tuple:
    """The codec parameters, unpacked by the struct format ``fmt``; their size is checked."""
    size = struct.calcsize(fmt)
    if len(header.params) != size:
        raise MalformedPayloadError(
            f"{header.codec} parameters are {len(header.params)} bytes, expected {size}"
        )
    return struct.unpack(fmt, header.params)


def check_body_size(header: Header, body: bytes, size: int) -> None:
    """Refuse a body that is not ``size`` bytes (checked before decoding allocates)."""
    if len(body) != size:
        raise MalformedPayloadError(
            f"{header.codec} body of shape {header.shape} must be {size} bytes, got {len(body)}"
        )


def bf16_bytes(t: torch.Tensor) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian u16 each. A finite value
    that rounds to Inf (|x| over about 3.39e38) is refused: the decoder would refuse the
    payload (as fp16's encoder refuses its overflow)."""
    b = t.to(torch.bfloat16)
    if not bool(torch.isfinite(b).all()) and bool(torch.isfinite(t).all()):
        raise ValueError("a value overflows bfloat16 (|x| > ~3.39e38); send it as float32 (raw)")
    return b.view(torch.int16).numpy().astype("<i2").tobytes()


def bf16_values(buf: bytes) -> np.ndarray:
    """Little-endian u16 bfloat16 -> float32 (the top half of each float32)."""
    return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def finite_f32s(buf: bytes, what: str) -> np.ndarray:
    """Little-endian float32 values; NaN or Inf is a malformed payload."""
    a = np.frombuffer(buf, dtype="<f4").astype(np.float32)
    if not np.isfinite(a).all():
        raise MalformedPayloadError(f"{what} holds NaN or Inf")
    return a


def pack_uints(values: np.ndarray, bits: int) -> bytes:
    """Unsigned ints of ``bits`` bits each, element i at bit offset i*bits, LSB first."""
    v = values.astype(np.uint32).reshape(-1, 1)
    field = ((v >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.bool_)
    return np.packbits(field.reshape(-1), bitorder="little").tobytes()


def _unpacked_bits(data: bytes, n: int, bits: int, what: str) -> np.ndarray:
    """The first ``n * bits`` bits of ``data`` (LSB first) as 0/1 uint8, the padding after
    them checked to be zero."""
    if len(data) != (n * bits + 7) // 8:
        raise MalformedPayloadError(f"{what}: {len(data)} bytes for {n} x {bits} bits")
    raw = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if raw[n * bits:].any():
        raise MalformedPayloadError(f"{what}: padding bits after the last field are not zero")
    return raw[: n * bits]


def unpack_uints(data: bytes, n: int, bits: int, what: str) -> np.ndarray:
    field = _unpacked_bits(data, n, bits, what).reshape(n, bits).astype(np.uint32)
    return (field << np.arange(bits, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def unpack_bools(data: bytes, n: int, what: str) -> np.ndarray:
    """``n`` one-bit fields (see :func:`unpack_uints`) as booleans (a view of the 0/1
    bits: no widening to uint32 and back)."""
    return _unpacked_bits(data, n, 1, what).view(np.bool_)


# _BYTE_BITS[b, j]: bit j (least significant first) of the byte b.
_BYTE_BITS = ((np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1).astype(np.bool_)


def signed_scalars(data: bytes, n: int, s: float, what: str) -> np.ndarray:
    """``n`` one-bit fields (see :func:`unpack_uints`) as float32 values, ``-s`` where the
    bit is set and ``s`` where not: ``np.where(unpack_bools(data, n, what), -s, s)``, bit
    for bit (negative zero included), with the same checks.

    One lookup per byte (a table of the 256 bytes' eight values) instead of widening the
    bits to booleans and selecting: about 4 times as fast on large tensors (a server
    decodes every client's signs every round)."""
    if len(data) != (n + 7) // 8:
        raise MalformedPayloadError(f"{what}: {len(data)} bytes for {n} x 1 bits")
    raw = np.frombuffer(data, dtype=np.uint8)
    if n % 8 and raw[-1] >> (n % 8):
        raise MalformedPayloadError(f"{what}: padding bits after the last field are not zero")
    s = np.float32(s)
    return np.where(_BYTE_BITS, -s, s)[raw].reshape(-1)[:n]


def pack_bools(bits: np.ndarray) -> bytes:
    """Booleans, 8 per byte, LSB first, zero padding."""
    return np.packbits(bits.astype(np.bool_).reshape(-1), bitorder="little").tobytes()


def as_output(values: np.ndarray, header: Header) -> torch.Tensor:
    """Decoded values as the writable float32 tensor of the header's shape."""
    # np.require copies read-only views of the body (torch wants writable memory).
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(header.shape)


# --------------------------------------------------------------------------- varints


def varint_lengths(v: np.ndarray) -> np.ndarray:
    """Bytes of the LEB128 encoding of each value (values < 2**35)."""
    v = v.astype(np.uint64)
    n = np.ones(v.shape, dtype=np.int64)
    for j in range(1, 5):
        n += v >= (np.uint64(1) << np.uint64(7 * j))
    return n


def pack_varints(v: np.ndarray) -> bytes:
    """Unsigned LEB128 (7 bits per byte, low group first, 0x80 = more follow), vectorized."""
    v = v.astype(np.uint64).reshape(-1)
    if v.size == 0:
        return b""
    n = varint_lengths(v)
    j = np.arange(5, dtype=np.uint64)
    groups = ((v[:, None] >> (np.uint64(7) * j)) & np.uint64(0x7F)).astype(np.uint8)
    more = (np.arange(5)[None, :] < (n[:, None] - 1)).astype(np.uint8) << 7
    keep = np.arange(5)[None, :] < n[:, None]
    return (groups | more)[keep].tobytes()


def read_varint(buf: bytes, off: int, what: str) -> tuple[int, int]:
    value = 0
    for j in range(5):
        if off + j >= len(buf):
            raise MalformedPayloadError(f"{what}: varint truncated at byte {off + j}")
        b = buf[off + j]
        value |= (b & 0x7F) << (7 * j)
        if b < 0x80:
            if value >= 2**32:
                raise MalformedPayloadError(f"{what}: varint {value} exceeds 32 bits")
            return value, off + j + 1
    raise MalformedPayloadError(f"{what}: varint longer than 5 bytes")


def read_varints(buf: bytes, off: int, count: int, what: str) -> tuple[np.ndarray, int]:
    """``count`` LEB128 values from ``buf[off:]`` -> (uint64 array, offset after them)."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64), off
    if count > len(buf) - off:
        raise MalformedPayloadError(f"{what}: {count} varints announced but only {len(buf) - off} bytes follow")
    b = np.frombuffer(buf, dtype=np.uint8, offset=off)
    ends = np.flatnonzero(b < 0x80)
    if ends.size < count:
        raise MalformedPayloadError(f"{what}: {count} varints announced, {ends.size} found before the body ends")
    ends = ends[:count]
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise MalformedPayloadError(f"{what}: varint longer than 5 bytes")
    stop = int(ends[-1]) + 1
    seg = b[:stop].astype(np.uint64) & np.uint64(0x7F)
    group = np.repeat(np.arange(count), lengths)
    pos = np.arange(stop) - np.repeat(starts, lengths)
    vals = np.zeros(count, dtype=np.uint64)
    np.add.at(vals, group, seg << (np.uint64(7) * pos.astype(np.uint64)))
    if (vals >= np.uint64(2**32)).any():
        raise MalformedPayloadError(f"{what}: varint exceeds 32 bits")
    return vals, off + stop
