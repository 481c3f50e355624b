"""The :class:`Topology` object and :func:`build_topology`: a topology by name.

A :class:`Topology` is a validated graph (static, or time-varying with a period) that
gives the mixing matrix of any round, who hears whom, and the spectral gap to log when a
run starts. It only describes who talks to whom: it places no devices and knows nothing
of links or Flower.

Pure numpy: no Flower.

Examples
--------
>>> from fededge.topology import build_topology
>>> topo = build_topology("torus", 16)
>>> topo.in_neighbours(0)
[1, 3, 4, 12]
>>> topo.summary()
'torus: n=16, 32 edges, degree 4, metropolis mixing: second eigenvalue modulus 0.6000, spectral gap 0.4000'
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from fededge.topology import graph
from fededge.topology.graph import (
    TopologyError,
    check_adjacency,
    check_directed,
    degrees,
)
from fededge.topology.mixing import (
    check_rule,
    in_degree_uniform,
    mixing_matrix,
    second_eigenvalue_modulus,
)

__all__ = ["TOPOLOGIES", "Topology", "build_topology"]

def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=bool)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Topology:
    """Who hears whom: a validated communication graph, static or time-varying.

    Parameters
    ----------
    name : str
        For logs and results (``"ring"``, ``"custom"``, ...).
    adjacency : array_like
        ``(n, n)`` symmetric 0/1 matrix, zero diagonal, connected (checked by
        :func:`fededge.topology.graph.check_adjacency`). For a time-varying topology: the
        union of its rounds, symmetrised.
    rounds : tuple of array_like
        Empty for a static topology. Otherwise the directed graphs of one period
        (``rounds[t][i, j]``: in round t node i hears j); round t uses
        ``rounds[t % len(rounds)]``. Their symmetrised union must equal ``adjacency``.
    params : mapping
        The parameters it was built with (seed, p, k, rows, ...), for the record.

    Examples
    --------
    >>> import numpy as np
    >>> Topology.from_adjacency(np.array([[0, 1], [1, 0]])).mixing().tolist()
    [[0.5, 0.5], [0.5, 0.5]]
    """

    name: str
    adjacency: np.ndarray
    rounds: tuple[np.ndarray, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        adj = _frozen(check_adjacency(self.adjacency, what=f"{self.name} adjacency"))
        rounds = tuple(_frozen(check_directed(r, what=f"{self.name} round {t}", connected=False))
                       for t, r in enumerate(self.rounds))
        for t, r in enumerate(rounds):
            if r.shape != adj.shape:
                raise TopologyError(f"{self.name}: round {t} has shape {r.shape}, the graph {adj.shape}")
        if rounds:
            union = reduce(np.logical_or, rounds)
            if not np.array_equal(union | union.T, adj):
                raise TopologyError(f"{self.name}: the rounds' union is not the adjacency; build the "
                                    f"adjacency as the symmetrised union of the rounds")
        object.__setattr__(self, "adjacency", adj)
        object.__setattr__(self, "rounds", rounds)
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        # Round t's W by (t % period, rule): built and checked once. A relay asks for a
        # node's row about twice per node and round: rebuilt each time, W cost n^3 a round
        # (a ring of 1,000 nodes: 99 s of the relay's CPU per round).
        object.__setattr__(self, "_mixings", {})

    def __reduce__(self) -> tuple[Any, ...]:
        # (params is a read-only view, which pickle and deepcopy cannot copy)
        return (type(self), (self.name, self.adjacency, self.rounds, dict(self.params)))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_adjacency(cls, adjacency: Any, *, name: str = "custom") -> Topology:
        """A static topology from a symmetric 0/1 numpy adjacency matrix."""
        return cls(name=name, adjacency=adjacency)

    @classmethod
    def from_edges(cls, edges: Iterable[tuple[int, int]], n: int, *, name: str = "custom") -> Topology:
        """A static topology of n nodes from undirected ``(u, v)`` pairs."""
        return cls(name=name, adjacency=graph.from_edges(edges, n))

    @classmethod
    def from_edge_file(cls, path: str | Path, n: int, *, name: str = "file") -> Topology:
        """A static topology from a file of ``u v`` lines (see
        :func:`fededge.topology.graph.read_edge_list`)."""
        return cls(name=name, adjacency=graph.read_edge_list(path, n), params={"path": str(path)})

    @classmethod
    def from_networkx(cls, g: Any, *, name: str = "networkx") -> Topology:
        """A static topology from an undirected networkx graph (networkx imported lazily)."""
        return cls(name=name, adjacency=graph.from_networkx(g))

    # ------------------------------------------------------------------ structure
    @property
    def n(self) -> int:
        """Number of nodes."""
        return int(self.adjacency.shape[0])

    @property
    def time_varying(self) -> bool:
        """Whether the graph changes from round to round."""
        return bool(self.rounds)

    @property
    def period(self) -> int:
        """Rounds after which the graphs repeat (1 for a static topology)."""
        return len(self.rounds) or 1

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Undirected edges ``(u, v)``, ``u < v`` (the union over rounds if time-varying)."""
        return graph.edges(self.adjacency)

    def adjacency_at(self, t: int = 0) -> np.ndarray:
        """Round t's graph (``A[i, j]``: i hears j); the adjacency itself when static."""
        return self.rounds[t % len(self.rounds)] if self.rounds else self.adjacency

    def in_neighbours(self, i: int, t: int = 0) -> list[int]:
        """The nodes whose messages node i needs in round t."""
        return np.flatnonzero(self.adjacency_at(t)[i]).tolist()

    def out_neighbours(self, i: int, t: int = 0) -> list[int]:
        """The nodes that need node i's message in round t (where a relay sends it)."""
        return np.flatnonzero(self.adjacency_at(t)[:, i]).tolist()

    def digest(self) -> str:
        """SHA-256 of the graph (its adjacency and rounds, in hex): what a checkpoint
        compares on resume where the settings name only a file."""
        h = hashlib.sha256(f"{self.n} {len(self.rounds)}".encode())
        for a in (self.adjacency, *self.rounds):
            h.update(np.packbits(a).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ mixing and spectrum
    def mixing(self, t: int = 0, *, rule: str = "metropolis") -> np.ndarray:
        """Round t's mixing matrix W (read-only float64, checked doubly stochastic).

        Static: ``rule``'s W (:data:`fededge.topology.mixing.MIXINGS`), the same every
        round, symmetric. Time-varying: :func:`~fededge.topology.mixing.in_degree_uniform`
        of round t's graph, doubly stochastic but not symmetric. In the one-peer
        exponential graph every node has one in- and one out-neighbour per round, where
        both rules give the same 1/2-1/2 weights; ``rule`` is still checked.
        """
        check_rule(rule)
        key = (t % self.period, rule)
        w = self._mixings.get(key)  # type: ignore[attr-defined]
        if w is None:
            w = mixing_matrix(self.adjacency, rule) if not self.rounds else in_degree_uniform(self.adjacency_at(t))
            self._mixings[key] = w  # type: ignore[attr-defined]
        return w

    def period_mixing(self, *, rule: str = "metropolis") -> np.ndarray:
        """The product of one period's W, ``W(period-1) ... W(1) W(0)``: what a period of
        gossip does to the models (W itself when static)."""
        w = self.mixing(0, rule=rule)
        for t in range(1, self.period):
            w = self.mixing(t, rule=rule) @ w
        return w

    def second_eigenvalue_modulus(self, *, rule: str = "metropolis") -> float:
        """|lambda_2| per round: of W when static; of the period's product, to the power
        1/period, when time-varying."""
        return second_eigenvalue_modulus(self.period_mixing(rule=rule)) ** (1.0 / self.period)

    def spectral_gap(self, *, rule: str = "metropolis") -> float:
        """``1 - |lambda_2|`` per round (see :meth:`second_eigenvalue_modulus`)."""
        return 1.0 - self.second_eigenvalue_modulus(rule=rule)

    def summary(self, *, rule: str = "metropolis") -> str:
        """One line for the log at the start of a run: size, degrees, mixing, spectral gap."""
        d = degrees(self.adjacency)
        deg = f"degree {d.min()}" if d.min() == d.max() else f"degree {d.min()}..{d.max()}"
        lam = self.second_eigenvalue_modulus(rule=rule)
        if self.rounds:
            alone = max(second_eigenvalue_modulus(self.mixing(t, rule=rule)) for t in range(self.period))
            shape = (f"time-varying, period {self.period} (union: {len(self.edges)} edges, {deg}), "
                     f"1/2-1/2 weights, per round over a period")
            tail = f" (one round alone: {1.0 - alone:.4f})"
        else:
            shape, tail = f"{len(self.edges)} edges, {deg}, {rule} mixing", ""
        return (f"{self.name}: n={self.n}, {shape}: second eigenvalue modulus {lam:.4f}, "
                f"spectral gap {1.0 - lam:.4f}{tail}")


# ------------------------------------------------------------------ by name
def _one_peer_exponential(n: int) -> Topology:
    rounds = tuple(graph.one_peer_exponential(n, t) for t in range(len(graph.exponential_distances(n))))
    return Topology(name="one-peer-exponential", adjacency=graph.exponential(n), rounds=rounds)


def _file(n: int, *, path: str | Path) -> Topology:
    return Topology.from_edge_file(path, n)


_BUILDERS: dict[str, Callable[..., Any]] = {
    "ring": graph.ring,
    "torus": graph.torus,
    "complete": graph.complete,
    "star": graph.star,
    "hypercube": graph.hypercube,
    "erdos-renyi": graph.erdos_renyi,
    "k-regular": graph.k_regular,
    "exponential": graph.exponential,
    "one-peer-exponential": _one_peer_exponential,
    "file": _file,
}
#: Every name :func:`build_topology` knows.
TOPOLOGIES: tuple[str, ...] = tuple(_BUILDERS)


def build_topology(name: str, n: int, *, seed: int = 0, **params: Any) -> Topology:
    """A topology by name, validated.

    Parameters
    ----------
    name : str
        One of :data:`TOPOLOGIES`.
    n : int
        Number of nodes. Some families need a particular n: torus (rows x cols),
        hypercube (a power of two), k-regular (n * k even, k < n).
    seed : int
        Seed of the random families (``erdos-renyi``, ``k-regular``); the same seed gives
        the same graph. The others ignore it.
    **params
        The family's own: ``torus``: rows, cols; ``erdos-renyi``: p, max_tries;
        ``k-regular``: k, max_tries; ``file``: path (a file of ``u v`` lines).

    Raises
    ------
    TopologyError
        An unknown name (with the closest valid one), a parameter the family does not
        take, or a graph the family cannot form with these values.

    Examples
    --------
    >>> build_topology("erdos-renyi", 16, seed=3, p=0.3).n
    16
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        close = difflib.get_close_matches(str(name), TOPOLOGIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TopologyError(f"unknown topology {name!r}{hint} Valid topologies: {', '.join(TOPOLOGIES)}")
    sig = inspect.signature(builder).parameters
    accepted = [p for p, v in sig.items() if v.kind is v.KEYWORD_ONLY and p != "seed"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = f"takes {', '.join(accepted)}" if accepted else "takes no parameters"
        raise TopologyError(f"topology {name!r} {takes}; got {', '.join(unknown)}")
    missing = [p for p in accepted if sig[p].default is inspect.Parameter.empty and p not in params]
    if missing:
        raise TopologyError(f"topology {name!r} needs {', '.join(missing)} (for 'file': path='edges.txt')")
    if "seed" in sig:
        params = {**params, "seed": seed}
    built = builder(n, **params)
    if isinstance(built, Topology):
        return built
    return Topology(name=name, adjacency=built, params=params)
