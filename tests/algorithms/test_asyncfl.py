"""FedAsync, FedBuff, SSP and backup workers: the pure rules, to the number."""

import math
import random

import numpy as np
import pytest
import torch

from fededge.algorithms.asyncfl import (
    AsyncConfig, AsyncScheduler, AsyncServer, AsyncStateError, Event, EventQueue,
    StalenessFunction, first_arrivals,
)


def _vec(x):
    return {"w": torch.tensor(x, dtype=torch.float64)}


# ------------------------------------------------------------------ staleness functions
@pytest.mark.parametrize("tau", [0, 1, 2, 3, 4, 5, 7.5, 20])
def test_staleness_functions_follow_their_definitions(tau):
    assert StalenessFunction("constant")(tau) == 1.0
    for a in (0.5, 1.0, 2.0):
        assert StalenessFunction("polynomial", a=a)(tau) == pytest.approx((tau + 1) ** -a, rel=1e-15)
    for a, b in ((10.0, 4.0), (1.0, 0.0), (0.5, 2.0)):
        want = 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
        assert StalenessFunction("hinge", a=a, b=b)(tau) == pytest.approx(want, rel=1e-15)


def test_staleness_functions_are_one_when_fresh_and_never_grow():
    for f in (StalenessFunction("constant"), StalenessFunction("polynomial", a=0.5),
              StalenessFunction("hinge", a=10, b=4)):
        vals = [f(t) for t in range(50)]
        assert vals[0] == 1.0
        assert all(x >= y for x, y in zip(vals, vals[1:]))
    hinge = StalenessFunction("hinge", a=10, b=4)
    assert hinge(4) == 1.0 and hinge(5) == pytest.approx(1 / 11)


@pytest.mark.parametrize("bad, match", [
    (dict(kind="exp"), "staleness must be one of constant, polynomial, hinge"),
    (dict(a=-1.0), "staleness-a must be a finite number >= 0"),
    (dict(a=float("inf")), "staleness-a must be a finite number >= 0"),
    (dict(b=-0.5), "staleness-b must be a finite number >= 0"),
])
def test_bad_staleness_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        StalenessFunction(**bad)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        StalenessFunction()(-1)


@pytest.mark.parametrize("bad, match", [
    (dict(mode="fedprox"), "mode must be one of fedasync, fedbuff, ssp"),
    (dict(alpha=0.0), r"async-alpha must be in \(0, 1\]"),
    (dict(buffer_size=0), "buffer-size must be >= 1"),
    (dict(ssp_bound=-1), "ssp-bound must be >= 0"),
    (dict(concurrency=-2), "async-concurrency must be >= 0"),
])
def test_bad_async_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        AsyncConfig(**bad)


# ------------------------------------------------------------------ the server rules
def test_fedasync_mixes_each_update_with_alpha_times_staleness_weight():
    cfg = AsyncConfig(mode="fedasync", alpha=0.6, staleness=StalenessFunction("polynomial", a=0.5))
    s = AsyncServer(cfg, _vec([0.0, 0.0]), num_clients=3)
    assert s.receive(_vec([1.0, 2.0]), base_version=0)  # tau 0: a = 0.6
    x1 = np.array([0.6, 1.2])
    assert np.allclose(s.model["w"].numpy(), x1, rtol=0, atol=1e-15)
    assert s.receive(_vec([3.0, -1.0]), base_version=0)  # tau 1: a = 0.6 / sqrt(2)
    a = 0.6 / math.sqrt(2)
    x2 = (1 - a) * x1 + a * np.array([3.0, -1.0])
    assert np.allclose(s.model["w"].numpy(), x2, rtol=0, atol=1e-15)
    assert s.version == 2 and s.staleness == [0, 1]


def test_fedbuff_with_a_buffer_of_n_and_no_staleness_is_fedavg():
    """K = n fresh updates, constant weights, eta = 1: the example-weighted mean (FedAvg)."""
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=7)
    s = AsyncServer(AsyncConfig(mode="fedbuff", buffer_size=4, staleness=StalenessFunction("constant")),
                    _vec(x0), num_clients=4)
    for rnd in range(3):
        base = s.version
        models = [s.model["w"].numpy() + rng.normal(size=7) for _ in range(4)]
        n = rng.integers(5, 50, size=4).astype(float)
        made = [s.receive(_vec(m), base_version=base, num_examples=k) for m, k in zip(models, n)]
        assert made == [False, False, False, True]
        fedavg = sum(k * m for k, m in zip(n, models)) / n.sum()
        assert np.allclose(s.model["w"].numpy(), fedavg, rtol=0, atol=1e-12)
    assert s.staleness == [0] * 12


def test_fedbuff_weights_stale_deltas_and_takes_a_server_step():
    f = StalenessFunction("polynomial", a=0.5)
    s = AsyncServer(AsyncConfig(mode="fedbuff", buffer_size=2, server_lr=0.5, staleness=f),
                    _vec([0.0]), num_clients=3)
    s.keep([0])
    assert not s.receive(_vec([1.0]), base_version=0, num_examples=1)
    assert s.receive(_vec([2.0]), base_version=0, num_examples=3)
    assert s.model["w"].item() == pytest.approx(0.5 * (1 * 1.0 + 3 * 2.0) / 4)
    # Version 2 from a stale base (version 0, tau 1) and a fresh one (version 1, tau 0).
    x1 = s.model["w"].item()
    assert not s.receive(_vec([4.0]), base_version=0, num_examples=2)
    assert s.receive(_vec([x1 + 1.0]), base_version=1, num_examples=2)
    want = x1 + 0.5 * (2 * f(1) * (4.0 - 0.0) + 2 * f(0) * 1.0) / 4
    assert s.model["w"].item() == pytest.approx(want, rel=1e-14)


def test_ssp_adds_each_delta_over_n():
    s = AsyncServer(AsyncConfig(mode="ssp"), _vec([1.0]), num_clients=4)
    s.receive(_vec([3.0]), base_version=0)
    s.receive(_vec([0.0]), base_version=0)  # its delta is from version 0, not the current model
    assert s.model["w"].item() == pytest.approx(1.0 + (3.0 - 1.0) / 4 + (0.0 - 1.0) / 4)


def test_integer_buffers_are_taken_not_mixed():
    s = AsyncServer(AsyncConfig(mode="fedasync", alpha=0.5), {"w": torch.zeros(2), "n": torch.tensor(3)},
                    num_clients=2)
    s.receive({"w": torch.ones(2), "n": torch.tensor(7)}, base_version=0)
    assert s.model["n"].item() == 7 and s.model["n"].dtype == torch.int64


def test_an_update_from_a_forgotten_version_is_a_named_error():
    s = AsyncServer(AsyncConfig(mode="fedbuff", buffer_size=1), _vec([0.0]), num_clients=1)
    s.receive(_vec([1.0]), base_version=0)
    s.keep([])
    with pytest.raises(AsyncStateError, match="version 0, which the server no longer keeps"):
        s.receive(_vec([1.0]), base_version=0)
    with pytest.raises(AsyncStateError, match="update has tensors"):
        s.receive({"v": torch.zeros(1)}, base_version=1)


def test_backup_workers_take_the_first_m_arrivals():
    arr = {5: 3.0, 1: 1.0, 7: math.inf, 2: 1.0, 9: 2.5}
    assert first_arrivals(arr, 3) == [1, 2, 9]
    assert first_arrivals(arr, 10) == [1, 2, 9, 5]  # a dropout (inf) never counts
    with pytest.raises(ValueError):
        first_arrivals(arr, 0)


# ------------------------------------------------------------------ event-driven runs
def _simulate(mode, durations, *, ssp_bound=2, versions=60, drop=None, concurrency=0, seed=0):
    """Drive scheduler + server on a clock: client c takes durations(c, rng) per message.

    Returns the server, scheduler and the check log (done - slowest at each start)."""
    n = len(durations)
    rng = np.random.default_rng(seed)
    server = AsyncServer(AsyncConfig(mode=mode, ssp_bound=ssp_bound, buffer_size=3,
                                     staleness=StalenessFunction("constant")),
                         _vec(np.zeros(3)), num_clients=n)
    sched = AsyncScheduler(list(range(n)), concurrency=concurrency,
                           ssp_bound=ssp_bound if mode == "ssp" else None, seed=seed)
    queue, now, gaps = EventQueue(), 0.0, []

    def start_all():
        for c in sched.startable():
            if sched.ssp_bound is not None and c not in sched.lagging:
                gaps.append(sched.done[c] - sched.slowest())
            d = sched.start(c, version=server.version, at=now)
            dropped = drop is not None and drop(c, rng)
            t = now + (durations[c](rng) if not dropped else 50.0)
            queue.push(Event(t, d.seq, c, dropped=dropped))

    start_all()
    while server.version < versions:
        ev = queue.pop()
        now = ev.time
        if ev.dropped:
            sched.write_off(ev.client)
        else:
            d = sched.finish(ev.client)
            target = server.models[d.version]["w"].numpy() + 1.0  # each client moves its model by +1
            server.receive(_vec(target), base_version=d.version)
        server.keep({x.version for x in sched.running.values()})
        if not len(queue) or queue.peek().time > now:
            start_all()
    return server, sched, gaps


@pytest.mark.parametrize("seed", range(25))
def test_the_ssp_bound_is_never_violated(seed):
    """Property: over random lognormal speeds, jitter and dropouts, no active client ever
    starts more than s rounds ahead of the slowest active one."""
    r = random.Random(seed)
    n, s = r.randint(2, 9), r.randint(0, 4)
    speeds = [math.exp(r.gauss(0, 1.0)) for _ in range(n)]
    durations = [lambda g, sp=sp: sp * (1 + 0.3 * g.random()) for sp in speeds]
    p_drop = r.choice([0.0, 0.0, 0.1])
    server, sched, gaps = _simulate("ssp", durations, ssp_bound=s, versions=15 * n, seed=seed,
                                    drop=(lambda c, g: g.random() < p_drop) if p_drop else None)
    assert gaps and max(gaps) <= s
    assert sched.ahead() <= s + 1  # a client's clock moves when its update lands
    assert server.version == 15 * n


def test_ssp_with_bound_zero_is_bulk_synchronous_fedavg():
    durations = [lambda g, k=k: 1.0 + k + g.random() for k in range(4)]
    server, sched, gaps = _simulate("ssp", durations, ssp_bound=0, versions=20)
    # Every round of 4 updates starts from the same model and moves it by +1 (the mean).
    assert server.model["w"].numpy() == pytest.approx(np.full(3, 5.0))
    assert set(sched.done.values()) == {5}
    assert set(gaps) == {0}


def test_a_slow_client_stalls_ssp_only_through_the_bound():
    fast, slow = (lambda g: 1.0), (lambda g: 10.0)
    _, sched, _ = _simulate("ssp", [fast, fast, slow], ssp_bound=3, versions=30)
    assert sched.done[0] - sched.done[2] <= 4
    _, sched_async, _ = _simulate("fedasync", [fast, fast, slow], versions=30)
    assert sched_async.done[0] > 3 * sched_async.done[2]  # FedAsync never waits


def test_a_written_off_client_does_not_stall_ssp_and_rejoins():
    durations = [lambda g: 1.0] * 3
    # Client 2 drops its first two messages (written off at +50), then answers.
    state = {"n": 0}

    def drop(c, g):
        if c != 2:
            return False
        state["n"] += 1
        return state["n"] <= 2

    server, sched, gaps = _simulate("ssp", durations, ssp_bound=1, versions=200, drop=drop)
    assert sched.dropped[2] == 2 and 2 not in sched.lagging
    assert sched.contributions[2] > 0 and max(gaps) <= 1


def test_a_written_off_client_rejoins_at_the_slowest_active_clients_round():
    """It rejoined at its own old round (the slowest was computed with it back among the
    active), which held every other client at the SSP bound until it caught up alone."""
    sched = AsyncScheduler([0, 1, 2], concurrency=3, seed=0, ssp_bound=1)
    sched.start(2, version=0, at=0.0)
    sched.write_off(2)
    for _ in range(10):
        for c in (0, 1):
            sched.start(c, version=0, at=0.0)
            sched.finish(c)
    assert sched.done == {0: 10, 1: 10, 2: 0} and 2 in sched.lagging
    sched.start(2, version=0, at=0.0)
    sched.finish(2)
    assert sched.done[2] == 10 and not sched.lagging
    assert sched.may_start(0) and sched.may_start(1) and sched.ahead() == 0


def test_concurrency_limits_clients_in_flight():
    sched = AsyncScheduler(list(range(10)), concurrency=3, seed=1)
    first = sched.startable()
    assert len(first) == 3
    for c in first:
        sched.start(c, version=0, at=0.0)
    assert sched.startable() == []
    sched.finish(first[0])
    assert len(sched.startable()) == 1
    with pytest.raises(AsyncStateError, match="has no message in flight"):
        sched.finish(first[0])


def test_event_queue_orders_by_time_then_dispatch():
    q = EventQueue()
    for t, seq in ((2.0, 0), (1.0, 3), (1.0, 1), (0.5, 9)):
        q.push(Event(t, seq, client=seq))
    assert [(e.time, e.seq) for e in (q.pop() for _ in range(4))] == [(0.5, 9), (1.0, 1), (1.0, 3), (2.0, 0)]
