"""Bounded staleness (SSP): apply updates as they arrive; nobody runs too far ahead."""

from __future__ import annotations

from typing import Any

from fededge.algorithms.asyncfl import AsyncConfig
from fededge.strategies.asyncloop import AsyncFL

__all__ = ["SSP"]


class SSP(AsyncFL):
    """Stale synchronous parallel (Ho et al., NeurIPS 2013; the bounded delay of the
    parameter server, Li et al., OSDI 2014): each update is applied as it arrives,
    ``x <- x + Δ_i / n`` (each of the n clients owns 1/n of a round), and a client may
    start its next round only while it is at most ``bound`` rounds ahead of the slowest
    active client. ``bound = 0`` is bulk-synchronous: FedAvg with equal weights.

    Parameters
    ----------
    bound : int
        s, the rounds a client may run ahead of the slowest active one. Larger keeps
        fast clients busier at the price of staler updates.
    **shared
        ``concurrency``, ``seed``, ``order``, ``poll_s`` and Flower's FedAvg arguments:
        :class:`~fededge.strategies.asyncloop.AsyncFL`, whose event loop this is.

    Examples
    --------
    >>> strategy = SSP(bound=2)
    >>> strategy.config.ssp_bound
    2
    """

    def __init__(self, *, bound: int = AsyncConfig.ssp_bound, **shared: Any) -> None:
        super().__init__(config=AsyncConfig(mode="ssp", ssp_bound=bound), **shared)
