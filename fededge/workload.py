"""From a :class:`~fededge.config.RunConfig` to data, partitions and a model.

Pure (no Flower). The ClientApp, the ServerApp and the benchmarks' no-framework floor all
build their workload here, so the three see the same data split and the same
initial model for the same config.

Caches are keyed on the config fields that determine the data only (:func:`data_key`),
so a sweep over learning rates or local steps in one process shares one copy. Across
processes (a SuperNode starts one per message) the data set and each client's arrays
are also kept on disk, memory-mapped (:mod:`fededge.nodecache`; off with
``FEDEDGE_CACHE_DIR=off``): a fresh process maps them instead of rebuilding them.

A split that cannot work (too few samples for the clients, or no seeded Dirichlet draw
that gives every client ``min-partition-size``) raises :class:`~fededge.config.ConfigError`
in run-config terms; :func:`check_partition` lets a server find out before round 1.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from fededge.config import ConfigError, RunConfig
from fededge.data.datasets import CIFAR10_SUBDIR, CIFAR10_TEST_FILE, CIFAR10_TRAIN_FILES, MNIST_FILES, Dataset, load_dataset
from fededge.data.partition import PartitionError, partition
from fededge.models.zoo import build_model
from fededge.nodecache import NodeCache, default_cache_dir, file_stats

__all__ = ["CLIENT_TENSORS_CACHED", "DataKey", "check_partition", "client_cache_fields", "client_data", "data_key",
           "dataset_files", "dataset_for", "model_for", "node_cache", "partition_indices"]


class DataKey(NamedTuple):
    """The config fields that decide a client's data."""

    dataset: str
    data_dir: str | None
    seed: int
    synthetic_samples: int
    synthetic_amplitude: float
    partition: str
    alpha: float
    shards_per_client: int
    min_partition_size: int


def data_key(cfg: RunConfig, data_dir: str | None = None) -> DataKey:
    """``data_dir`` (a node's own) wins over ``cfg.data_dir``."""
    return DataKey(cfg.dataset, data_dir or cfg.data_dir or None, cfg.seed, cfg.synthetic_samples,
                   cfg.synthetic_amplitude, cfg.partition, cfg.alpha, cfg.shards_per_client, cfg.min_partition_size)


def dataset_for(cfg: RunConfig, data_dir: str | None = None) -> Dataset:
    """The data set of ``cfg`` (cached per process; data sets are read-only)."""
    k = data_key(cfg, data_dir)
    return _dataset(k.dataset, k.data_dir, k.seed, k.synthetic_samples, k.synthetic_amplitude)


def node_cache() -> NodeCache | None:
    """The on-disk cache of this process's environment (None when switched off)."""
    root = default_cache_dir()
    if root is None:
        return None
    if _CACHES.get(root) is None:
        _CACHES[root] = NodeCache(root)
    return _CACHES[root]


_CACHES: dict[Path, NodeCache] = {}


def dataset_files(name: str, data_dir: str | None) -> list[Path]:
    """The files on disk that data set ``name`` is read from (for the cache's key)."""
    if name == "digits":
        spec = importlib.util.find_spec("sklearn")  # locates, does not import, scikit-learn
        if spec is None or spec.origin is None:
            return []
        return [Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"]
    if data_dir is None:
        return []
    d = Path(data_dir)
    if name == "mnist":
        return [base / (f + gz) for f in MNIST_FILES.values() for base in (d, d / "MNIST" / "raw")
                for gz in ("", ".gz")]
    if name == "cifar10":
        return [base / f for f in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE) for base in (d, d / CIFAR10_SUBDIR)]
    return []


def _dataset_fields(name: str, data_dir: str | None, seed: int, synthetic_samples: int,
                    synthetic_amplitude: float) -> dict[str, Any]:
    return {"dataset": name, "data_dir": data_dir, "seed": seed, "synthetic_samples": synthetic_samples,
            "synthetic_amplitude": synthetic_amplitude, "files": file_stats(dataset_files(name, data_dir))}


@lru_cache(maxsize=2)
def _dataset(name: str, data_dir: str | None, seed: int, synthetic_samples: int,
             synthetic_amplitude: float) -> Dataset:
    def load() -> Dataset:
        return load_dataset(name, data_dir=data_dir, seed=seed, synthetic_samples=synthetic_samples,
                            synthetic_amplitude=synthetic_amplitude)

    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        ds = load()
        arrays = {k: getattr(ds, k).numpy() for k in ("x_train", "y_train", "x_test", "y_test")}
        return arrays, {"name": ds.name, "num_classes": ds.num_classes}

    cache = node_cache()
    if cache is None:
        return load()
    arrays, meta = cache.get_or_build(
        "dataset", _dataset_fields(name, data_dir, seed, synthetic_samples, synthetic_amplitude), build)
    return Dataset(str(meta["name"]), *(torch.from_numpy(arrays[k]) for k in ("x_train", "y_train")),
                   *(torch.from_numpy(arrays[k]) for k in ("x_test", "y_test")), num_classes=int(meta["num_classes"]))


def partition_indices(cfg: RunConfig, num_partitions: int, data_dir: str | None = None) -> list[np.ndarray]:
    """The training-set split of ``cfg`` into ``num_partitions`` clients (cached).

    Raises :class:`~fededge.config.ConfigError` when the split cannot work.
    """
    return _partition(data_key(cfg, data_dir), num_partitions)


def check_partition(cfg: RunConfig, num_partitions: int, data_dir: str | None = None) -> None:
    """Raise :class:`~fededge.config.ConfigError` if ``cfg``'s clients cannot split their data.

    Exact, not a rule of thumb: it runs the very partition every client runs (same data,
    same seed, same draws), so it fails exactly when they would. The one cheap test
    there is, ``num_partitions * min-partition-size > samples``, is necessary but not
    sufficient; the Dirichlet retry loop decides the rest, and its seeded draws give the
    same answer on every machine. The result is cached: in one process (fededge's
    in-process runtime) the clients reuse this split instead of computing it again.

    Examples
    --------
    >>> cfg = RunConfig.from_mapping({"dataset": "synthetic", "synthetic-samples": 2000})
    >>> check_partition(cfg, 1000)
    Traceback (most recent call last):
    ...
    fededge.errors.ConfigError: partition='dirichlet' cannot give each of the 1000 clients ...
    """
    parts = partition_indices(cfg, num_partitions, data_dir)
    why = cfg.trains_on_two_examples()
    if why is not None:  # min-partition-size bounds Dirichlet's splits only
        smallest = min((len(p) for p in parts), default=2)
        if smallest < 2:
            ones = sum(len(p) < 2 for p in parts)
            raise ConfigError(
                f"model {cfg.model!r} needs at least 2 training examples on every client ({why}); "
                f"partition={cfg.partition!r} gives {ones} of the {num_partitions} clients "
                f"{smallest}: use fewer clients, more data, or partition='dirichlet' with min-partition-size >= 2")


@lru_cache(maxsize=16)
def _partition(k: DataKey, num_partitions: int) -> list[np.ndarray]:
    ds = _dataset(k.dataset, k.data_dir, k.seed, k.synthetic_samples, k.synthetic_amplitude)
    try:
        return partition(
            ds.y_train.numpy(), num_partitions, scheme=k.partition, alpha=k.alpha,
            shards_per_partition=k.shards_per_client, seed=k.seed, min_partition_size=k.min_partition_size,
        )
    except PartitionError as err:
        raise _partition_config_error(err, k) from None


def _partition_config_error(err: PartitionError, k: DataKey) -> ConfigError:
    """The partitioner's failure, told in run-config keys, with what to change."""
    n, clients = err.num_samples, err.num_partitions
    data = f"the {n} training samples of dataset={k.dataset!r}"
    fewer = "use fewer clients (--num-clients, num-supernodes or the SuperNodes' num-partitions)"
    more = (f", or raise synthetic-samples (now {k.synthetic_samples}, of which the test split "
            f"keeps {k.synthetic_samples - n})") if k.dataset.startswith("synthetic") else ""
    if clients > n:
        return ConfigError(f"{clients} clients cannot share {data}: each needs at least one; {fewer}{more}")
    if err.scheme == "shards":
        return ConfigError(
            f"partition='shards' needs shards-per-client={k.shards_per_client} x {clients} clients = "
            f"{err.needed} shards of at least one sample, more than {data}; lower "
            f"shards-per-client or {fewer}{more}")
    head = (f"partition='dirichlet' cannot give each of the {clients} clients at least "
            f"min-partition-size={k.min_partition_size} of {data} with alpha={k.alpha}")
    if err.needed is not None:
        return ConfigError(
            f"{head}: that needs {err.needed} samples in all, whatever alpha; lower "
            f"min-partition-size or {fewer}{more}")
    return ConfigError(
        f"{head}: in each of its {err.draws} seeded draws some client got fewer (the smallest "
        f"{err.smallest} in the last); raise alpha (more even splits), lower min-partition-size "
        f"or {fewer}{more}")


def client_data(
    cfg: RunConfig, partition_id: int, num_partitions: int, device: torch.device,
    data_dir: str | None = None, *, on_disk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s training examples, on ``device`` (cached in the process;
    ``on_disk`` also in the node cache, for the next process of a SuperNode)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id must be in [0, {num_partitions}), got {partition_id}; check the "
            "SuperNode's --node-config 'partition-id=... num-partitions=...'"
        )
    return _client_tensors(data_key(cfg, data_dir), partition_id, num_partitions, str(device), on_disk)


def client_cache_fields(k: DataKey, partition_id: int, num_partitions: int) -> dict[str, Any]:
    """What a client's cached arrays depend on: the data key, its place in the split, and the
    data set's files (size and mtime)."""
    return {**k._asdict(), "files": file_stats(dataset_files(k.dataset, k.data_dir)),
            "partition_id": partition_id, "num_partitions": num_partitions}


#: Clients whose data a process keeps on its device (any process may run any client):
#: issue 35's sizing of the processes on a GPU counts them.
CLIENT_TENSORS_CACHED = 64


@lru_cache(maxsize=CLIENT_TENSORS_CACHED)
def _client_tensors(k: DataKey, pid: int, n: int, device: str, on_disk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        ds = _dataset(k.dataset, k.data_dir, k.seed, k.synthetic_samples, k.synthetic_amplitude)
        idx = _partition(k, n)[pid]
        t = torch.from_numpy(idx)
        return {"index": idx, "x": ds.x_train.index_select(0, t).numpy(),
                "y": ds.y_train.index_select(0, t).numpy()}, {}

    cache = node_cache() if on_disk else None
    if cache is None:
        arrays, _ = build()
    else:
        arrays, _ = cache.get_or_build("client", client_cache_fields(k, pid, n), build)
    return torch.from_numpy(arrays["x"]).to(device), torch.from_numpy(arrays["y"]).to(device)


def model_for(cfg: RunConfig, ds: Dataset) -> nn.Module:
    """The initial model of ``cfg``: seeded, without touching the global RNG."""
    return build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=cfg.seed)
