"""Checkpoint and resume of the asynchronous strategies (issue 18): a run stopped at a
checkpoint and continued on a fresh grid, strategy and clock makes the same versions, bit
for bit, at the same simulated times, as a run never stopped."""

from __future__ import annotations

import io
import random

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord

from fededge import _flwr_internals as fi
from fededge.clients.app import app as client_app
from fededge.config import RunConfig
from fededge.netem.runclock import RunClock
from fededge.server.runner import train_config
from fededge.server.grid import SUPERLINK_NODE_ID, InProcessGrid
from fededge.server.experiment import seeded_sampling
from fededge.strategies.registry import build_strategy
from fededge.strategies.resume import ResumeError
from fededge.workload import dataset_for, model_for

N = 8  # versions (rounds)
NODES = 5
# Async strategies refuse compression (config.py: their replies are used one by one
# against the version each client trained on), so these runs are uncompressed; the
# clients' context.state (sampler positions) is still carried by the grid's state.
BASE = {"num-rounds": N, "local-steps": 2, "model": "mlp", "batch-size": 16, "progress": "off",
        "netem": "4g:0.5,3g:0.5", "sim-step-s": 0.01, "seed": 3}
RUNS = {
    "fedbuff": {"strategy": "fedbuff", "buffer-size": 2},
    "fedasync": {"strategy": "fedasync", "async-concurrency": 3},  # idle clients drawn: the scheduler's RNG
    "ssp": {"strategy": "ssp", "ssp-bound": 1},
    "backup": {"strategy": "backup", "backup-workers": 2},
    # An ideal network: identical clients' replies arrive at the same instant, so the
    # checkpoint's version is made by one of several arrivals at that instant.
    "fedasync-same-instant": {"strategy": "fedasync", "netem": ""},
}


class Stop(Exception):
    """A simulated kill, right after a checkpoint was written."""


class Hook:
    """A CheckpointHook: at ``at``, save everything the experiment would, then stop."""

    def __init__(self, at, strategy, grid, clock, stop=True):
        self.at, self.strategy, self.grid, self.clock, self.stop = at, strategy, grid, clock, stop
        self.asked = []
        self.blob = None
        self.out_when_due = None  # messages in flight when the checkpoint was found due

    def due(self, server_round):
        self.asked.append(server_round)
        if server_round == self.at and getattr(self.strategy, "_run", None) is not None:
            self.out_when_due = len(self.strategy._run.inflight)
        return server_round == self.at

    def save(self, server_round):
        buf = io.BytesIO()
        torch.save({"round": server_round, "strategy": self.strategy.state_dict(), "grid": self.grid.state_dict(),
                    "random": random.getstate(), "clock": self.clock.state_dict()}, buf)
        self.blob = buf.getvalue()
        if self.stop:
            raise Stop


class Lagging:
    """The in-process grid, but a reply comes back only after ``hold`` more pulls of it
    (0 to 3, by the dispatch's sequence number: replies are pulled late and out of
    order, as on Ray or a SuperLink, and the same way in a resumed run)."""

    def __init__(self, inner):
        self.inner = inner
        self.hold = {}  # message id -> pulls still to wait
        self.ready = {}  # message id -> reply

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for mid, m in zip(ids, messages):
            self.hold[mid] = int(m.metadata.group_id.lstrip("a")) % 4
        return ids

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        for r in self.inner.pull_messages([m for m in ids if m not in self.ready]):
            self.ready[r.metadata.reply_to_message_id] = r
        out = []
        for mid in ids:
            if mid in self.ready:
                self.hold[mid] -= 1
                if self.hold[mid] < 0:
                    del self.hold[mid]
                    out.append(self.ready.pop(mid))
        return out

    def state_dict(self):
        assert not self.ready, "a reply held back at a checkpoint"
        return self.inner.state_dict()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(over, *, stop_at=None, resume=None, node_offset=0, lagging=False, stop=True):
    """One run: ``{version: (arrays, sim_s)}`` of the versions it made, and its hook."""
    cfg = RunConfig.from_mapping({**BASE, **over})
    grid = InProcessGrid(client_app, num_nodes=NODES, run_config=cfg.to_mapping(), seed=cfg.seed + node_offset)
    if lagging:
        grid = Lagging(grid)
    strategy = build_strategy(cfg)
    strategy.poll_s = 0.0
    ds = dataset_for(cfg)
    initial = ArrayRecord(model_for(cfg, ds).state_dict())
    clock = RunClock(netem=cfg.netem, compute_speed=cfg.compute_speed, sim_step_s=cfg.sim_step_s, seed=cfg.seed)
    strategy.attach_clock(clock)
    hook = Hook(stop_at, strategy, grid, clock, stop)
    strategy.attach_checkpoint(hook)
    made = {}

    def evaluate_fn(v, arrays):
        made[v] = ({k: t.clone() for k, t in arrays.to_torch_state_dict().items()},
                   strategy.round_report(v).sim_s)
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    clock.know_nodes(grid.get_node_ids())
    run_id = grid.run.run_id
    with seeded_sampling(cfg.seed), fi.task_identity(run_id=run_id, node_id=SUPERLINK_NODE_ID, task_id=run_id):
        if resume is not None:
            saved = torch.load(io.BytesIO(resume), weights_only=True)
            clock.load_state_dict(saved["clock"])
            clock.know_nodes(grid.get_node_ids())
            strategy.load_state_dict(saved["strategy"])
            if node_offset == 0:
                grid.load_state_dict(saved["grid"])
            random.setstate(saved["random"])
        try:
            strategy.start(grid, initial, num_rounds=N, timeout=3600, train_config=train_config(cfg),
                           evaluate_fn=evaluate_fn)
        except Stop:
            pass
    return made, hook


def _same(a, b, versions):
    for v in versions:
        assert sorted(a[v][0]) == sorted(b[v][0])
        for t in a[v][0]:
            assert torch.equal(a[v][0][t], b[v][0][t]), (v, t)
        assert a[v][1] == b[v][1], v


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(name):
    full, hook = _run(RUNS[name])
    assert sorted(full) == list(range(N + 1))
    assert hook.asked == list(range(1, N + 1))  # asked after every version
    # Not vacuous: every version changes the model and takes simulated time.
    w = [full[v][0]["net.1.weight"] for v in range(N + 1)]
    assert all(not torch.equal(a, b) for a, b in zip(w, w[1:]))
    assert all(full[v][1] >= 0 for v in range(1, N + 1)) and sum(full[v][1] for v in range(1, N + 1)) > 0

    k = N // 2
    first, hook = _run(RUNS[name], stop_at=k)
    assert sorted(first) == list(range(k + 1)) and hook.blob is not None
    _same(first, full, range(k + 1))
    rest, _ = _run(RUNS[name], resume=hook.blob)
    assert sorted(rest) == list(range(k + 1, N + 1))  # version 0 not evaluated again
    _same(rest, full, range(k + 1, N + 1))


def _state(blob):
    return torch.load(io.BytesIO(blob), weights_only=True)["strategy"]


def test_the_checkpoint_holds_stale_dispatches_and_queued_replies():
    """What makes fedbuff's resume non-trivial: clients still train on older versions
    (kept by the server) and their replies wait in the queue, Messages and all."""
    _, hook = _run(RUNS["fedbuff"], stop_at=N // 2)
    run = _state(hook.blob)["run"]
    assert run["server"]["version"] == N // 2
    running = run["scheduler"]["running"]
    assert {v for _, v, _, _ in running} - {N // 2}  # some train on an older version ...
    assert {v for _, v, _, _ in running} <= set(run["server"]["models"])  # ... which the server keeps
    queued = run["queue"]["events"]
    assert queued and all(payload is not None for *_, payload in queued)
    assert {seq for _, seq, *_ in queued} <= {seq for *_, seq in running}


def test_a_checkpoint_inside_an_instant_uses_the_rest_of_the_instant_before_sending():
    _, hook = _run(RUNS["fedasync-same-instant"], stop_at=N // 2)
    run = _state(hook.blob)["run"]
    assert run["mid_instant"]
    assert any(t == run["now"] for t, *_ in run["queue"]["events"])  # arrivals left at this instant


def test_replies_pulled_late_and_out_of_order_change_nothing_under_clock_order():
    """Replies held back by the grid (as on Ray) are used in simulated-arrival order: the
    run equals the in-process one; a checkpoint pulls every reply still out first, and
    the run resumed on a fresh (prompt) grid still equals it."""
    over = RUNS["fedbuff"]
    full, _ = _run(over)
    lagged, _ = _run(over, lagging=True)
    _same(lagged, full, range(N + 1))
    first, hook = _run(over, stop_at=N // 2, lagging=True)
    _same(first, full, range(N // 2 + 1))
    rest, _ = _run(over, resume=hook.blob)
    _same(rest, full, range(N // 2 + 1, N + 1))


def test_under_arrival_order_a_checkpoint_pulls_the_replies_still_out_and_resumes_exactly():
    """Real arrival order (a SuperLink) is not reproducible from run to run, but a run
    resumed from a checkpoint continues exactly as the run that wrote it did: the
    replies still out were pulled into the checkpoint's queue."""
    over = {**RUNS["fedbuff"], "async-order": "arrival"}
    going_on, hook = _run(over, stop_at=N // 2, lagging=True, stop=False)
    assert hook.out_when_due > 0 and sorted(going_on) == list(range(N + 1))
    assert _state(hook.blob)["run"]["queue"]["events"]
    rest, _ = _run(over, resume=hook.blob, lagging=True)
    _same(rest, going_on, range(N // 2 + 1, N + 1))


@pytest.mark.parametrize("name", ["fedbuff", "fedasync"])
def test_a_resumed_run_on_other_nodes_is_refused(name):
    _, hook = _run(RUNS[name], stop_at=2)
    with pytest.raises(ResumeError, match="node id"):
        _run(RUNS[name], resume=hook.blob, node_offset=1)


def test_state_dict_is_read_only_at_a_checkpoint():
    strategy = build_strategy(RunConfig.from_mapping({**BASE, **RUNS["fedbuff"]}))
    with pytest.raises(RuntimeError, match="checkpoint"):
        strategy.state_dict()


def test_a_checkpoint_of_another_mode_is_refused():
    _, hook = _run(RUNS["fedbuff"], stop_at=2)
    other = build_strategy(RunConfig.from_mapping({**BASE, **RUNS["fedasync"]}))
    with pytest.raises(ResumeError, match="fedbuff"):
        other.load_state_dict(_state(hook.blob))
