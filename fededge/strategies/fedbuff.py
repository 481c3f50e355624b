"""FedBuff: buffer K client deltas, then take one server step."""

from __future__ import annotations

from typing import Any

from fededge.algorithms.asyncfl import AsyncConfig, StalenessFunction
from fededge.strategies.asyncloop import AsyncFL

__all__ = ["FedBuff"]


class FedBuff(AsyncFL):
    """FedBuff (Nguyen et al., AISTATS 2022, arXiv:2106.06639): the server buffers client
    deltas ``Δ_i = x_i - x(v_i)`` as they arrive and, once ``buffer_size`` are in, steps
    ``x <- x + server_lr * Σ n_i s(tau_i) Δ_i / Σ n_i``. One server version per buffer.
    With a buffer of every client, no staleness and ``server_lr = 1`` it is FedAvg.

    Parameters
    ----------
    buffer_size : int
        K, updates per server step (the paper uses 10). Smaller steps more often on
        staler updates; larger waits longer for slow clients.
    server_lr : float
        The server's step on the buffered mean delta (1: the mean delta itself).
    staleness : StalenessFunction, optional
        ``s(tau)``, how much a stale delta counts (default: polynomial, ``a = 0.5``, the
        paper's ``1 / sqrt(1 + tau)``).
    **shared
        ``concurrency``, ``seed``, ``order``, ``poll_s`` and Flower's FedAvg arguments:
        :class:`~fededge.strategies.asyncloop.AsyncFL`, whose event loop this is.

    Examples
    --------
    >>> strategy = FedBuff(buffer_size=5, concurrency=8, fraction_train=1.0)
    >>> strategy.config.buffer_size, strategy.config.concurrency
    (5, 8)
    """

    def __init__(self, *, buffer_size: int = AsyncConfig.buffer_size, server_lr: float = AsyncConfig.server_lr,
                 staleness: StalenessFunction | None = None, **shared: Any) -> None:
        super().__init__(config=AsyncConfig(mode="fedbuff", buffer_size=buffer_size, server_lr=server_lr,
                                            staleness=staleness or StalenessFunction()), **shared)
