"""Normalisation statistics of the server's own model, pooled from its clients.

BatchNorm's running mean and variance are not weights: they describe the activations of
one set of weights on some data. A server that averages the statistics its clients
trained with holds statistics of no model it has (the average of the statistics is not
the statistics of the averaged weights; under a lossy uplink the clients' models are not
even the ones the server decodes). Recalibration asks clients for the statistics of the
server's aggregated model itself, each on a few batches of its own data, and pools them
here into the statistics of their union:

    mean = sum_i w_i mu_i
    var  = sum_i w_i (var_i + (mu_i - mean)^2)

with ``w_i = n_i / sum_j n_j`` (``n_i`` the client's examples). The second term is the
spread of the clients' means: a centralised batch mixing every client's data sees it, a
client's own batches (non-IID) do not. With one client, or clients whose means agree,
the pool is the weighted average.

Pure: no Flower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from fededge.compress.roles import is_statistic

__all__ = ["NormStatsError", "check_statistics", "pool_statistics", "statistic_names"]

_MEAN, _VAR = "running_mean", "running_var"


class NormStatsError(ValueError):
    """A client's statistics do not fit the model (names, shapes, values)."""


def statistic_names(state: Mapping[str, object]) -> list[str]:
    """The names of ``state``'s normalisation statistics (``running_mean``/``running_var``).

    >>> statistic_names({"bn.weight": 0, "bn.running_mean": 0, "bn.running_var": 0})
    ['bn.running_mean', 'bn.running_var']
    """
    return [n for n in state if is_statistic(n)]


def check_statistics(stats: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> None:
    """Refuse statistics that are not exactly ``model``'s: the same names, the same shapes,
    finite values and variances >= 0.

    Raises
    ------
    NormStatsError
        Naming the first tensor that does not fit, and why.
    """
    want = statistic_names(model)
    missing = [n for n in want if n not in stats]
    extra = [n for n in stats if n not in want]
    if missing or extra:
        raise NormStatsError(f"statistics do not match the model's: missing {missing[:3]}, unknown {extra[:3]}")
    for n in want:
        s = stats[n]
        if tuple(s.shape) != tuple(model[n].shape):  # type: ignore[union-attr]
            raise NormStatsError(f"tensor {n!r}: shape {tuple(s.shape)}, the model's is "
                                 f"{tuple(model[n].shape)}")  # type: ignore[union-attr]
        if not bool(torch.isfinite(s).all()):
            raise NormStatsError(f"tensor {n!r}: not finite")
        if n.endswith(_VAR) and bool((s < 0).any()):
            raise NormStatsError(f"tensor {n!r}: a negative variance")


def pool_statistics(parts: Sequence[tuple[float, Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The statistics of the union of the clients' data, from each client's ``(n_i,
    statistics)`` (see the module's docstring), in float64 arithmetic and returned in
    float32. Every part must hold the same names; a ``running_var`` is pooled with the
    ``running_mean`` of its module.

    Examples
    --------
    >>> a = {"bn.running_mean": torch.tensor([0.0]), "bn.running_var": torch.tensor([1.0])}
    >>> b = {"bn.running_mean": torch.tensor([2.0]), "bn.running_var": torch.tensor([1.0])}
    >>> {k: v.tolist() for k, v in pool_statistics([(1, a), (1, b)]).items()}
    {'bn.running_mean': [1.0], 'bn.running_var': [2.0]}
    """
    if not parts:
        raise ValueError("pool_statistics needs at least one client's statistics")
    weights = [float(n) for n, _ in parts]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"every client's example count must be > 0, got {weights}")
    total = sum(weights)
    names = list(parts[0][1])
    for _, s in parts[1:]:
        if list(s) != names:
            raise ValueError("every client's statistics must hold the same tensors, in the same order")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith(_MEAN):
            out[name] = sum(w / total * s[name].double() for w, (_, s) in zip(weights, parts))
    for name in names:
        if not name.endswith(_VAR):
            continue
        mean_name = name[: -len(_VAR)] + _MEAN
        if mean_name not in out:
            raise ValueError(f"{name!r} has no {mean_name!r} to pool it with")
        mean = out[mean_name]
        out[name] = sum(w / total * (s[name].double() + (s[mean_name].double() - mean) ** 2)
                        for w, (_, s) in zip(weights, parts))
    return {n: out[n].float() for n in names}
