"""From a :class:`~fededge.config.RunConfig` to data, partitions and a model.

Pure (no Flower). The ClientApp, the ServerApp and the benchmarks' no-framework floor all
build their workload here, so the three see the same data split and the same
initial model for the same config.

Caches are keyed on the config fields that determine the data only (:func:`data_key`),
so a sweep over learning rates or local steps in one process shares one copy.

A split that cannot work (too few samples for the clients, or no seeded Dirichlet draw
that gives every client ``min-partition-size``) raises :class:`~fededge.config.ConfigError`
in run-config terms; :func:`check_partition` lets a server find out before round 1.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from fededge.config import ConfigError, RunConfig
from fededge.data.datasets import Dataset, load_dataset
from fededge.data.partition import PartitionError, partition
from fededge.models.zoo import build_model

__all__ = ["DataKey", "check_partition", "client_data", "data_key", "dataset_for", "model_for",
           "partition_indices"]


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


@lru_cache(maxsize=2)
def _dataset(name: str, data_dir: str | None, seed: int, synthetic_samples: int,
             synthetic_amplitude: float) -> Dataset:
    return load_dataset(name, data_dir=data_dir, seed=seed, synthetic_samples=synthetic_samples,
                        synthetic_amplitude=synthetic_amplitude)


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
    fededge.config.ConfigError: partition='dirichlet' cannot give each of the 1000 clients ...
    """
    partition_indices(cfg, num_partitions, data_dir)


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
    data_dir: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s training examples, on ``device`` (cached)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id must be in [0, {num_partitions}), got {partition_id}; check the "
            "SuperNode's --node-config 'partition-id=... num-partitions=...'"
        )
    return _client_tensors(data_key(cfg, data_dir), partition_id, num_partitions, str(device))


@lru_cache(maxsize=64)
def _client_tensors(k: DataKey, pid: int, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ds = _dataset(k.dataset, k.data_dir, k.seed, k.synthetic_samples, k.synthetic_amplitude)
    idx = torch.from_numpy(_partition(k, n)[pid])
    return ds.x_train.index_select(0, idx).to(device), ds.y_train.index_select(0, idx).to(device)


def model_for(cfg: RunConfig, ds: Dataset) -> nn.Module:
    """The initial model of ``cfg``: seeded, without touching the global RNG."""
    return build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=cfg.seed)
