"""Error feedback loses nothing; PowerSGD is exact at full rank and warm-starts; DGC
follows its schedule and a NumPy reference of momentum correction."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fededge.compress import (
    DGCConfig, DGCEncoder, ErrorFeedback, PowerSGDConfig, PowerSGDEncoder, build_codec, decode_any, unpack,
)

EPS32 = 2.0**-23


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ error feedback

EF_CODECS = [("onebit", {}), ("signsgd", {}), ("topk", {"ratio": 0.01}), ("threshold", {"tau": 1.0}),
             ("int8", {}), ("fp16", {})]


@pytest.mark.parametrize("name,params", EF_CODECS, ids=[c for c, _ in EF_CODECS])
def test_error_feedback_loses_nothing(name, params):
    ef = ErrorFeedback(build_codec(name, **params))
    g = gen(5)
    total_in = torch.zeros(40, 25, dtype=torch.float64)
    total_out = torch.zeros_like(total_in)
    for step in range(30):
        x = torch.randn(40, 25, generator=g)
        e_old = ef.residual.get("w", torch.zeros(40, 25)).double()
        y = decode_any(ef.encode("w", x, generator=g)).double()
        e_new = ef.residual["w"].double()
        # x + e_old == decoded + e_new, up to the two float32 roundings (sum, difference)
        lhs, rhs = x.double() + e_old, y + e_new
        tol = EPS32 * (lhs.abs() + e_new.abs())
        assert ((lhs - rhs).abs() <= tol).all()
        total_in += x.double()
        total_out += y
    # telescoped: everything sent plus what is still held is everything that came in
    assert torch.allclose(total_out + ef.residual["w"].double(), total_in, atol=1e-4, rtol=1e-5)


def test_error_feedback_residual_stays_bounded_with_topk():
    d, steps, delta = 1000, 500, 0.01
    ef = ErrorFeedback(build_codec("topk", ratio=delta))
    g = gen(9)
    norms = []
    for _ in range(steps):
        ef.encode("w", torch.randn(d, generator=g))
        norms.append(float(ef.residual["w"].norm()))
    g_norm = math.sqrt(d)  # E||x||^2 = d
    # Stich et al. 2018: E||e||^2 <= 4 (1 - delta) / delta^2 E||x||^2 for a delta-contraction
    assert max(norms) <= 2 * math.sqrt(1 - delta) / delta * g_norm
    # and far below a random walk (what the residual would be if nothing were sent) ...
    assert norms[-1] < math.sqrt(steps) * g_norm / 3
    # ... and stationary: the last 100 steps are no larger than steps 100-200
    assert max(norms[-100:]) <= 1.25 * max(norms[100:200])


def test_error_feedback_state_round_trip_reproduces_payloads():
    a = ErrorFeedback(build_codec("onebit"))
    xs = [torch.randn(8, 9, generator=gen(i)) for i in range(4)]
    for x in xs[:2]:
        a.encode("w", x)
    b = ErrorFeedback(build_codec("onebit"))
    b.load_state_dict(a.state_dict())
    assert all(a.encode("w", x) == b.encode("w", x) for x in xs[2:])
    with pytest.raises(ValueError, match="changed shape"):
        a.encode("w", torch.randn(3))


# ------------------------------------------------------------------ PowerSGD


@pytest.mark.parametrize("shape", [(5, 7), (7, 5), (4, 3, 2, 2), (1, 6)])
def test_powersgd_full_rank_is_exact(shape):
    x = torch.randn(shape, generator=gen())
    r = min(shape[0], math.prod(shape[1:]))
    y = decode_any(build_codec("powersgd", rank=r).encode(x, generator=gen()))
    assert (y - x).abs().max() <= 1e-5 * x.abs().max()
    enc = PowerSGDEncoder(PowerSGDConfig(rank=64))  # clamped to full rank
    y = decode_any(enc.encode("w", x))
    assert (y - x).abs().max() <= 1e-5 * x.abs().max()
    assert enc.residual["w"].abs().max() <= 1e-5 * x.abs().max()


def test_powersgd_full_rank_exact_for_rank_deficient_matrix():
    u = torch.randn(6, 2, generator=gen())
    x = u @ torch.randn(2, 8, generator=gen(1))
    y = decode_any(build_codec("powersgd", rank=6).encode(x, generator=gen()))
    assert (y - x).abs().max() <= 1e-5 * x.abs().max()


def test_powersgd_error_feedback_loses_nothing():
    enc = PowerSGDEncoder(PowerSGDConfig(rank=1, seed=3))
    for i in range(10):
        x = torch.randn(12, 10, generator=gen(i))
        e_old = enc.residual.get("w", torch.zeros(12, 10)).double()
        y = decode_any(enc.encode("w", x)).double()
        e_new = enc.residual["w"].double()
        lhs = x.double() + e_old
        assert ((lhs - y - e_new).abs() <= 4 * EPS32 * (lhs.abs() + e_new.abs() + y.abs())).all()


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    g = gen(4)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=g))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    s = torch.tensor([10.0, 5.0] + [0.5 * 0.8**i for i in range(38)])
    m = (u[:, :40] * s) @ v.T
    best = float(s[2:].norm())  # Eckart-Young: the optimal rank-2 error
    enc = PowerSGDEncoder(PowerSGDConfig(rank=2, seed=0))
    errs = []
    for _ in range(8):
        enc.residual.clear()  # isolate the warm start from error feedback
        errs.append(float((decode_any(enc.encode("w", m)) - m).norm()))
    assert errs[-1] <= 1.01 * best < errs[0]


def test_powersgd_error_feedback_stays_bounded_after_a_dead_warm_start():
    """One zero update of a tensor leaves a warm-started Q of zero (Q' = M^T P = 0), and
    from then on one power step sends nothing: the residual grew by every later update.
    The encoder keeps at least r / n of M's energy (its r largest rows when the power
    step keeps less), so error feedback stays bounded by sqrt(1-d) / (1 - sqrt(1-d))
    times the largest update, d = r / n."""
    n, m, r = 16, 12, 2
    enc = PowerSGDEncoder(PowerSGDConfig(rank=r, seed=0))
    enc.encode("w", torch.zeros(n, m))  # a frozen round
    assert float(enc.q["w"].abs().max()) == 0.0  # the warm start is dead
    d = r / n
    bound = math.sqrt(1 - d) / (1 - math.sqrt(1 - d))
    g = gen(7)
    v = torch.randn(4, m, generator=g)
    # Adversarial too: the same update again and again, in rows the dead P does not span.
    peak = 0.0
    for t in range(300):
        x = torch.zeros(n, m)
        x[n - 1 - t % 4] = v[t % 4]
        peak = max(peak, float(x.norm()))
        decode_any(enc.encode("w", x))
        res = float(enc.residual["w"].norm())
        assert res <= bound * peak * (1 + 1e-5), (t, res, bound * peak)
    # The contraction itself: what is left is at most (1 - r/n) of M's energy.
    x = torch.randn(n, m, generator=g)
    m_energy = float((x + enc.residual["w"]).square().sum())
    decode_any(enc.encode("w", x))
    assert float(enc.residual["w"].square().sum()) <= (1 - d) * m_energy * (1 + 1e-5)


def test_powersgd_without_the_guard_would_grow_without_bound():
    """The same sequence through one plain warm-started power step (the rule before the
    guard): the residual grows linearly, so the test above can fail."""
    from fededge.compress.powersgd import power_step

    n, m, r = 16, 12, 2
    q = torch.zeros(m, r)
    res = torch.zeros(n, m)
    g = gen(7)
    v = torch.randn(4, m, generator=g)
    for t in range(300):
        x = torch.zeros(n, m)
        x[n - 1 - t % 4] = v[t % 4]
        mat = x + res
        p, q = power_step(mat, q)
        res = mat - p @ q.T
    assert float(res.norm()) > 50 * math.sqrt(m)


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1.0, 1e12, 1e30])
def test_powersgd_orthogonalisation_holds_for_ill_conditioned_and_extreme_scales(scale):
    """P has orthonormal columns (Householder QR) for a delta of condition number 1e7 at
    any float32 scale, from tiny (1e-30, where squares underflow) to large; the residual
    never exceeds M, and the decoded tensor is finite."""
    g = gen(11)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -7, 48, dtype=torch.float64)
    mat = ((u[:, :48] * s) @ v.T * scale).float()
    enc = PowerSGDEncoder(PowerSGDConfig(rank=4, seed=1))
    for _ in range(3):
        enc.residual.clear()
        y = decode_any(enc.encode("w", mat))
        p = enc.q["w"]  # Q = M^T P; P itself is rebuilt from the payload below
        assert torch.isfinite(y).all() and torch.isfinite(p).all()
        assert float(enc.residual["w"].norm()) <= float(mat.norm()) * (1 + 1e-5)
    header, body = unpack(enc.encode("w", mat))
    P = torch.from_numpy(np.frombuffer(body[: 4 * 4 * 64], dtype="<f4").copy()).view(64, 4)
    assert torch.allclose(P.T @ P, torch.eye(4), atol=1e-5)
    # The top singular direction is found whatever the scale.
    top = torch.from_numpy(u[:, 0].numpy()).float()
    assert float((P.T @ top).norm()) > 0.999


def test_powersgd_more_iterations_approach_the_best_rank_r_at_the_same_bytes():
    g = gen(5)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=g))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    s = torch.tensor([10.0, 6.0, 4.0] + [2.0 * 0.9**i for i in range(37)])
    m = (u[:, :40] * s) @ v.T
    best = float(s[2:].norm())  # Eckart-Young: the optimal rank-2 error
    errs, sizes = [], set()
    for iters in (1, 2, 8):
        enc = PowerSGDEncoder(PowerSGDConfig(rank=2, seed=0, iters=iters))
        payload = enc.encode("w", m)
        sizes.add(len(payload))
        errs.append(float((decode_any(payload) - m).norm()))
    assert len(sizes) == 1  # the same bytes
    assert errs[2] <= 1.01 * best < errs[1] < errs[0]
    with pytest.raises(ValueError, match="iters must be an integer in 1..100"):
        PowerSGDConfig(iters=0)


def test_powersgd_fallback_seed_and_state():
    enc = PowerSGDEncoder(PowerSGDConfig(rank=2, seed=7, fallback="fp16"))
    b = torch.randn(10, generator=gen())
    assert unpack(enc.encode("bias", b))[0].codec == "fp16"
    assert unpack(PowerSGDEncoder().encode("bias", b))[0].codec == "raw"
    x = torch.randn(9, 4, 3, generator=gen())
    p1 = enc.encode("w", x)
    twin = PowerSGDEncoder(PowerSGDConfig(rank=2, seed=7, fallback="fp16"))
    assert twin.encode("w", x) == p1                      # same (seed, name): same Q
    assert twin.encode("other", x) != PowerSGDEncoder(PowerSGDConfig(rank=2, seed=7)).encode("w", x)
    restored = PowerSGDEncoder(enc.config)
    restored.load_state_dict(enc.state_dict())
    assert restored.encode("w", x) == enc.encode("w", x)  # warm Q and residual carried over
    with pytest.raises(ValueError, match="fallback must be"):
        PowerSGDConfig(fallback="int8")


# ------------------------------------------------------------------ DGC


def test_dgc_warmup_follows_its_definition():
    cfg = DGCConfig(initial_sparsity=0.75, final_sparsity=0.999, warmup_rounds=4)
    for r in range(10):
        density = 0.25 * (0.001 / 0.25) ** min(r / 4, 1)
        assert cfg.sparsity_at(r) == pytest.approx(1 - density, rel=1e-12, abs=1e-15)
    s = [cfg.sparsity_at(r) for r in range(6)]
    assert s[0] == pytest.approx(0.75) and s[4] == s[5] == pytest.approx(0.999)
    assert all(a < b for a, b in zip(s[:4], s[1:5]))
    # exponential: the density falls by the same factor every round
    ratios = [(1 - s[r + 1]) / (1 - s[r]) for r in range(4)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)
    assert DGCConfig(warmup_rounds=0).sparsity_at(0) == pytest.approx(0.999)


def numpy_dgc(deltas, m, densities, clip):
    d = deltas[0].size
    u = np.zeros(d, np.float32)
    v = np.zeros(d, np.float32)
    sent = []
    for delta, dens in zip(deltas, densities):
        g = delta.astype(np.float32)
        if clip is not None and np.linalg.norm(g.astype(np.float64)) > clip:
            g = g * np.float32(clip / np.linalg.norm(g.astype(np.float64)))
        u = np.float32(m) * u + g
        v = v + u
        k = min(d, max(1, math.ceil(round(dens * d, 6))))
        idx = np.argsort(-np.abs(v), kind="stable")[:k]
        out = np.zeros(d, np.float32)
        out[idx] = v[idx]
        u[idx] = 0
        v[idx] = 0
        sent.append(out)
    return sent


@pytest.mark.parametrize("clip", [None, 5.0])
def test_dgc_momentum_correction_matches_numpy_reference(clip):
    cfg = DGCConfig(initial_sparsity=0.5, final_sparsity=0.95, warmup_rounds=3, momentum=0.9, clip_norm=clip)
    enc = DGCEncoder(cfg)
    g = gen(8)
    deltas = [torch.randn(200, generator=g).numpy() for _ in range(6)]
    ref = numpy_dgc(deltas, 0.9, [1 - cfg.sparsity_at(r) for r in range(6)], clip)
    for r, (delta, want) in enumerate(zip(deltas, ref)):
        got = decode_any(enc.encode("w", torch.from_numpy(delta).view(10, 20), round=r)).reshape(-1).numpy()
        assert (got != 0).sum() == (want != 0).sum() == math.ceil(round((1 - cfg.sparsity_at(r)) * 200, 6))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dgc_without_momentum_is_topk_with_error_feedback():
    cfg = DGCConfig(initial_sparsity=0.9, final_sparsity=0.9, warmup_rounds=0, momentum=0.0)
    enc, ef = DGCEncoder(cfg), ErrorFeedback(build_codec("topk", ratio=1 - cfg.sparsity_at(0)))
    g = gen(2)
    for r in range(5):
        x = torch.randn(300, generator=g)
        assert enc.encode("w", x, round=r) == ef.encode("w", x)


def test_dgc_state_round_trip_and_validation():
    enc = DGCEncoder(DGCConfig(warmup_rounds=2))
    x = torch.randn(50, generator=gen())
    enc.encode("w", x, round=0)
    twin = DGCEncoder(enc.config)
    twin.load_state_dict(enc.state_dict())
    assert twin.encode("w", x, round=1) == enc.encode("w", x, round=1)
    for kwargs, match in (({"final_sparsity": 1.0}, "final_sparsity"), ({"initial_sparsity": 0.9999}, "initial_sparsity"),
                          ({"momentum": 1.0}, "momentum"), ({"clip_norm": 0.0}, "clip_norm"),
                          ({"warmup_rounds": -1}, "warmup_rounds")):
        with pytest.raises(ValueError, match=match):
            DGCConfig(**kwargs)


def test_powersgd_refusing_an_update_leaves_its_state_as_it_was():
    """x was added into the residual in place before the NaN/Inf check: a refused update
    stayed in the residual and every later update of that tensor was refused too."""
    from fededge.compress.powersgd import PowerSGDConfig, PowerSGDEncoder

    enc, twin = PowerSGDEncoder(PowerSGDConfig(rank=2)), PowerSGDEncoder(PowerSGDConfig(rank=2))
    g = torch.Generator().manual_seed(0)
    first, later = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    assert enc.encode("w", first) == twin.encode("w", first)
    bad = first.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        enc.encode("w", bad)
    assert enc.encode("w", later) == twin.encode("w", later)  # as if the bad one never came
    assert torch.equal(enc.residual["w"], twin.residual["w"])


def test_powersgd_works_whatever_torchs_default_dtype():
    from fededge.compress.powersgd import PowerSGDConfig, PowerSGDEncoder

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        payload = PowerSGDEncoder(PowerSGDConfig(rank=2)).encode("w", torch.ones(8, 6, dtype=torch.float32))
    finally:
        torch.set_default_dtype(before)
    assert payload == PowerSGDEncoder(PowerSGDConfig(rank=2)).encode("w", torch.ones(8, 6))


def test_dgc_below_the_papers_initial_sparsity_and_an_overflowing_accumulation():
    """dgc-sparsity < 0.75 was refused by the warm-up's fixed start (0.75), a setting the
    user cannot change; an accumulation that overflows built a payload the server refuses."""
    from fededge.compress.dgc import DGCConfig, DGCEncoder
    from fededge.compress.update import UpdateConfig

    assert DGCConfig(final_sparsity=0.5).initial_sparsity == 0.5
    assert DGCConfig(final_sparsity=0.99).initial_sparsity == 0.75
    UpdateConfig(compressor="dgc", dgc_sparsity=0.5).build_codec()
    enc = DGCEncoder(DGCConfig(final_sparsity=0.5, warmup_rounds=0, momentum=0.0))
    big = torch.full((4,), 2e38)
    enc.encode("w", big, round=0)
    u, v = enc.u["w"].clone(), enc.v["w"].clone()
    with pytest.raises(ValueError, match="overflows"):
        enc.encode("w", big, round=1)
    assert torch.equal(enc.u["w"], u) and torch.equal(enc.v["w"], v)  # unchanged
    enc.encode("w", torch.ones(4), round=1)
