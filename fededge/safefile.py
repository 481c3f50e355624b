"""One file of plain values and tensors, written atomically and verified when read.

The format of fededge's checkpoints (:mod:`fededge.server.checkpoint`) and of the
clients' saved state (:mod:`fededge.clients.statestore`)::

    b"FEDEDGE-CKPT\\x01"            13 bytes: magic and format version
    sha256(body)                    32 bytes
    len(body)                       8 bytes, big-endian
    body                            torch.save() of a dict of plain values and tensors

:func:`write_file` writes a temporary file in the same directory, flushes and fsyncs it,
renames it over its final name and fsyncs the directory: a crash at any moment leaves
the old file or the new one complete, never a half-written file under the final name.
With ``durable=False`` (a file that only has to outlive this process's next use) it
skips both fsyncs: a process that dies still leaves the old file or the new one, but
after a power loss the file may be the old one, missing, or refused as corrupt.
:func:`read_file` refuses, by name, a file that is truncated, corrupt or of another
format, and reads the body with ``torch.load(weights_only=True)`` (plain values and
tensors only, no arbitrary objects).

Pure: torch only.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["MAGIC", "SafeFileError", "bytes_from_tensor", "fsync_dir", "read_file", "tensor_of_bytes", "write_file"]

MAGIC = b"FEDEDGE-CKPT\x01"
_HEAD = len(MAGIC) + 40


class SafeFileError(RuntimeError):
    """A file that cannot be used: unreadable, truncated, corrupt or not fededge's."""


def tensor_of_bytes(blob: bytes) -> torch.Tensor:
    """``blob`` as a 1-D uint8 tensor, for a payload: ``torch.save`` stores a tensor's
    storage raw, where bytes in its pickle (protocol 2) are re-encoded as text, about 1.5
    times their size and slowly. :func:`bytes_from_tensor` gives them back."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)


def bytes_from_tensor(t: Any, what: str = "bytes") -> bytes:
    """The bytes :func:`tensor_of_bytes` stored; :class:`SafeFileError` naming ``what``
    for anything but a 1-D uint8 tensor."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        kind = f"{t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise SafeFileError(f"{what} is a {kind}, not the 1-D uint8 tensor of stored bytes")
    return t.numpy().tobytes()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike[str], payload: dict[str, Any], *, durable: bool = True) -> tuple[int, float]:
    """Write ``payload`` to ``path`` atomically; return its size in bytes and the seconds
    it took (serialising, hashing, the write and, unless ``durable=False``, both fsyncs).

    ``durable=False`` leaves out the two fsyncs: the file is still replaced atomically
    (a process that dies leaves the old file or the new one), but a power loss may leave
    either missing or, if the machine crashes before the data reaches the disk, one that
    :func:`read_file` refuses as corrupt. For a file that only has to outlive this
    process's next message (a spilled client state), not the machine."""
    t0 = time.perf_counter()
    path = Path(path)
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(body).digest() + len(body).to_bytes(8, "big"))
        f.write(body)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)
    return _HEAD + len(body), time.perf_counter() - t0


def read_file(path: str | os.PathLike[str], what: str = "file",
              error: type[SafeFileError] = SafeFileError) -> dict[str, Any]:
    """The payload of a file :func:`write_file` wrote; ``error`` (a :class:`SafeFileError`)
    naming ``what``, the file and what is wrong when it cannot be used."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what} {path}: cannot be read: {err}") from err
    if not data.startswith(MAGIC):
        raise error(f"{what} {path}: not a fededge {what} (format {MAGIC!r} expected)")
    if len(data) < _HEAD:
        raise error(f"{what} {path}: truncated ({len(data)} bytes, header is {_HEAD})")
    digest, size = data[len(MAGIC):len(MAGIC) + 32], int.from_bytes(data[len(MAGIC) + 32:_HEAD], "big")
    body = data[_HEAD:]
    if len(body) != size:
        raise error(f"{what} {path}: truncated ({len(body)} of {size} bytes of its body)")
    if hashlib.sha256(body).digest() != digest:
        raise error(f"{what} {path}: corrupt (its sha256 does not match its contents)")
    try:
        return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as err:  # noqa: BLE001 - a body that hashes right but does not load
        raise error(f"{what} {path}: unreadable body: {type(err).__name__}: {err}") from err
