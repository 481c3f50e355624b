"""The per-tensor rule of an update's plan: a tensor's role from its name, shape and dtype,
and the codec a role goes with. :mod:`fededge.compress.plan` documents the rule and
builds plans from it; :mod:`fededge.compress.update`'s encoder follows it.

Pure: no Flower.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["COUNTERS", "ROLES", "SERVER", "STATISTICS", "PlanMismatchError", "is_counter", "is_statistic", "role_codec",
           "server_keeps", "server_sets_statistics", "tensor_role"]

#: The roles a tensor can have, in the order the rule decides them.
ROLES: tuple[str, ...] = ("integer", "statistic", "small", "vector", "matrix")
#: Last name components of normalisation statistics (torch's BatchNorm, InstanceNorm and
#: SyncBatchNorm buffers). ``num_batches_tracked`` is an integer and goes as it is.
STATISTICS: tuple[str, ...] = ("running_mean", "running_var")
#: The plan's "codec" of a tensor the client does not send because the server sets it
#: (normalisation statistics and their counters under ``norm-stats = global``).
SERVER = "server"
#: Last name components of integer counters, sent as they are whatever dtype a server's
#: aggregation left them in (FedAvg averages BatchNorm's counter into a float).
COUNTERS: tuple[str, ...] = ("num_batches_tracked",)


class PlanMismatchError(ValueError):
    """A payload's codec is not what the plan gives its tensor: the client and the server
    hold different compression configs (or a different model)."""


def is_counter(name: str) -> bool:
    """Whether ``name`` is an integer counter (sent as it is, whatever its dtype).

    >>> is_counter("bn1.num_batches_tracked")
    True
    """
    return name.rsplit(".", 1)[-1] in COUNTERS


def is_statistic(name: str) -> bool:
    """Whether ``name`` is a normalisation statistic (by its last dotted component).

    >>> is_statistic("layer1.0.bn1.running_var"), is_statistic("layer1.0.bn1.weight")
    (True, False)
    """
    return name.rsplit(".", 1)[-1] in STATISTICS


def tensor_role(name: str, shape: tuple[int, ...], floating: bool, config: Any) -> str:
    """The role of one tensor under ``config``, an :class:`~fededge.compress.update.UpdateConfig`
    (see :mod:`fededge.compress.plan`)."""
    if not floating or is_counter(name):
        # By name too: a server whose strategy averaged the counter holds it as a float.
        return "integer"
    if is_statistic(name):
        return "statistic"
    numel = int(np.prod(shape)) if shape else 1
    if numel < 1 or numel < config.min_numel:
        return "small"
    if len(shape) < 2 and (not config.compress_1d or config.compressor == "powersgd"):
        return "vector"
    return "matrix"


def server_sets_statistics(config: Any) -> bool:
    """Whether clients under ``config`` send no normalisation statistics because the server
    recalibrates them (``norm-stats = global``, :class:`fededge.strategies.normstats.NormCalibrated`):
    their role's codec is then :data:`SERVER`."""
    return getattr(config, "norm_stats", "") == "global"


def server_keeps(name: str, config: Any) -> bool:
    """Whether clients under ``config`` leave tensor ``name`` out of their updates because
    the server sets it itself: the normalisation statistics and their counters under
    ``norm-stats = global`` (the plan's codec :data:`SERVER`)."""
    return server_sets_statistics(config) and (is_statistic(name) or is_counter(name))


def role_codec(role: str, config: Any, name: str = "") -> str | None:
    """The wire codec of a role under ``config``; None for integers (sent as they are),
    but :data:`SERVER` for a counter (``name`` given) where the server sets the
    statistics it counts for (``norm-stats = global``)."""
    if role == "integer":
        return SERVER if server_keeps(name, config) else None
    if role == "statistic":
        return SERVER if server_sets_statistics(config) else "raw"
    if role in ("small", "vector"):
        return config.small_codec
    return "topk" if config.compressor == "dgc" else config.compressor
