"""Gossip arithmetic against its defining properties: consensus at the spectral gap's
rate, exact averaging (complete graph, one-peer exponential), CHOCO with the identity
compressor equal to D-PSGD, CHOCO's preserved average and per-node form, push-sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fededge.algorithms.dga import average
from fededge.algorithms.gossip import (
    ChocoConfig,
    ChocoNode,
    GossipError,
    choco_step,
    codec_compressor,
    consensus_distance,
    identity,
    mean_model,
    mix,
    mix_row,
    mixing_row,
    push_sum_estimates,
    push_sum_step,
)
from fededge.compress import build_codec
from fededge.topology import build_topology, push_sum_weights
from fededge.topology.mixing import one_peer_exponential_mixing


def _models(n: int, seed: int = 0, *, dtype=torch.float64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(4, 3, generator=g, dtype=dtype), "b": torch.randn(5, generator=g, dtype=dtype)}
            for _ in range(n)]


def _close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], **tol)


# ------------------------------------------------------------------ D-PSGD mixing
@pytest.mark.parametrize("name", ["ring", "star", "erdos-renyi", "exponential"])
def test_mix_is_the_matrix_product_and_keeps_the_average(name):
    # the consensus rate against the spectral gap is tested on W itself in
    # tests/topology/test_mixing.py; here mix must be exactly that product
    n = 9
    w = build_topology(name, n, seed=2).mixing()
    xs = _models(n, seed=4)
    ref = np.stack([x["w"].numpy().ravel() for x in xs])
    start = consensus_distance(xs)
    for _ in range(20):
        xs, ref = mix(xs, w), w @ ref
    np.testing.assert_allclose(np.stack([x["w"].numpy().ravel() for x in xs]), ref, rtol=1e-13, atol=1e-13)
    _close(mean_model(xs), mean_model(_models(n, seed=4)), rtol=0, atol=1e-13)
    assert consensus_distance(xs) < 0.5 * start


@pytest.mark.parametrize("n", [2, 3, 5, 16])
def test_complete_graph_averages_in_one_step_like_fedavg(n):
    xs = _models(n, seed=3)
    mixed = mix(xs, build_topology("complete", n).mixing())
    fedavg = average(xs, [1.0] * n)
    for x in mixed:
        if n in (2, 16):  # 1/n is exact in binary: the same sum, bit for bit
            assert all(torch.equal(x[k], fedavg[k]) for k in x)
        _close(x, fedavg, rtol=1e-15, atol=1e-15)
    assert consensus_distance(mixed) < 1e-28


@settings(max_examples=25, deadline=None, derandomize=True)
@given(log2n=st.integers(1, 6), start=st.integers(0, 50), seed=st.integers(0, 2**31))
def test_one_peer_exponential_gossip_reaches_the_exact_average(log2n, start, seed):
    n = 1 << log2n
    xs = _models(n, seed=seed)
    want = mean_model(xs)
    for t in range(start, start + log2n):
        assert consensus_distance(xs) > 1e-6, "not averaged before the last round"
        xs = mix(xs, one_peer_exponential_mixing(n, t))
    for x in xs:
        _close(x, want, rtol=0, atol=1e-13)


def test_mix_row_is_one_nodes_share_of_mix():
    topo = build_topology("ring", 6)
    w = topo.mixing()
    xs = _models(6)
    row = mixing_row(w, 2)
    assert sorted(row) == [1, 2, 3]
    got = mix_row({j: xs[j] for j in row}, row, own=2)
    assert all(torch.equal(got[k], mix(xs, w)[2][k]) for k in got)
    with pytest.raises(GossipError, match="node 2 weights node\\(s\\) \\[3\\] but has no model"):
        mix_row({1: xs[1], 2: xs[2]}, row, own=2)


def test_integer_buffers_stay_each_nodes_own():
    xs = _models(3)
    for i, x in enumerate(xs):
        x["bn.num_batches_tracked"] = torch.tensor(10 * i)
    mixed = mix(xs, build_topology("complete", 3).mixing())
    assert [int(x["bn.num_batches_tracked"]) for x in mixed] == [0, 10, 20]
    assert consensus_distance(mixed) < 1e-28


def test_consensus_distance_matches_numpy():
    xs = _models(5, seed=9)
    flat = np.stack([np.concatenate([x["w"].numpy().ravel(), x["b"].numpy().ravel()]) for x in xs])
    want = np.mean(np.sum((flat - flat.mean(axis=0)) ** 2, axis=1))
    assert consensus_distance(xs) == pytest.approx(want, rel=1e-13)


def test_mix_input_errors():
    xs = _models(3)
    with pytest.raises(GossipError, match="shape \\(4, 4\\) but there are 3 models"):
        mix(xs, np.eye(4))
    xs[1] = {"w": xs[1]["w"]}
    with pytest.raises(GossipError, match="model 1 has different tensors"):
        mix(xs, np.full((3, 3), 1 / 3))


# ------------------------------------------------------------------ CHOCO-SGD
def _local_step(x: dict, target: dict, lr: float) -> dict:
    """Deterministic local 'training': a gradient step on 1/2 ||x - target||^2."""
    return {k: v - lr * (v - target[k]) for k, v in x.items()}


@pytest.mark.parametrize("name", ["ring", "torus", "exponential", "erdos-renyi"])
def test_choco_with_the_identity_compressor_is_dpsgd(name):
    n = 12
    w = build_topology(name, n, seed=2).mixing()
    targets = _models(n, seed=100)  # non-IID: each node pulls towards its own target
    dpsgd = choco = _models(n, seed=1)
    hats = [{k: torch.zeros_like(v) for k, v in x.items()} for x in choco]
    for _ in range(30):
        dpsgd = mix([_local_step(x, t, 0.1) for x, t in zip(dpsgd, targets)], w)
        choco, hats = choco_step([_local_step(x, t, 0.1) for x, t in zip(choco, targets)], hats, w,
                                 gamma=1.0, compressor=identity)
        for a, b in zip(choco, dpsgd):
            _close(a, b, rtol=1e-12, atol=1e-12)
    assert consensus_distance(dpsgd) > 1e-3, "the non-IID targets keep the nodes apart"


def _topk(ratio: float):
    """Top-k in plain torch: the codec's arithmetic without its wire format (fast)."""
    def q(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        keep = flat.abs().topk(max(1, int(np.ceil(ratio * flat.numel())))).indices
        out = torch.zeros_like(flat)
        out[keep] = flat[keep]
        return out.reshape(x.shape)
    return q


@pytest.mark.parametrize(("name", "gamma", "bound"), [
    ("ring", 0.4, 1e-3), ("torus", 0.2, 1e-12), ("exponential", 0.2, 1e-12)])
def test_choco_with_top_k_keeps_the_average_and_reaches_consensus(name, gamma, bound):
    n = 16
    w = build_topology(name, n).mixing()
    g = torch.Generator().manual_seed(5)
    xs = [{"w": torch.randn(20, generator=g, dtype=torch.float64)} for _ in range(n)]
    start_mean, start_dist = mean_model(xs), consensus_distance(xs)
    hats = [{"w": torch.zeros(20, dtype=torch.float64)} for _ in xs]
    q = _topk(0.2)
    assert torch.count_nonzero(q(xs[0]["w"])) == 4, "each message carries 4 of the 20 values"
    for _ in range(200):
        xs, hats = choco_step(xs, hats, w, gamma=gamma, compressor=q)
        _close(mean_model(xs), start_mean, rtol=0, atol=1e-12)  # symmetric W: the mean never moves
    assert consensus_distance(xs) < bound * start_dist


def test_choco_nodes_equal_the_all_nodes_step():
    n = 8
    topo = build_topology("k-regular", n, seed=4, k=3)
    w = topo.mixing()
    cfg = ChocoConfig(gamma=0.4)
    init = {k: torch.zeros_like(v) for k, v in _models(1)[0].items()}
    nodes = [ChocoNode(cfg, index=i, neighbours=topo.in_neighbours(i), init=init) for i in range(n)]
    xs_nodes = xs_all = _models(n, seed=6)
    hats = [dict(init) for _ in range(n)]
    q = codec_compressor(build_codec("topk", ratio=0.3))  # the real codec, through its payload
    for _ in range(10):
        msgs = [node.message(x, q) for node, x in zip(nodes, xs_nodes)]
        xs_nodes = [node.step(x, {j: msgs[j] for j in [i, *topo.in_neighbours(i)]}, mixing_row(w, i))
                    for i, (node, x) in enumerate(zip(nodes, xs_nodes))]
        xs_all, hats = choco_step(xs_all, hats, w, gamma=0.4, compressor=q)
        for a, b in zip(xs_nodes, xs_all):
            assert all(torch.equal(a[k], b[k]) for k in a)
    for i, node in enumerate(nodes):  # every node's copy of x̂_j is the same public estimate
        for j, h in node.hats.items():
            assert all(torch.equal(h[k], hats[j][k]) for k in h)


def test_a_lost_choco_message_is_a_zero_update_for_every_copy():
    """The Flower relay's case: node 3's message of a round never arrives. Every node
    that hears 3 keeps its x̂_3 (receive), so all copies of every estimate still agree,
    and receive + mix is step when nothing is lost."""
    n, lost = 6, 3
    topo = build_topology("ring", n)
    w = topo.mixing()
    cfg = ChocoConfig(gamma=0.5)
    init = _models(1)[0]
    nodes = [ChocoNode(cfg, index=i, neighbours=topo.in_neighbours(i), init=init) for i in range(n)]
    twins = [ChocoNode.from_estimates(cfg, i, node.hats) for i, node in enumerate(nodes)]
    xs = _models(n, seed=3)
    q = codec_compressor(build_codec("topk", ratio=0.5))
    for rnd in range(3):
        msgs = [node.message(x, q) for node, x in zip(nodes, xs)]
        mixed = []
        for i, (node, twin) in enumerate(zip(nodes, twins)):
            got = {j: msgs[j] for j in node.hats if rnd != 1 or j != lost}
            node.receive(got)
            mixed.append(node.mix(xs[i], mixing_row(w, i)))
            if rnd != 1:  # nothing lost: the two halves are step, bit for bit
                stepped = twin.step(xs[i], got, mixing_row(w, i))
                assert all(torch.equal(stepped[k], mixed[i][k]) for k in stepped)
            twin.hats = dict(node.hats)
        xs = mixed
        for j in range(n):
            copies = [node.hats[j] for node in nodes if j in node.hats]
            assert all(torch.equal(c[k], copies[0][k]) for c in copies for k in c)
    with pytest.raises(GossipError, match=r"node 0 got messages from \[3\], which it does not hear"):
        nodes[0].receive({3: msgs[3]})


def test_choco_node_state_round_trips_and_is_checked():
    cfg = ChocoConfig(gamma=0.5)
    node = ChocoNode(cfg, index=2, neighbours=[1, 3], init=_models(1)[0])
    again = ChocoNode.from_state_dict(cfg, 2, node.state_dict())
    assert again.hats.keys() == node.hats.keys()
    assert all(torch.equal(again.hats[j][k], node.hats[j][k]) for j in node.hats for k in node.hats[j])
    with pytest.raises(GossipError, match="no estimate of node 5 itself"):
        ChocoNode.from_state_dict(cfg, 5, node.state_dict())
    with pytest.raises(GossipError, match="unknown CHOCO state key 'x/1'"):
        ChocoNode.from_state_dict(cfg, 2, {"x/1": torch.zeros(1)})
    x = _models(1, seed=1)[0]
    q = node.message(x, identity)
    with pytest.raises(GossipError, match="node 2 needs the messages of \\[1, 2, 3\\].*got \\[1, 2\\]"):
        node.step(x, {1: q, 2: q}, {1: 0.25, 2: 0.5, 3: 0.25})
    with pytest.raises(GossipError, match="weights \\[4\\], which it does not hear"):
        node.step(x, {1: q, 2: q, 3: q}, {2: 0.5, 4: 0.5})


def test_choco_refuses_bad_gamma_and_shape_changing_compressors():
    for gamma in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gamma must be in \\(0, 1\\]"):
            ChocoConfig(gamma=gamma)
    xs = _models(2)
    hats = [{k: torch.zeros_like(v) for k, v in x.items()} for x in xs]
    with pytest.raises(GossipError, match="must return a tensor of the input's shape"):
        choco_step(xs, hats, np.full((2, 2), 0.5), gamma=1.0, compressor=lambda t: t.ravel()[:1])


def test_codec_compressor_keeps_dtype_and_shape():
    x = torch.randn(6, 7, dtype=torch.float64)
    y = codec_compressor(build_codec("qsgd", levels=4), generator=torch.Generator().manual_seed(0))(x)
    assert y.dtype == torch.float64 and y.shape == x.shape and not torch.equal(x, y)


# ------------------------------------------------------------------ push-sum
def test_push_sum_reaches_the_average_on_an_unbalanced_directed_graph():
    n = 7
    adj = np.zeros((n, n), dtype=bool)
    adj[np.arange(n), (np.arange(n) - 1) % n] = True  # i hears i - 1: a directed ring
    adj[0, 3] = adj[0, 5] = adj[4, 1] = True  # chords: in- and out-degrees now differ
    p = push_sum_weights(adj)
    assert not np.allclose(p.sum(axis=1), 1.0), "not doubly stochastic: plain gossip would be biased"
    xs, ws = _models(n, seed=8), [1.0] * n
    want = mean_model(xs)
    for _ in range(200):
        xs, ws = push_sum_step(xs, ws, p)
    assert sum(ws) == pytest.approx(n)  # mass is conserved
    for z in push_sum_estimates(xs, ws):
        _close(z, want, rtol=0, atol=1e-10)
    biased = _models(n, seed=8)
    for _ in range(200):
        biased = mix(biased, p)
    assert not torch.allclose(biased[0]["w"], want["w"], atol=1e-3), "the weights are what de-bias it"
    with pytest.raises(GossipError, match="2 push-sum weights for 7 models"):
        push_sum_step(xs, [1.0, 1.0], p)


def test_qsgd_is_positively_homogeneous_so_choco_may_scale_before_encoding():
    """choco-scale multiplies the difference before it is encoded; every node decodes
    the payload as is. That equals scaling the decoded q only if Q(c x) = c Q(x) for the
    same random draws: true of QSGD (levels depend on |x_i| / ||x||)."""
    from fededge.algorithms.gossip import codec_compressor

    x = torch.randn(2048, generator=torch.Generator().manual_seed(1))
    codec = build_codec("qsgd", levels=2, bucket=512)
    for c in (0.5, 1 / 12.3):
        a = codec_compressor(codec, generator=torch.Generator().manual_seed(7))(x * c)
        b = codec_compressor(codec, generator=torch.Generator().manual_seed(7))(x) * c
        _close({"q": a}, {"q": b}, rtol=1e-6, atol=1e-7)


def test_the_variance_factors_bound_the_codecs_error():
    """E||Q(x) - x||^2 <= omega ||x||^2, measured over draws, for each unbiased codec."""
    from fededge.algorithms.gossip import codec_compressor
    from fededge.compress.update import UpdateConfig

    x = torch.randn(4096, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    for cfg in (UpdateConfig(compressor="qsgd", qsgd_levels=2), UpdateConfig(compressor="qsgd", qsgd_levels=16),
                UpdateConfig(compressor="randk", topk_ratio=0.1), UpdateConfig(compressor="terngrad")):
        omega = cfg.variance_factor(x.numel())
        q = codec_compressor(cfg.build_codec(), generator=torch.Generator().manual_seed(3))
        err = sum(float(((q(x) - x) ** 2).sum()) for _ in range(20)) / 20 / float((x ** 2).sum())
        assert 0 < err <= omega * 1.05, (cfg.compressor, err, omega)
    assert UpdateConfig(compressor="topk").variance_factor(4096) == 0.0
    assert UpdateConfig(compressor="qsgd").variance_factor(100) == 0.0  # under min_numel: raw


def test_choco_with_unbiased_qsgd_needs_the_scale():
    """QSGD with 2 levels (omega ~ 11) makes CHOCO's estimates diverge; Q / (1 + omega)
    (choco-scale's automatic value) is a contraction and averaging converges."""
    from fededge.algorithms.gossip import codec_compressor
    from fededge.compress.update import UpdateConfig

    n, dim = 16, 1024
    w = build_topology("ring", n).mixing()
    cfg = UpdateConfig(compressor="qsgd", qsgd_levels=2)
    scale = 1 / (1 + cfg.variance_factor(dim))
    g = torch.Generator().manual_seed(4)
    start = [{"w": torch.randn(dim, generator=g, dtype=torch.float64)} for _ in range(n)]
    q = codec_compressor(cfg.build_codec(), generator=torch.Generator().manual_seed(5))
    results = {}
    for name, compressor in (("raw", q), ("scaled", lambda x: q(x * scale))):
        xs, hats = start, [{"w": torch.zeros(dim, dtype=torch.float64)} for _ in range(n)]
        for _ in range(300):
            xs, hats = choco_step(xs, hats, w, gamma=0.05, compressor=compressor)
        results[name] = consensus_distance(xs) / consensus_distance(start)
    assert results["scaled"] < 0.1
    assert not results["raw"] < 1.0  # grows (or NaN): the unscaled estimate error explodes


def test_choco_estimates_that_start_at_a_model_with_an_integer_buffer():
    """The docs say to start the estimates at the common initial model: one with a
    BatchNorm counter made choco_step fail (the messages carry floats only)."""
    from fededge.algorithms.gossip import choco_step, identity

    n = 4
    w = build_topology("ring", n).mixing()
    init = {"w": torch.zeros(3), "bn.num_batches_tracked": torch.tensor(0)}
    models = [{"w": torch.randn(3, generator=torch.Generator().manual_seed(i)),
               "bn.num_batches_tracked": torch.tensor(5 + i)} for i in range(n)]
    out, hats = choco_step(models, [dict(init) for _ in range(n)], w, gamma=1.0, compressor=identity)
    assert [int(m["bn.num_batches_tracked"]) for m in out] == [5, 6, 7, 8]  # each node's own
    assert all(set(h) == {"w"} for h in hats)


def test_a_decoded_message_is_added_in_the_estimates_dtype_by_everyone():
    """The node cast its own q to a bf16 model's dtype; the relay and the neighbours added
    the float32 decoded q: three copies of one estimate, no longer the same."""
    from fededge.algorithms.gossip import ChocoConfig, ChocoNode

    hat = {"w": torch.randn(8, 8).to(torch.bfloat16)}
    q = {"w": torch.randn(8, 8) * 1e-3}  # float32, as a decoder gives it
    node = ChocoNode.from_estimates(ChocoConfig(), 0, {0: hat, 1: hat})
    node.receive({1: q})
    got = node.hats[1]["w"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, hat["w"] + q["w"].to(torch.bfloat16))
