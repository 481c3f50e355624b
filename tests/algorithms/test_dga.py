"""DGA's round-form rule against a hand trajectory and an independent NumPy reference."""

import numpy as np
import pytest
import torch

from fededge.algorithms.dga import DGAClient, DGAConfig, average


def _quadratic_clients(n: int, dim: int, seed: int = 0):
    """f_j(x) = 1/2 (x - c_j)^T A_j (x - c_j), A_j SPD: deterministic local GD."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        m = rng.standard_normal((dim, dim))
        out.append((m @ m.T / dim + 0.5 * np.eye(dim), rng.standard_normal(dim) * 3))
    return out


def _local_steps(x: np.ndarray, a: np.ndarray, c: np.ndarray, k: int, lr: float) -> np.ndarray:
    for _ in range(k):
        x = x - lr * a @ (x - c)
    return x


def _run_dga(cfg: DGAConfig, clients, weights, rounds: int, k: int, lr: float, x0: np.ndarray):
    """fededge's DGAClient driven round by round; returns each client's model after each round."""
    dga = [DGAClient(cfg, {"x": torch.tensor(x0, dtype=torch.float64)}) for _ in clients]
    history = []
    avgs = {}  # round -> its average (the server's side)
    for t in range(1, rounds + 1):
        deltas = []
        for state, (a, c) in zip(dga, clients):
            start = state.model["x"].numpy()
            delta = {"x": torch.tensor(_local_steps(start, a, c, k, lr) - start)}
            state.finish_round(t, delta)
            deltas.append(delta)
        avgs[t] = average(deltas, weights)
        for s in range(1, t + 1):  # averages arriving at the end of round t
            if s + cfg.delay_at(s) == t:
                for state in dga:
                    state.receive(s, avgs[s])
        history.append([state.model["x"].numpy().copy() for state in dga])
    return history


def _reference(cfg: DGAConfig, clients, weights, rounds: int, k: int, lr: float, x0: np.ndarray,
               avgs_out: list | None = None):
    """Independent NumPy form: rebuild every client's model from the unrolled formula."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    own: list[list[np.ndarray]] = [[] for _ in clients]  # own[j][s-1] = Δ(s, j)
    avg: list[np.ndarray] = []
    models = [x0.copy() for _ in clients]
    history = []
    for t in range(1, rounds + 1):
        deltas = [_local_steps(models[j], a, c, k, lr) - models[j] for j, (a, c) in enumerate(clients)]
        for j, d in enumerate(deltas):
            own[j].append(d)
        avg.append(sum(wj * d for wj, d in zip(w, deltas)))
        arrived = [s for s in range(1, t + 1) if s + cfg.delay_at(s) <= t]
        pending = [s for s in range(1, t + 1) if s + cfg.delay_at(s) > t]
        for j in range(len(clients)):
            x = x0 + sum((avg[s - 1] for s in arrived), np.zeros_like(x0))
            if cfg.correction:
                x = x + sum((own[j][s - 1] for s in pending), np.zeros_like(x0))
            models[j] = x
        history.append([m.copy() for m in models])
    if avgs_out is not None:
        avgs_out.extend(avg)
    return history


def test_hand_trajectory_two_scalar_clients():
    # f_1 = (x-1)^2/2, f_2 = (x+1)^2/2, equal weights, x0 = 0, one step of lr 0.5, D = 1.
    clients = [(np.eye(1), np.array([1.0])), (np.eye(1), np.array([-1.0]))]
    hist = _run_dga(DGAConfig(delay=1), clients, [1, 1], 3, 1, 0.5, np.zeros(1))
    # r1: Δ = ±0.5, nothing arrives -> ±0.5; r2: Δ = ±0.25, round 1's average (0) arrives
    # and swaps the own ±0.5 -> ±0.25; r3: from ±0.25, Δ = ±0.375, round 2 swapped -> ±0.375.
    assert [h[0][0] for h in hist] == pytest.approx([0.5, 0.25, 0.375])
    assert [h[1][0] for h in hist] == pytest.approx([-0.5, -0.25, -0.375])
    plain = _run_dga(DGAConfig(delay=1, correction=False), clients, [1, 1], 3, 1, 0.5, np.zeros(1))
    assert all(h[0][0] == 0.0 and h[1][0] == 0.0 for h in plain)  # only averages (0) move it


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize(("delay", "warmup"), [(1, 0), (2, 0), (3, 2), (5, 1)])
def test_matches_the_numpy_reference(delay, warmup, correction):
    clients = _quadratic_clients(4, 6, seed=delay)
    weights = [3, 1, 2, 5]
    cfg = DGAConfig(delay=delay, correction=correction, warmup_rounds=warmup)
    got = _run_dga(cfg, clients, weights, 12, 3, 0.05, np.ones(6))
    ref = _reference(cfg, clients, weights, 12, 3, 0.05, np.ones(6))
    for t, (g, r) in enumerate(zip(got, ref)):
        for j in range(4):
            np.testing.assert_allclose(g[j], r[j], rtol=1e-12, atol=1e-12, err_msg=f"round {t + 1} client {j}")


@pytest.mark.parametrize("correction", [True, False])
def test_zero_delay_is_synchronous_local_sgd(correction):
    clients = _quadratic_clients(3, 4)
    weights = [1, 2, 3]
    got = _run_dga(DGAConfig(delay=0, correction=correction), clients, weights, 8, 5, 0.1, np.zeros(4))
    x = np.zeros(4)  # FedAvg with K = 5 local steps
    w = np.array(weights) / 6
    for t in range(8):
        x = sum(wj * _local_steps(x, a, c, 5, 0.1) for wj, (a, c) in zip(w, clients))
        for j in range(3):
            np.testing.assert_allclose(got[t][j], x, rtol=1e-12, atol=1e-12)


def test_identical_clients_stay_within_their_last_d_updates_of_the_global_model():
    a, c = _quadratic_clients(1, 5)[0]
    delay, k, lr = 3, 2, 0.05
    cfg = DGAConfig(delay=delay)
    states = [DGAClient(cfg, {"x": torch.zeros(5, dtype=torch.float64)}) for _ in range(3)]
    global_x = torch.zeros(5, dtype=torch.float64)
    avgs = {}
    for t in range(1, 15):
        deltas = []
        for s in states:
            start = s.model["x"].numpy()
            d = {"x": torch.tensor(_local_steps(start, a, c, k, lr) - start)}
            s.finish_round(t, d)
            deltas.append(d)
        avgs[t] = average(deltas, [1, 1, 1])
        if t - delay >= 1:
            for s in states:
                s.receive(t - delay, avgs[t - delay])
            global_x = global_x + avgs[t - delay]["x"]
        for s in states:
            assert s.staleness() == min(t, delay)
            recent = sum((d["x"] for d in s.in_flight.values()), torch.zeros(5, dtype=torch.float64))
            torch.testing.assert_close(s.model["x"], global_x + recent, rtol=0, atol=1e-12)


def test_state_dict_round_trip_and_errors():
    cfg = DGAConfig(delay=2)
    s = DGAClient(cfg, {"w": torch.ones(2, 2), "b": torch.zeros(2)})
    s.finish_round(1, {"w": torch.full((2, 2), 0.5), "b": torch.ones(2)})
    s.finish_round(2, {"w": torch.full((2, 2), 0.25), "b": torch.ones(2)})
    back = DGAClient.from_state_dict(cfg, s.state_dict())
    assert sorted(back.in_flight) == [1, 2]
    torch.testing.assert_close(back.model["w"], torch.full((2, 2), 1.75))
    with pytest.raises(ValueError, match=r"average of round 7 arrived.*in flight: \[1, 2\]"):
        back.receive(7, {"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="already finished"):
        back.finish_round(2, {"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="delay must be >= 0"):
        DGAConfig(delay=-1)
    assert DGAConfig(delay=4, warmup_rounds=2).delay_at(2) == 0 and DGAConfig(delay=4, warmup_rounds=2).delay_at(3) == 4


# ------------------------------------------------------------------ timing on the clock
from fededge.algorithms.dga import DGATimeline  # noqa: E402
from fededge.netem.clock import ClientLink, ClientRound, SimClock, synchronous_round  # noqa: E402
from fededge.netem.profiles import Direction, LinkProfile  # noqa: E402


def _link(rate, delay, jitter=0.0, speed=1.0):
    d = Direction(rate_bps=rate, delay_s=delay, jitter_s=jitter)
    return ClientLink(LinkProfile(name="t", up=d, down=d, source="test"), speed=speed)


def test_zero_delay_timeline_is_synchronous_fedavg_on_the_clock():
    links = [_link(8e6, 0.1, 0.01), _link(2e6, 0.3, 0.05, speed=0.5), _link(20e6, 0.02)]
    work = [ClientRound(j, 200_000, 0.3 + 0.1 * j, 200_000) for j in range(3)]
    sync = SimClock(links, seed=4)
    ends_sync = [synchronous_round(sync, work).end for _ in range(5)]
    clock = SimClock(links, seed=4)
    tl = DGATimeline(clock, DGAConfig(delay=0), clients=range(3))
    ends_dga = [tl.run_round(t, work) for t in range(1, 6)]
    assert ends_dga == pytest.approx(ends_sync, abs=1e-12)


def test_homogeneous_round_times_by_hand():
    # 100 kB each way at 1 MB/s + 0.1 s delay: 0.1 s on the wire, 0.2 s to arrive; compute 0.5 s.
    work = [ClientRound(0, 100_000, 0.5, 100_000)]
    fed = SimClock([_link(8e6, 0.1)])
    assert [synchronous_round(fed, work).end for _ in range(4)] == pytest.approx([0.9, 1.8, 2.7, 3.6])
    # DGA, D = 1: round 1 starts when the model arrives (0.2), computes to 0.7, its reply
    # leaves at 0.8 and arrives at 0.9. Round t starts when the reply of t-1 has left and
    # the average of t-2 has arrived: every round takes compute + 0.1 s of upload.
    tl = DGATimeline(SimClock([_link(8e6, 0.1)]), DGAConfig(delay=1), clients=[0])
    assert [tl.run_round(t, work) for t in range(1, 5)] == pytest.approx([0.9, 1.5, 2.1, 2.7])
    assert [tl.started[(t, 0)] for t in range(1, 5)] == pytest.approx([0.2, 0.8, 1.4, 2.0])


def test_a_round_is_never_ready_before_the_round_it_builds_on():
    """G(t) = G(t-1) + round t's average: where round t-1's slowest client has no work in
    round t (a dropout), round t was 'ready' before round t-1, and its sim_s negative."""
    tl = DGATimeline(SimClock([ClientLink(None), ClientLink(None, speed=0.1)]), DGAConfig(delay=1), clients=[0, 1])
    r1 = tl.run_round(1, [ClientRound(0, 0, 1.0, 0), ClientRound(1, 0, 1.0, 0)])
    assert r1 == pytest.approx(10.0)  # the slow client: 1 s of compute at speed 0.1
    r2 = tl.run_round(2, [ClientRound(0, 0, 1.0, 0)])  # client 1 dropped out of round 2
    assert r2 >= r1 and tl.ready[2] >= tl.ready[1]
    r3 = tl.run_round(3, [ClientRound(0, 0, 1.0, 0)])
    assert r3 >= r2


def test_a_node_that_pulls_gets_its_next_message_only_after_its_reply_arrived():
    # The hand case above with a pulling node (a Flower SuperNode): round t's message leaves
    # when the reply of round t-1 has arrived (0.9), so download, compute and upload run in
    # series again and every round takes 0.9 s, as FedAvg's; DGA's overlap is gone.
    work = [ClientRound(0, 100_000, 0.5, 100_000)]
    d = Direction(rate_bps=8e6, delay_s=0.1)
    link = ClientLink(LinkProfile(name="t", up=d, down=d, source="test"), pulls=True)
    tl = DGATimeline(SimClock([link]), DGAConfig(delay=1), clients=[0])
    assert [tl.run_round(t, work) for t in range(1, 5)] == pytest.approx([0.9, 1.8, 2.7, 3.6])
    assert [tl.arrived[(t, 0)] for t in range(1, 5)] == pytest.approx([0.2, 1.1, 2.0, 2.9])
    # Two pulling nodes, one computing 4x slower, D = 2: the fast node still runs ahead of
    # the slow one (it waits for its own reply, not for the slow node's), as on the testbed.
    links = [ClientLink(LinkProfile(name="t", up=d, down=d, source="test"), pulls=True),
             ClientLink(LinkProfile(name="t", up=d, down=d, source="test"), speed=0.25, pulls=True)]
    two = [ClientRound(0, 100_000, 0.5, 100_000), ClientRound(1, 100_000, 0.5, 100_000)]
    tl = DGATimeline(SimClock(links), DGAConfig(delay=2), clients=[0, 1])
    ends = [tl.run_round(t, two) for t in range(1, 4)]
    assert tl.started[(2, 0)] < tl.started[(2, 1)] and ends[-1] > 3 * 0.9
    # The knob reaches the links: RunClock(nodes_pull=True) builds pulling devices.
    from fededge.netem.runclock import RunClock

    assert all(c.pulls for c in RunClock(netem="4g", nodes_pull=True).build(3).clients)
    assert not any(c.pulls for c in RunClock(netem="4g").build(3).clients)


def test_computing_ahead_hides_the_compute_of_a_node_that_pulls():
    # The pulling node above, with compute-ahead (D = 2): round 1 as before (arrives 0.2,
    # computed to 0.7, reply arrives 0.9). Round 1's message brought round 2's content, so
    # the node computes round 2 from 0.7 to 1.2 while its reply travels and round 2's
    # message comes (pulled at 0.9, arrives 1.1); the reply leaves at 1.2 and arrives 1.4.
    # Every later round the same: 0.5 s a round, the compute alone, against 0.9 s without.
    work = [ClientRound(0, 100_000, 0.5, 100_000)]
    d = Direction(rate_bps=8e6, delay_s=0.1)
    link = ClientLink(LinkProfile(name="t", up=d, down=d, source="test"), pulls=True)
    tl = DGATimeline(SimClock([link]), DGAConfig(delay=2, compute_ahead=True), clients=[0])
    assert [tl.run_round(t, work) for t in range(1, 5)] == pytest.approx([0.9, 1.4, 1.9, 2.4])
    assert [tl.started[(t, 0)] for t in range(1, 5)] == pytest.approx([0.2, 0.7, 1.2, 1.7])
    assert [tl.arrived[(t, 0)] for t in range(1, 5)] == pytest.approx([0.2, 1.1, 1.6, 2.1])
    # A message may only carry the next round's content once that round's global model
    # exists: not in the warm-up (D = 0: round 3 starts from G(2), round 2's own average).
    cfg = DGAConfig(delay=1, warmup_rounds=2, compute_ahead=True)
    assert [cfg.previews(t) for t in range(1, 6)] == [False, False, True, True, True]
    assert not any(DGAConfig(delay=0, compute_ahead=True).previews(t) for t in range(1, 6))
    assert not any(DGAConfig(delay=2).previews(t) for t in range(1, 6))
    with pytest.raises(ValueError, match="compute_ahead must be true or false"):
        DGAConfig(compute_ahead="yes")


def test_a_node_that_finds_no_message_asks_again_three_seconds_later():
    from fededge.netem.clock import pulled

    assert pulled(0.5, 1.0) == 1.0  # the message was waiting: taken at once
    assert pulled(4.0, 1.0) == 4.0  # ready exactly at the second ask
    assert pulled(4.2, 1.0) == pytest.approx(7.0)  # asked at 1, 4 (nothing), 7
    # On the timeline: two pulling nodes, D = 1 with compute-ahead, node 1 uploading 10x
    # slower. Round 2's message waits for round 1's average: node 1's reply, at 1.8 s (0.2
    # down, 0.5 compute, 1.1 up). Node 0 replied at 0.9 and asked then; it asks again at
    # 3.9 and has the message at 4.1 (0.2 s down), though it was ready at 1.8.
    fast, slow = Direction(rate_bps=8e6, delay_s=0.1), Direction(rate_bps=8e5, delay_s=0.1)
    links = [ClientLink(LinkProfile(name="f", up=fast, down=fast, source="test"), pulls=True),
             ClientLink(LinkProfile(name="s", up=slow, down=fast, source="test"), pulls=True)]
    work = [ClientRound(0, 100_000, 0.5, 100_000), ClientRound(1, 100_000, 0.5, 100_000)]
    tl = DGATimeline(SimClock(links), DGAConfig(delay=1, compute_ahead=True), clients=[0, 1])
    for t in (1, 2):
        tl.run_round(t, work)
    assert (tl.replied[(1, 0)], tl.ready[1]) == pytest.approx((0.9, 1.8))
    assert tl.arrived[(2, 0)] == pytest.approx(4.1) and tl.arrived[(2, 1)] == pytest.approx(2.0)
    # FedAvg's rounds on the same links: round 2 is broadcast at 1.8, node 0 asks at 3.9.
    clock = SimClock(links)
    assert synchronous_round(clock, work).end == pytest.approx(1.8)
    second = synchronous_round(clock, work)
    assert second.downloaded[0] == pytest.approx(4.1) and second.downloaded[1] == pytest.approx(2.0)
    # A checkpoint of the clock keeps when each device last replied.
    again = SimClock(links)
    again.load_state_dict(clock.state_dict())
    assert again.replied == clock.replied and again.receive(0, 5.0) == clock.receive(0, 5.0)


def test_a_slow_client_delays_others_only_through_the_averages_they_wait_for():
    links = [_link(80e6, 0.01), _link(80e6, 0.01, speed=0.25)]  # client 1 computes 4x slower
    work = [ClientRound(0, 10_000, 0.1, 10_000), ClientRound(1, 10_000, 0.1, 10_000)]
    # D large: no average is ever needed within 6 rounds, so the fast client never waits.
    tl = DGATimeline(SimClock(links), DGAConfig(delay=10), clients=[0, 1])
    for t in range(1, 7):
        tl.run_round(t, work)
    fast = [tl.started[(t, 0)] for t in range(1, 7)]
    assert np.diff(fast) == pytest.approx([0.1 + 0.001] * 5)  # its compute + its own upload
    # D = 1: from round 3 on, round t's message carries the average of round t-2, which waits
    # for the slow client's upload: the fast client now starts at those averages' arrival.
    tl = DGATimeline(SimClock(links), DGAConfig(delay=1), clients=[0, 1])
    for t in range(1, 7):
        tl.run_round(t, work)
    for t in range(3, 7):
        assert tl.started[(t, 0)] == pytest.approx(max(tl.arrived[(t, 0)], tl.started[(t - 1, 0)] + 0.101))
        assert tl.started[(t, 0)] > tl.started[(t - 1, 0)] + 0.2  # held back by the slow client


# ------------------------------------------------------------------ the global-model form
from fededge.algorithms.dga import DGAServer, DGAStateError, last_arrived  # noqa: E402


def _run_global_form(cfg: DGAConfig, clients, weights, rounds: int, k: int, lr: float, x0: np.ndarray,
                     momentum: float = 0.0):
    """What the Flower strategy and ClientApp run: G(g) down, G(g) + Δ up, server advances G.
    With ``momentum``, each client's K steps are heavy ball with a buffer it keeps across
    rounds (keep-momentum).

    Returns each client's model at the start of each round (after sync) and G(t)."""
    server = DGAServer(cfg, {"x": torch.tensor(x0, dtype=torch.float64)})
    states = [DGAClient(cfg, {"x": torch.tensor(x0, dtype=torch.float64)}) for _ in clients]
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    starts, globals_ = [], []
    buffers = [np.zeros_like(x0) for _ in clients]  # heavy ball's first step: buf = 0 * m + grad
    for t in range(1, rounds + 1):
        g = last_arrived(cfg, t)
        new = t == 1 or g != last_arrived(cfg, t - 1)
        replies = []
        starts.append([])
        for j, (st, (a, c)) in enumerate(zip(states, clients)):
            st.sync(g, server.global_model(g) if new else None)
            start = st.model["x"].numpy().copy()
            starts[-1].append(start)
            if momentum:
                end, buffers[j] = _momentum_steps(start, a, c, k, lr, momentum, buffers[j])
            else:
                end = _local_steps(start, a, c, k, lr)
            replies.append(st.train_round(t, {"x": torch.tensor(end)}))
        ybar = {"x": sum(wj * r["x"] for wj, r in zip(w, replies))}
        globals_.append(server.advance(t, ybar)["x"].numpy().copy())
    return starts, globals_


def _momentum_steps(x: np.ndarray, a: np.ndarray, c: np.ndarray, k: int, lr: float, m: float, buf: np.ndarray):
    for _ in range(k):
        buf = m * buf + a @ (x - c)
        x = x - lr * buf
    return x, buf


def _paper_rule(delay: int, correction: bool, clients, weights, iterations: int, lr: float, m: float,
                x0: np.ndarray):
    """Zhu et al.'s per-iteration rule with momentum SGD, written from the paper: worker j's
    optimiser steps on e(i,j) = g(i,j) - g(i-D,j) + avg g(i-D) (with correction) or on
    avg g(i-D) alone (without), g(s, .) = 0 for s < 1. Returns the workers' models after
    each iteration."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    models = [x0.copy() for _ in clients]
    u = [np.zeros_like(x0) for _ in clients]
    grads: list[list[np.ndarray]] = []  # grads[i-1][j] = g(i, j)
    history = []
    for i in range(1, iterations + 1):
        grads.append([a @ (models[j] - c) for j, (a, c) in enumerate(clients)])
        old = grads[i - 1 - delay] if i - delay >= 1 else [np.zeros_like(x0)] * len(clients)
        old_avg = sum(wj * gj for wj, gj in zip(w, old))
        for j in range(len(clients)):
            e = grads[i - 1][j] - old[j] + old_avg if correction else old_avg
            u[j] = m * u[j] + e
            models[j] = models[j] - lr * u[j]
        history.append([x.copy() for x in models])
    return history


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("delay", [0, 1, 4])
def test_k1_with_kept_momentum_is_the_papers_rule_with_momentum_sgd(delay, correction):
    """K = 1 with the client's momentum kept across rounds (keep-momentum) is the paper's
    per-iteration DGA with momentum SGD: momentum is linear, so the paper's optimiser on the
    corrected gradient equals local heavy ball on the client's own gradients, with the
    own-for-average swap on the model (docs/algorithms.md). The round form restarting its
    buffer every round is not (checked too: at K = 1 its momentum never acts)."""
    clients = _quadratic_clients(3, 5, seed=3)
    weights = [2, 1, 3]
    cfg = DGAConfig(delay=delay, correction=correction)
    lr, m, rounds = 0.02, 0.9, 25
    starts, _ = _run_global_form(cfg, clients, weights, rounds, 1, lr, np.ones(5), momentum=m)
    ref = _paper_rule(delay, correction, clients, weights, rounds, lr, m, np.ones(5))
    for t in range(2, rounds + 1):  # the model round t starts from = the paper's after iteration t-1
        for j in range(3):
            np.testing.assert_allclose(starts[t - 1][j], ref[t - 2][j], rtol=1e-9, atol=1e-9,
                                       err_msg=f"round {t} client {j}")
    restarted, _ = _run_global_form(cfg, clients, weights, rounds, 1, lr, np.ones(5))
    assert not np.allclose(restarted[-1][0], ref[-2][0], rtol=1e-3)


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize(("delay", "warmup"), [(0, 0), (1, 0), (3, 2), (5, 1)])
def test_global_form_trains_the_same_models_as_the_average_form(delay, warmup, correction):
    clients = _quadratic_clients(4, 6, seed=7)
    weights = [3, 1, 2, 5]
    cfg = DGAConfig(delay=delay, correction=correction, warmup_rounds=warmup)
    starts, globals_ = _run_global_form(cfg, clients, weights, 12, 3, 0.05, np.ones(6))
    avgs: list[np.ndarray] = []
    ref = _reference(cfg, clients, weights, 12, 3, 0.05, np.ones(6), avgs_out=avgs)
    for t in range(2, 13):  # the model a client starts round t from = the reference after t-1
        for j in range(4):
            np.testing.assert_allclose(starts[t - 1][j], ref[t - 2][j], rtol=1e-10, atol=1e-10,
                                       err_msg=f"round {t} client {j}")
    for t in range(1, 13):  # G(t) = x(1) + every average up to t
        np.testing.assert_allclose(globals_[t - 1], np.ones(6) + sum(avgs[:t]), rtol=1e-10, atol=1e-10)


def test_global_form_at_zero_delay_is_fedavg_bit_for_bit():
    clients = _quadratic_clients(3, 4)
    cfg = DGAConfig(delay=0)
    x = np.zeros(4, dtype=np.float32)
    server = DGAServer(cfg, {"x": torch.tensor(x)})
    states = [DGAClient(cfg, {"x": torch.tensor(x)}) for _ in clients]
    w = [0.2, 0.3, 0.5]
    for t in range(1, 6):
        afters = [_local_steps(x, a.astype(np.float32), c.astype(np.float32), 3, np.float32(0.1)).astype(np.float32)
                  for a, c in clients]
        fedavg = sum(np.float32(wj) * af for wj, af in zip(w, afters))
        replies = []
        for st, af in zip(states, afters):
            st.sync(t - 1, server.global_model(t - 1))
            assert torch.equal(st.model["x"], torch.tensor(x))  # starts from G(t-1) exactly
            reply = st.train_round(t, {"x": torch.tensor(af)})
            assert torch.equal(reply["x"], torch.tensor(af))  # replies x' itself
            replies.append(reply)
        got = server.advance(t, {"x": sum(np.float32(wj) * r["x"] for wj, r in zip(w, replies))})
        assert np.array_equal(got["x"].numpy(), fedavg)
        x = fedavg


def test_last_arrived_and_server_history():
    cfg = DGAConfig(delay=2, warmup_rounds=2)
    assert [last_arrived(cfg, t) for t in range(1, 10)] == [0, 1, 2, 2, 2, 3, 4, 5, 6]
    assert [last_arrived(DGAConfig(delay=0), t) for t in (1, 2, 5)] == [0, 1, 4]
    with pytest.raises(ValueError, match="rounds start at 1"):
        last_arrived(cfg, 0)
    server = DGAServer(DGAConfig(delay=3), {"x": torch.zeros(2)})
    for t in range(1, 8):
        server.advance(t, {"x": server.global_model(last_arrived(server.config, t))["x"] + 1.0})
    assert sorted(server.globals) == [4, 5, 6, 7]  # G(last_arrived(8)) = G(4) onwards
    torch.testing.assert_close(server.global_model(7)["x"], torch.full((2,), 7.0))
    with pytest.raises(KeyError, match="not kept"):
        server.global_model(1)
    with pytest.raises(ValueError, match="expected 8, got 9"):
        server.advance(9, {"x": torch.zeros(2)})
    torch.testing.assert_close(server.skip(8)["x"], torch.full((2,), 7.0))


def test_sync_refuses_a_state_that_does_not_fit_the_message():
    st = DGAClient(DGAConfig(delay=2), {"x": torch.zeros(2)})
    st.sync(0, {"x": torch.ones(2)})
    st.train_round(1, {"x": torch.full((2,), 2.0)})
    with pytest.raises(DGAStateError, match="holds the global model of round 3.*holds round 0"):
        st.sync(3, None)
    with pytest.raises(DGAStateError, match="already trained"):
        st.train_round(1, {"x": torch.zeros(2)})
    back = DGAClient.from_state_dict(st.config, st.state_dict())
    assert back.global_round == 0 and sorted(back.in_flight) == [1]
    back.sync(1, {"x": torch.full((2,), 5.0)})  # round 1's own update is now inside G(1)
    assert back.global_round == 1 and back.in_flight == {}
    torch.testing.assert_close(back.model["x"], torch.full((2,), 5.0))
    with pytest.raises(DGAStateError, match="arrived after"):
        back.sync(0, {"x": torch.zeros(2)})


def _ema_statistic_run(cfg: DGAConfig, statistics, rounds: int, k: int = 1, b: float = 2.0,
                       decay: float = 0.0) -> list[float]:
    """A BatchNorm running variance through DGA's global-model form: each client starts
    from what sync gives it and takes k EMA steps (torch's momentum 0.1) towards the
    batch variance b. Returns G(t) of the statistic after each round."""
    name = "bn.running_var"
    server = DGAServer(cfg, {name: torch.tensor([1.0], dtype=torch.float64)}, statistics=statistics,
                       statistics_decay=decay)
    clients = [DGAClient(cfg, {name: torch.tensor([1.0], dtype=torch.float64)}) for _ in range(2)]
    out = []
    for t in range(1, rounds + 1):
        g = last_arrived(cfg, t)
        new = t == 1 or g != last_arrived(cfg, t - 1)
        replies = []
        for c in clients:
            c.sync(g, server.global_model(g) if new else None)
            x = c.model[name].clone()
            for _ in range(k):
                x = 0.9 * x + 0.1 * b
            replies.append(c.train_round(t, {name: x}))
        out.append(float(server.advance(t, {name: (replies[0][name] + replies[1][name]) / 2})[name]))
    return out


def test_uncorrected_running_statistics_continue_one_workers_average_and_stay_stable():
    from fededge.algorithms.dga import norm_statistics

    names = ["conv.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert norm_statistics(names) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    stats = norm_statistics(["bn.running_var"])
    cfg = DGAConfig(delay=20, correction=False)
    # As a delayed change, x(t) = x(t-1) + 0.1 (b - x(t-21)) oscillates with a growing
    # amplitude: the variance goes negative (what made uncorrected cnn-bn evaluate at chance).
    delayed = _ema_statistic_run(cfg, frozenset(), rounds=200)
    assert min(delayed) < 0 and max(abs(v - 2.0) for v in delayed[-20:]) > 1.0
    # With the clients' decay c = 0.9^K, the server's statistic is one worker's average
    # without delay, x(t) = c x(t-1) + (1 - c) b: the gap to b shrinks by c every round.
    for k in (1, 5):
        c = 0.9 ** k
        ema = _ema_statistic_run(cfg, stats, rounds=60, k=k, decay=c)
        assert ema == pytest.approx([2.0 - c ** t for t in range(1, 61)], rel=1e-12)
    # decay 0: the round's average itself, x(t) = 0.9 x(t-21) + 0.2: stable, but it lags
    avg = _ema_statistic_run(cfg, stats, rounds=200)
    assert all(1.0 <= a <= b <= 2.0 for a, b in zip(avg, avg[1:]))
    assert abs(avg[-1] - 2.0) == pytest.approx(0.9 ** 10, rel=1e-9)
    # The weights' rule is untouched, and so is every entry with the correction or at D = 0.
    with_stats = DGAServer(cfg, {"w": torch.zeros(1), "bn.running_var": torch.ones(1)}, statistics=stats,
                           statistics_decay=0.5)
    plain = DGAServer(cfg, {"w": torch.zeros(1), "bn.running_var": torch.ones(1)})
    for t in range(1, 30):
        ybar = {"w": torch.full((1,), float(t)), "bn.running_var": torch.full((1,), 3.0 + t)}
        a, b = with_stats.advance(t, ybar), plain.advance(t, ybar)
        assert torch.equal(a["w"], b["w"])
    assert float(a["bn.running_var"]) != float(b["bn.running_var"])
    for corr, d in ((True, 20), (False, 0)):
        c = DGAConfig(delay=d, correction=corr)
        assert _ema_statistic_run(c, stats, rounds=60, decay=0.9) == _ema_statistic_run(c, frozenset(), rounds=60)
    with pytest.raises(ValueError, match="statistics_decay must be in"):
        DGAServer(cfg, {"w": torch.zeros(1)}, statistics_decay=1.0)


def test_stale_stability_limit_matches_the_closed_forms_and_bounds_a_real_run():
    import math

    from fededge.algorithms.dga import stale_stability_limit

    for m in (0.0, 0.5, 0.9):
        assert stale_stability_limit(0, m) == pytest.approx(2 * (1 + m), abs=1e-9)  # synchronous heavy ball
    for d in (1, 2, 5, 10, 20):
        assert stale_stability_limit(d) == pytest.approx(2 * math.sin(math.pi / (2 * (2 * d + 1))), abs=1e-9)
    assert stale_stability_limit(10, 0.9) == pytest.approx(0.0114, abs=5e-5)
    assert stale_stability_limit(20, 0.9) < stale_stability_limit(10, 0.9) < stale_stability_limit(5, 0.9)

    def run(a: float, d: int, m: float, steps: int = 20_000) -> float:
        """The stale-only recursion itself, from w = 1: |w| at the end."""
        w = [1.0] * (d + 2)
        for _ in range(steps):
            w.append(w[-1] + m * (w[-1] - w[-2]) - a * w[-1 - d])
            w.pop(0)
        return abs(w[-1])

    for d, m in ((0, 0.9), (5, 0.0), (10, 0.9), (20, 0.9)):
        limit = stale_stability_limit(d, m)
        for a in (0.5 * limit, 0.9 * limit):  # the whole interval below the limit converges
            assert run(a, d, m) < 1e-3
        assert not run(1.05 * limit, d, m) < 1e3  # just above it diverges (inf or nan: also not < 1e3)
    with pytest.raises(ValueError, match="momentum"):
        stale_stability_limit(3, 1.0)
