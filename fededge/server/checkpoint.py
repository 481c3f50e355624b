"""A run's checkpoints on disk: written atomically, verified when read, the last two kept.

A checkpoint is one file, ``<run dir>/checkpoints/round-<NNNNNN>.ckpt``, in the format of
:mod:`fededge.safefile` (magic, sha256, length, ``torch.save`` body). It is written to a
temporary file in the same directory, flushed and fsync'ed, renamed over its final name
and the directory fsync'ed, so a crash at any moment leaves either the previous
checkpoints or the new one complete, never a half-written file under a
checkpoint's name. The two newest are kept: if the newest cannot be read (truncated,
corrupt, another format), :func:`latest_checkpoint` refuses it by name and uses the one
before. The body is read with ``torch.load(weights_only=True)``: plain values and
tensors only, no arbitrary objects.

Pure: no Flower. What goes into the body is :class:`fededge.server.experiment.Experiment`'s
business.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from fededge.safefile import MAGIC, SafeFileError, read_file, write_file

__all__ = ["CHECKPOINT_DIR", "MAGIC", "CheckpointError", "KEEP", "checkpoint_files", "latest_checkpoint",
           "read_checkpoint", "states_file_for", "write_checkpoint"]

log = logging.getLogger("fededge")

#: The run directory's subdirectory that holds the checkpoints.
CHECKPOINT_DIR = "checkpoints"
#: How many checkpoints are kept (the newest, and one to fall back on).
KEEP = 2
_NAME = re.compile(r"round-(\d{6,})\.ckpt")


class CheckpointError(SafeFileError):
    """A checkpoint that cannot be used (missing, corrupt, or for another run)."""


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
    path = d / f"round-{server_round:06d}.ckpt"
    size, _ = write_file(path, payload)
    kept = checkpoint_files(run_dir)
    for old in kept[:-KEEP]:
        old.unlink(missing_ok=True)
    # Side files (a checkpoint's client states, written before it: states_file_for) go with
    # their checkpoint; one whose checkpoint was never written (a killed writer) goes too.
    rounds = {p.name.split(".")[0] for p in kept[-KEEP:]}
    for side in d.glob("round-*.states"):
        if side.name.split(".")[0] not in rounds:
            side.unlink(missing_ok=True)
    # Left by a writer that was killed (with SQLite's journal, before side files had
    # none). Whatever its pid: this process's own writes are renamed into place by now,
    # and a container's entrypoint restarts with the pid of the one that was killed.
    for stale in d.glob(".round-*.tmp*"):
        stale.unlink(missing_ok=True)
    return path, size, time.perf_counter() - t0


def states_file_for(run_dir: str | os.PathLike[str], server_round: int) -> Path:
    """Where the checkpoint of ``server_round`` keeps a side file of client states (the
    in-process grid's states on disk, or those in memory past
    :data:`~fededge.server.nodestates.INLINE_STATES_MAX`); pruned with the checkpoint."""
    d = Path(run_dir) / CHECKPOINT_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d / f"round-{server_round:06d}.states"


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The payload of one checkpoint file; :class:`CheckpointError` naming the file and
    what is wrong when it is truncated, corrupt or not a fededge checkpoint."""
    return read_file(path, what="checkpoint", error=CheckpointError)


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
