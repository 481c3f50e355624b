"""FedAsync: mix each client's model into the server's as it arrives."""

from __future__ import annotations

from typing import Any

from fededge.algorithms.asyncfl import AsyncConfig, StalenessFunction
from fededge.strategies.asyncloop import AsyncFL

__all__ = ["FedAsync"]


class FedAsync(AsyncFL):
    """FedAsync (Xie, Koyejo and Gupta, 2019, arXiv:1903.03934): every arriving model is
    mixed in at once, ``x <- (1 - a) x + a x_i`` with ``a = alpha * s(tau)``, ``tau`` the
    versions made since the client received its model. One server version per update.

    Parameters
    ----------
    alpha : float
        The mixing weight, in (0, 1] (the paper's experiments use 0.6). Lower it when
        clients are many and their updates noisy.
    staleness : StalenessFunction, optional
        ``s(tau)``, how much a stale model counts (default: polynomial, ``a = 0.5``).
    **shared
        ``concurrency``, ``seed``, ``order``, ``poll_s`` and Flower's FedAvg arguments:
        :class:`~fededge.strategies.asyncloop.AsyncFL`, whose event loop this is.

    Examples
    --------
    >>> strategy = FedAsync(alpha=0.6, staleness=StalenessFunction("hinge", a=10, b=4))
    >>> strategy.config.mode
    'fedasync'
    """

    def __init__(self, *, alpha: float = AsyncConfig.alpha, staleness: StalenessFunction | None = None,
                 **shared: Any) -> None:
        super().__init__(config=AsyncConfig(mode="fedasync", alpha=alpha, staleness=staleness or StalenessFunction()),
                         **shared)
