"""fededge.algorithms: the client-side arithmetic of training algorithms (pure torch, no
Flower): delayed gradient averaging (:mod:`fededge.algorithms.dga`)."""

from fededge.algorithms.dga import DGAClient, DGAConfig, average

__all__ = ["DGAClient", "DGAConfig", "average"]
