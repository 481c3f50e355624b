"""The app's own model and data: a small MLP on scikit-learn's bundled digits (8x8
images, 10 classes; nothing is downloaded), split IID over the nodes."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    """64 -> 32 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This node's shard of the training set (the first 1,440 digits)."""
    x, y = _digits()
    return x[:1440][partition_id::num_partitions], y[:1440][partition_id::num_partitions]


def test_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out 357 digits, evaluated on the server."""
    x, y = _digits()
    return x[1440:], y[1440:]


def train(net: Net, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, batch: int = 32) -> float:
    """``steps`` mini-batch SGD steps; the mean training loss."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(len(y))
    total = 0.0
    for _ in range(steps):
        idx = torch.randint(len(y), (batch,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / steps


def evaluate(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy)."""
    with torch.no_grad():
        logits = net(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
