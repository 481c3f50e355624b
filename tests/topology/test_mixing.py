"""Properties of the mixing matrices: doubly stochastic for every built-in topology, the
rules' formulas by hand, spectral gaps against closed forms, exact one-peer averaging, and
the named error for every invalid W."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fededge.topology import TOPOLOGIES, TopologyError, build_topology
from fededge.topology.graph import complete, hypercube, one_peer_exponential, ring
from fededge.topology.mixing import (
    ATOL,
    MIXINGS,
    check_column_stochastic,
    check_mixing,
    in_degree_uniform,
    max_degree,
    metropolis_hastings,
    mixing_matrix,
    one_peer_exponential_mixing,
    push_sum_weights,
    second_eigenvalue_modulus,
    spectral_gap,
)

BUILT_IN = [t for t in TOPOLOGIES if t != "file"]
#: The (topology, n) pairs of {2, 3, 8, 16, 33} a family cannot form (default parameters).
CANNOT_FORM = {
    ("torus", 2), ("torus", 3), ("hypercube", 3), ("hypercube", 33),
    ("k-regular", 2), ("k-regular", 3),  # default k = 4 needs n > 4
}


def assert_doubly_stochastic(w: np.ndarray, *, symmetric: bool) -> None:
    assert np.all(w >= 0)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=ATOL)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=ATOL)
    if symmetric:
        np.testing.assert_allclose(w, w.T, rtol=0, atol=ATOL)


@pytest.mark.parametrize("rule", MIXINGS)
@pytest.mark.parametrize("n", [2, 3, 8, 16, 33])
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_topology_mixes_doubly_stochastic(name, n, rule):
    if (name, n) in CANNOT_FORM:
        with pytest.raises(TopologyError, match=name):
            build_topology(name, n, seed=1)
        return
    topo = build_topology(name, n, seed=1)
    for t in range(topo.period):
        w = topo.mixing(t, rule=rule)
        assert_doubly_stochastic(w, symmetric=not topo.time_varying)
        off = ~np.eye(n, dtype=bool)
        assert not np.any((w != 0) & off & ~topo.adjacency_at(t)), "weight on a non-edge"
        assert np.all(w.diagonal() > 0)
    assert 0.0 < topo.spectral_gap(rule=rule) <= 1.0


STATIC = [t for t in BUILT_IN if t not in ("one-peer-exponential", "complete")]


@pytest.mark.parametrize("rule", MIXINGS)
@pytest.mark.parametrize("n", [16, 33])
@pytest.mark.parametrize("name", STATIC)
def test_average_consensus_decays_at_the_spectral_gap_rate(name, n, rule):
    if (name, n) in CANNOT_FORM:
        pytest.skip("the family cannot form this n (tested above)")
    topo = build_topology(name, n, seed=1)
    w, lam = topo.mixing(rule=rule), topo.second_eigenvalue_modulus(rule=rule)
    x = np.random.default_rng(n).standard_normal((n, 3))  # random vectors, no training
    mean = x.mean(axis=0)
    err = [np.sum((x - mean) ** 2)]
    while err[-1] > 1e-22 * err[0] and len(err) < 3000:
        x = w @ x
        err.append(np.sum((x - mean) ** 2))
    # squared error ~ C |lambda_2|^(2t): fit the slope of its log over the late rounds
    tail = np.log(err[len(err) // 2:])
    slope = np.polyfit(np.arange(tail.size), tail, 1)[0]
    assert np.exp(slope / 2) == pytest.approx(lam, abs=0.01)
    np.testing.assert_allclose(x.mean(axis=0), mean, rtol=0, atol=1e-12)


def test_rules_by_hand_on_a_triangle_with_a_tail():
    # triangle 0-1-2 and the edge 2-3: degrees 2, 2, 3, 1
    adj = np.array([[0, 1, 1, 0], [1, 0, 1, 0], [1, 1, 0, 1], [0, 0, 1, 0]])
    third, quarter = 1 / 3, 1 / 4
    mh = [[1 - third - quarter, third, quarter, 0],
          [third, 1 - third - quarter, quarter, 0],
          [quarter, quarter, quarter, quarter],
          [0, 0, quarter, 1 - quarter]]
    np.testing.assert_allclose(metropolis_hastings(adj), mh, rtol=0, atol=1e-15)
    md = [[0.5, quarter, quarter, 0], [quarter, 0.5, quarter, 0],
          [quarter, quarter, quarter, quarter], [0, 0, quarter, 0.75]]
    np.testing.assert_allclose(max_degree(adj), md, rtol=0, atol=1e-15)
    assert np.array_equal(mixing_matrix(adj, "max-degree"), max_degree(adj))


@pytest.mark.parametrize("rule", MIXINGS)
@pytest.mark.parametrize("n", [2, 3, 16, 33])
def test_complete_graph_weights_are_the_average(n, rule):
    w = mixing_matrix(complete(n), rule)
    np.testing.assert_allclose(w, np.full((n, n), 1 / n), rtol=0, atol=1e-15)
    assert spectral_gap(w) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [3, 4, 5, 16, 33, 64])
def test_ring_gap_matches_its_closed_form(n):
    # Metropolis-Hastings on a ring is circulant: eigenvalues 1/3 + 2/3 cos(2 pi k / n)
    lam = [abs(1 / 3 + 2 / 3 * np.cos(2 * np.pi * k / n)) for k in range(1, n)]
    assert second_eigenvalue_modulus(metropolis_hastings(ring(n))) == pytest.approx(max(lam), abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_hypercube_gap_matches_its_closed_form(n):
    d = n.bit_length() - 1  # W = (I + A) / (d + 1); A has eigenvalues d - 2m
    want = max(abs(1 + d - 2 * m) / (d + 1) for m in range(1, d + 1))
    assert second_eigenvalue_modulus(metropolis_hastings(hypercube(n))) == pytest.approx(want, abs=1e-12)


def test_disconnected_w_has_no_gap():
    block = np.kron(np.eye(2), np.full((2, 2), 0.5))
    assert spectral_gap(block) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_one_peer_exponential_averages_exactly_over_any_log2n_rounds(n):
    tau = n.bit_length() - 1
    avg = np.full((n, n), 1 / n)
    for start in range(tau):  # any tau consecutive rounds: the rounds' matrices commute
        prod = np.eye(n)
        for t in range(start, start + tau):
            w = one_peer_exponential_mixing(n, t)
            assert_doubly_stochastic(w, symmetric=False)
            prod = w @ prod
        assert np.array_equal(prod, avg), "entries are dyadic: the product is exactly 1/n"
    if n > 2:  # fewer rounds are not enough
        prod = np.eye(n)
        for t in range(tau - 1):
            prod = one_peer_exponential_mixing(n, t) @ prod
        assert not np.allclose(prod, avg)


def test_one_peer_exact_average_in_rational_arithmetic():
    n, tau = 8, 3
    x = [Fraction(v) for v in (5, -3, 7, 1, 0, 2, 9, -4)]
    for t in range(tau):  # node i takes the mean of itself and node i - 2^t
        d = 1 << t
        x = [(x[i] + x[(i - d) % n]) / 2 for i in range(n)]
    assert x == [Fraction(17, 8)] * n


@pytest.mark.parametrize("n", [3, 5, 12])
def test_one_peer_without_a_power_of_two_still_contracts(n):
    topo = build_topology("one-peer-exponential", n)
    assert 0.0 < topo.spectral_gap() < 1.0


def test_in_degree_uniform_refuses_an_irregular_directed_graph():
    # 0 hears 1 and 2, 1 hears 0, 2 hears 1: column 1 gets 1/3 + 1/2 + 1/2
    adj = np.array([[0, 1, 1], [1, 0, 0], [0, 1, 0]])
    with pytest.raises(TopologyError, match="column 1 sums to .*push-sum"):
        in_degree_uniform(adj)


def test_push_sum_weights_are_column_stochastic_only():
    adj = np.array([[0, 1, 1], [1, 0, 0], [0, 1, 0]])
    p = push_sum_weights(adj)
    np.testing.assert_allclose(p.sum(axis=0), 1.0, rtol=0, atol=ATOL)
    assert not np.allclose(p.sum(axis=1), 1.0)
    assert p[0, 1] == pytest.approx(1 / 3) and p[2, 1] == pytest.approx(1 / 3)
    with pytest.raises(TopologyError, match="column 0 sums to"):
        check_column_stochastic(np.array([[0.5, 0.5], [0.0, 0.5]]))


# ------------------------------------------------------------------ invalid mixing matrices
@pytest.mark.parametrize(("w", "kwargs", "match"), [
    (np.array([[1.5, -0.5], [-0.5, 1.5]]), {}, r"negative weight -0.5 at \(0, 1\)"),
    (np.array([[0.5, 0.4], [0.4, 0.5]]), {}, "row 0 sums to 0.9"),
    (np.array([[0.5, 0.5], [0.2, 0.8]]), {}, "column 0 sums to 0.7.*push-sum"),
    (np.array([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5], [0.25, 0.25, 0.5]]), {}, r"not symmetric: W\[0, 1\]"),
    (np.full((3, 3), 1 / 3), {"adjacency": ring(3) & ~np.eye(3, dtype=bool) & np.array(
        [[1, 1, 0], [1, 1, 1], [0, 1, 1]], dtype=bool)}, r"W\[0, 2\].*0 does not hear 2"),
    (np.kron(np.eye(2), np.full((2, 2), 0.5)), {}, "disconnected"),
    (np.eye(3)[:2], {}, "square"),
    (np.array([[np.inf, 0], [0, 1]]), {}, "non-finite"),
])
def test_invalid_mixing_matrices_fail_with_the_named_error(w, kwargs, match):
    with pytest.raises(TopologyError, match=match):
        check_mixing(w, **kwargs)


def test_check_mixing_tolerance_is_1e_12():
    w = metropolis_hastings(ring(6)).copy()
    w[0, 0] += 1e-13
    check_mixing(w, symmetric=False)
    w[0, 0] += 1e-11
    with pytest.raises(TopologyError, match="row 0 sums to"):
        check_mixing(w)


def test_checked_matrices_are_read_only():
    w = metropolis_hastings(ring(4))
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1.0


def test_unknown_rule_suggests_the_closest():
    with pytest.raises(TopologyError, match="unknown mixing rule 'metropolis-hastings'; did you mean 'metropolis'"):
        mixing_matrix(ring(4), "metropolis-hastings")


def test_one_peer_round_is_not_connected_alone_but_is_allowed():
    w = one_peer_exponential_mixing(16, 3)  # distance 8 = n/2: a perfect matching, symmetric
    assert np.array_equal(w, w.T)
    assert np.array_equal(w != 0, one_peer_exponential(16, 3) | np.eye(16, dtype=bool))
