"""A bundle: every tensor payload of one update in a single byte string.

Flower serialises each array of a record as an object of its own, with a header that
carries 64-hex-character ids. For a compressed update of ten small payloads that framing
(about 5 kB) can outweigh the payloads. A bundle travels as one uint8 array, so framing
is paid once (about 1 kB per reply), and a client in another language produces one blob.

Two layouts (little-endian; docs/wire-format.md), both read by :func:`unpack_bundle`:

```
version 1                                    version 2 (compact; what pack_bundle writes)
0   2  magic b"FB"                           0   2  magic b"FB"
2   1  version (1)                           2   1  version (2)
3   4  count N (<= 65535)                    3   4  Z, the length of a zlib stream (RFC 1950)
..     N entries: name length L (u16),       7   Z  the zlib stream; it inflates to:
       L bytes of UTF-8 name, payload              count N (u32, <= 65535), N entries: name
       length P (u32)                              length L (u16), the name, payload length
..     the N payloads, concatenated                P (u32), head length H (u16, <= P); then
                                                   the N heads (each payload's first H bytes)
                                             ..     the N tails (each payload's last P - H bytes)
```

Version 2 is version 1 with the metadata deflated: the names and each payload's header
(its first H bytes: :func:`fededge.compress.wire.header_length`, 0 for bytes that are not
a wire payload) go through zlib together, the bodies as they are. A model's names
("layer2.0.conv1.weight") and its payloads' headers (shapes, codec ids) repeat, so a
62-tensor reduced ResNet's 2.9 kB of them become about 0.5 kB; the bodies, quantised or
sparse values, would gain little from zlib and cost its time. Both versions give the same
payloads back, byte for byte.

Names are unique and non-empty. The total length must match exactly. Each payload is a
wire-format payload (fededge.compress.wire) and is decoded separately. Pure.
"""

from __future__ import annotations

import struct
import zlib

from fededge.compress.wire import MalformedPayloadError, header_length, inflate

__all__ = ["BUNDLE_MAGIC", "pack_bundle", "unpack_bundle"]

BUNDLE_MAGIC = b"FB"
BUNDLE_VERSION = 2  # written by pack_bundle; 1 and 2 are read
BUNDLE_VERSIONS = (1, 2)
MAX_ENTRIES = 65535
#: The most a version-2 bundle's metadata may inflate to: N entries of at most
#: 2 + 65,535 + 4 + 2 bytes and heads of at most 65,535 each, bounded for sanity.
MAX_METADATA = 64 * 2**20


def pack_bundle(payloads: dict[str, bytes], *, version: int = BUNDLE_VERSION) -> bytes:
    """Name -> payload, in insertion order, as one bundle (``version`` 2 by default: the
    compact layout; 1 for readers that know only the first)."""
    if version not in BUNDLE_VERSIONS:
        raise ValueError(f"bundle version must be one of {BUNDLE_VERSIONS}, got {version!r}")
    if len(payloads) > MAX_ENTRIES:
        raise ValueError(f"a bundle holds at most {MAX_ENTRIES} tensors, got {len(payloads)}")
    entries = []
    for name, payload in payloads.items():
        raw = name.encode("utf-8")
        if not raw or len(raw) > 0xFFFF:
            raise ValueError(f"tensor name must be 1..65535 UTF-8 bytes, got {name!r}")
        entries.append(struct.pack("<H", len(raw)) + raw + struct.pack("<I", len(payload)))
    if version == 1:
        return b"".join([struct.pack("<2sBI", BUNDLE_MAGIC, 1, len(payloads)), *entries, *payloads.values()])
    heads = [min(header_length(p), 0xFFFF) for p in payloads.values()]
    meta = b"".join([struct.pack("<I", len(payloads)),
                     *(e + struct.pack("<H", h) for e, h in zip(entries, heads)),
                     *(p[:h] for p, h in zip(payloads.values(), heads))])
    if len(meta) > MAX_METADATA:
        raise ValueError(f"a version-2 bundle's names and headers take at most {MAX_METADATA} bytes, these "
                         f"{len(meta)}: write version 1")
    packed = zlib.compress(meta, 9)
    return b"".join([struct.pack("<2sBI", BUNDLE_MAGIC, 2, len(packed)), packed,
                     *(p[h:] for p, h in zip(payloads.values(), heads))])


def unpack_bundle(data: bytes) -> dict[str, bytes]:
    """One bundle (version 1 or 2) -> name -> payload. Raises MalformedPayloadError
    naming the problem."""
    buf = memoryview(data)
    if len(buf) < 7:
        raise MalformedPayloadError(f"bundle of {len(buf)} bytes is shorter than its 7-byte header")
    magic, version, count = struct.unpack_from("<2sBI", buf, 0)
    if magic != BUNDLE_MAGIC:
        raise MalformedPayloadError(f"bad bundle magic {bytes(magic)!r}, expected {BUNDLE_MAGIC!r}")
    if version not in BUNDLE_VERSIONS:
        raise MalformedPayloadError(f"unknown bundle version {version}; this decoder reads versions "
                                    f"{', '.join(map(str, BUNDLE_VERSIONS))}")
    if version == 2:
        return _unpack_v2(buf, count)
    entries, off = _entries(buf, 7, count, heads=False)
    total = off + sum(p for _, p, _ in entries)
    if total != len(buf):
        raise MalformedPayloadError(f"bundle entries announce {total} bytes in all, but it has {len(buf)}")
    out: dict[str, bytes] = {}
    for name, plen, _ in entries:
        if name in out:
            raise MalformedPayloadError(f"bundle names tensor {name!r} twice")
        out[name] = bytes(buf[off:off + plen])
        off += plen
    return out


def _unpack_v2(buf: memoryview, zlen: int) -> dict[str, bytes]:
    if len(buf) < 7 + zlen:
        raise MalformedPayloadError(f"bundle announces {zlen} bytes of metadata, but has {len(buf) - 7} after "
                                    "its header")
    meta = memoryview(inflate(bytes(buf[7:7 + zlen]), MAX_METADATA, what="bundle metadata",
                              too_long="inflates past its limit", stream="bundle's metadata stream"))
    if len(meta) < 4:
        raise MalformedPayloadError(f"bundle metadata of {len(meta)} bytes is shorter than its 4-byte count")
    (count,) = struct.unpack_from("<I", meta, 0)
    entries, off = _entries(meta, 4, count, heads=True)
    if off + sum(h for _, _, h in entries) != len(meta):
        raise MalformedPayloadError(f"bundle metadata announces {off + sum(h for _, _, h in entries)} bytes, "
                                    f"but inflates to {len(meta)}")
    total = 7 + zlen + sum(p - h for _, p, h in entries)
    if total != len(buf):
        raise MalformedPayloadError(f"bundle entries announce {total} bytes in all, but it has {len(buf)}")
    out: dict[str, bytes] = {}
    tail = 7 + zlen
    for name, plen, head in entries:
        if name in out:
            raise MalformedPayloadError(f"bundle names tensor {name!r} twice")
        out[name] = b"".join((meta[off:off + head], buf[tail:tail + plen - head]))
        off += head
        tail += plen - head
    return out


def _entries(buf: memoryview, off: int, count: int, *, heads: bool) -> tuple[list[tuple[str, int, int]], int]:
    """``count`` entries from ``off``: (name, payload length, head length (0 in version
    1)) each, and the offset after them."""
    if count > MAX_ENTRIES:
        raise MalformedPayloadError(f"bundle announces {count} entries, more than {MAX_ENTRIES}")
    entries: list[tuple[str, int, int]] = []
    tail = 6 if heads else 4
    for i in range(count):
        if len(buf) < off + 2:
            raise MalformedPayloadError(f"bundle truncated in entry {i}'s name length")
        (nlen,) = struct.unpack_from("<H", buf, off)
        off += 2
        if nlen == 0 or len(buf) < off + nlen + tail:
            raise MalformedPayloadError(f"bundle entry {i}: name of {nlen} bytes is empty or truncated")
        try:
            name = bytes(buf[off:off + nlen]).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPayloadError(f"bundle entry {i}: name is not UTF-8") from None
        off += nlen
        (plen,) = struct.unpack_from("<I", buf, off)
        off += 4
        head = 0
        if heads:
            (head,) = struct.unpack_from("<H", buf, off)
            off += 2
            if head > plen:
                raise MalformedPayloadError(f"bundle entry {i}: head of {head} bytes is longer than its "
                                            f"{plen}-byte payload")
        entries.append((name, plen, head))
    return entries, off
