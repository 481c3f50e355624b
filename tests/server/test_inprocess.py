"""The in-process runtime: Flower's Grid semantics, FedAvg arithmetic, bytes on the wire."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.clients.train import BatchSampler, local_sgd, scheduled_lr
from fededge.config import ConfigError, RunConfig
from fededge.server.experiment import NotEnoughNodesError, RoundFailedError, wait_for_nodes
from fededge.server.grid import InProcessGrid
from fededge.server.inprocess import run_inprocess
from fededge.server.metering import MeteredGrid, wire_size
from fededge.server.results import METRIC_FIELDS
from fededge.workload import client_data, dataset_for, model_for

SHAPES = {"w": (3, 4), "b": (4,)}


def _node_arrays(pid: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + pid)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _rec(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _weight(pid: int) -> int:
    return 7 * (pid + 1) + pid * pid


fixed_client = ClientApp()


@fixed_client.train()
def _fixed_train(msg: Message, context: Context) -> Message:
    """Replies with node-specific arrays and weights; fails on partition 3 if asked."""
    pid = int(context.node_config[keys.PARTITION_ID])
    if pid == 3 and context.run_config.get("fail-node-3"):
        raise RuntimeError("node 3 is broken")
    n = int(context.state["calls"]["n"]) + 1 if "calls" in context.state else 1
    context.state["calls"] = ConfigRecord({"n": n})
    content = RecordDict({
        "arrays": _rec(_node_arrays(pid)),
        "metrics": MetricRecord({"num-examples": _weight(pid), "calls": n}),
    })
    return Message(content=content, reply_to=msg)


def _start_fedavg(num_nodes: int, rounds: int = 1, **run_config):
    holder = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        metered = MeteredGrid(grid)
        holder["result"] = FedAvg(min_available_nodes=num_nodes, min_train_nodes=num_nodes,
                                  fraction_evaluate=0.0).start(
            grid=metered, initial_arrays=_rec({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}),
            num_rounds=rounds,
        )
        holder["traffic"] = metered.take()
        holder["grid"] = grid

    grid = InProcessGrid(fixed_client, num_nodes=num_nodes, run_config=run_config)
    server_ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        server(grid, server_ctx)
    holder["grid"] = grid
    return holder


def test_fedavg_aggregate_equals_numpy_weighted_mean():
    out = _start_fedavg(5)
    agg = out["result"].arrays
    w = np.array([_weight(p) for p in range(5)], dtype=np.float64)
    for k in SHAPES:
        stack = np.stack([_node_arrays(p)[k].astype(np.float64) for p in range(5)])
        expected = np.tensordot(w / w.sum(), stack, axes=1)
        np.testing.assert_allclose(agg[k].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_context_state_persists_per_node_across_rounds():
    out = _start_fedavg(3, rounds=4)
    counts = [int(ctx.state["calls"]["n"]) for ctx in out["grid"].contexts.values()]
    assert counts == [4, 4, 4]


def test_failing_client_is_left_out_and_counted():
    out = _start_fedavg(5, **{"fail-node-3": True})
    # FedAvg keeps the other four; the failure is an error reply, counted by the meter.
    assert out["traffic"].failures == 1 and out["traffic"].train_replies == 4
    assert "node 3 is broken" in out["traffic"].errors[0]
    w = np.array([_weight(p) for p in (0, 1, 2, 4)], dtype=np.float64)
    stack = np.stack([_node_arrays(p)["b"].astype(np.float64) for p in (0, 1, 2, 4)])
    np.testing.assert_allclose(out["result"].arrays["b"].numpy(), np.tensordot(w / w.sum(), stack, axes=1), rtol=1e-6)


def test_bytes_up_equals_serialized_reply_size():
    grid = InProcessGrid(fixed_client, num_nodes=2, run_config={})
    metered = MeteredGrid(grid)
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msgs = [Message(RecordDict({"arrays": _rec({"w": np.ones((100, 10), np.float32)})}), nid, "train")
                for nid in grid.get_node_ids()]
    down_expected = [wire_size(m) for m in msgs]
    replies = list(metered.send_and_receive(msgs))
    t = metered.take()
    up_expected = sum(sum(map(len, fi.message_objects(r).values())) for r in replies)
    assert t.bytes_up == up_expected
    assert t.bytes_down == sum(down_expected)
    # The grid noted each size as it serialised the message; the meter took the notes.
    assert all(fi.take_noted_wire_size(m) is None for m in [*msgs, *replies])
    # Independent check against Flower's protobuf of the whole message: the object
    # tree adds only small per-object headers, never a second copy of the arrays.
    from flwr.common.serde import message_to_proto

    for m in [*msgs, *replies]:
        proto = message_to_proto(m).ByteSize()
        n_objects = len(fi.message_objects(m))
        # Each object adds a header with its type, length and children's 64-hex-char ids.
        assert 0 < wire_size(m) - proto <= 200 * n_objects
    # 12 float32 arrays per reply: at least the raw bytes must be there.
    assert t.bytes_up > 2 * 16 * 4


def test_the_grid_notes_the_wire_size_of_what_it_serialises_and_the_meter_counts_the_same_without_notes():
    grid = InProcessGrid(fixed_client, num_nodes=3, run_config={})
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        model = _rec({"w": np.arange(600, dtype=np.float32).reshape(60, 10)})
        msgs = [Message(RecordDict({"arrays": model, "config": ConfigRecord({"i": i})}), nid, "train")
                for i, nid in enumerate(grid.get_node_ids())]
    ids = list(grid.push_messages(msgs))
    assert [fi.take_noted_wire_size(m) for m in msgs] == [wire_size(m) for m in msgs]
    replies = list(grid.pull_messages(ids))
    assert [fi.take_noted_wire_size(r) for r in replies] == [wire_size(r) for r in replies]
    assert all(fi.take_noted_wire_size(m) is None for m in [*msgs, *replies])  # taken once
    # Through the meter, with notes and without (a grid that notes nothing): the same bytes.
    counted = []
    for noting in (True, False):
        metered = MeteredGrid(InProcessGrid(fixed_client, num_nodes=3, run_config={}))
        if not noting:
            metered.inner.push_messages = _forgetting(metered.inner.push_messages)
            metered.inner.pull_messages = _forgetting(metered.inner.pull_messages)
        with fi.task_identity(run_id=1, node_id=1, task_id=1):
            again = [Message(RecordDict({"arrays": model}), nid, "train", group_id="1")
                     for nid in metered.get_node_ids()]
        list(metered.pull_messages(list(metered.push_messages(again))))
        t = metered.take()
        counted.append((t.bytes_down, t.bytes_up))
    assert counted[0] == counted[1] and counted[0][0] > 3 * 600 * 4


def _forgetting(call):  # noqa: ANN001, ANN202
    """``call`` (a grid's push or pull), dropping the size notes of what it sent or got."""
    def wrapped(arg):  # noqa: ANN001, ANN202
        arg = list(arg)
        out = call(arg)
        out = list(out)
        for m in [*arg, *out]:
            if isinstance(m, Message):
                fi.take_noted_wire_size(m)
        return out
    return wrapped


def test_serialise_gives_flowers_own_objects_and_sees_a_changed_message():
    """fi.serialise computes each object id once (Flower's no_object_id_recompute): its
    objects are exactly what Flower's recursive object ids give, and a message changed
    after it was serialised is serialised anew, never from stale ids."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msg = Message(RecordDict({"arrays": _rec({"w": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float32)}),
                                  "config": ConfigRecord({"lr": 0.1}), "metrics": MetricRecord({"n": 3})}), 7, "train")
    root, objects = fi.serialise(msg)
    assert root == msg.object_id
    assert objects == {oid: o.deflate() for oid, o in get_all_nested_objects(msg).items()}
    assert sum(map(len, objects.values())) == wire_size(msg)
    msg.content["arrays"]["w"] = Array(np.full(6, 2.0, dtype=np.float32))  # changed after serialising
    msg.content["config"]["lr"] = 0.2
    root2, objects2 = fi.serialise(msg)
    assert root2 != root and root2 == msg.object_id
    back = fi.message_from_objects(root2, dict(objects2))
    np.testing.assert_array_equal(back.content["arrays"]["w"].numpy(), np.full(6, 2.0, dtype=np.float32))
    assert back.content["config"]["lr"] == 0.2
    # A record changed since its id was computed, whose old content another record of the
    # message now has: inside no_object_id_recompute Flower would trust its stale id.
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        a = ConfigRecord({"x": 1})
        _ = a.object_id
        a["x"] = 2
        msg = Message(RecordDict({"b": ConfigRecord({"x": 1}), "a": a}), 7, "train")  # b's id first
    root, objects = fi.serialise(msg)
    back = fi.message_from_objects(root, dict(objects))
    assert (back.content["a"]["x"], back.content["b"]["x"]) == (2, 1)


def test_pull_runs_messages_in_push_order_and_allows_pushing_ahead():
    grid = InProcessGrid(fixed_client, num_nodes=1, run_config={})
    nid = next(iter(grid.get_node_ids()))
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msgs = [Message(RecordDict({"arrays": _rec({"w": np.zeros(2, np.float32)})}), nid, "train")
                for _ in range(3)]
    ids = list(grid.push_messages(msgs))
    assert grid.messages_run == 0  # nothing runs until a reply is pulled
    third = list(grid.pull_messages([ids[2]]))
    assert grid.messages_run == 3  # the first two ran before it, in order
    assert third[0].content["metrics"]["calls"] == 3
    rest = list(grid.pull_messages(ids[:2]))
    assert [r.content["metrics"]["calls"] for r in rest] == [1, 2]


def test_message_to_unknown_node_is_refused():
    grid = InProcessGrid(fixed_client, num_nodes=1, run_config={})
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msg = Message(RecordDict(), 12345, "train")
    with pytest.raises(ValueError, match="unknown node 12345"):
        grid.push_messages([msg])


def test_flower_internals_are_as_expected():
    fi.check()


def test_a_changed_internal_is_named(monkeypatch):
    def broken(*_a, **_k):
        raise TypeError("signature changed")

    monkeypatch.setattr(fi, "inflate_object_from_contents", broken)
    with pytest.raises(fi.FlowerInternalsChanged, match="inflate_object_from_contents"):
        fi.check()


def test_a_changed_aggregation_is_named(monkeypatch):
    monkeypatch.setattr(fi, "aggregate_arrayrecords", lambda records, key: records[0]["a"])
    with pytest.raises(fi.FlowerInternalsChanged, match="aggregate_arrayrecords"):
        fi.check()


def test_fededge_s_average_is_flowers_bit_for_bit_and_a_run_uses_it_only_while_it_runs():
    from flwr.serverapp.strategy import fedavg
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    rng = np.random.default_rng(3)
    records = [RecordDict({"arrays": ArrayRecord({
        "w": Array(rng.standard_normal((7, 5)).astype(np.float32)),
        "f": Array(np.asfortranarray(rng.standard_normal((3, 4)))),  # float64, Fortran order
        "n": Array(rng.integers(0, 9, size=6)),
        "s": Array(np.array(rng.standard_normal(), dtype=np.float32))}),  # 0-d: its product is a scalar
        "metrics": MetricRecord({"num-examples": int(w)})}) for w in rng.integers(1, 50, size=9)]
    ours, theirs = fi.average_arrayrecords(records, "num-examples"), aggregate_arrayrecords(records, "num-examples")
    assert list(ours) == list(theirs) == ["w", "f", "n", "s"]
    assert all(vars(ours[k]) == vars(theirs[k]) for k in ours) and ours.object_id == theirs.object_id
    flower = fedavg.aggregate_arrayrecords
    with fi.fast_average():
        with fi.fast_average():  # nested (or another thread's run): put back after the last
            pass
        assert fedavg.aggregate_arrayrecords is fi.average_arrayrecords
    assert fedavg.aggregate_arrayrecords is flower is aggregate_arrayrecords
    with pytest.raises(RuntimeError), fi.fast_average():
        raise RuntimeError("a failed run")
    assert fedavg.aggregate_arrayrecords is flower
    # Someone else's patch of the name is left alone, during and after.
    def theirs_patch(records, key):  # noqa: ANN001, ANN202
        return aggregate_arrayrecords(records, key)

    fedavg.aggregate_arrayrecords = theirs_patch
    try:
        with fi.fast_average():
            assert fedavg.aggregate_arrayrecords is theirs_patch
        assert fedavg.aggregate_arrayrecords is theirs_patch
    finally:
        fedavg.aggregate_arrayrecords = flower


def test_the_meter_counts_a_grid_that_notes_no_sizes_before_it_pushes():
    """Flower's simulation hands pushed messages to threads of its own: the meter must not
    serialise them after the push (it would change their cached ids meanwhile)."""
    class Plain(InProcessGrid):
        notes_wire_sizes = False

        def push_messages(self, messages):  # noqa: ANN001, ANN202
            seen.append(sum(t.bytes_down for t in metered._traffic.values()))
            return super().push_messages(messages)

    seen: list[int] = []
    metered = MeteredGrid(Plain(fixed_client, num_nodes=2, run_config={}))
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msgs = [Message(RecordDict({"arrays": _rec({"w": np.ones(8, np.float32)})}), nid, "train", group_id="1")
                for nid in metered.get_node_ids()]
    expected = sum(wire_size(m) for m in msgs)
    list(metered.send_and_receive(msgs))
    list(metered.pull_messages(list(metered.push_messages(msgs))))
    assert seen == [expected, 2 * expected]  # each time counted before the push


def test_a_moved_internal_module_is_named_at_import():
    code = ("import sys; sys.modules['flwr.supercore.inflatable.inflatable_utils'] = None\n"
            "import fededge._flwr_internals\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "FlowerInternalsChanged: Flower internal 'flwr.supercore.inflatable.inflatable_utils'" in out.stderr


def test_a_moved_grid_class_is_named_not_taken_for_another_runtime(monkeypatch):
    """The asynchronous strategies ask whether a grid is a SuperLink's (HttpGrid): if Flower
    moved it, the answer is an error naming it, never a silent "no"."""
    monkeypatch.setitem(sys.modules, "flwr.superlink.grid.http_grid", None)  # import fails
    with pytest.raises(fi.FlowerInternalsChanged, match="HttpGrid"):
        fi.is_deployment(object())
    with pytest.raises(fi.FlowerInternalsChanged, match="HttpGrid"):
        fi.runs_messages_in_order(object())


def test_bad_config_key_stops_before_any_training(tmp_path):
    with pytest.raises(ConfigError, match="unknown run-config key 'num-round'"):
        run_inprocess({"num-round": 2, "results-dir": str(tmp_path)}, num_clients=2)
    assert list(tmp_path.iterdir()) == []


def _plain_local_training(over: dict, calls: list[tuple[int, float]]) -> dict:
    """The one client's model trained by local_sgd alone: one call per (steps, lr), each
    with a fresh momentum buffer, the sampler continuing across calls."""
    cfg = RunConfig.from_mapping(over)
    model = model_for(cfg, dataset_for(cfg))
    x, y = client_data(cfg, 0, 1, torch.device("cpu"))
    sampler = BatchSampler(len(x), cfg.batch_size, seed=cfg.seed, stream=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.client_threads)  # same reduction order as the client's
    try:
        for steps, lr in calls:
            local_sgd(model, x, y, steps=steps, lr=lr, momentum=cfg.momentum, sampler=sampler)
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


@pytest.mark.parametrize("keep", [False, True])
def test_one_client_equals_plain_local_training(tmp_path, keep):
    """keep-momentum: the client's momentum runs across rounds, so with one client the
    rounds are one run of 12 local steps; without it the buffer restarts each round."""
    over = {"num-rounds": 3, "local-steps": 4, "batch-size": 16, "partition": "iid", "device": "cpu",
            "results-dir": str(tmp_path), "progress": "off", "seed": 3, "model": "mlp", "keep-momentum": keep}
    fed = torch.load(run_inprocess(over, num_clients=1) / "model.pt")
    lr = RunConfig.from_mapping(over).local_lr
    plain = _plain_local_training(over, [(12, lr)] if keep else [(4, lr)] * 3)  # kept: the rounds are one call
    for k, v in plain.items():
        assert torch.equal(fed[k], v), k


@pytest.mark.parametrize("schedule, warmup", [("cosine", 1), ("step", 0), ("constant", 2)])
def test_one_client_follows_the_lr_schedule(tmp_path, schedule, warmup):
    """lr-schedule: each round's K steps run at scheduled_lr of that round; with one client
    the federated model is plain local training at those rates, bit for bit."""
    over = {"num-rounds": 4, "local-steps": 3, "batch-size": 16, "partition": "iid", "device": "cpu",
            "results-dir": str(tmp_path), "progress": "off", "seed": 5, "model": "mlp",
            "lr-schedule": schedule, "lr-warmup-rounds": warmup, "local-lr": 0.2}
    fed = torch.load(run_inprocess(over, num_clients=1) / "model.pt")
    rates = [scheduled_lr(0.2, t, 4, schedule=schedule, warmup_rounds=warmup) for t in (1, 2, 3, 4)]
    assert len(set(rates)) > 1  # the schedule changes the rate, so a client ignoring it fails below
    plain = _plain_local_training(over, [(3, lr) for lr in rates])
    for k, v in plain.items():
        assert torch.equal(fed[k], v), k


def test_default_task_learns_in_a_few_inprocess_rounds(tmp_path):
    run_dir = run_inprocess(
        {"num-rounds": 6, "results-dir": str(tmp_path), "progress": "off", "target-accuracy": 0.85},
        num_clients=10,
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == list(range(7))
    for rec in lines:
        assert set(METRIC_FIELDS) <= set(rec)
    assert lines[-1]["accuracy"] >= 0.85
    assert all(r["num_clients"] == 10 for r in lines[1:])
    # Uplink per round: ten replies, each the model's float32 bytes plus a little
    # framing (object headers, metadata, metrics): within 1% + 4 kB per reply.
    n_params = json.loads((run_dir / "config.json").read_text())["model_parameters"]
    for r in lines[1:]:
        per_reply = r["bytes_up"] / 10
        assert 4 * n_params < per_reply < 4 * n_params * 1.01 + 4096, per_reply
    assert all(r["sim_s"] > 0 for r in lines[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["rounds_to_target"] is not None
    assert summary["total_bytes_up"] == sum(r["bytes_up"] for r in lines)


@pytest.mark.parametrize("strategy", ["fedadam", "fedprox", "fedmedian"])
def test_flower_strategies_plug_in(tmp_path, strategy):
    run_dir = run_inprocess(
        {"strategy": strategy, "num-rounds": 3, "local-steps": 10, "results-dir": str(tmp_path),
         "progress": "off", "server-lr": 0.05, "partition": "iid"},
        num_clients=4,
    )
    cfg = json.loads((run_dir / "config.json").read_text())
    # (a server optimiser's inside PlainBuffers: its step on parameters only)
    assert cfg["strategy_class"].startswith("flwr.serverapp.strategy") or (
        strategy == "fedadam" and cfg["strategy_class"] == "fededge.strategies.plainbuffers.PlainBuffers")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    assert max(json.loads(line)["accuracy"] for line in lines) > 0.4  # chance is 0.1


@pytest.mark.parametrize("strategy", ["fedadam", "fedavgm"])
def test_a_server_optimiser_returns_the_model_in_its_own_dtypes(tmp_path, strategy):
    """FedAdam's step by a float64 scalar made a float32 model float64 (every downlink
    doubled from round 2), and Flower's average left BatchNorm's counter a float64 8.75
    that the clients' load_state_dict truncated."""
    run_dir = run_inprocess({"strategy": strategy, "model": "cnn-bn", "num-rounds": 3, "local-steps": 3,
                             "results-dir": str(tmp_path), "progress": "off", "server-lr": 0.05}, num_clients=4)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    down = [r["bytes_down"] for r in lines[1:]]
    assert down[1] == down[2] and down[1] < 1.02 * down[0], down  # (round 1's config is a little shorter)
    model = torch.load(run_dir / "model.pt")
    assert {str(v.dtype) for k, v in model.items() if not k.endswith("num_batches_tracked")} == {"torch.float32"}
    assert all(v.dtype == torch.int64 and int(v) == 9 for k, v in model.items() if k.endswith("num_batches_tracked"))


def test_run_fails_loudly_when_every_client_fails(tmp_path):
    # partition-id out of range on every node: each ClientApp call raises.
    bad = [{"partition-id": 99}] * 3
    with pytest.raises(RoundFailedError, match=r"round 1: no client update could be used \(3 of 3.*partition-id must be in"):
        run_inprocess({"num-rounds": 2, "results-dir": str(tmp_path), "progress": "off"},
                      num_clients=3, node_configs=bad)
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "RoundFailedError" in summary["error"]
    assert summary["total_failures"] == 3


def test_one_failing_node_is_left_out_and_the_run_goes_on(tmp_path):
    nodes = [{}, {"partition-id": 99}, {}]
    run_dir = run_inprocess({"num-rounds": 2, "local-steps": 3, "results-dir": str(tmp_path),
                             "progress": "off"}, num_clients=3, node_configs=nodes)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["failures"] for r in lines] == [0, 1, 1]
    assert [r["num_clients"] for r in lines] == [0, 2, 2]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_more_clients_per_round_than_clients_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="'clients-per-round' is 5 but the in-process run has only 3"):
        run_inprocess({"clients-per-round": 5, "results-dir": str(tmp_path)}, num_clients=3)


def test_waiting_for_nodes_has_a_deadline():
    class Two:
        def get_node_ids(self):
            return [11, 12]

    assert wait_for_nodes(Two(), 2, 0.1, poll_s=0.01) == 2
    with pytest.raises(NotEnoughNodesError, match="needs 3 connected nodes .* only 2 connected"):
        wait_for_nodes(Two(), 3, 0.05, poll_s=0.01)


def test_save_model_false_writes_no_model(tmp_path):
    run_dir = run_inprocess({"num-rounds": 1, "local-steps": 2, "save-model": False,
                             "results-dir": str(tmp_path), "progress": "off"}, num_clients=2)
    assert not (run_dir / "model.pt").exists()
    assert (run_dir / "summary.json").exists()
