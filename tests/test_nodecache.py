"""The node-local cache: a hit is the rebuild bit for bit; a changed input or a corrupt
entry is rebuilt, never trusted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fededge import workload
from fededge.config import RunConfig
from fededge.nodecache import NodeCache, default_cache_dir, file_stats


def _clear() -> None:
    workload._dataset.cache_clear()
    workload._partition.cache_clear()
    workload._client_tensors.cache_clear()
    workload._CACHES.clear()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", str(d))
    _clear()
    yield d
    _clear()


def _client(cfg: dict, pid: int = 1, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    _clear()  # a fresh process: nothing in memory
    return workload.client_data(RunConfig.from_mapping(cfg), pid, n, torch.device("cpu"))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("cfg", [{}, {"dataset": "synthetic", "synthetic-samples": 600, "partition": "iid"}])
def test_hit_equals_rebuild_bit_for_bit(cache_dir, monkeypatch, cfg):
    built = _client(cfg)  # builds and writes
    assert workload.node_cache().stats.builds == 2
    hit = _client(cfg)  # maps
    stats = workload.node_cache().stats
    assert (stats.hits, stats.builds) == (1, 0)
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", "off")
    plain = _client(cfg)  # no cache at all
    assert workload.node_cache() is None
    for a, b, c in zip(built, hit, plain):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        assert _bits(a) == _bits(b) == _bits(c)
    ds_plain = workload.dataset_for(RunConfig.from_mapping(cfg))
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", str(cache_dir))
    _clear()
    ds_hit = workload.dataset_for(RunConfig.from_mapping(cfg))
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert _bits(getattr(ds_plain, k)) == _bits(getattr(ds_hit, k))
    assert (ds_plain.name, ds_plain.num_classes) == (ds_hit.name, ds_hit.num_classes)


def test_hit_does_not_import_the_data_sets_builder(cache_dir):
    """The point of the cache: a fresh process with a hit skips scikit-learn (digits)."""
    import subprocess
    import sys

    _client({})
    code = ("import sys, torch\nfrom fededge.config import RunConfig\nfrom fededge import workload\n"
            "workload.client_data(RunConfig.from_mapping({}), 1, 3, torch.device('cpu'))\n"
            "workload.dataset_for(RunConfig.from_mapping({}))\n"
            "print('sklearn' in sys.modules, workload.node_cache().stats.as_dict())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "FEDEDGE_CACHE_DIR": str(cache_dir)}).stdout
    assert out.strip() == "False {'hits': 2, 'builds': 0, 'rejected': 0}"


@pytest.mark.parametrize("change", [{"seed": 1}, {"alpha": 0.3}, {"partition": "iid"},
                                    {"min-partition-size": 3}])
def test_changing_an_input_rebuilds(cache_dir, change):
    base = _client({})
    entries = set(cache_dir.iterdir())
    other = _client(change)
    assert workload.node_cache().stats.builds >= 1  # the client's arrays; the data set may be a hit
    new = set(cache_dir.iterdir()) - entries
    assert any(p.name.startswith("client-") for p in new)
    if "min-partition-size" not in change:  # a looser minimum may draw the same split
        assert _bits(base[1]) != _bits(other[1]) or _bits(base[0]) != _bits(other[0])


def test_partition_id_and_count_are_in_the_key(cache_dir):
    a = _client({}, pid=0, n=3)
    b = _client({}, pid=1, n=3)
    c = _client({}, pid=1, n=4)
    assert len({_bits(a[1]), _bits(b[1]), _bits(c[1])}) == 3
    assert len([p for p in cache_dir.iterdir() if p.name.startswith("client-")]) == 3


def test_dataset_file_change_rebuilds(tmp_path):
    """On-disk data: a file's size or mtime is part of the key."""
    f = tmp_path / "data.bin"
    f.write_bytes(b"\x01\x02")
    cache = NodeCache(tmp_path / "c")
    calls = []

    def build():
        calls.append(1)
        return {"x": np.frombuffer(f.read_bytes(), dtype=np.uint8).copy()}, {}

    def get():
        return cache.get_or_build("t", {"files": file_stats([f])}, build)[0]["x"]

    assert get().tolist() == [1, 2] and get().tolist() == [1, 2] and len(calls) == 1
    f.write_bytes(b"\x01\x02\x03")
    assert get().tolist() == [1, 2, 3] and len(calls) == 2
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # touched, same bytes
    get()
    assert len(calls) == 3


def _corrupt_truncate(d: Path) -> None:
    p = d / "x.npy"
    p.write_bytes(p.read_bytes()[:-7])


def _corrupt_flip(d: Path) -> None:
    p = d / "x.npy"
    b = bytearray(p.read_bytes())
    b[-3] ^= 0xFF  # same size, a different value
    p.write_bytes(bytes(b))


def _corrupt_shape(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m["arrays"]["x"]["shape"] = [1]
    (d / "manifest.json").write_text(json.dumps(m))


def _corrupt_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


def _corrupt_missing(d: Path) -> None:
    (d / "y.npy").unlink()


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_shape, _corrupt_manifest,
                                     _corrupt_missing])
def test_corrupt_entry_is_rebuilt(cache_dir, corrupt):
    # Copied: a mapping of the file would see an in-place corruption (fededge itself never
    # writes in place: it renames a new entry over the old one, a new inode).
    good = tuple(t.clone() for t in _client({}))
    (entry,) = [p for p in cache_dir.iterdir() if p.name.startswith("client-")]
    corrupt(entry)
    again = _client({})
    stats = workload.node_cache().stats
    assert stats.rejected == 1 and stats.builds == 1
    assert all(_bits(a) == _bits(b) for a, b in zip(good, again))
    hit = _client({})  # the rebuilt entry is good again
    assert workload.node_cache().stats.as_dict() == {"hits": 1, "builds": 0, "rejected": 0}
    assert all(_bits(a) == _bits(b) for a, b in zip(good, hit))
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_writes_are_atomic_nothing_half_written(tmp_path, monkeypatch):
    """A build that fails midway leaves no entry and no temporary directory."""
    cache = NodeCache(tmp_path / "c")

    def bad_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", bad_save)
    arrays, _ = cache.get_or_build("t", {"a": 1}, lambda: ({"x": np.arange(3)}, {}))
    assert arrays["x"].tolist() == [0, 1, 2]  # still served, from memory
    assert list((tmp_path / "c").iterdir()) == []


def test_two_processes_building_one_key_keep_the_first_good_entry(tmp_path, monkeypatch):
    """Two processes miss on one key (a sweep's runs, SuperNodes sharing a cache) and
    both build: the second store found the first's entry and replaced it as if bad, which
    pulled it from under the first's read-back (an OSError that stopped that process)
    and any load meanwhile. Now the second uses the good entry; a read-back that fails
    anyway serves the arrays built."""
    import fededge.nodecache as nc

    root = tmp_path / "c"
    a, b = NodeCache(root), NodeCache(root)
    key = ("dataset", {"k": 1})
    assert b.load(*key) is None  # b misses and builds (slower)
    a.get_or_build(*key, lambda: ({"x": np.full(10, 1.0, np.float32)}, {}))
    entry = a.entry_dir(*key)
    inode = entry.stat().st_ino
    seen = []
    real_rmtree = nc.shutil.rmtree

    def rmtree(p, *args, **kw):  # a load by a third process while b stores
        seen.append(NodeCache(root).load(*key))
        return real_rmtree(p, *args, **kw)

    monkeypatch.setattr(nc.shutil, "rmtree", rmtree)
    assert b.store(*key, {"x": np.full(10, 1.0, np.float32)}) == entry
    assert entry.stat().st_ino == inode  # a's entry, not replaced
    assert all(got is not None for got in seen)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    # A read-back that fails (the entry replaced meanwhile): the arrays built, not an error.
    monkeypatch.setattr(NodeCache, "load", lambda self, kind, fields: None)
    arrays, _ = NodeCache(root).get_or_build("other", {"k": 2}, lambda: ({"y": np.arange(4)}, {}))
    assert arrays["y"].tolist() == [0, 1, 2, 3]


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", "off")
    assert default_cache_dir() is None
    monkeypatch.delenv("FEDEDGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fededge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "fededge"
