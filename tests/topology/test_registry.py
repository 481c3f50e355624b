"""build_topology and Topology: names, parameters, seeded reproducibility, time-varying
rounds, neighbours, immutability and the start-of-run summary."""

from __future__ import annotations

import numpy as np
import pytest

from fededge.topology import TOPOLOGIES, Topology, TopologyError, build_topology
from fededge.topology.graph import exponential, one_peer_exponential, ring


def test_names_are_the_issues_list():
    assert TOPOLOGIES == ("ring", "torus", "complete", "star", "hypercube", "erdos-renyi", "k-regular",
                          "exponential", "one-peer-exponential", "file")


@pytest.mark.parametrize(("name", "match"), [
    ("rnig", "unknown topology 'rnig'; did you mean 'ring'\\? Valid topologies: ring, torus, "),
    ("erdos_renyi", "did you mean 'erdos-renyi'"),
    ("mesh", "unknown topology 'mesh' Valid topologies: .*one-peer-exponential, file"),
])
def test_unknown_name_lists_the_valid_ones(name, match):
    with pytest.raises(TopologyError, match=match):
        build_topology(name, 8)


def test_parameters_are_checked_per_family():
    with pytest.raises(TopologyError, match="topology 'ring' takes no parameters; got p"):
        build_topology("ring", 8, p=0.5)
    with pytest.raises(TopologyError, match="topology 'torus' takes rows, cols; got k"):
        build_topology("torus", 8, k=3)
    with pytest.raises(TopologyError, match="topology 'file' needs path"):
        build_topology("file", 8)
    assert build_topology("torus", 12, rows=2).params == {"rows": 2}
    assert build_topology("k-regular", 10, seed=3, k=3).params == {"k": 3, "seed": 3}


@pytest.mark.parametrize(("name", "params"), [("erdos-renyi", {"p": 0.3}), ("k-regular", {"k": 3})])
def test_seeded_random_graphs_are_reproducible(name, params):
    a = build_topology(name, 20, seed=11, **params)
    b = build_topology(name, 20, seed=11, **params)
    assert np.array_equal(a.adjacency, b.adjacency)
    assert not np.array_equal(a.adjacency, build_topology(name, 20, seed=12, **params).adjacency)


def test_file_topology_and_its_node_count(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("0 1\n1 2\n2 3\n3 0\n")
    topo = build_topology("file", 4, path=str(path))
    assert topo.name == "file" and topo.edges == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert topo.params["path"] == str(path)
    with pytest.raises(TopologyError, match="node 4 of the edge list g.txt has no neighbours"):
        build_topology("file", 5, path=str(path))
    with pytest.raises(TopologyError, match="names node 3, outside 0..2"):
        build_topology("file", 3, path=str(path))


def test_static_topology_structure():
    topo = build_topology("torus", 16)
    assert (topo.n, topo.period, topo.time_varying) == (16, 1, False)
    assert topo.in_neighbours(5) == topo.out_neighbours(5) == [1, 4, 6, 9]
    assert np.array_equal(topo.mixing(0), topo.mixing(7))
    assert np.array_equal(topo.period_mixing(), topo.mixing())


@pytest.mark.parametrize("n", [8, 12])
def test_one_peer_topology_cycles_its_rounds(n):
    topo = build_topology("one-peer-exponential", n)
    tau = (n - 1).bit_length()
    assert topo.time_varying and topo.period == tau
    assert np.array_equal(topo.adjacency, exponential(n))
    for t in range(2 * tau):
        d = 1 << (t % tau)
        assert np.array_equal(topo.adjacency_at(t), one_peer_exponential(n, t))
        assert all(topo.out_neighbours(i, t) == [(i + d) % n] for i in range(n))
        assert all(topo.in_neighbours(i, t) == [(i - d) % n] for i in range(n))
        np.testing.assert_array_equal(topo.mixing(t, rule="metropolis"), topo.mixing(t, rule="max-degree"))


def test_one_peer_period_product_is_the_average_for_a_power_of_two():
    topo = build_topology("one-peer-exponential", 16)
    assert np.array_equal(topo.period_mixing(), np.full((16, 16), 1 / 16))
    assert topo.spectral_gap() == pytest.approx(1.0)


def test_summary_names_size_rule_and_gap():
    assert build_topology("ring", 16).summary(rule="max-degree") == (
        "ring: n=16, 16 edges, degree 2, max-degree mixing: second eigenvalue modulus 0.9493, "
        "spectral gap 0.0507")
    assert "degree 1..7" in build_topology("star", 8).summary()
    line = build_topology("one-peer-exponential", 16).summary()
    assert "time-varying, period 4" in line and "spectral gap 1.0000 (one round alone: 0.0000)" in line
    with pytest.raises(TopologyError, match="unknown mixing rule"):
        build_topology("one-peer-exponential", 16).mixing(0, rule="uniform")


def test_topology_is_immutable_and_does_not_freeze_its_input():
    adj = ring(5)
    topo = Topology.from_adjacency(adj)
    adj[0, 1] = False  # the caller's array stays writable and the topology unchanged
    assert topo.adjacency[0, 1]
    with pytest.raises(ValueError, match="read-only"):
        topo.adjacency[0, 1] = False
    with pytest.raises(AttributeError):
        topo.name = "other"
    with pytest.raises(TypeError):
        topo.params["x"] = 1


def test_constructors_validate():
    with pytest.raises(TopologyError, match="custom adjacency is disconnected"):
        Topology.from_adjacency(np.kron(np.eye(2), 1 - np.eye(2)))
    assert Topology.from_edges([(0, 1), (1, 2)], 3).edges == [(0, 1), (1, 2)]
    bad_rounds = (one_peer_exponential(8, 0),)
    with pytest.raises(TopologyError, match="rounds' union is not the adjacency"):
        Topology(name="x", adjacency=exponential(8), rounds=bad_rounds)


def test_from_networkx():
    nx = pytest.importorskip("networkx")
    topo = Topology.from_networkx(nx.cycle_graph(6))
    assert np.array_equal(topo.adjacency, ring(6)) and topo.name == "networkx"


def test_a_topology_pickles_and_copies_and_builds_its_mixing_once():
    """params is a read-only view, which pickle and deepcopy could not copy; mixing() was
    rebuilt and re-checked on every call (a relay asks ~2n times a round: n^3 a round)."""
    import copy
    import pickle

    from fededge.topology import mixing as mixing_module

    topo = build_topology("erdos-renyi", 12, seed=3, p=0.5)
    for twin in (copy.deepcopy(topo), pickle.loads(pickle.dumps(topo))):
        assert twin.name == topo.name and dict(twin.params) == dict(topo.params)
        assert np.array_equal(twin.adjacency, topo.adjacency) and twin.digest() == topo.digest()
        assert np.array_equal(twin.mixing(0), topo.mixing(0))
    calls = []
    real = mixing_module.metropolis_hastings
    mixing_module.metropolis_hastings = lambda a: calls.append(1) or real(a)
    try:
        fresh = build_topology("ring", 6)
        w = [fresh.mixing(t) for t in range(5)]
    finally:
        mixing_module.metropolis_hastings = real
    assert len(calls) == 1 and all(x is w[0] for x in w) and not w[0].flags.writeable
    assert build_topology("ring", 6).digest() != build_topology("torus", 6).digest()
