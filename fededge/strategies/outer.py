"""FedAvg with an outer optimiser: the ``diloco`` strategy (see fededge.algorithms.outer)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fededge.algorithms.outer import OuterSGD

__all__ = ["FedAvgOuter"]


class FedAvgOuter(FedAvg):
    """FedAvg whose average drives an outer SGD step with (Nesterov) momentum.

    ``lr = 1, momentum = 0`` is FedAvg exactly. DiLoCo's setting is ``lr = 0.7,
    momentum = 0.9, nesterov = True`` (the ``diloco`` strategy's defaults).
    """

    def __init__(self, *, lr: float = OuterSGD.lr, momentum: float = OuterSGD.momentum,
                 nesterov: bool = OuterSGD.nesterov,
                 **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.outer = OuterSGD(lr=lr, momentum=momentum, nesterov=nesterov)
        self._current: ArrayRecord | None = None

    def state_dict(self) -> dict[str, Any]:
        """The outer momentum buffers, for a checkpoint (Flower's loop runs this
        strategy, so nothing else lives between rounds)."""
        return {"buffers": {k: v.clone() for k, v in self.outer.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.buffers = {k: v.clone() for k, v in state["buffers"].items()}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._current = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        avg, metrics = super().aggregate_train(server_round, replies)
        if avg is None or self._current is None:
            return avg, metrics
        current = {k: torch.from_numpy(v.numpy()) for k, v in self._current.items()}
        average = {k: torch.from_numpy(v.numpy()) for k, v in avg.items()}
        new = self.outer.step(current, average)
        return ArrayRecord({k: new[k] for k in avg.keys()}), metrics
