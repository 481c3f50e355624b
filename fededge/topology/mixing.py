"""Mixing matrices for gossip, their checks, and the spectral gap.

A gossip round replaces node i's model by ``x_i <- sum_j W[i, j] x_j``. For the nodes to
agree on the average of their models, W must be doubly stochastic (rows and columns sum
to 1, weights >= 0), zero off the graph's edges, and its graph connected. The
**spectral gap** ``1 - |lambda_2|``, with ``|lambda_2|`` the second-largest eigenvalue
modulus of W, sets the speed: the distance to the average shrinks by about
``|lambda_2|`` per round.

Rules for an undirected graph with degrees ``d_i`` (:data:`MIXINGS`):

- ``metropolis`` (Metropolis-Hastings; Xiao & Boyd, 2004): ``W[i, j] = 1 / (1 +
  max(d_i, d_j))`` on each edge, the rest of the row on the diagonal. Symmetric and
  local: a node needs only its neighbours' degrees, not the whole graph's.
- ``max-degree`` (uniform): ``W[i, j] = 1 / (d_max + 1)`` on each edge, the rest on the
  diagonal. On a regular graph both rules give ``1 / (d + 1)``; on the complete graph
  both give ``J / n``, the exact average in one step.

For directed graphs: :func:`in_degree_uniform` (``1 / (1 + d_in(i))``, doubly stochastic
when every node hears d nodes and is heard by d nodes, the same d for all, as in the
one-peer exponential graph's rounds) and :func:`push_sum_weights` (column stochastic, for push-sum on any strongly
connected directed graph; Kempe et al., 2003; Assran et al., 2019).

Pure numpy: no Flower.

Examples
--------
>>> from fededge.topology.graph import ring
>>> from fededge.topology.mixing import metropolis_hastings, spectral_gap
>>> round(spectral_gap(metropolis_hastings(ring(16))), 4)
0.0507
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from fededge.topology.graph import (
    TopologyError,
    check_adjacency,
    check_directed,
    degrees,
    is_connected,
    one_peer_exponential,
    square_nonnegative,
)

__all__ = [
    "ATOL",
    "MIXINGS",
    "check_column_stochastic",
    "check_mixing",
    "check_rule",
    "in_degree_uniform",
    "max_degree",
    "metropolis_hastings",
    "mixing_matrix",
    "one_peer_exponential_mixing",
    "push_sum_weights",
    "second_eigenvalue_modulus",
    "spectral_gap",
]

#: The mixing rules :func:`mixing_matrix` knows.
MIXINGS: tuple[str, ...] = ("metropolis", "max-degree")
#: Tolerance of the checks: symmetric and stochastic within this, entry by entry.
ATOL = 1e-12


def _fill_diagonal(w: np.ndarray) -> np.ndarray:
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def metropolis_hastings(adj: Any) -> np.ndarray:
    """Metropolis-Hastings weights of an undirected graph, float64, checked.

    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` for each edge ``i ~ j``; ``W[i, i] = 1 -
    sum_{j != i} W[i, j]``. Symmetric and doubly stochastic for any connected graph.
    """
    a = check_adjacency(adj)
    d = degrees(a)
    w = np.where(a, 1.0 / (1.0 + np.maximum.outer(d, d)), 0.0)
    return check_mixing(_fill_diagonal(w), adjacency=a)


def max_degree(adj: Any) -> np.ndarray:
    """Uniform weights ``1 / (d_max + 1)`` on every edge, the rest on the diagonal; checked."""
    a = check_adjacency(adj)
    w = np.where(a, 1.0 / (1.0 + degrees(a).max()), 0.0)
    return check_mixing(_fill_diagonal(w), adjacency=a)


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`MIXINGS`; else :class:`TopologyError` with the
    closest valid name."""
    if rule not in MIXINGS:
        close = difflib.get_close_matches(str(rule), MIXINGS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TopologyError(f"unknown mixing rule {rule!r}{hint} Valid rules: {', '.join(MIXINGS)}")
    return rule


def mixing_matrix(adj: Any, rule: str = "metropolis") -> np.ndarray:
    """W of an undirected graph by rule name: one of :data:`MIXINGS`."""
    build = {"metropolis": metropolis_hastings, "max-degree": max_degree}[check_rule(rule)]
    return build(adj)


def in_degree_uniform(adj: Any) -> np.ndarray:
    """Weights of a directed graph (``A[i, j]``: i hears j): node i averages itself and its
    in-neighbours equally, ``W[i, j] = 1 / (1 + d_in(i))``.

    Row stochastic always; checked doubly stochastic (not symmetric), which holds when the
    graph is regular (every node hears d nodes and is heard by d nodes), as in each round of
    the one-peer exponential graph, where it is the 1/2-1/2 rule. For other directed graphs
    this raises :class:`TopologyError`: use :func:`push_sum_weights`.
    """
    a = check_directed(adj, connected=False)
    w = (a | np.eye(a.shape[0], dtype=bool)) / (1.0 + degrees(a))[:, None]
    return check_mixing(w, adjacency=a, symmetric=False, connected=False)


def one_peer_exponential_mixing(n: int, t: int) -> np.ndarray:
    """Round ``t``'s W of the one-peer exponential graph: ``(I + P_t) / 2``.

    ``P_t`` moves node ``i - 2^(t mod tau)``'s model to node i (``tau = ceil(log2 n)``,
    see :func:`fededge.topology.graph.one_peer_exponential`). Doubly stochastic, not
    symmetric (except where the distance is n/2). The ``P_t`` are powers of one cyclic
    shift, so they commute, and for n a power of two the product over any tau consecutive
    rounds is ``prod_k (I + S^(2^k)) / 2 = (1/n) sum_m S^m = J / n``: the exact average.
    A round whose distance d shares a factor with n (every round when n is a power of two)
    has spectral gap 0 on its own (exact averaging needs all tau distances).
    """
    return in_degree_uniform(one_peer_exponential(n, t))


def push_sum_weights(adj: Any) -> np.ndarray:
    """Column-stochastic push-sum weights of a directed graph (``A[i, j]``: i hears j).

    Node j splits what it holds equally over itself and its out-neighbours: ``P[i, j] =
    1 / (1 + d_out(j))`` when i hears j or i = j. Push-sum (Kempe et al., 2003; SGP,
    Assran et al., 2019) runs the same mixing on the models and on a scalar weight
    started at 1; their ratio converges to the average on any strongly connected graph.
    See :func:`fededge.algorithms.gossip.push_sum_step`.
    """
    a = check_directed(adj)
    p = (a | np.eye(a.shape[0], dtype=bool)) / (1.0 + a.sum(axis=0))[None, :]
    return check_column_stochastic(p)


def _square_finite(w: Any, what: str) -> np.ndarray:
    w = np.array(w, dtype=np.float64)  # a copy: the caller's array is never frozen
    square_nonnegative(w, what, "gossip weights must be >= 0 (Metropolis-Hastings and "
                                "max-degree never are)")
    return w


def _sums_to_one(sums: np.ndarray, what: str, kind: str, atol: float, fix: str) -> None:
    off = np.abs(sums - 1.0)
    if np.any(off > atol):
        i = int(np.argmax(off))
        raise TopologyError(f"{what}: {kind} {i} sums to {float(sums[i])!r}, not 1 (off by {off[i]:.2e} > "
                            f"{atol:g}); {fix}")


def check_mixing(w: Any, *, adjacency: Any = None, symmetric: bool = True, connected: bool = True,
                 atol: float = ATOL) -> np.ndarray:
    """Validate a gossip mixing matrix; return a read-only float64 copy.

    Parameters
    ----------
    w : array_like
        The ``(n, n)`` matrix, ``W[i, j]`` the weight node i gives node j's model.
    adjacency : array_like, optional
        The graph; if given, W must be zero off its edges and the diagonal.
    symmetric : bool
        Require ``W == W.T`` within ``atol`` (static undirected gossip). The one-peer
        exponential rounds are doubly stochastic but not symmetric: pass False.
    connected : bool
        Require W's graph (its off-diagonal nonzeros) to be connected: otherwise some
        nodes never hear of others and consensus is never reached. False for the rounds of
        a time-varying graph, which are connected only over a period.
    atol : float
        Tolerance of the row, column and symmetry checks (1e-12).

    Raises
    ------
    TopologyError
        A negative or non-finite weight, a row or column not summing to 1, an asymmetric
        W where a symmetric one is required, a weight on a non-edge, a disconnected W.
    """
    what = "mixing matrix"
    w = _square_finite(w, what)
    _sums_to_one(w.sum(axis=1), what, "row", atol,
                 "each row must average its node's inputs; rebuild W with a mixing rule")
    _sums_to_one(w.sum(axis=0), what, "column", atol,
                 "a column that does not sum to 1 moves the average; use a symmetric rule, or "
                 "push-sum for a directed graph")
    if symmetric and np.any(np.abs(w - w.T) > atol):
        i, j = np.argwhere(np.abs(w - w.T) > atol)[0]
        raise TopologyError(f"{what} is not symmetric: W[{i}, {j}] = {float(w[i, j])!r} but W[{j}, {i}] = "
                            f"{float(w[j, i])!r}; use Metropolis-Hastings or max-degree weights, or pass "
                            f"symmetric=False for a directed round")
    off = w.copy()
    np.fill_diagonal(off, 0.0)
    if adjacency is not None:
        a = np.asarray(adjacency, dtype=bool)
        if a.shape != w.shape:
            raise TopologyError(f"{what} is {w.shape} but the graph has shape {a.shape}; build W from this graph")
        stray = (off != 0) & ~a
        if np.any(stray):
            i, j = np.argwhere(stray)[0]
            raise TopologyError(f"{what} gives W[{i}, {j}] = {w[i, j]:.3g}, but {i} does not hear {j} in "
                                f"the graph; a node can only mix its neighbours' models")
    if connected and w.shape[0] > 1 and not is_connected(off != 0):
        raise TopologyError(f"{what} is disconnected (its off-diagonal nonzeros do not link every "
                            f"node): the models never reach consensus; add edges")
    w.setflags(write=False)
    return w


def check_column_stochastic(p: Any, *, atol: float = ATOL) -> np.ndarray:
    """Validate push-sum weights: >= 0 and every column summing to 1; a read-only float64
    copy."""
    p = _square_finite(p, "push-sum matrix")
    _sums_to_one(p.sum(axis=0), "push-sum matrix", "column", atol,
                 "node j must hand out exactly what it holds; use push_sum_weights")
    p.setflags(write=False)
    return p


def second_eigenvalue_modulus(w: Any) -> float:
    """``|lambda_2|``: the largest eigenvalue modulus of W once the consensus eigenvalue 1 is
    removed, i.e. of ``W - J/n`` (W doubly stochastic, so ``J/n`` commutes with W).

    It is the asymptotic factor by which the distance to the average shrinks per round.
    A disconnected graph keeps a second eigenvalue 1. For a non-symmetric W it is the
    asymptotic rate, not a bound on every single round.
    """
    w = _square_finite(w, "mixing matrix")
    for axis, kind in ((1, "row"), (0, "column")):
        _sums_to_one(w.sum(axis=axis), "mixing matrix", kind, 1e-9,
                     "the spectral gap is defined here for doubly stochastic W")
    m = w - 1.0 / w.shape[0]
    sym = np.allclose(m, m.T, rtol=0.0, atol=ATOL)
    ev = np.linalg.eigvalsh((m + m.T) / 2) if sym else np.linalg.eigvals(m)
    return float(min(1.0, np.abs(ev).max()))


def spectral_gap(w: Any) -> float:
    """``1 - |lambda_2|`` of a doubly stochastic W (see :func:`second_eigenvalue_modulus`):
    1 for exact averaging in one round (``J / n``), near 0 for slow mixing (a long ring)."""
    return 1.0 - second_eigenvalue_modulus(w)
