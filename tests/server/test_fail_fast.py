"""Issue 15: a configuration that cannot work stops the run once, by name, before training;
a client's exception is a failure and an undecodable update a rejection, each reported once.

The impossible configuration is the reported one scaled down: 100 clients, 2,000 synthetic
samples (1,600 for training), Dirichlet alpha 0.5, min-partition-size 10. It passes the
cheap necessary test (100 * 10 <= 1,600), yet no seeded draw gives every client 10.
"""

import json
import logging

import pytest
from flwr.app import Array, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.clients.app import app as fededge_client
from fededge.clients.app import train as fededge_train
from fededge.clients.app import run_config_mods
from fededge.clients.mods import config_error_mod
from fededge.keys import COMPRESSED
from fededge.config import ConfigError, RunConfig
from fededge.server.app import app as fededge_server
from fededge.server.grid import InProcessGrid
from fededge.server.inprocess import run_inprocess
from fededge.server.metering import MeteredGrid
from fededge.workload import check_partition, client_data

CLIENTS = 100
IMPOSSIBLE = {"dataset": "synthetic", "synthetic-samples": 2000, "clients-per-round": 5, "num-rounds": 3,
              "model": "mlp", "local-steps": 2, "progress": "off"}


def _assert_names_the_knobs(msg: str) -> None:
    for needle in ("min-partition-size=10", "alpha=0.5", "1600 training samples", f"{CLIENTS} clients",
                   "raise alpha", "lower min-partition-size", "use fewer clients"):
        assert needle in msg, (needle, msg)


class _Opaque(Grid):
    """A grid the server cannot look into, as in a deployment: it forwards to an in-process
    grid, but is neither one nor a wrapper (no ``inner``) of one."""

    def __init__(self, grid: InProcessGrid) -> None:
        self._g = grid

    def set_run(self, run):  # noqa: ANN001, ANN201
        self._g.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self._g.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return self._g.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self):  # noqa: ANN201
        return self._g.get_node_ids()

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        return self._g.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        return self._g.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        return self._g.send_and_receive(messages, timeout=timeout)


def _serve(grid: Grid, run_config: dict) -> None:
    """fededge's ServerApp on ``grid``, as a runtime would start it."""
    cfg = RunConfig.from_mapping(run_config).to_mapping()
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=cfg)
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        fededge_server(grid, ctx)


def _grid(run_config: dict, num_nodes: int = CLIENTS) -> InProcessGrid:
    return InProcessGrid(fededge_client, num_nodes=num_nodes,
                         run_config=RunConfig.from_mapping(run_config).to_mapping())


def _summary(results) -> dict:  # noqa: ANN001
    (run_dir,) = list(results.iterdir())
    return json.loads((run_dir / "summary.json").read_text())


# ----------------------------------------------------------------- the check itself


def test_the_check_is_exact_not_the_cheap_bound():
    cfg = RunConfig.from_mapping(IMPOSSIBLE)
    assert CLIENTS * cfg.min_partition_size <= 1600  # the necessary condition holds ...
    with pytest.raises(ConfigError) as err:  # ... and the split still cannot be made
        check_partition(cfg, CLIENTS)
    _assert_names_the_knobs(str(err.value))
    # 60 clients can: the check passes and every client then builds its data from it.
    check_partition(cfg, 60)
    sizes = [len(client_data(cfg, pid, 60, "cpu")[1]) for pid in range(60)]
    assert min(sizes) >= cfg.min_partition_size and sum(sizes) == 1600


def test_needing_more_samples_than_there_are_says_so_whatever_alpha():
    cfg = RunConfig.from_mapping({**IMPOSSIBLE, "alpha": 100.0})
    with pytest.raises(ConfigError, match=r"200 clients .*min-partition-size=10 .*1600 training samples .*"
                                          r"alpha=100.0: that needs 2000 samples in all"):
        check_partition(cfg, 200)


def test_a_batchnorm1d_model_needs_two_examples_on_every_client_whatever_the_partition():
    """min-partition-size bounds Dirichlet's splits only: with iid, 1,000 clients of
    digits' 1,437 training images gave 563 of them one image, and cnn-bn's BatchNorm1d
    failed on the client in round 1 with torch's message."""
    cfg = RunConfig.from_mapping({"model": "cnn-bn", "dataset": "digits", "partition": "iid"})
    with pytest.raises(ConfigError, match=r"model 'cnn-bn' needs at least 2 training examples on every client .*"
                                          r"partition='iid' gives 563 of the 1000 clients 1: use fewer clients"):
        check_partition(cfg, 1000)
    check_partition(cfg, 700)  # two each
    check_partition(RunConfig.from_mapping({"model": "cnn", "dataset": "digits", "partition": "iid"}), 1000)


# ----------------------------------------------------------------- simulation: the server checks


def test_inprocess_run_stops_before_anything_starts(tmp_path):
    results = tmp_path / "results"
    with pytest.raises(ConfigError) as err:
        run_inprocess({**IMPOSSIBLE, "results-dir": str(results)}, num_clients=CLIENTS)
    _assert_names_the_knobs(str(err.value))
    assert not results.exists()  # no run directory, no ServerApp, no client


def test_the_serverapp_checks_an_inprocess_grid_before_round_1(tmp_path):
    grid = _grid(IMPOSSIBLE)
    with pytest.raises(ConfigError) as err:
        _serve(grid, {**IMPOSSIBLE, "results-dir": str(tmp_path)})
    _assert_names_the_knobs(str(err.value))
    assert grid.messages_run == 0  # no client computed the split only to fail
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["error"].startswith("ConfigError: partition='dirichlet'")


def test_in_flower_simulation_the_server_asks_one_node_then_checks(tmp_path, monkeypatch):
    """Flower's simulation shows the ServerApp no node configs: one ``query`` to fededge's
    ClientApp tells it num-partitions (Ray itself: tests/server/test_flwr_run.py)."""
    monkeypatch.setattr(fi, "is_flower_simulation", lambda g: isinstance(g, _Opaque))
    grid = _grid(IMPOSSIBLE)
    with pytest.raises(ConfigError) as err:
        _serve(_Opaque(grid), {**IMPOSSIBLE, "results-dir": str(tmp_path)})
    _assert_names_the_knobs(str(err.value))
    assert grid.messages_run == 1  # the query, no train message
    assert not (next(tmp_path.iterdir()) / "metrics.jsonl").read_text().strip()  # not even round 0


def test_the_query_reports_the_node_config():
    grid = _grid({})
    node = list(grid.get_node_ids())[7]
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msg = Message(RecordDict(), node, "query")
    (reply,) = grid.send_and_receive([msg])
    assert dict(reply.content[keys.METRICS]) == {keys.REPLY_PARTITION_ID: 7, keys.REPLY_NUM_PARTITIONS: CLIENTS}


# ----------------------------------------------------------------- deployment: the client says so


def test_a_clients_config_error_stops_the_run_by_name_in_round_1(tmp_path):
    """Where the server cannot see the node configs (a deployment), every client builds its
    own split; the first reply that says it cannot stops the run with the client's words."""
    grid = _grid(IMPOSSIBLE)
    with pytest.raises(ConfigError) as err:
        _serve(_Opaque(grid), {**IMPOSSIBLE, "results-dir": str(tmp_path)})
    msg = str(err.value)
    assert msg.startswith("a client (node ") and " reports: partition='dirichlet'" in msg
    _assert_names_the_knobs(msg)
    assert "4 more of the 5 replies reported a configuration error" in msg
    assert grid.messages_run == 5  # round 1 only, not round after round
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["error"] == f"ConfigError: {msg}"


def test_config_error_mod_names_config_errors_and_passes_others_on():
    app = ClientApp(mods=[config_error_mod])

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        if context.run_config["boom"] == "config":
            raise ConfigError("run-config key 'x' must be > 0")
        raise RuntimeError("a bug")

    grid = InProcessGrid(app, num_nodes=1, run_config={"boom": "config"})
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msg = Message(RecordDict(), next(iter(grid.get_node_ids())), "train")
    (reply,) = grid.send_and_receive([msg])
    assert reply.error.reason == f"{keys.CONFIG_ERROR}: run-config key 'x' must be > 0"
    with pytest.raises(RuntimeError, match="a bug"):
        app(msg, Context(run_id=1, node_id=2, node_config={}, state=RecordDict(),
                         run_config={"boom": "bug"}))


def test_metered_grid_counts_a_config_error_reply_then_raises():
    class Replies(_Opaque):
        def __init__(self, replies):  # noqa: ANN001
            self.replies = replies

        def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
            return self.replies

    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        ask = Message(RecordDict(), 5, "train")
    fi.set_message_id(ask, "m1")
    bad = Message(Error(2, f"{keys.CONFIG_ERROR}: lower min-partition-size"), reply_to=ask)
    metered = MeteredGrid(Replies([bad]))
    with pytest.raises(ConfigError, match=r"^a client \(node 5\) reports: lower min-partition-size$"):
        metered.send_and_receive([])
    t = metered.take()
    assert (t.replies, t.failures) == (1, 1)


# ----------------------------------------------------------------- failed vs rejected, once each


def test_a_client_exception_is_a_failure_reported_once_per_round(tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG, logger="fededge")
    nodes = [{}, {"partition-id": 99}, {}]  # node 1's ClientApp raises every round
    run_dir = run_inprocess({"num-rounds": 2, "local-steps": 3, "results-dir": str(tmp_path),
                             "progress": "lines"}, num_clients=3, node_configs=nodes)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["failures"] for r in lines] == [0, 1, 1] and [r["rejected"] for r in lines] == [0, 0, 0]
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if "partition-id must be in" in x]
    assert [x.split(": node ")[0] for x in said] == ["[fededge] round 1: a client failed",
                                                     "[fededge] round 2: a client failed"]
    assert "rejected" not in err
    # fededge logs no second line per failure; the in-process runtime shows the
    # traceback of a new error once and the repeat at DEBUG.
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("fededge")]
    assert [(r.name, r.levelname) for r in warned] == [("fededge.server.inprocess", "ERROR")]
    assert "Traceback" in warned[0].getMessage()


def _corrupting(partition: int):
    def mod(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == partition and COMPRESSED in reply.content:
            rec = reply.content[COMPRESSED]
            name = next(iter(rec.keys()))
            rec[name] = Array(rec[name].numpy()[:-3].copy())  # truncate: it no longer decodes
        return reply
    return mod


def test_an_undecodable_update_is_rejected_once_per_round_and_the_run_goes_on(tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG, logger="fededge")
    app = ClientApp(mods=[config_error_mod])
    app.train(mods=[_corrupting(1), run_config_mods])(fededge_train)
    run_dir = run_inprocess({"num-rounds": 2, "local-steps": 3, "partition": "iid", "compressor": "topk",
                             "results-dir": str(tmp_path), "progress": "lines"}, num_clients=3, client_app=app)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rejected"] for r in lines] == [0, 1, 1] and [r["failures"] for r in lines] == [0, 0, 0]
    assert [r["num_clients"] for r in lines[1:]] == [2, 2]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    err = capsys.readouterr().err
    assert err.count("a compressed update was rejected and left out") == 2
    assert "a client failed" not in err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("fededge")]


def test_a_failure_before_the_nodes_are_waited_for_leaves_the_run_failed_not_running(tmp_path, monkeypatch):
    """What ran between the run directory's creation and the round loop's try (the clock
    attached to the strategy, a resume refused) left summary.json saying 'running'."""
    from fededge.server import experiment

    def broken(strategy, clock):  # noqa: ANN001, ANN202
        raise RuntimeError("the clock could not be attached")

    monkeypatch.setattr(experiment, "attach_clock", broken)
    with pytest.raises(RuntimeError, match="could not be attached"):
        run_inprocess({"num-rounds": 1, "local-steps": 1, "progress": "off", "results-dir": str(tmp_path)},
                      num_clients=2)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: the clock could not be attached"
