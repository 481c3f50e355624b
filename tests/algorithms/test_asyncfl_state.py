"""The asynchronous server, scheduler and event queue saved mid-run (issue 18): loaded
into fresh objects, they continue exactly as the originals do."""

import io

import pytest
import torch

from fededge.algorithms.asyncfl import AsyncConfig, AsyncScheduler, AsyncServer, Event, EventQueue

CLIENTS = [11, 22, 33, 44, 55]
SPEED = {11: 1.0, 22: 1.7, 33: 2.9, 44: 0.6, 55: 4.1}


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _fresh(mode):
    config = AsyncConfig(mode=mode, buffer_size=3, alpha=0.5, ssp_bound=1)
    initial = {"w": torch.zeros(4, dtype=torch.float64), "steps": torch.tensor(0)}
    server = AsyncServer(config, initial, num_clients=len(CLIENTS))
    sched = AsyncScheduler(CLIENTS, concurrency=3, ssp_bound=1 if mode == "ssp" else None, seed=7)
    return server, sched, EventQueue()


class Sim:
    """A pure event loop: each dispatch trains (a seeded step from the model it was
    sent), arrives after its client's time; every 7th dispatch is written off."""

    def __init__(self, mode):
        self.server, self.sched, self.queue = _fresh(mode)
        self.now = 0.0
        self.dispatch()

    def dispatch(self):
        for c in self.sched.startable():
            d = self.sched.start(c, version=self.server.version, at=self.now)
            if d.seq % 7 == 6:
                self.queue.push(Event(self.now + 10.0, d.seq, c, dropped=True))
                continue
            g = torch.Generator().manual_seed(d.seq)
            update = {"w": self.server.model["w"] + torch.randn(4, generator=g, dtype=torch.float64),
                      "steps": torch.tensor(d.seq)}
            self.queue.push(Event(self.now + SPEED[c] * (1 + d.seq % 3), d.seq, c, payload=update))

    def step(self):
        ev = self.queue.pop()
        self.now = max(self.now, ev.time)
        if ev.payload is None:
            self.sched.write_off(ev.client)
        else:
            d = self.sched.finish(ev.client)
            self.server.receive(ev.payload, base_version=d.version, num_examples=1.0 + ev.client % 3)
            self.server.keep({x.version for x in self.sched.running.values()})
        self.dispatch()
        return self.server.version, {k: v.clone() for k, v in self.server.model.items()}, self.now

    def state_dict(self):
        return {"server": self.server.state_dict(), "sched": self.sched.state_dict(),
                "queue": self.queue.state_dict(), "now": self.now}

    @classmethod
    def from_state(cls, mode, state):
        sim = cls.__new__(cls)
        sim.server, sim.sched, sim.queue = _fresh(mode)
        sim.server.load_state_dict(state["server"])
        sim.sched.load_state_dict(state["sched"])
        sim.queue.load_state_dict(state["queue"])
        sim.now = state["now"]
        return sim


@pytest.mark.parametrize("mode", ["fedasync", "fedbuff", "ssp"])
@pytest.mark.parametrize("k", [1, 5, 12])
def test_a_loop_saved_and_loaded_mid_run_continues_exactly(mode, k):
    sim = Sim(mode)
    for _ in range(k):
        sim.step()
    state = _roundtrip(sim.state_dict())
    resumed = Sim.from_state(mode, state)
    went_on = [sim.step() for _ in range(25)]
    again = [resumed.step() for _ in range(25)]
    for (v1, m1, t1), (v2, m2, t2) in zip(went_on, again):
        assert (v1, t1) == (v2, t2)
        assert all(torch.equal(m1[n], m2[n]) for n in m1)
    # Not vacuous: write-offs, stale updates and the scheduler's draws all happened.
    assert sum(sim.sched.dropped.values()) > 0 and max(sim.server.staleness) > 0
    assert went_on[-1][0] > went_on[0][0]


def test_fedbuff_saved_with_a_partial_buffer_keeps_it():
    sim = Sim("fedbuff")
    while sim.server.buffered == 0:
        sim.step()
    state = _roundtrip(sim.state_dict())
    assert len(state["server"]["buffer"]) == sim.server.buffered
    assert Sim.from_state("fedbuff", state).server.buffered == sim.server.buffered


def test_the_scheduler_state_holds_its_generator():
    a = AsyncScheduler(CLIENTS, concurrency=2, seed=1)
    a.rng.random()
    b = AsyncScheduler(CLIENTS, concurrency=2, seed=99)
    b.load_state_dict(_roundtrip(a.state_dict()))
    assert [a.startable() for _ in range(5)] == [b.startable() for _ in range(5)]


def test_the_queue_pops_in_the_same_order_ties_by_dispatch():
    q = EventQueue()
    for t, seq in [(2.0, 5), (1.0, 3), (2.0, 1), (0.5, 9), (1.0, 0)]:
        q.push(Event(t, seq, client=seq, payload={"x": torch.tensor(float(seq))}))
    r = EventQueue()
    r.load_state_dict(_roundtrip(q.state_dict(encode=lambda p: {"enc": p["x"]})), decode=lambda p: {"x": p["enc"]})
    got = [(e.time, e.seq, e.client, float(e.payload["x"])) for e in (r.pop() for _ in range(len(r)))]
    want = [(e.time, e.seq, e.client, float(e.payload["x"])) for e in (q.pop() for _ in range(len(q)))]
    assert got == want == [(0.5, 9, 9, 9.0), (1.0, 0, 0, 0.0), (1.0, 3, 3, 3.0), (2.0, 1, 1, 1.0), (2.0, 5, 5, 5.0)]


def test_a_state_of_other_clients_or_another_model_is_refused():
    sched = AsyncScheduler(CLIENTS, concurrency=3, seed=0)
    with pytest.raises(ValueError, match="clients"):
        AsyncScheduler(CLIENTS[:4], concurrency=3, seed=0).load_state_dict(sched.state_dict())
    server, _, _ = _fresh("fedasync")
    other = AsyncServer(AsyncConfig(), {"v": torch.zeros(2)}, num_clients=2)
    with pytest.raises(ValueError, match="tensors"):
        other.load_state_dict(server.state_dict())
