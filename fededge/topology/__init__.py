"""fededge.topology: communication graphs and mixing matrices for gossip.

Pure numpy: never imports Flower (see docs/architecture.md). docs/topology.md lists the
topologies, the mixing rules and their spectral gaps.

- :mod:`~fededge.topology.graph`: the graph families, custom graphs (edge-list file,
  adjacency matrix, networkx), and :class:`TopologyError`.
- :mod:`~fededge.topology.mixing`: Metropolis-Hastings and max-degree weights, the
  one-peer exponential and push-sum weights, the doubly stochastic check, the spectral gap.
- :mod:`~fededge.topology.registry`: :class:`Topology` and :func:`build_topology`.

Examples
--------
>>> from fededge.topology import build_topology
>>> topo = build_topology("ring", 8)
>>> w = topo.mixing(rule="metropolis")      # (8, 8), symmetric, doubly stochastic
>>> print(topo.summary())
ring: n=8, 8 edges, degree 2, metropolis mixing: second eigenvalue modulus 0.8047, spectral gap 0.1953
"""

from fededge.topology.graph import TopologyError
from fededge.topology.mixing import (
    MIXINGS,
    check_mixing,
    max_degree,
    metropolis_hastings,
    mixing_matrix,
    one_peer_exponential_mixing,
    push_sum_weights,
    second_eigenvalue_modulus,
    spectral_gap,
)
from fededge.topology.registry import TOPOLOGIES, Topology, build_topology

__all__ = [
    "MIXINGS",
    "TOPOLOGIES",
    "Topology",
    "TopologyError",
    "build_topology",
    "check_mixing",
    "max_degree",
    "metropolis_hastings",
    "mixing_matrix",
    "one_peer_exponential_mixing",
    "push_sum_weights",
    "second_eigenvalue_modulus",
    "spectral_gap",
]
