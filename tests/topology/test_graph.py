"""Properties of fededge.topology.graph: each family's shape, seeded reproducibility, custom
graphs, and the named error for every invalid graph."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fededge.topology.graph import (
    TopologyError,
    check_adjacency,
    check_directed,
    complete,
    degrees,
    edges,
    erdos_renyi,
    exponential,
    exponential_distances,
    from_edges,
    from_networkx,
    hypercube,
    is_connected,
    k_regular,
    one_peer_exponential,
    read_edge_list,
    ring,
    star,
    torus,
    torus_shape,
)


def test_ring_complete_and_star_have_their_degrees():
    assert degrees(ring(7)).tolist() == [2] * 7
    assert edges(ring(2)) == [(0, 1)]
    assert degrees(complete(5)).tolist() == [4] * 5
    assert degrees(star(6)).tolist() == [5, 1, 1, 1, 1, 1]
    assert edges(star(3)) == [(0, 1), (0, 2)]


@pytest.mark.parametrize(("n", "shape"), [(16, (4, 4)), (8, (2, 4)), (33, (3, 11)), (12, (3, 4)), (4, (2, 2))])
def test_torus_is_near_square_and_wraps(n, shape):
    assert torus_shape(n) == shape
    rows, cols = shape
    a = torus(n)
    # node r * cols + c hears its four grid neighbours, with wrap-around
    for i in range(n):
        r, c = divmod(i, cols)
        want = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
        assert set(np.flatnonzero(a[i])) == want - {i}
    if min(shape) >= 3:
        assert degrees(a).tolist() == [4] * n


def test_torus_shape_from_one_side_or_both():
    assert torus_shape(12, rows=2) == (2, 6)
    assert torus_shape(12, cols=2) == (6, 2)
    assert torus_shape(12, rows=4, cols=3) == (4, 3)
    for bad in ({"rows": 5}, {"rows": 3, "cols": 3}, {"rows": 1}, {"cols": 12}):
        with pytest.raises(TopologyError, match="rows \\* cols = n"):
            torus_shape(12, **bad)


@pytest.mark.parametrize("n", [2, 3, 7, 13, 31])
def test_torus_refuses_an_n_without_two_factors(n):
    with pytest.raises(TopologyError, match=f"n={n} cannot form a 2-D torus.*'ring'"):
        torus(n)


def test_hypercube_neighbours_differ_in_one_bit():
    a = hypercube(16)
    for i, j in edges(a):
        assert (i ^ j).bit_count() == 1
    assert degrees(a).tolist() == [4] * 16
    with pytest.raises(TopologyError, match="n=12 is not a power of two; use n=8 or n=16"):
        hypercube(12)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16, 33])
def test_exponential_graph_joins_powers_of_two(n):
    assert exponential_distances(n) == [2**k for k in range(n) if 2**k < n]
    a = exponential(n)
    want = {(i, (i + s * d) % n) for i in range(n) for d in exponential_distances(n) for s in (1, -1)}
    assert {(int(i), int(j)) for i, j in zip(*np.nonzero(a))} == {(i, j) for i, j in want if i != j}


@pytest.mark.parametrize("n", [2, 3, 8, 12, 16])
def test_one_peer_rounds_are_permutations_cycling_through_the_distances(n):
    dist = exponential_distances(n)
    union = np.zeros((n, n), dtype=bool)
    for t in range(2 * len(dist)):
        a = one_peer_exponential(n, t)
        assert a.sum(axis=0).tolist() == [1] * n and a.sum(axis=1).tolist() == [1] * n
        d = dist[t % len(dist)]
        for i in range(n):  # node i sends to i + 2^(t mod tau): that node hears i
            assert a[(i + d) % n, i]
        union |= a
    assert np.array_equal(union | union.T, exponential(n))


def test_one_peer_refuses_a_negative_round():
    with pytest.raises(TopologyError, match="round t must be an integer >= 0"):
        one_peer_exponential(8, -1)


# ------------------------------------------------------------------ random families
def test_erdos_renyi_is_reproducible_connected_and_seed_dependent():
    a = erdos_renyi(30, p=0.2, seed=7)
    assert np.array_equal(a, erdos_renyi(30, p=0.2, seed=7))
    assert is_connected(a) and np.array_equal(a, a.T) and not a.diagonal().any()
    assert len({erdos_renyi(30, p=0.2, seed=s).tobytes() for s in range(5)}) == 5


def test_erdos_renyi_gives_up_naming_p_and_n():
    with pytest.raises(TopologyError, match="no connected graph in 3 draws with p=0.01 and n=40"):
        erdos_renyi(40, p=0.01, seed=0, max_tries=3)
    with pytest.raises(TopologyError, match="p must be in"):
        erdos_renyi(10, p=0.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(3, 40), k=st.integers(2, 8), seed=st.integers(0, 2**31))
def test_k_regular_is_regular_connected_and_reproducible(n, k, seed):
    if k >= n or (n * k) % 2:
        with pytest.raises(TopologyError, match="k < n|must be even"):
            k_regular(n, k=k, seed=seed)
        return
    a = k_regular(n, k=k, seed=seed)
    assert degrees(a).tolist() == [k] * n
    assert is_connected(a) and np.array_equal(a, a.T) and not a.diagonal().any()
    assert np.array_equal(a, k_regular(n, k=k, seed=seed))


def test_k_regular_is_random_not_the_circulant_start():
    draws = {k_regular(20, k=4, seed=s).tobytes() for s in range(6)}
    assert len(draws) == 6


def test_k_regular_refuses_impossible_degrees():
    with pytest.raises(TopologyError, match="n \\* k must be even"):
        k_regular(9, k=3)
    with pytest.raises(TopologyError, match="1 <= k < n"):
        k_regular(4, k=4)
    with pytest.raises(TopologyError, match="perfect matching"):
        k_regular(6, k=1)
    assert edges(k_regular(2, k=1)) == [(0, 1)]


# ------------------------------------------------------------------ custom graphs
def test_edge_list_file_with_comments_blank_lines_and_both_directions(tmp_path):
    path = tmp_path / "edges.txt"
    path.write_text("# a square with a diagonal\n0 1\n1 2   # inline comment\n\n2 3\n3 0\n2 0\n0 2\n")
    a = read_edge_list(path, 4)
    assert edges(a) == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]


@pytest.mark.parametrize(("text", "match"), [
    ("0 1\n1 x\n", r"edges.txt:2: expected 'u v'"),
    ("0 1 2\n", r"edges.txt:1: expected 'u v'"),
    ("0 1\n1 4\n", "names node 4, outside 0..3"),
    ("0 1\n1 1\n", "self-loop"),
    ("0 1\n1 2\n", "node 3 of the edge list edges.txt has no neighbours"),
    ("0 1\n2 3\n", "disconnected"),
])
def test_bad_edge_list_files_name_the_problem(tmp_path, text, match):
    path = tmp_path / "edges.txt"
    path.write_text(text)
    with pytest.raises(TopologyError, match=match):
        read_edge_list(path, 4)


def test_missing_edge_list_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read the edge-list file"):
        read_edge_list(tmp_path / "nope.txt", 4)


def test_networkx_graph_is_read_in_label_order():
    nx = pytest.importorskip("networkx")
    g = nx.petersen_graph()
    assert np.array_equal(from_networkx(g), nx.to_numpy_array(g, nodelist=range(10)) > 0)
    labelled = nx.relabel_nodes(nx.path_graph(3), {0: "a", 1: "b", 2: "c"})
    assert edges(from_networkx(labelled)) == [(0, 1), (1, 2)]
    with pytest.raises(TopologyError, match="directed"):
        from_networkx(nx.DiGraph([(0, 1), (1, 0)]))
    loop = nx.cycle_graph(4)
    loop.add_edge(2, 2)
    with pytest.raises(TopologyError, match="self-loop at node 2"):
        from_networkx(loop)
    with pytest.raises(TopologyError, match="disconnected"):
        from_networkx(nx.Graph([(0, 1), (2, 3)]))


def test_networkx_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)  # makes `import networkx` fail
    with pytest.raises(ImportError, match="pip install networkx"):
        from_networkx(object())


# ------------------------------------------------------------------ invalid graphs
TWO_TRIANGLES = np.kron(np.eye(2, dtype=int), np.ones((3, 3), dtype=int) - np.eye(3, dtype=int))


@pytest.mark.parametrize(("adj", "match"), [
    (TWO_TRIANGLES, r"disconnected: node\(s\) \[3, 4, 5\] cannot be reached from node 0"),
    (np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]]), "node 2 of the adjacency matrix has no neighbours"),
    (np.array([[0, -1], [-1, 0]]), r"negative weight -1 at \(0, 1\)"),
    (np.array([[0, 0.5], [0.5, 0]]), r"entry 0.5 at \(0, 1\).*check_mixing"),
    (np.array([[0, 1, 1], [1, 0, 1], [0, 1, 0]]), r"not symmetric: \(0, 2\).*push_sum_weights"),
    (np.array([[1, 1], [1, 0]]), "self-loop at node 0"),
    (np.ones((2, 3)), "square"),
    (np.zeros((1, 1)), "gossip needs n >= 2"),
    (np.array([[0, np.nan], [np.nan, 0]]), "non-finite"),
])
def test_invalid_adjacency_fails_with_the_named_error(adj, match):
    with pytest.raises(TopologyError, match=match):
        check_adjacency(adj)


def test_topology_error_is_a_value_error():
    assert issubclass(TopologyError, ValueError)


@pytest.mark.parametrize("family", [ring, complete, star, hypercube, exponential, torus])
@pytest.mark.parametrize("n", [1, 0, 2.5, "8", True])
def test_families_refuse_a_bad_node_count(family, n):
    with pytest.raises(TopologyError, match="n must be"):
        family(n)


def test_from_edges_checks_unless_told_not_to():
    with pytest.raises(TopologyError, match="disconnected"):
        from_edges([(0, 1), (2, 3)], 4)
    assert not is_connected(from_edges([(0, 1), (2, 3)], 4, check=False))


def test_directed_checks():
    ring_dir = np.roll(np.eye(5, dtype=bool), 1, axis=1)  # i hears i + 1
    assert check_directed(ring_dir).sum() == 5
    one_way = np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]])
    with pytest.raises(TopologyError, match="node 2 .* hears no one"):
        check_directed(one_way)
    never_heard = np.array([[0, 1, 0], [1, 0, 0], [1, 0, 0]])
    with pytest.raises(TopologyError, match="node 2 .* heard by no one"):
        check_directed(never_heard)
    two_cycles = np.kron(np.eye(2, dtype=bool), np.roll(np.eye(2, dtype=bool), 1, axis=1))
    with pytest.raises(TopologyError, match="not strongly connected"):
        check_directed(two_cycles)
    assert check_directed(two_cycles, connected=False).shape == (4, 4)


def test_bad_graphs_are_named_for_what_is_wrong():
    """A graph where node 0 reaches everyone but not everyone reaches node 0 was reported
    as "never reaches node(s) []"; a (0, 0) matrix as "must be square"; a float or bool
    node in an edge list raised numpy's IndexError or set a whole row."""
    from fededge.topology.graph import check_directed, from_edges

    a = np.zeros((4, 4), dtype=bool)
    for hears, speaks in ((1, 0), (0, 1), (2, 1), (3, 2), (2, 3)):  # 0 -> 1 -> 2 <-> 3, 1 -> 0
        a[hears, speaks] = True
    with pytest.raises(TopologyError, match=r"node\(s\) \[2, 3\] never reach node 0"):
        check_directed(a)
    with pytest.raises(TopologyError, match="has no nodes"):
        check_directed(np.zeros((0, 0), dtype=bool))
    for bad in ((0, 1.5), (True, 2)):
        with pytest.raises(TopologyError, match="not an integer"):
            from_edges([(0, 1), bad], 3)
    assert from_edges([(np.int64(0), 1), (1, 2)], 3).sum() == 4
