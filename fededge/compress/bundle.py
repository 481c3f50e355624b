"""A bundle: every tensor payload of one update in a single byte string.

Flower serialises each array of a record as an object of its own, with a header that
carries 64-hex-character ids. For a compressed update of ten small payloads that framing
(about 5 kB) can outweigh the payloads. A bundle travels as one uint8 array, so framing
is paid once (about 1 kB per reply), and a client in another language produces one blob.

Layout (little-endian; docs/wire-format.md):

```
0   2  magic b"FB"
2   1  version (1)
3   4  count N (<= 65535)
..     N entries: name length L (u16), L bytes of UTF-8 name, payload length P (u32)
..     the N payloads, concatenated in entry order
```

Names are unique and non-empty. The total length must match exactly. Each payload is a
wire-format payload (fededge.compress.wire) and is decoded separately. Pure.
"""

from __future__ import annotations

import struct

from fededge.compress.wire import MalformedPayloadError

__all__ = ["BUNDLE_MAGIC", "pack_bundle", "unpack_bundle"]

BUNDLE_MAGIC = b"FB"
BUNDLE_VERSION = 1
MAX_ENTRIES = 65535


def pack_bundle(payloads: dict[str, bytes]) -> bytes:
    """Name -> payload, in insertion order, as one bundle."""
    if len(payloads) > MAX_ENTRIES:
        raise ValueError(f"a bundle holds at most {MAX_ENTRIES} tensors, got {len(payloads)}")
    head = [struct.pack("<2sBI", BUNDLE_MAGIC, BUNDLE_VERSION, len(payloads))]
    for name, payload in payloads.items():
        raw = name.encode("utf-8")
        if not raw or len(raw) > 0xFFFF:
            raise ValueError(f"tensor name must be 1..65535 UTF-8 bytes, got {name!r}")
        head.append(struct.pack("<H", len(raw)) + raw + struct.pack("<I", len(payload)))
    return b"".join(head) + b"".join(payloads.values())


def unpack_bundle(data: bytes) -> dict[str, bytes]:
    """One bundle -> name -> payload. Raises MalformedPayloadError naming the problem."""
    buf = memoryview(data)
    if len(buf) < 7:
        raise MalformedPayloadError(f"bundle of {len(buf)} bytes is shorter than its 7-byte header")
    magic, version, count = struct.unpack_from("<2sBI", buf, 0)
    if magic != BUNDLE_MAGIC:
        raise MalformedPayloadError(f"bad bundle magic {bytes(magic)!r}, expected {BUNDLE_MAGIC!r}")
    if version != BUNDLE_VERSION:
        raise MalformedPayloadError(f"unknown bundle version {version}; this decoder reads {BUNDLE_VERSION}")
    if count > MAX_ENTRIES:
        raise MalformedPayloadError(f"bundle announces {count} entries, more than {MAX_ENTRIES}")
    off = 7
    entries: list[tuple[str, int]] = []
    for i in range(count):
        if len(buf) < off + 2:
            raise MalformedPayloadError(f"bundle truncated in entry {i}'s name length")
        (nlen,) = struct.unpack_from("<H", buf, off)
        off += 2
        if nlen == 0 or len(buf) < off + nlen + 4:
            raise MalformedPayloadError(f"bundle entry {i}: name of {nlen} bytes is empty or truncated")
        try:
            name = bytes(buf[off:off + nlen]).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPayloadError(f"bundle entry {i}: name is not UTF-8") from None
        off += nlen
        (plen,) = struct.unpack_from("<I", buf, off)
        off += 4
        entries.append((name, plen))
    total = off + sum(p for _, p in entries)
    if total != len(buf):
        raise MalformedPayloadError(f"bundle entries announce {total} bytes in all, but it has {len(buf)}")
    out: dict[str, bytes] = {}
    for name, plen in entries:
        if name in out:
            raise MalformedPayloadError(f"bundle names tensor {name!r} twice")
        out[name] = bytes(buf[off:off + plen])
        off += plen
    return out
