"""A reply Flower's strategies cannot aggregate is rejected, logged and left out, and the
run goes on (MeteredGrid.screen): unchecked, one NaN made the model NaN (and FedAdam's
moments for good), a misshapen array was broadcast into the average, and a reply with
other metric names or no weight stopped the run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from fededge import keys
from fededge.clients import app as fapp
from fededge.server.experiment import RoundFailedError
from fededge.server.inprocess import run_inprocess
from fededge.strategies._replies import screen_replies

BASE = {"num-rounds": 3, "local-steps": 10, "progress": "off", "partition": "iid"}


def _corrupt(reply: Message, how: str) -> None:
    arrays = reply.content[keys.ARRAYS]
    name = next(iter(arrays.keys()))
    metrics = reply.content[keys.METRICS]
    if how == "nan":
        nd = arrays[name].numpy().copy()
        nd.flat[0] = np.nan
        arrays[name] = Array(nd)
    elif how == "inf-weight":
        metrics["num-examples"] = float("inf")
    elif how == "shape":
        arrays[name] = Array(np.zeros(1, dtype=np.float32))
    elif how == "extra-metric":
        metrics["extra"] = 1.0
    elif how == "no-weight":
        del metrics["num-examples"]
    elif how == "two-metric-records":
        reply.content["more"] = MetricRecord({"x": 1.0})
    elif how == "list-compute-s":  # fededge's metering reads it: a list stopped the run
        metrics[keys.COMPUTE_S] = [1.0, 2.0]
        metrics[keys.REPLY_PARTITION_ID] = [1]


def _app(how: str, partitions: set[int], at_round: int = 2) -> ClientApp:
    app = ClientApp()

    def corrupt(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        reply = call_next(msg, context)
        if (int(context.node_config[keys.PARTITION_ID]) in partitions and keys.ARRAYS in reply.content
                and int(msg.content[keys.CONFIG][keys.SERVER_ROUND]) == at_round and not reply.has_error()):
            _corrupt(reply, how)
        return reply

    app.train(mods=[corrupt, fapp.run_config_mods])(fapp.train)
    return app


def _lines(run_dir):  # noqa: ANN001, ANN202
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy, how", [
    ("fedavg", "nan"), ("fedadam", "nan"), ("fedavg", "inf-weight"), ("fedavg", "shape"),
    ("fedmedian", "shape"), ("fedavg", "extra-metric"), ("fedavg", "no-weight"), ("fedavg", "two-metric-records"),
])
def test_a_bad_reply_is_rejected_and_the_run_goes_on(tmp_path, caplog, strategy, how):
    run_dir = run_inprocess({**BASE, "strategy": strategy, "server-lr": 0.05, "results-dir": str(tmp_path)},
                            num_clients=4, client_app=_app(how, {1}))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    lines = _lines(run_dir)
    assert [r["rejected"] for r in lines[1:]] == [0, 1, 0]
    assert [r["num_clients"] for r in lines[1:]] == [4, 3, 4]
    assert all(r["failures"] == 0 for r in lines[1:])
    model = torch.load(run_dir / "model.pt")
    assert all(bool(torch.isfinite(v.double()).all()) for v in model.values())
    assert lines[-1]["accuracy"] > 0.3
    said = [r.getMessage() for r in caplog.records if "rejected and left out" in r.getMessage()]
    assert len(said) == 1 and "round 2" in said[0], said


def test_fededges_own_metrics_of_another_type_are_ignored_not_fatal(tmp_path):
    run_dir = run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=4,
                            client_app=_app("list-compute-s", {0, 1, 2, 3}))
    lines = _lines(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert [r["rejected"] for r in lines[1:]] == [0, 0, 0] and [r["num_clients"] for r in lines[1:]] == [4, 4, 4]


def test_a_round_of_only_bad_replies_stops_the_run_naming_them(tmp_path):
    with pytest.raises(RoundFailedError, match=r"round 2: no client update could be used .*4 rejected.*NaN or Inf"):
        run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=4, client_app=_app("nan", {0, 1, 2, 3}))


def test_screen_replies_takes_the_metrics_most_replies_have(monkeypatch):
    from flwr.app import RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # (a Message is made within a task)
        monkeypatch.setattr(TaskIdentity, attr, 1)

    def reply(**metrics):  # noqa: ANN003, ANN202
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, **metrics})}), dst_node_id=1,
                       message_type="train")

    a, b, c = reply(loss=1.0), reply(loss=2.0), reply(acc=0.5)
    assert screen_replies([c, a, b], weight_key="num-examples") == [
        "reply's metrics [acc, num-examples] are not the round's other replies' [loss, num-examples] (Flower "
        "averages replies whose metrics have the same names, each a number or a list of one length)", None, None]
    assert screen_replies([c, a], weight_key="num-examples")[0] is None  # a tie: the first usable reply's
    lists = screen_replies([reply(loss=[1.0, 2.0]), reply(loss=[1.0]), reply(loss=[3.0, 4.0])],
                           weight_key="num-examples")
    assert lists[0] is None and lists[2] is None and "loss (a list of 1)" in lists[1]
    for bad, why in ((float("nan"), "is nan,"), (-2.0, "is -2.0,")):
        assert why in screen_replies([reply(**{"num-examples": bad})], weight_key="num-examples")[0]
    # a weight of 0: Flower weighs it as nothing; only a round of nothing but 0 is refused
    assert screen_replies([reply(**{"num-examples": 0}), reply()], weight_key="num-examples") == [None, None]
    assert "nothing to average" in screen_replies([reply(**{"num-examples": 0})], weight_key="num-examples")[0]
    # lists of other lengths: refused only where Flower's own aggregation averages them
    lists = [reply(loss=[1.0, 2.0]), reply(loss=[1.0])]
    assert screen_replies(lists, weight_key="num-examples", metric_kinds=False) == [None, None]


def test_compressed_replies_to_a_strategy_that_does_not_decode_them_are_refused_by_name(tmp_path):
    """CompressionMod on the clients and no Compressed on the server: Flower's FedAvg
    averaged the payloads' bytes into the model (a 'bundle' array), the run "completed"."""
    from fededge.clients.mods import CompressionMod
    from fededge.compress.update import UpdateConfig

    app = ClientApp(mods=[CompressionMod(UpdateConfig(compressor="topk", topk_ratio=0.1))])
    app.train(mods=[fapp.run_config_mods])(fapp.train)
    with pytest.raises(RoundFailedError, match=r"round 1: .*wrap the strategy in Compressed\(strategy, update="):
        run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=3, client_app=app)


def test_what_the_screen_follows_and_what_it_leaves_alone():
    """The screen took FedAvg's rules for any strategy: a custom Strategy without
    num-examples, Flower's DP wrapper (it keeps FedAvg in .strategy) with another weight
    key and FedXgb* (trees of growing shapes) had every reply refused."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyServerSideFixedClipping, FedAvg, FedXgbBagging, Strategy)

    from fededge.strategies._replies import screen_for
    from fededge.strategies.compressed import Compressed
    from fededge.strategies.plainbuffers import PlainBuffers

    class Own(Strategy):
        def configure_train(self, *a):  # noqa: ANN002, ANN202
            return []

        aggregate_train = configure_evaluate = aggregate_evaluate = summary = configure_train

    dp = DifferentialPrivacyServerSideFixedClipping(FedAvg(weighted_by_key="n"), noise_multiplier=0.1,
                                                    clipping_norm=1.0, num_sampled_clients=2)
    assert screen_for(dp) == ("n", False, True)
    assert screen_for(Compressed(PlainBuffers(FedAvg()))) == ("num-examples", True, True)
    assert screen_for(Own()) is None and screen_for(FedXgbBagging()) is None
    assert screen_for(FedAvg(train_metrics_aggr_fn=lambda records, key: None))[2] is False


def test_a_model_that_changes_between_rounds_is_checked_against_what_each_node_was_sent(tmp_path):
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fededge.server.experiment import Experiment
    from fededge.server.grid import InProcessGrid, run_server

    class Growing(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
            if server_round == 2:
                arrays = ArrayRecord({**{k: v for k, v in arrays.items()}, "extra": Array(np.zeros(3, np.float32))})
            return super().configure_train(server_round, arrays, config, grid)

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:  # noqa: ANN202
        got = msg.content["arrays"]
        out = ArrayRecord({k: Array(a.numpy() + 0.5) for k, a in got.items()})
        return Message(RecordDict({"model": out, "metrics": MetricRecord({"num-examples": 3})}), reply_to=msg)

    server = ServerApp()
    ran = {}

    @server.main()
    def main(grid: Grid, context: Context) -> None:  # noqa: ANN202
        exp = Experiment(evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": 0.5, "loss": 1.0}),
                         results_dir=str(tmp_path), progress="off")
        ran["final"] = exp.run(Growing(fraction_evaluate=0.0, min_available_nodes=3), grid,
                               initial_arrays=ArrayRecord({"w": Array(np.zeros(2, np.float32))}), num_rounds=3)

    grid = InProcessGrid(client, num_nodes=3, run_config={})
    try:
        run_server(server, grid)
    finally:
        grid.close()
    (run_dir,) = tmp_path.iterdir()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # another ArrayRecord name ("model") and the array added in round 2: nothing refused
    assert [r["rejected"] for r in lines[1:]] == [0, 0, 0] and [r["num_clients"] for r in lines[1:]] == [3, 3, 3]


def test_a_round_of_only_rejected_replies_fails_even_beside_a_dropout(tmp_path):
    """A dropout in the round made every-reply-rejected look like 'every client dropped
    out': the run went on with an unchanged model, never stopping."""
    with pytest.raises(RoundFailedError, match=r"round 2: no client update could be used .*rejected.*NaN or Inf"):
        run_inprocess({**BASE, "dropout": 0.25, "results-dir": str(tmp_path)}, num_clients=4,
                      client_app=_app("nan", {0, 1, 2, 3}))


def test_own_loops_take_a_reply_with_several_metric_records(monkeypatch):
    """usable_reply (DGA, async) took Flower's one-MetricRecord rule: a reply with a
    second record (timings of one's own) was refused, though those loops read the first."""
    import numpy as np
    from flwr.app import ArrayRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fededge.strategies._replies import usable_reply

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(2, np.float32))}),
                          "metrics": MetricRecord({"num-examples": 3}), "timing": MetricRecord({"t": 1.0})})
    reply = Message(content, dst_node_id=1, message_type="train")
    assert usable_reply(reply, arrays_key="arrays", model_keys={"w"}, weight_key="num-examples") is None
