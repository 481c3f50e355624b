"""The bytes between fededge's ClientApp shim and a node's warm worker (one Unix socket).

Flower's PUBLIC record types only: a :class:`~flwr.app.RecordDict` is written as a JSON
header that lists its records (``ArrayRecord``: each :class:`~flwr.app.Array`'s
``dtype``, ``shape``, ``stype``; ``ConfigRecord`` and ``MetricRecord``: their values)
followed by raw blobs (each array's ``data`` bytes, each ``bytes`` config value). No
``flwr.common.serde``, protobuf or other internals: a Flower upgrade that changes its own
wire format does not touch this one. Values round-trip exactly: JSON keeps ints, bools
and floats (Python writes the shortest repr that reads back to the same double, NaN and
infinities included), array bytes are copied as they are.

A frame is ``!Q`` total length, ``!I`` header length, the UTF-8 JSON header, the blobs
back to back (their lengths are in the header). No torch here: the shim imports this.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Mapping
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

__all__ = ["MAX_FRAME_BYTES", "WireError", "decode_records", "encode_records", "recv_frame", "send_frame"]

MAX_FRAME_BYTES = 1 << 34  # 16 GiB: a sanity bound on a length read off the socket
_LEN = struct.Struct("!Q")
_HDR = struct.Struct("!I")


class WireError(RuntimeError):
    """A frame that is cut short, too large, or not what the protocol writes."""


def _value(v: Any, blobs: list[bytes]) -> Any:
    if isinstance(v, bytes):
        blobs.append(v)
        return {"$b": len(blobs) - 1}
    if isinstance(v, list):
        return [_value(x, blobs) for x in v]
    return v


def _unvalue(v: Any, blobs: list[bytes]) -> Any:
    if isinstance(v, dict):
        return blobs[int(v["$b"])]
    if isinstance(v, list):
        return [_unvalue(x, blobs) for x in v]
    return v


def encode_records(rd: RecordDict, blobs: list[bytes]) -> list[Any]:
    """``rd`` as a JSON-able list (order kept); array bytes and ``bytes`` values go to ``blobs``."""
    out: list[Any] = []
    for name, rec in rd.items():
        if isinstance(rec, ArrayRecord):
            arrays = []
            for key, arr in rec.items():
                blobs.append(arr.data)
                arrays.append([key, arr.dtype, list(arr.shape), arr.stype, len(blobs) - 1])
            out.append([name, "array", arrays])
        elif isinstance(rec, ConfigRecord):
            out.append([name, "config", [[k, _value(v, blobs)] for k, v in rec.items()]])
        elif isinstance(rec, MetricRecord):
            out.append([name, "metric", [[k, v] for k, v in rec.items()]])
        else:
            raise WireError(f"record {name!r} is a {type(rec).__name__}: only ArrayRecord, ConfigRecord "
                            "and MetricRecord travel to the worker")
    return out


def decode_records(items: list[Any], blobs: list[bytes]) -> RecordDict:
    """The inverse of :func:`encode_records`."""
    rd = RecordDict()
    for name, kind, body in items:
        if kind == "array":
            rd[name] = ArrayRecord({key: Array(dtype=dtype, shape=tuple(shape), stype=stype, data=blobs[i])
                                    for key, dtype, shape, stype, i in body})
        elif kind == "config":
            rd[name] = ConfigRecord({k: _unvalue(v, blobs) for k, v in body})
        elif kind == "metric":
            rd[name] = MetricRecord({k: v for k, v in body})
        else:
            raise WireError(f"unknown record kind {kind!r}")
    return rd


def send_frame(sock: socket.socket, header: Mapping[str, Any], blobs: list[bytes]) -> None:
    """Write one frame: the header (JSON) and ``blobs``; their sizes go in the header."""
    head = json.dumps({**header, "$blobs": [len(b) for b in blobs]}).encode()
    total = _HDR.size + len(head) + sum(len(b) for b in blobs)
    sock.sendall(_LEN.pack(total) + _HDR.pack(len(head)) + head)
    for b in blobs:
        sock.sendall(b)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[bytes]]:
    """Read one frame; raise :class:`WireError` if the peer closes first or it is malformed."""
    (total,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if total > MAX_FRAME_BYTES or total < _HDR.size:
        raise WireError(f"frame of {total} bytes is out of bounds")
    (hlen,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if hlen > total - _HDR.size:
        raise WireError(f"header of {hlen} bytes in a frame of {total}")
    header = json.loads(_recv_exact(sock, hlen))
    sizes = header.pop("$blobs", [])
    if sum(sizes) != total - _HDR.size - hlen:
        raise WireError("blob sizes do not add up to the frame")
    return header, [_recv_exact(sock, n) for n in sizes]
