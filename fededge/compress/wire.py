"""The wire format of a compressed tensor: a versioned header and a codec body.

docs/wire-format.md specifies it byte by byte; tests/compress/vectors/ holds test vectors
so that a client in another language can check itself. All integers are little-endian.

```
offset size  field
0      2     magic b"FE"
2      1     version (1)
3      1     codec id (see CODEC_IDS)
4      1     flags: bit 0 = body is zlib-compressed (the lossless stage)
5      1     dtype of the original tensor (see DTYPES)
6      1     ndim (0..8)
7      4*n   shape, one uint32 per dimension
..     2     length P of the codec parameters
..     P     codec parameters (codec-specific, fixed layout per codec)
..     4     length B of the body (after the lossless stage, if any)
..     B     body
```

A decoder refuses anything else with :class:`MalformedPayloadError`, which names what is
wrong. That covers a short buffer, a wrong magic, an unknown version, codec or dtype, a
shape too large, trailing bytes, and a body that is not the length its codec needs.
Pure: no Flower.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "MAGIC", "VERSION", "CODEC_IDS", "DTYPES", "MAX_ELEMENTS", "MalformedPayloadError",
    "Header", "pack", "unpack", "header_length", "inflate", "peek_codec", "pack_bits", "unpack_bits", "decode_limit",
]

MAGIC = b"FE"
VERSION = 1
FLAG_ZLIB = 0x01
MAX_NDIM = 8
#: A decoder refuses tensors larger than this (2**31 elements: 8 GiB of float32), so a
#: forged shape cannot make it allocate without bound.
MAX_ELEMENTS = 2**31

# A sparse or low-rank body legitimately decodes to far more elements than it has bytes
# (one top-k index can stand for 2**31 zeros), so body-length checks alone cannot bound a
# decoder's memory. A caller that knows its model (the server) lowers the bound here.
_DECODE_LIMIT: ContextVar[int] = ContextVar("fededge_decode_limit", default=MAX_ELEMENTS)


@contextmanager
def decode_limit(max_elements: int) -> Iterator[None]:
    """Within this block, :func:`unpack` refuses shapes of more than ``max_elements``.

    A server that knows the largest tensor of its model sets this to that size, so that a
    forged header (a huge shape with a tiny sparse or low-rank body) cannot make it
    allocate gigabytes. Nests; the tighter of the enclosing limits and
    :data:`MAX_ELEMENTS` applies.

    Examples
    --------
    >>> with decode_limit(1 << 20):
    ...     pass  # decode_any(payload) here refuses tensors of more than 1 Mi elements
    """
    if max_elements < 0:
        raise ValueError(f"max_elements must be >= 0, got {max_elements}")
    token = _DECODE_LIMIT.set(min(max_elements, _DECODE_LIMIT.get()))
    try:
        yield
    finally:
        _DECODE_LIMIT.reset(token)


CODEC_IDS: dict[str, int] = {
    "raw": 0, "fp16": 1, "bf16": 2, "int8": 3, "qsgd": 4, "terngrad": 5, "onebit": 6,
    "signsgd": 7, "threshold": 8, "topk": 9, "randk": 10, "powersgd": 11,
}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}

DTYPES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3,
}
DTYPE_OF = {v: k for k, v in DTYPES.items()}


class MalformedPayloadError(ValueError):
    """A payload cannot be decoded; the message says which field is wrong and how."""


@dataclass(frozen=True)
class Header:
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    zlib: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def pack(header: Header, body: bytes) -> bytes:
    """Header + body -> one payload. ``header.zlib`` compresses the body (lossless stage)."""
    if header.codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {header.codec!r}")
    if len(header.shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {len(header.shape)}")
    if header.dtype not in DTYPES:
        raise ValueError(f"dtype {header.dtype} is not in the wire format; cast to float32 first")
    if header.zlib:
        body = zlib.compress(body, 6)
    flags = FLAG_ZLIB if header.zlib else 0
    head = struct.pack("<2sBBBBB", MAGIC, VERSION, CODEC_IDS[header.codec], flags,
                       DTYPES[header.dtype], len(header.shape))
    head += struct.pack(f"<{len(header.shape)}I", *header.shape)
    head += struct.pack("<H", len(header.params)) + header.params
    return head + struct.pack("<I", len(body)) + body


def unpack(payload: bytes, *, max_body: int | None = None) -> tuple[Header, bytes]:
    """One payload -> (header, body after the lossless stage). Validates every field."""
    buf = memoryview(payload)
    if len(buf) < 7:
        raise MalformedPayloadError(f"payload of {len(buf)} bytes is shorter than the 7-byte header")
    codec = peek_codec(bytes(buf[:4]))  # magic, version, codec id
    flags, dtype_id, ndim = struct.unpack_from("<BBB", buf, 4)
    if flags & ~FLAG_ZLIB:
        raise MalformedPayloadError(f"unknown flag bits 0x{flags & ~FLAG_ZLIB:02x}")
    if dtype_id not in DTYPE_OF:
        raise MalformedPayloadError(f"unknown dtype id {dtype_id}; known: {sorted(DTYPE_OF)}")
    if ndim > MAX_NDIM:
        raise MalformedPayloadError(f"ndim {ndim} exceeds {MAX_NDIM}")
    off = 7
    need = off + 4 * ndim + 2
    if len(buf) < need:
        raise MalformedPayloadError(f"payload truncated in the shape (need {need} bytes, have {len(buf)})")
    shape = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    limit = min(MAX_ELEMENTS, _DECODE_LIMIT.get())
    if math.prod(shape) > limit:
        raise MalformedPayloadError(f"shape {shape} has more than {limit} elements (the decode limit)")
    (plen,) = struct.unpack_from("<H", buf, off)
    off += 2
    if len(buf) < off + plen + 4:
        raise MalformedPayloadError(f"payload truncated in the codec parameters ({plen} bytes announced)")
    params = bytes(buf[off:off + plen])
    off += plen
    (blen,) = struct.unpack_from("<I", buf, off)
    off += 4
    if len(buf) != off + blen:
        raise MalformedPayloadError(
            f"body length field says {blen} bytes but {len(buf) - off} follow the header"
        )
    body = bytes(buf[off:])
    zl = bool(flags & FLAG_ZLIB)
    if zl:
        limit = max_body if max_body is not None else 64 * max(1, math.prod(shape)) + 4096
        body = inflate(body, limit, what="zlib body", too_long="larger than the codec can need",
                       stream="zlib stream")
    return Header(codec, DTYPE_OF[dtype_id], tuple(shape), params, zl), body


def inflate(data: bytes, limit: int, *, what: str, too_long: str, stream: str) -> bytes:
    """``data``, one complete zlib stream and nothing after it, inflated to at most
    ``limit`` bytes; :class:`MalformedPayloadError` otherwise, naming ``what`` (a
    stream that does not inflate), ``too_long`` (one truncated or past the limit) and
    ``stream`` (bytes after its end)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit)
    except zlib.error as err:
        raise MalformedPayloadError(f"{what} does not decompress: {err}") from None
    if d.unconsumed_tail or not d.eof:
        raise MalformedPayloadError(f"{what} is truncated or {too_long}")
    if d.unused_data:
        raise MalformedPayloadError(f"{len(d.unused_data)} bytes follow the end of the {stream}")
    return out


def header_length(payload: bytes) -> int:
    """The length of ``payload``'s header (13 + 4n + P bytes: everything before the body),
    read from its ndim and parameter-length fields; 0 where it is not a payload of this
    format (no magic, or shorter than the header it announces). Validates nothing else:
    :func:`unpack` does.

    Examples
    --------
    >>> header_length(pack(Header("fp16", torch.float32, (2, 3), b""), b"0" * 12))
    21
    >>> header_length(b"not a payload")
    0
    """
    if len(payload) < 7 or payload[:2] != MAGIC:
        return 0
    ndim = payload[6]
    if len(payload) < 9 + 4 * ndim:
        return 0
    (plen,) = struct.unpack_from("<H", payload, 7 + 4 * ndim)
    n = 13 + 4 * ndim + plen
    return n if len(payload) >= n else 0


def peek_codec(payload: bytes) -> str:
    """The codec a payload names in its header, without reading the body.

    A receiver that expects one codec checks it before decoding, so that a client and a
    server configured differently fail by name rather than by a decoded tensor that
    happens to fit. Raises :class:`MalformedPayloadError` for a short buffer, a wrong
    magic, an unknown version or codec id; :func:`unpack` validates everything else.

    Examples
    --------
    >>> peek_codec(pack(Header("fp16", torch.float32, (2,), b""), b"0" * 4))
    'fp16'
    """
    if len(payload) < 4:
        raise MalformedPayloadError(f"payload of {len(payload)} bytes is shorter than the 7-byte header")
    magic, version, codec_id = payload[:2], payload[2], payload[3]
    if magic != MAGIC:
        raise MalformedPayloadError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a fededge payload")
    if version != VERSION:
        raise MalformedPayloadError(f"unknown wire-format version {version}; this decoder reads version {VERSION}")
    if codec_id not in CODEC_NAMES:
        raise MalformedPayloadError(f"unknown codec id {codec_id}; known: {sorted(CODEC_NAMES)}")
    return CODEC_NAMES[codec_id]


def pack_bits(bits: torch.Tensor) -> bytes:
    """A bool tensor -> bytes, 8 per byte, least significant bit first (numpy 'little')."""
    arr = bits.detach().to("cpu", torch.bool).numpy().reshape(-1)
    return np.packbits(arr, bitorder="little").tobytes()


def unpack_bits(data: bytes, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`; ``data`` must hold exactly ``ceil(n / 8)`` bytes."""
    if len(data) != (n + 7) // 8:
        raise MalformedPayloadError(f"bit field of {len(data)} bytes for {n} bits (need {(n + 7) // 8})")
    arr = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little", count=n)
    return torch.from_numpy(arr.astype(np.bool_))
