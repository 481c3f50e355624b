"""A run's checkpoints on disk: written atomically, verified when read, the last two kept.

A checkpoint is one file, ``<run dir>/checkpoints/round-<NNNNNN>.ckpt``::

    b"FEDEDGE-CKPT\\x01"            13 bytes: magic and format version
    sha256(body)                    32 bytes
    len(body)                       8 bytes, big-endian
    body                            torch.save() of a dict of plain values and tensors

It is written to a temporary file in the same directory, flushed and fsync'ed, renamed
over its final name and the directory fsync'ed, so a crash at any moment leaves either
the previous checkpoints or the new one complete, never a half-written file under a
checkpoint's name. The two newest are kept: if the newest cannot be read (truncated,
corrupt, another format), :func:`latest_checkpoint` refuses it by name and uses the one
before. The body is read with ``torch.load(weights_only=True)``: plain values and
tensors only, no arbitrary objects.

Pure: no Flower. What goes into the body is :class:`fededge.server.measure.Experiment`'s
business.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_DIR", "CheckpointError", "KEEP", "checkpoint_files", "latest_checkpoint",
           "read_checkpoint", "write_checkpoint"]

log = logging.getLogger("fededge")

MAGIC = b"FEDEDGE-CKPT\x01"
#: The run directory's subdirectory that holds the checkpoints.
CHECKPOINT_DIR = "checkpoints"
#: How many checkpoints are kept (the newest, and one to fall back on).
KEEP = 2
_NAME = re.compile(r"round-(\d{6,})\.ckpt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, or for another run)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The run's checkpoint files, oldest first."""
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def write_checkpoint(run_dir: str | os.PathLike[str], server_round: int, payload: dict[str, Any]) -> tuple[Path, int, float]:
    """Write ``payload`` as the checkpoint of ``server_round``; keep the newest :data:`KEEP`.

    Returns ``(path, bytes, seconds)``: its size and what writing it cost (serialising,
    hashing, the write and both fsyncs).
    """
    t0 = time.perf_counter()
    d = Path(run_dir) / CHECKPOINT_DIR
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    path = d / f"round-{server_round:06d}.ckpt"
    tmp = d / f".{path.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(body).digest() + len(body).to_bytes(8, "big"))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(d)
    for old in checkpoint_files(run_dir)[:-KEEP]:
        old.unlink(missing_ok=True)
    for stale in d.glob(".round-*.tmp"):  # left by a writer that was killed
        if stale != tmp:
            stale.unlink(missing_ok=True)
    return path, len(MAGIC) + 40 + len(body), time.perf_counter() - t0


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The payload of one checkpoint file; :class:`CheckpointError` naming the file and
    what is wrong when it is truncated, corrupt or not a fededge checkpoint."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: cannot be read: {err}") from err
    head = len(MAGIC) + 40
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path}: not a fededge checkpoint (format {MAGIC!r} expected)")
    if len(data) < head:
        raise CheckpointError(f"checkpoint {path}: truncated ({len(data)} bytes, header is {head})")
    digest, size = data[len(MAGIC):len(MAGIC) + 32], int.from_bytes(data[len(MAGIC) + 32:head], "big")
    body = data[head:]
    if len(body) != size:
        raise CheckpointError(f"checkpoint {path}: truncated ({len(body)} of {size} bytes of its body)")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {path}: corrupt (its sha256 does not match its contents)")
    try:
        return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as err:  # noqa: BLE001 - a body that hashes right but does not load
        raise CheckpointError(f"checkpoint {path}: unreadable body: {type(err).__name__}: {err}") from err


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of ``run_dir`` that reads back intact, with its payload.

    A newer one that does not is refused by name (logged as a warning) and the one
    before it is used. Raises :class:`CheckpointError` when none is usable.
    """
    files = checkpoint_files(run_dir)
    if not files:
        raise CheckpointError(
            f"{run_dir} has no checkpoint ({CHECKPOINT_DIR}/round-*.ckpt): the run wrote none before it "
            "stopped (checkpoint-every=0, or it stopped before the first checkpoint round); start it again")
    errors = []
    for path in reversed(files):
        try:
            payload = read_checkpoint(path)
        except CheckpointError as err:
            log.warning("%s; using the one before it", err)
            errors.append(str(err))
            continue
        return path, payload
    raise CheckpointError(f"no usable checkpoint in {run_dir}: " + "; ".join(errors))
