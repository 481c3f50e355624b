"""The outer optimiser of local SGD: the averaged update as a pseudo-gradient.

FedAvg sets the global model to the clients' average ``x̄``. The local SGD / DiLoCo line
(Reddi et al., 2021; Douillard et al., 2023, "DiLoCo") treats ``Δ = x - x̄`` as a gradient
and takes an outer SGD step with momentum, Nesterov in DiLoCo (outer lr 0.7, momentum 0.9)::

    b <- Δ                    (first round; PyTorch's convention)
    b <- mu * b + Δ           (later rounds)
    step = Δ + mu * b         (Nesterov)   or   b   (heavy ball)
    x <- x - lr * step

This is ``torch.optim.SGD(lr, momentum, nesterov)`` applied to the pseudo-gradient, which
the tests check to the number, on the model's parameters: normalisation statistics
(BatchNorm's running mean and variance) and counters take the clients' average, as buffers
take no optimiser step. With ``lr = 1`` and ``mu = 0`` it is FedAvg, and then
returns the average itself (bit for bit, not ``x - (x - x̄)``). Pure torch, no Flower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fededge.algorithms.normstats import statistic_names

__all__ = ["OuterSGD"]

Weights = dict[str, torch.Tensor]


@dataclass
class OuterSGD:
    """Outer SGD with (Nesterov) momentum on the pseudo-gradient ``x - average``."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    buffers: Weights = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def step(self, current: Weights, average: Weights) -> Weights:
        """The new global model from the current one and the clients' average."""
        if self.lr == 1.0 and self.momentum == 0.0:
            return {k: v.clone() for k, v in average.items()}
        out: Weights = {}
        statistics = set(statistic_names(current))
        for k, x in current.items():
            if not torch.is_floating_point(x):  # counters (BatchNorm's num_batches_tracked): the average,
                out[k] = average[k].round().to(x.dtype)  # rounded (29.999999999999996 is 30, not 29)
                continue
            if k in statistics:
                # Normalisation statistics are averages of activations, not parameters: the
                # outer optimiser (torch's SGD over model.parameters()) never steps them.
                # Stepped, a running variance went negative (lr 0.7 x 1.9 of its change)
                # and the model evaluated to NaN from round 2.
                out[k] = average[k].to(x.dtype).clone()
                continue
            g = x - average[k].to(x.dtype)
            if self.momentum > 0:
                buf = self.buffers.get(k)
                buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                self.buffers[k] = buf
                g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
            out[k] = x.add(g, alpha=-self.lr)  # the same arithmetic as torch.optim.SGD
        return out
