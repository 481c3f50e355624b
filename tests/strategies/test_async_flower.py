"""FedAsync, FedBuff, SSP and backup workers through Flower (strategy + ClientApp),
in-process; dropouts and silent nodes for every strategy and for FedAvg."""

import contextlib
import random
import json
import time

import pytest
import torch

from fededge import _flwr_internals as fi
from fededge.config import ConfigError, RunConfig
from fededge.server.runner import run_experiment
from fededge.server.grid import SUPERLINK_NODE_ID, InProcessGrid
from fededge.server.inprocess import run_inprocess
from fededge.strategies.asyncfl import AsyncFL, BackupWorkers, FedAsync, FedBuff, SSP
from fededge.strategies.registry import build_strategy

BASE = {"num-rounds": 4, "local-steps": 3, "progress": "off", "partition": "iid"}
ASYNC = ["fedasync", "fedbuff", "ssp", "backup"]


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _models(a, b):
    return torch.load(a / "model.pt"), torch.load(b / "model.pt")


def test_backup_workers_with_no_backups_is_fedavg_bit_for_bit(tmp_path):
    fedavg = run_inprocess({**BASE, "results-dir": str(tmp_path / "a")}, num_clients=4)
    backup = run_inprocess({**BASE, "strategy": "backup", "backup-workers": 0,
                            "results-dir": str(tmp_path / "b")}, num_clients=4)
    ma, mb = _models(fedavg, backup)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert [r["accuracy"] for r in _lines(fedavg)] == [r["accuracy"] for r in _lines(backup)]
    assert all(r["late"] == [] and r["num_clients"] == 4 for r in _lines(backup)[1:])


def test_backup_workers_with_no_backups_keep_fedavgs_clock_where_nodes_pull(tmp_path):
    """A pulling node (a SuperNode, nodes-pull) takes its next message at its next ask
    after its reply: FedAvg's round charged it, backup workers' did not."""
    over = {**BASE, "sim-step-s": 0.5, "compute-speed": "lognormal:0.2", "nodes-pull": True}
    fedavg = run_inprocess({**over, "results-dir": str(tmp_path / "a")}, num_clients=4)
    backup = run_inprocess({**over, "strategy": "backup", "backup-workers": 0,
                            "results-dir": str(tmp_path / "b")}, num_clients=4)
    times = [[r["sim_s"] for r in _lines(run)[1:]] for run in (fedavg, backup)]
    assert times[1] == pytest.approx(times[0], abs=1e-9)
    assert times[0][1] - times[0][0] > 3.0  # the 3 s poll is in each round after the first


def test_backup_workers_break_equal_arrivals_by_client(tmp_path):
    """Identical clients on an ideal link with a fixed step arrive together every round;
    the first m were those of the smallest (random, per run) message ids: two runs of one
    config and seed took different clients and made different models."""
    over = {**BASE, "strategy": "backup", "backup-workers": 2, "sim-step-s": 0.01}
    runs = [run_inprocess({**over, "results-dir": str(tmp_path / k)}, num_clients=4) for k in "ab"]
    for run in runs:
        lines = _lines(run)[1:]
        assert [r["contributors"] for r in lines] == [[0, 1]] * 4, [r["contributors"] for r in lines]
        assert [r["late"] for r in lines] == [[2, 3]] * 4
    ma, mb = _models(*runs)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_fedbuff_with_a_buffer_of_n_and_no_staleness_is_fedavg(tmp_path):
    """Identical clients on an ideal network arrive together: every buffer holds one fresh
    update per client, and FedBuff's step is FedAvg's mean (to float rounding)."""
    over = {**BASE, "sim-step-s": 0.01}
    fedavg = run_inprocess({**over, "results-dir": str(tmp_path / "a")}, num_clients=4)
    buff = run_inprocess({**over, "strategy": "fedbuff", "buffer-size": 4, "staleness": "polynomial",
                          "results-dir": str(tmp_path / "b")}, num_clients=4)
    ma, mb = _models(fedavg, buff)
    for k in ma:
        assert torch.allclose(ma[k].double(), mb[k].double(), rtol=0, atol=1e-5), k
    lines = _lines(buff)[1:]
    assert all(r["staleness_hist"] == {"0": 4} and r["num_clients"] == 4 for r in lines)
    assert [r["sim_s"] for r in lines] == pytest.approx([0.03, 0.06, 0.09, 0.12])
    assert [r["sim_s"] for r in _lines(fedavg)[1:]] == pytest.approx([0.03, 0.06, 0.09, 0.12])


def test_async_arrivals_follow_the_simulated_clock_and_fast_clients_contribute_more(tmp_path):
    over = {**BASE, "num-rounds": 24, "strategy": "fedasync", "netem": "wifi:0.5,3g:0.5",
            "compute-speed": "lognormal:1.0", "sim-step-s": 0.05, "results-dir": str(tmp_path)}
    run = run_inprocess(over, num_clients=4)
    lines = _lines(run)[1:]
    sims = [r["sim_s"] for r in lines]
    assert sims == sorted(sims) and len(set(sims)) > 1
    contrib = [_summary(run)["contributions"].get(str(p), 0) for p in range(4)]
    assert sum(contrib) == 24 and max(contrib) >= 2 * min(contrib) + 1
    assert max(int(k) for k in _summary(run)["staleness_hist"]) >= 1
    # The seed (with sim-step-s) makes the run deterministic, arrival order included.
    again = run_inprocess({**over, "results-dir": str(tmp_path / "again")}, num_clients=4)
    assert [(r["sim_s"], r["contributors"], r["accuracy"]) for r in _lines(again)[1:]] == \
           [(r["sim_s"], r["contributors"], r["accuracy"]) for r in lines]


def test_backup_workers_drop_the_slowest_and_record_it(tmp_path):
    over = {**BASE, "strategy": "backup", "backup-workers": 0.25, "netem": "wifi:0.5,3g:0.5",
            "compute-speed": "lognormal:1.0", "sim-step-s": 0.05, "results-dir": str(tmp_path)}
    run = run_inprocess(over, num_clients=4)
    for r in _lines(run)[1:]:
        assert r["num_clients"] == 3 and len(r["late"]) == 1 and set(r["late"]).isdisjoint(r["contributors"])
    assert sum(_summary(run)["late_replies"].values()) == 4
    fedavg = run_inprocess({**over, "strategy": "fedavg", "results-dir": str(tmp_path / "f")}, num_clients=4)
    assert _lines(run)[-1]["sim_s"] < _lines(fedavg)[-1]["sim_s"]


@pytest.mark.parametrize("strategy", ["fedavg", *ASYNC])
def test_a_run_completes_with_30_percent_of_clients_never_answering(tmp_path, strategy):
    over = {**BASE, "strategy": strategy, "dropout": 0.3, "round-timeout": 20.0, "sim-step-s": 0.05,
            "num-rounds": 6, "buffer-size": 3, "backup-workers": 1, "results-dir": str(tmp_path)}
    run = run_inprocess(over, num_clients=10)
    assert _summary(run)["status"] == "completed"
    lines = _lines(run)[1:]
    assert len(lines) == 6 and all(r["num_clients"] >= 1 for r in lines)
    dropped = {p for r in lines for p in r.get("dropped") or []}
    if strategy in ("fedavg", "backup"):
        # Synchronous rounds meet the three dropouts every round: they wait for the timeout
        # (backup workers with e = 1 cannot cover three).
        assert len(dropped) == 3 and all(r["round_sim_s"] >= 20.0 for r in lines)
        assert all(r["num_clients"] == 7 for r in lines)
    else:
        # Asynchronous ones never wait: six versions are made long before any timeout.
        assert lines[-1]["sim_s"] < 20.0
        assert not set(_summary(run)["contributions"]) & dropped


class SilentGrid:
    """A grid on which some nodes never answer (their messages vanish), as dead
    SuperNodes would; ``send_and_receive`` waits out its timeout like Flower's."""

    def __init__(self, inner, silent):
        self.inner, self.silent, self._n = inner, set(silent), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def push_messages(self, messages):
        messages, ids = list(messages), []
        live = [m for m in messages if m.metadata.dst_node_id not in self.silent]
        live_ids = iter(self.inner.push_messages(live))
        for m in messages:
            if m.metadata.dst_node_id in self.silent:
                self._n += 1
                ids.append(f"silent-{self._n}")
            else:
                ids.append(next(live_ids))
        return ids

    def pull_messages(self, message_ids):
        return self.inner.pull_messages([i for i in message_ids if not i.startswith("silent-")])

    def send_and_receive(self, messages, *, timeout=None):
        ids = list(self.push_messages(messages))
        got, t0 = {}, time.monotonic()
        while len(got) < len(ids) and time.monotonic() - t0 < (timeout or 3600):
            for r in self.pull_messages([i for i in ids if i not in got]):
                got[r.metadata.reply_to_message_id] = r
            time.sleep(0.05)
        return [got[i] for i in ids if i in got]


@pytest.mark.timing
@pytest.mark.parametrize("strategy", ["fedavg", "fedasync", "ssp", "backup"])
def test_silent_nodes_cost_the_round_timeout_in_real_time_and_nothing_more(tmp_path, strategy):
    rounds = 3 if strategy in ("fedavg", "backup") else 8  # async: the write-off (sim 1 s) is used
    cfg = RunConfig.from_mapping({**BASE, "strategy": strategy, "round-timeout": 1.0, "num-rounds": rounds,
                                  "results-dir": str(tmp_path), "backup-workers": 1, "ssp-bound": 1,
                                  "sim-step-s": 0.2})
    from fededge.clients.app import app
    inner = InProcessGrid(app, num_nodes=4, run_config=cfg.to_mapping(), seed=cfg.seed)
    dead = sorted(inner.get_node_ids())[:1]
    grid = SilentGrid(inner, dead)
    grid.runs_messages_in_order = True
    t0 = time.monotonic()
    with fi.task_identity(run_id=1, node_id=SUPERLINK_NODE_ID, task_id=1):
        res = run_experiment(grid, cfg, runtime="inprocess")
    took = time.monotonic() - t0
    assert res.summary["status"] == "completed"
    lines = _lines(res.run_dir)[1:]
    assert len(lines) == rounds and all(r["num_clients"] >= 1 for r in lines)
    assert any(r.get("dropped") for r in lines)
    assert took < 30  # at most one 1 s timeout per round, plus training


@pytest.mark.parametrize("bad, match", [
    ({"strategy": "fedasync", "async-alpha": 1.5}, r"'async-alpha': async-alpha must be in \(0, 1\]"),
    ({"strategy": "fedbuff", "buffer-size": 0}, "'buffer-size': buffer-size must be >= 1"),
    ({"staleness": "exponential"}, "'staleness': staleness must be one of constant, polynomial, hinge"),
    ({"strategy": "ssp", "ssp-bound": -1}, "'ssp-bound': ssp-bound must be >= 0"),
    ({"backup-workers": 1.5}, "'backup-workers': backup as a fraction must be < 1"),
    ({"dropout": 1.0}, r"'dropout' must be in \[0.0, 1.0\)"),
    ({"async-order": "fifo"}, "'async-order': order must be one of auto, clock, arrival"),
    ({"strategy": "fedbuff", "compressor": "topk"}, "not supported with strategy='fedbuff'"),
    ({"sim-step-s": -1.0}, "'sim-step-s': sim_step_s must be a number of seconds >= 0"),
])
def test_bad_async_settings_are_named(bad, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(bad)


def test_the_registry_builds_the_async_strategies():
    over = {"buffer-size": 5, "ssp-bound": 3, "async-alpha": 0.3, "staleness": "hinge", "async-concurrency": 2}
    for name, cls in (("fedasync", FedAsync), ("fedbuff", FedBuff), ("ssp", SSP)):
        s = build_strategy(RunConfig.from_mapping({"strategy": name, **over}))
        assert type(s) is cls and isinstance(s, AsyncFL) and s.config.mode == name
        assert s.config.concurrency == 2
    assert build_strategy(RunConfig.from_mapping({"strategy": "fedbuff", **over})).config.buffer_size == 5
    assert build_strategy(RunConfig.from_mapping({"strategy": "ssp", **over})).config.ssp_bound == 3
    fedasync = build_strategy(RunConfig.from_mapping({"strategy": "fedasync", **over}))
    assert fedasync.config.alpha == 0.3 and fedasync.config.staleness.kind == "hinge"
    b = build_strategy(RunConfig.from_mapping({"strategy": "backup", "backup-workers": 0.2}))
    assert isinstance(b, BackupWorkers) and b.backups_for(10) == 2 and b.backups_for(1) == 0


def test_an_async_run_where_nobody_answers_stops_with_a_clear_error(tmp_path):
    """dropout 0.6 of 2 clients rounds to both: FedAsync must not spin forever."""
    with pytest.raises(RuntimeError, match="messages in a row got no usable reply"):
        run_inprocess({**BASE, "strategy": "fedasync", "dropout": 0.8, "round-timeout": 5.0,
                       "results-dir": str(tmp_path)}, num_clients=2)


@pytest.mark.parametrize("strategy", ["fedasync", "backup"])
def test_a_failing_client_is_written_off_and_the_others_go_on(tmp_path, strategy):
    from .apps import failing_once

    run = run_inprocess({**BASE, "strategy": strategy, "backup-workers": 1, "num-rounds": 6,
                         "round-timeout": 2.0, "sim-step-s": 0.5, "results-dir": str(tmp_path)},
                        num_clients=3, client_app=failing_once(partition=1, at_round=1))
    lines = _lines(run)[1:]
    assert _summary(run)["status"] == "completed" and len(lines) == 6
    # Its first message failed before the server learnt its partition id: the node id names it.
    assert sum(len(r.get("dropped") or []) for r in lines) == 1
    assert _summary(run)["contributions"].get("1", 0) >= 1  # it rejoined


def test_an_error_reply_in_arrival_order_does_not_move_the_clock_by_the_timeout(tmp_path):
    """Under arrival order a reply is used when it is pulled: an error reply stamped at
    its message's departure plus round-timeout (clock order's stand-in for a dropout)
    waited behind every later arrival (here: the whole run, the client never asked
    again) and moved the run's clock past that mark when used. Stamped as it came, the
    client is asked again after another's update (at once, an error that comes back at
    once was a storm of retries that stopped the run as 'no client is answering')."""
    from .apps import failing_once

    run = run_inprocess({**BASE, "strategy": "fedasync", "async-order": "arrival", "num-rounds": 6,
                         "round-timeout": 1000.0, "sim-step-s": 0.5, "results-dir": str(tmp_path)},
                        num_clients=3, client_app=failing_once(partition=1, at_round=1))
    lines = _lines(run)[1:]
    assert _summary(run)["status"] == "completed" and len(lines) == 6
    assert sum(len(r.get("dropped") or []) for r in lines) == 1
    assert lines[-1]["sim_s"] < 100.0, [r["sim_s"] for r in lines]  # 6 versions of 3-step clients


class _TricklingGrid:
    """A SuperLink-like grid: one reply per pull; node 2's first message comes back as
    ``first`` (a simulated dropout or a client's error), every other as a trained reply."""

    def __init__(self, first):
        self.first, self.n, self.pending = first, 0, {}

    def get_node_ids(self):
        return [1, 2]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self.n += 1
            mid = f"{self.n:064x}"
            fi.set_message_id(m, mid)
            self.pending[mid] = m
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        from flwr.app import Error, Message, MetricRecord, RecordDict

        from fededge import keys

        for mid in ids:
            m = self.pending.pop(mid, None)
            if m is None:
                continue
            if m.metadata.dst_node_id == 2 and self.first is not None:
                reply, self.first = Message(Error(code=0, reason=self.first), reply_to=m), None
                return [reply]
            return [Message(RecordDict({"arrays": m.content["arrays"], "metrics": MetricRecord(
                {"num-examples": 10, keys.LOCAL_STEPS_DONE: 1})}), reply_to=m)]
        return []


@pytest.mark.parametrize("kind", ["dropout", "error"])
def test_a_write_off_in_arrival_order_leaves_the_clock_where_the_arrivals_put_it(kind):
    """Replies trickle in as on a SuperLink: a write-off stamped at its departure plus
    round-timeout, used when it came up, moved the run's clock (and every later version)
    by the timeout."""
    from flwr.app import ArrayRecord

    from fededge.strategies._replies import DROPOUT_REASON

    reason = f"{DROPOUT_REASON} (test)" if kind == "dropout" else "RuntimeError: boom"
    strategy = FedAsync(order="arrival", step_s=1.0, poll_s=0.0)
    with fi.task_identity(run_id=1, node_id=0, task_id=1):
        strategy.start(_TricklingGrid(reason), ArrayRecord({"w": torch.zeros(2)}), num_rounds=4, timeout=100.0)
    reports = [strategy.round_report(v) for v in range(1, 5)]
    assert sum(len(r.dropped) for r in reports) == 1
    assert all(r.sim_s < 10.0 for r in reports), [r.sim_s for r in reports]


def _same_runs(a, b) -> bool:
    def strip(lines):
        for r in lines:
            r.pop("wall_s")
            for c in r.get("clients", []):
                c.pop("compute_s")  # measured, recorded as such
        return lines
    return strip(_lines(a)) == strip(_lines(b))


def _slowed(monkeypatch, seconds: float) -> None:
    """Make the first client that trains sleep ``seconds`` in real time, every message."""
    from fededge.clients import app as client_app

    real, first = client_app.local_sgd, []

    def slow(model, x, y, **kw):  # noqa: ANN001, ANN003, ANN202
        if not first:
            first.append(x.data_ptr())
        if x.data_ptr() == first[0]:
            time.sleep(seconds)
        return real(model, x, y, **kw)

    monkeypatch.setattr(client_app, "local_sgd", slow)


#: An ideal network, so that compute decides the order of arrivals.
ORDERED = {**BASE, "num-rounds": 8, "netem": "", "compute-speed": "lognormal:1.0", "buffer-size": 2,
           "backup-workers": 1}


@pytest.mark.parametrize("strategy", ASYNC)
def test_same_config_and_seed_same_run_by_default_whatever_the_wall_clock(tmp_path, strategy, monkeypatch,
                                                                           caplog):
    """Issue 37: fedbuff in-process differed from round 3 on between two runs of one
    config, its arrivals ordered by the measured compute. By default the clock charges
    async-step-s per local step: a run equals one in which a client trains 50 ms slower
    in real time (the control below shows that this changes a run that measures)."""
    over = {**ORDERED, "strategy": strategy}
    with caplog.at_level("INFO", logger="fededge"):
        a = run_inprocess({**over, "results-dir": str(tmp_path / "a")}, num_clients=4)
    assert "0.01 s per reported local step (async-step-s)" in caplog.text
    _slowed(monkeypatch, 0.05)
    b = run_inprocess({**over, "results-dir": str(tmp_path / "b")}, num_clients=4)
    assert _same_runs(a, b)
    ma, mb = _models(a, b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_measured_compute_must_be_asked_for_is_said_in_the_log_and_follows_the_wall_clock(tmp_path, caplog,
                                                                                          monkeypatch):
    over = {**ORDERED, "strategy": "fedbuff", "async-step-s": 0.0}
    with caplog.at_level("INFO", logger="fededge"):
        a = run_inprocess({**over, "results-dir": str(tmp_path / "a")}, num_clients=4)
    warned = [r for r in caplog.records if "measured on the wall clock (async-step-s=0)" in r.getMessage()]
    assert warned and warned[0].levelname == "WARNING"
    _slowed(monkeypatch, 0.05)
    b = run_inprocess({**over, "results-dir": str(tmp_path / "b")}, num_clients=4)
    assert not _same_runs(a, b)  # the control: the slow client's arrivals come later
    with pytest.raises(ConfigError, match="async-step-s"):
        RunConfig.from_mapping({"async-step-s": -1})


@pytest.mark.parametrize("strategy", ["fedbuff", "backup", "dga"])
def test_the_clock_uploads_each_reply_as_the_meter_counted_it_without_serialising_it_again(tmp_path, monkeypatch,
                                                                                          strategy):
    """The simulated clock's upload of a reply takes the bytes the meter counted when it
    was pulled: no reply is serialised a second time to size it (45 MB each for a
    ResNet-18), and the simulated times are those of sizing it again (where the clock
    charges modelled compute; DGA's charges the measured seconds)."""
    from unittest import mock

    calls = []
    real = fi.wire_size
    monkeypatch.setattr(fi, "wire_size", lambda m, cache=None: calls.append(m) or real(m, cache))
    runs = []
    for counted in (True, False):
        calls.clear()
        forget = mock.patch("fededge.server.metering.remember_counted_size", lambda m, n: None)
        with (contextlib.nullcontext() if counted else forget):
            run_dir = run_inprocess({"num-rounds": 3, "model": "mlp", "progress": "off", "checkpoint-every": 0,
                                     "strategy": strategy, "netem": "4g", "results-dir": str(tmp_path / str(counted))},
                                    num_clients=5)
        runs.append((_lines(run_dir), len(calls)))
    (with_counts, sized_again), (without, sized_before) = runs
    assert sized_again == 0 and sized_before > 0
    for a, b in zip(with_counts, without, strict=True):
        assert a["bytes_up"] == b["bytes_up"]
        if strategy != "dga":  # DGA's clock charges the measured compute seconds: two runs differ there
            assert (a["sim_s"], a["round_sim_s"]) == (b["sim_s"], b["round_sim_s"])


def test_fixed_participants_are_sized_from_the_nodes_there_once_enough_connected():
    """Sized before waiting for min_available: one node connected at first gave 10
    participants of 10 at fraction 0.5, all connected gave 5."""
    from fededge.strategies._replies import fixed_participants

    class Joining:  # nodes connect as the grid is asked (a SuperLink's early seconds)
        def __init__(self, first):
            self.seen = first

        def get_node_ids(self):
            self.seen = min(10, self.seen + 3)
            return list(range(1, self.seen + 1))

    for first in (1, 10):
        random.seed(0)
        got = fixed_participants(Joining(first), fraction=0.5, min_nodes=2, min_available=10)
        assert len(got) == 5, (first, got)
