"""From a :class:`~fededge.config.RunConfig` to data, partitions and a model.

Pure (no Flower). The ClientApp, the ServerApp and the benchmarks' no-framework floor all
build their workload here, so the three see the same data split and the same
initial model for the same config.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

from fededge.config import RunConfig
from fededge.data.datasets import Dataset, load_dataset
from fededge.data.partition import partition
from fededge.models.zoo import build_model

__all__ = ["dataset_for", "partition_indices", "model_for", "client_data"]


def dataset_for(cfg: RunConfig, data_dir: str | None = None) -> Dataset:
    """The data set of ``cfg`` (cached per process; data sets are read-only)."""
    return _dataset(cfg.dataset, data_dir or cfg.data_dir or None, cfg.seed, cfg.synthetic_samples)


@lru_cache(maxsize=2)
def _dataset(name: str, data_dir: str | None, seed: int, synthetic_samples: int) -> Dataset:
    return load_dataset(name, data_dir=data_dir, seed=seed, synthetic_samples=synthetic_samples)


def partition_indices(cfg: RunConfig, num_partitions: int, data_dir: str | None = None) -> list[np.ndarray]:
    """The training-set split of ``cfg`` into ``num_partitions`` clients (cached)."""
    return _partition(
        cfg.dataset, data_dir or cfg.data_dir or None, cfg.seed, cfg.synthetic_samples,
        num_partitions, cfg.partition, cfg.alpha, cfg.shards_per_client, cfg.min_partition_size,
    )


@lru_cache(maxsize=16)
def _partition(name, data_dir, seed, synthetic_samples, num_partitions, scheme, alpha, shards,
               min_size) -> list[np.ndarray]:
    ds = _dataset(name, data_dir, seed, synthetic_samples)
    return partition(
        ds.y_train.numpy(), num_partitions, scheme=scheme, alpha=alpha,
        shards_per_partition=shards, seed=seed, min_partition_size=min_size,
    )


def client_data(
    cfg: RunConfig, partition_id: int, num_partitions: int, device: torch.device,
    data_dir: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s training examples, on ``device``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id must be in [0, {num_partitions}), got {partition_id}; check the "
            "SuperNode's --node-config 'partition-id=... num-partitions=...'"
        )
    ds = dataset_for(cfg, data_dir)
    idx = torch.from_numpy(partition_indices(cfg, num_partitions, data_dir)[partition_id])
    return ds.x_train.index_select(0, idx).to(device), ds.y_train.index_select(0, idx).to(device)


def model_for(cfg: RunConfig, ds: Dataset) -> nn.Module:
    """The initial model of ``cfg``: seeded, without touching the global RNG."""
    return build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=cfg.seed)
