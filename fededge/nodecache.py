"""A node's on-disk cache of what it derives from the run config alone: memory-mapped ``.npy``.

On a SuperNode every message runs in a fresh ``flwr-clientapp`` process
(shared/reference/flower-notes.md), which would otherwise rebuild the node's data set
and its partition each time: for ``digits`` that alone imports scikit-learn and SciPy
(about 2.5 CPU s; BENCHMARKS.md, "Where one message's seconds go"). The first process
writes the arrays here; every later one maps them (``np.load(mmap_mode="c")``: pages
shared through the page cache, copy-on-write, so torch may hold them as writable
tensors).

An entry is a directory ``ROOT/KIND-HASH/`` of ``NAME.npy`` files and a
``manifest.json``. ``HASH`` is the SHA-256 of everything the arrays depend on: the
caller's ``fields`` (the data key, partition id, number of partitions, ...), the
stats (size, mtime) of the data set's files on disk, :data:`CACHE_FORMAT_VERSION`, and a
fingerprint of the source of the code that builds the arrays (``fededge/data/*.py`` and
this module), so that a changed normalisation or partitioner never serves old arrays.

Trust nothing read back: an entry is used only if its manifest parses and names the
same key, every array has the recorded shape, dtype and byte size, and the SHA-256 of
every file matches. Anything else (a truncated file, a stray write, a half-written
entry, another version) is rebuilt and replaced. Writes are atomic: the entry is
written to a temporary directory beside it, each file fsynced, then renamed into
place; a concurrent writer that loses the race uses the winner's entry. A file is never
written in place once it is in an entry (a replaced entry is a new directory, new
inodes), so the mappings of processes that already hold it stay intact.

The root: :data:`ENV_CACHE_DIR` if set (empty or ``off`` disables the cache), else
``$XDG_CACHE_HOME/fededge``, else ``~/.cache/fededge``. A SuperNode can set it per node
with the node-config key :data:`NODE_CONFIG_CACHE_DIR` (read by fededge's shim and
worker, :mod:`fededge.clients.shim`) or ``fededge supernode --cache-dir``.

No torch and no Flower here: numpy, hashing and files.

Example
-------
>>> cache = NodeCache("/tmp/fededge-cache")                      # doctest: +SKIP
>>> arrays = cache.get_or_build("demo", {"n": 3}, lambda: ({"x": np.arange(3)}, {}))
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fededge import keys

__all__ = ["CACHE_FORMAT_VERSION", "ENV_CACHE_DIR", "NODE_CONFIG_CACHE_DIR", "CacheStats", "NodeCache",
           "code_fingerprint", "default_cache_dir", "file_stats"]

CACHE_FORMAT_VERSION = 1
ENV_CACHE_DIR = "FEDEDGE_CACHE_DIR"
NODE_CONFIG_CACHE_DIR = keys.CACHE_DIR
_MANIFEST = "manifest.json"
_OFF = {"", "off", "0", "none"}
_log = logging.getLogger(__name__)

Build = Callable[[], "tuple[dict[str, np.ndarray], dict[str, Any]]"]


def default_cache_dir() -> Path | None:
    """The cache root from the environment; None when the cache is switched off."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fededge"


def file_stats(paths: list[Path]) -> list[list[Any]]:
    """``[path, size, mtime_ns]`` of each existing file (sorted): the on-disk inputs' identity."""
    out = []
    for p in sorted({Path(p) for p in paths}):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


_FINGERPRINT: str | None = None


def code_fingerprint() -> str:
    """SHA-256 of the source that builds cached arrays (fededge/data/*.py, this module)."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for p in [Path(__file__).resolve(), *sorted((here / "data").glob("*.py"))]:
            h.update(p.name.encode())
            h.update(p.read_bytes())
        _FINGERPRINT = h.hexdigest()
    return _FINGERPRINT


class CacheStats:
    """Counters of one :class:`NodeCache` (hits, builds, and entries rejected as corrupt)."""

    def __init__(self) -> None:
        self.hits = self.builds = self.rejected = 0

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "builds": self.builds, "rejected": self.rejected}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NodeCache:
    """Arrays derived from a key, written once, memory-mapped afterwards.

    Parameters
    ----------
    root : path
        The cache directory (created, mode 0700, on the first write).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.stats = CacheStats()

    @staticmethod
    def key(kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The full key of an entry: ``fields`` plus the format version and code fingerprint."""
        return {"format": CACHE_FORMAT_VERSION, "code": code_fingerprint(), "kind": kind,
                "fields": json.loads(json.dumps(dict(fields), sort_keys=True, default=str))}

    def entry_dir(self, kind: str, fields: Mapping[str, Any]) -> Path:
        """Where the entry of ``(kind, fields)`` lives."""
        blob = json.dumps(self.key(kind, fields), sort_keys=True).encode()
        return self.root / f"{kind}-{hashlib.sha256(blob).hexdigest()[:32]}"

    def load(self, kind: str, fields: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The entry's arrays (memory-mapped, copy-on-write) and meta, or None if absent or
        not to be trusted (a corrupt entry is counted in ``stats.rejected``)."""
        d = self.entry_dir(kind, fields)
        if not d.is_dir():
            return None
        try:
            return self._load_checked(d, self.key(kind, fields))
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            self.stats.rejected += 1
            _log.warning("fededge cache: rebuilding %s: %s", d, err)
            return None

    @staticmethod
    def _load_checked(d: Path, key: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        manifest = json.loads((d / _MANIFEST).read_text())
        if manifest.get("key") != key:
            raise ValueError("manifest names another key")
        arrays = {}
        for name, spec in manifest["arrays"].items():
            path = d / f"{name}.npy"
            if path.stat().st_size != int(spec["bytes"]):
                raise ValueError(f"{path.name}: {path.stat().st_size} bytes, manifest says {spec['bytes']}")
            if _sha256(path) != spec["sha256"]:
                raise ValueError(f"{path.name}: checksum mismatch")
            a = np.load(path, mmap_mode="c", allow_pickle=False)
            if list(a.shape) != list(spec["shape"]) or a.dtype.str != spec["dtype"]:
                raise ValueError(f"{path.name}: {a.dtype.str}{list(a.shape)}, manifest says "
                                 f"{spec['dtype']}{spec['shape']}")
            arrays[name] = a
        return arrays, dict(manifest.get("meta", {}))

    def store(self, kind: str, fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
              meta: Mapping[str, Any] | None = None) -> Path:
        """Write an entry atomically (replacing a bad one); return its directory."""
        final = self.entry_dir(kind, fields)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=self.root))
        try:
            specs = {}
            for name, a in arrays.items():
                a = np.ascontiguousarray(a)
                path = tmp / f"{name}.npy"
                with open(path, "wb") as f:
                    np.save(f, a, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                specs[name] = {"shape": list(a.shape), "dtype": a.dtype.str, "bytes": path.stat().st_size,
                               "sha256": _sha256(path)}
            manifest = {"key": self.key(kind, fields), "arrays": specs, "meta": dict(meta or {})}
            with open(tmp / _MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists() and self._is_good(final, manifest["key"]):
                # Another process built the same key and stored it since our miss: use
                # its entry (the same arrays). Replacing it would pull it from under
                # that process's read-back (and anyone's load), which then failed.
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            if final.exists():  # a bad entry: move it aside, then take its place
                trash = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    trash = None  # type: ignore[assignment]
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:  # another process put a (fresh) entry there first: use that one
                shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    @classmethod
    def _is_good(cls, d: Path, key: dict[str, Any]) -> bool:
        try:
            cls._load_checked(d, key)
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            return False
        return True

    def get_or_build(self, kind: str, fields: Mapping[str, Any], build: Build) -> tuple[dict[str, np.ndarray],
                                                                                       dict[str, Any]]:
        """The entry's arrays and meta, building and storing them first if needed.

        ``build()`` returns ``(arrays, meta)``; meta must be JSON. What is returned after a
        build is read back from the cache, so a hit and a build give the same arrays.
        """
        got = self.load(kind, fields)
        if got is not None:
            self.stats.hits += 1
            return got
        arrays, meta = build()
        self.stats.builds += 1
        try:
            self.store(kind, fields, arrays, meta)
        except OSError as err:  # a read-only or full disk: work without the cache
            _log.warning("fededge cache: cannot write under %s (%s); not caching", self.root, err)
            return dict(arrays), dict(meta)
        got = self.load(kind, fields)
        if got is None:  # replaced meanwhile by a process that found it bad: ours, from memory
            _log.warning("fededge cache: the entry just written under %s did not read back; using the arrays "
                         "built here", self.root)
            return dict(arrays), dict(meta)
        return got
