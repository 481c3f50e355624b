"""Direct delivery in the in-process runtime (issue 35, item 2): messages handed over as
copies, their bytes on the wire computed from Flower's format.

The size must be exactly what serialising gives (``fededge._flwr_internals.wire_size``),
whatever the message holds: equal arrays and equal chunks are carried once on the wire,
so those are the cases that matter. And a run must be the same run: the same bytes, the
same losses, bit for bit, as with every message serialised.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fededge import _flwr_internals as fi
from fededge.arrays import record_from_torch
from fededge.clients import cohort
from fededge.models.zoo import build_model
from fededge.server.grid import InProcessGrid
from fededge.server.inprocess import run_inprocess


def _message(content: RecordDict | None = None) -> Message:
    with fi.task_identity(run_id=3, node_id=1, task_id=1):
        msg = Message(content, 5, "train")
    fi.set_run_id(msg, 3)
    fi.set_message_id(msg, "f" * 64)
    return msg


def _check(msg: Message) -> int:
    """The direct size of ``msg``'s copy equals its serialised size, and the copy, once
    sized, serialises to the original's objects (no stand-in id is left behind)."""
    copy = fi.detached_copy(msg)
    size = fi.direct_wire_size(copy)
    assert size == fi.wire_size(msg) == sum(fi.direct_wire_split(copy))
    assert fi.message_own_bytes(copy) == fi.direct_wire_split(copy)[0]
    assert fi.serialise(copy) == fi.serialise(msg)
    return size


def test_a_model_message_is_sized_exactly():
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    # BatchNorm's num_batches_tracked and fresh running statistics repeat: equal Arrays
    _check(_message(RecordDict({"arrays": record_from_torch(model.state_dict()),
                                "config": ConfigRecord({"lr": 0.1, "server-round": 3, "l": [1, 2], "s": "x"})})))


def test_equal_chunks_and_arrays_count_once(monkeypatch):
    # Small chunks, so that arrays span many and zeros give equal ones; an array equal to
    # another whole, and one equal to another only in its first chunk.
    from flwr.app.message import array as array_module

    monkeypatch.setattr(array_module, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 256)
    z = np.zeros(1000, dtype=np.float32)
    half = np.concatenate([np.zeros(40, dtype=np.float32), np.arange(960, dtype=np.float32)])
    rng = np.random.default_rng(0)
    record = ArrayRecord({"z": Array(z), "z-again": Array(z.copy()), "half": Array(half),
                          "r": Array(rng.standard_normal(333).astype(np.float32)),
                          "i": Array(np.arange(7, dtype=np.int64)), "scalar": Array(np.array(3.0, dtype=np.float32)),
                          "empty": Array(np.zeros(0, dtype=np.float32))})
    size = _check(_message(RecordDict({"a": record, "m": MetricRecord({"n": 3, "v": [0.5, 1.5]})})))
    # the two zero arrays and the zero chunks are carried once: fewer bytes than their sum
    assert size < sum(len(a.data) for a in record.values())


def test_messages_without_arrays_and_errors():
    _check(_message(RecordDict({"m": MetricRecord({"n": 3})})))
    _check(_message(RecordDict()))
    _check(Message(Error(0, "the ClientApp raised"), reply_to=_message(RecordDict())))
    _check(Message(RecordDict({"m": MetricRecord({"n": 1})}), reply_to=_message(RecordDict())))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70), st.sampled_from(["float32", "int64", "float16"])),
                min_size=1, max_size=8), st.integers(16, 300))
def test_any_arrays_any_chunking(spec, chunk):
    """Arrays drawn from a few values (so that equal arrays and chunks are common), any
    length, three dtypes, any chunk size: the direct size is the serialised size."""
    from flwr.app.message import array as array_module

    saved = array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = chunk
    try:
        arrays = {f"a{i}": Array(np.full(n, value, dtype=dtype)) for i, (value, n, dtype) in enumerate(spec)}
        _check(_message(RecordDict({"a": ArrayRecord(arrays)})))
    finally:
        array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = saved


def test_a_copy_shares_nothing_mutable():
    original = _message(RecordDict({"a": ArrayRecord({"x": Array(np.arange(4, dtype=np.float32))}),
                                    "c": ConfigRecord({"l": [1, 2]})}))
    copy = fi.detached_copy(original)
    copy.content["a"]["x"] = Array(np.zeros(4, dtype=np.float32))
    copy.content["c"]["l"].append(3)
    copy.content["new"] = MetricRecord({"n": 1})
    fi.set_message_id(copy, "changed")
    assert np.array_equal(original.content["a"]["x"].numpy(), np.arange(4, dtype=np.float32))
    assert list(original.content["c"]["l"]) == [1, 2] and "new" not in original.content
    assert original.metadata.message_id != "changed"


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("overrides", [
    {},
    {"compressor": "signsgd", "error-feedback": True, "client-states": "disk"},
    {"strategy": "dga", "dga-delay": 1, "compressor": "topk", "error-feedback": True, "momentum": 0.9},
    {"strategy": "fedadam", "compressor": "powersgd", "error-feedback": True, "norm-stats": "global",
     "model": "cnn-bn"},
    {"cohort": True, "compressor": "signsgd", "error-feedback": True},
    {"strategy": "fedbuff", "dropout": 0.2, "netem": "4g"},
    {"compressor": "qsgd", "dropout": 0.2},
], ids=["fedavg", "signsgd-disk", "dga-topk", "fedadam-powersgd-global", "cohort", "fedbuff-dropout", "qsgd-dropout"])
def test_a_direct_run_is_the_serialised_run(tmp_path, overrides):
    """The same bytes per round and per client, the same losses and accuracies, bit for
    bit."""
    runs = []
    for direct in (False, True):
        cohort.reset_measurements()  # each run meets its cohorts afresh
        run_dir = run_inprocess({"num-rounds": 2, "model": "mlp", "progress": "off", "checkpoint-every": 0,
                                 "results-dir": str(tmp_path / str(direct))} | overrides, num_clients=5, direct=direct)
        runs.append(_lines(run_dir))
        note = json.loads((run_dir / "config.json").read_text())["inprocess_runtime"]
        assert ("handed over directly" in note) == direct
    for a, b in zip(*runs, strict=True):
        assert a["bytes_up"] > 0 or a["round"] == 0
        for key in ("bytes_up", "bytes_down", "loss", "accuracy", "failures"):
            assert a[key] == b[key], key
        assert [c["bytes_up"] for c in a.get("clients", [])] == [c["bytes_up"] for c in b.get("clients", [])]


def test_direct_is_the_default_for_fededges_app_in_one_process(tmp_path):
    run_dir = run_inprocess({"num-rounds": 1, "model": "mlp", "progress": "off", "results-dir": str(tmp_path)},
                            num_clients=3)
    assert "handed over directly" in json.loads((run_dir / "config.json").read_text())["inprocess_runtime"]


def test_direct_is_refused_where_it_cannot_work():
    from fededge.clients.app import app

    with pytest.raises(ValueError, match="needs workers=1"):
        InProcessGrid(app, num_nodes=2, run_config={}, workers=2, client_app_ref="fededge.clients.app:app",
                      direct=True)
    with pytest.raises(ValueError, match="fededge's own ClientApp"):
        run_inprocess({"num-rounds": 1}, num_clients=2, client_app="fededge.clients.app:app", direct=True)


def test_a_failing_client_gives_an_error_reply_and_the_run_goes_on(tmp_path, monkeypatch):
    """A ClientApp that raises on one node: that node's reply is an error (counted as a
    failure, its traceback logged), the others' updates are used."""
    from fededge.clients import app as client_app

    real = client_app.client_workload

    def failing(context):
        work = real(context)
        if work.partition_id == 1:
            raise RuntimeError("node 1 is broken")
        return work

    monkeypatch.setattr(client_app, "client_workload", failing)
    run_dir = run_inprocess({"num-rounds": 2, "model": "mlp", "progress": "off", "results-dir": str(tmp_path)},
                            num_clients=4, direct=True)
    lines = _lines(run_dir)
    assert [x["failures"] for x in lines[1:]] == [1, 1]
    assert lines[-1]["accuracy"] > 0.2


# -- the grid: what a strategy and the meter see, either way ----------------------------

def _echo_app(msg, ctx):
    """Changes what it received, fails on request, keeps a state, replies x + 1."""
    x = msg.content["a"]["x"].numpy()
    msg.content["a"]["x"] = Array(np.zeros(3, dtype=np.float32))
    msg.content["c"]["l"].append(99)
    if msg.content["c"]["fail"]:
        raise RuntimeError("boom")
    ctx.state["kept"] = ArrayRecord({"x": Array(x)})
    return Message(RecordDict({"a": ArrayRecord({"x": Array(x + 1)}), "m": MetricRecord({"n": np.float64(1.0)})}),
                   reply_to=msg)


def _grid_message(grid: InProcessGrid, node: int, fail: bool = False) -> Message:
    with fi.task_identity(run_id=grid.run.run_id, node_id=1, task_id=grid.run.run_id):
        return Message(RecordDict({"a": ArrayRecord({"x": Array(np.arange(3, dtype=np.float32))}),
                                   "c": ConfigRecord({"l": [1], "fail": fail})}), node, "train")


@pytest.mark.parametrize("fail", [False, True], ids=["reply", "error"])
def test_the_grid_gives_the_same_replies_sizes_and_ids_either_way(fail):
    """The noted sizes (down and up) are the serialised ones; a reply answers its
    message's id (64 hex digits, as a SuperLink's); an error reply reads the same;
    neither side sees what the other changes after the hand-over."""
    seen = []
    for direct in (False, True):
        grid = InProcessGrid(_echo_app, num_nodes=2, run_config={}, direct=direct)
        node = grid.get_node_ids()[0]
        msg = _grid_message(grid, node, fail)
        (mid,) = grid.push_messages([msg])
        assert fi.take_noted_wire_size(msg) == fi.wire_size(msg)
        msg.content["c"]["l"].append(7)  # the server changes its message after the push
        (reply,) = grid.pull_messages([mid])
        assert len(mid) == 64 and reply.metadata.reply_to_message_id == mid
        assert fi.take_noted_wire_size(reply) == fi.wire_size(reply)
        assert list(msg.content["c"]["l"]) == [1, 7]  # the client's change did not come back
        assert np.array_equal(msg.content["a"]["x"].numpy(), np.arange(3, dtype=np.float32))
        seen.append((reply.has_error(), reply.error.code if reply.has_error() else None,
                     reply.error.reason if reply.has_error() else None,
                     None if reply.has_error() else reply.content["a"]["x"].numpy().tolist(),
                     None if reply.has_error() else type(reply.content["m"]["n"]),
                     reply.metadata.src_node_id, reply.metadata.dst_node_id, reply.metadata.group_id,
                     reply.metadata.message_type))
    assert seen[0] == seen[1]
    assert seen[1][0] == fail


def test_a_model_pushed_to_many_nodes_is_sized_exactly_for_each(monkeypatch):
    """The grid sizes a content of shared records once for all its messages. Each
    message's own object still counts as itself (its metadata differs in length), and
    contents that share only some records, or the same records under another name, are
    sized on their own."""
    grid = InProcessGrid(_echo_app, num_nodes=9, run_config={}, direct=True)
    nodes = list(grid.get_node_ids())
    model = ArrayRecord({"x": Array(np.arange(3, dtype=np.float32)), "w": Array(np.ones((40, 7), np.float32))})
    config = ConfigRecord({"l": [1], "fail": False})
    other = ConfigRecord({"l": [1, 2, 3], "fail": False})  # a longer config: another size
    with fi.task_identity(run_id=grid.run.run_id, node_id=1, task_id=grid.run.run_id):
        msgs = [Message(RecordDict({"a": model, "c": config}), n, "train") for n in nodes[:5]]
        msgs.append(Message(RecordDict({"a": model, "c": other}), nodes[5], "train"))  # one record shared
        msgs.append(Message(RecordDict({"model": model, "c": config}), nodes[6], "train"))  # another name
        msgs.append(Message(RecordDict({"a": model, "c": config, "d": MetricRecord({"m": 1.0})}), nodes[7], "train"))
        msgs.append(Message(RecordDict({"a": model, "c": config}), nodes[8], "train"))
    for i, m in enumerate(msgs):
        m.metadata.group_id = "g" * (3 * i)  # each message's own bytes differ
    want = [fi.wire_size(m) for m in msgs]
    contents_sized = []
    real = fi.direct_wire_split
    monkeypatch.setattr(fi, "direct_wire_split", lambda m: contents_sized.append(m) or real(m))
    grid.push_messages(msgs)
    got = [fi.take_noted_wire_size(m) for m in msgs]
    assert got == want
    assert len(set(got)) == len(got)
    assert len(contents_sized) == 4  # the shared content once, and each of the three others


def test_a_direct_push_is_all_or_nothing_and_refuses_a_message_twice():
    grid = InProcessGrid(_echo_app, num_nodes=2, run_config={}, direct=True)
    a, b = grid.get_node_ids()
    good, bad = _grid_message(grid, a), _grid_message(grid, b)
    bad.content["a"]["x"].__dict__["shape"] = (np.int64(3),)  # cannot go on Flower's wire (not JSON)
    with pytest.raises(TypeError):
        grid.push_messages([good, bad])
    assert grid.state_dict()["messages_run"] == 0  # nothing was left pending
    (mid,) = grid.push_messages([good])
    with pytest.raises(ValueError, match="pushed twice"):
        grid.push_messages([good])
    with pytest.raises(ValueError, match="pushed twice"):
        grid.push_messages([_grid_message(grid, b)] * 2)
    grid.pull_messages([mid])
    grid.push_messages([good])  # once its first push has run, it may go again


def test_a_message_sized_after_a_real_serialisation_is_sized_the_same():
    """Ids cached by an earlier serialisation (of this very message) are not taken for
    the stand-ins: two arrays whose real ids are cached count as what they are."""
    msg = _message(RecordDict({"a": ArrayRecord({"x": Array(np.zeros(10, dtype=np.float32)),
                                                 "y": Array(np.zeros(10, dtype=np.float32)),
                                                 "z": Array(np.ones(10, dtype=np.float32))})}))
    want = fi.wire_size(msg)  # caches real ids on the arrays
    assert fi.direct_wire_size(msg) == want
    assert fi.serialise(msg) == fi.serialise(fi.detached_copy(msg))


# -- a reply's model kept on its device (TensorArray; CPU tensors stand in for a GPU's) ---

def _resident(state: dict) -> ArrayRecord:
    """``state`` as a GPU client's reply under direct delivery: its float tensors of at
    least one dimension TensorArrays, the rest bytes."""
    from fededge import arrays

    record_from_torch(state)  # each (dtype, shape)'s header checked against Flower's once
    with arrays.replies_on_device(everywhere=True):
        record = record_from_torch(state, on_device=None)
    for k, t in state.items():
        assert isinstance(record[k], arrays.TensorArray) == (t.is_floating_point() and t.dim() > 0
                                                           and t.dtype != __import__("torch").float16), k
    return record


def _tensor_array(t):  # noqa: ANN001, ANN202 - any dtype numpy has, for sizing
    from fededge import arrays

    arrays.from_numpy(t.numpy())  # its header checked against Flower's
    return arrays.TensorArray(t.clone(), *arrays._resident_header(t))


def test_a_model_of_tensor_arrays_is_sized_exactly_without_its_bytes():
    from fededge import arrays

    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    record = _resident(model.state_dict())  # fresh BatchNorm statistics: equal arrays
    msg = _message(RecordDict({"arrays": record}))
    copy = fi.detached_copy(msg)
    resident = {k for k, a in record.items() if isinstance(a, arrays.TensorArray)}
    assert len(resident) > len(record) // 2
    assert all(copy.content["arrays"][k].tensor is record[k].tensor and copy.content["arrays"][k] is not record[k]
               for k in resident)
    size = fi.direct_wire_size(copy)
    own, content = fi.direct_wire_split(copy)  # the grid's form, for a model pushed to many nodes
    assert all(copy.content["arrays"][k].__dict__["_data"] is None for k in resident)  # no bytes were made
    assert size == own + content == fi.wire_size(msg)
    assert fi.serialise(copy) == fi.serialise(msg)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70), st.sampled_from(["float32", "int64", "float16"]),
                          st.sampled_from(["bytes", "tensor", "tensor+bytes"]), st.integers(1, 3)),
                min_size=1, max_size=8), st.integers(16, 300))
def test_tensor_arrays_and_arrays_any_chunking(spec, chunk):
    """As test_any_arrays_any_chunking, each array an Array of bytes, a TensorArray, or
    a TensorArray whose bytes were made, in 1 to 3 dimensions (headers of different
    lengths), so that equal chunks meet within and across the kinds, and chunks hold
    header bytes, tensor bytes or both."""
    import torch

    from flwr.app.message import array as array_module

    saved = array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = chunk
    try:
        record = ArrayRecord()
        for i, (value, n, dtype, kind, dims) in enumerate(spec):
            t = torch.full((n,) + (1,) * (dims - 1), value, dtype=getattr(torch, dtype))
            a = Array(t.numpy()) if kind == "bytes" else _tensor_array(t)
            if kind == "tensor+bytes":
                assert len(a.data) > 0
            record[f"a{i}"] = a
        _check(_message(RecordDict({"a": record})))
    finally:
        array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = saved


@pytest.mark.parametrize("chunk", [40, 64, 97, 1000])
def test_tensor_arrays_differing_in_one_byte_are_told_apart(chunk):
    """Equal-length TensorArrays that differ in a single byte, at the tensor's first and
    last byte, next to a fingerprint's place and away from all of them: each chunk that
    differs counts as a chunk of its own, as serialising counts it (an off-by-one in the
    spans' slicing would class two of them equal)."""
    import torch

    from flwr.app.message import array as array_module

    saved = array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = chunk
    try:
        base = torch.arange(60, dtype=torch.float32)
        record = ArrayRecord()
        record["same"] = _tensor_array(base)
        for i, at in enumerate([0, 1, 17, 31, 59]):  # element positions; the byte changed is the element's last
            t = base.clone()
            t.view(torch.uint8)[4 * at + 3] ^= 1
            record[f"d{i}"] = _tensor_array(t)
        record["twin"] = _tensor_array(base)
        _check(_message(RecordDict({"a": record})))
    finally:
        array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE = saved


@pytest.mark.parametrize("mix", ["tensors", "first-bytes", "later-bytes", "later-other-dtypes"])
def test_the_average_of_tensor_arrays_is_flowers_bit_for_bit_and_stays_on_the_device(mix):
    import torch
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fededge import arrays

    rng = np.random.default_rng(5)
    records, plain = [], []
    for i, w in enumerate(rng.integers(1, 50, size=7)):
        state = {"w": torch.from_numpy(rng.standard_normal((7, 5)).astype(np.float32)),
                 "d": torch.from_numpy(rng.standard_normal(4)),  # float64
                 "n": torch.from_numpy(rng.integers(0, 9, size=3)),  # int64: numpy's float64 product
                 "s": torch.tensor(float(rng.standard_normal()), dtype=torch.float32)}  # 0-d
        if mix == "later-other-dtypes" and i == 3:  # a key's dtype changes: numpy's promotion rules
            state = {"w": (state["w"] * 100).to(torch.int64), "d": state["d"].to(torch.float16),
                     "n": state["n"], "s": state["s"]}
        bytes_only = (mix == "first-bytes" and i == 0) or (mix == "later-bytes" and i == 3)
        rec = record_from_torch(state) if bytes_only else _resident(state)
        metrics = MetricRecord({"num-examples": int(w)})
        records.append(RecordDict({"arrays": rec, "metrics": metrics}))
        plain.append(RecordDict({"arrays": record_from_torch(state), "metrics": metrics}))
    ours, theirs = fi.average_arrayrecords(records, "num-examples"), aggregate_arrayrecords(plain, "num-examples")
    assert list(ours) == list(theirs) == ["w", "d", "n", "s"]
    kinds = {k: isinstance(a, arrays.TensorArray) for k, a in ours.items()}
    assert kinds == {"w": mix != "first-bytes", "d": mix != "first-bytes", "n": False, "s": False}
    for k in ours:
        assert (ours[k].dtype, tuple(ours[k].shape), ours[k].data) == (theirs[k].dtype, tuple(theirs[k].shape),
                                                                       theirs[k].data), k
    assert ours.object_id == theirs.object_id


@pytest.mark.parametrize("overrides", [
    {"model": "cnn-bn"},
    {"compressor": "signsgd", "error-feedback": True, "client-states": "disk"},
    {"cohort": True, "model": "cnn-bn", "strategy": "fedadam"},
    {"strategy": "fedbuff", "dropout": 0.2, "netem": "4g"},
], ids=["fedavg-cnn-bn", "signsgd-disk", "cohort-fedadam", "fedbuff-dropout"])
def test_a_run_with_replies_kept_on_the_device_is_the_serialised_run(tmp_path, monkeypatch, overrides):
    """Direct delivery with every reply's model a TensorArray (CPU tensors standing in
    for a GPU's, ``replies_on_device(everywhere=True)``): the same bytes and losses, bit
    for bit, as the serialised run; and the server averaged on the tensors."""
    from fededge import arrays

    # Both runs must take the same path: the cohort's verdict on its own speed (cohorts, or
    # per client from the group's second cohort on, by timing) can differ between two runs
    # on a busy machine, and the two paths round differently.
    monkeypatch.setattr(cohort, "_judge", lambda *args, **kwargs: None)
    made = []
    real = fi._array_of_average
    monkeypatch.setattr(fi, "_array_of_average", lambda v: made.append(real(v)) or made[-1])
    runs = []
    for resident in (False, True):
        cohort.reset_measurements()
        with arrays.replies_on_device(everywhere=True) if resident else contextlib.nullcontext():
            run_dir = run_inprocess({"num-rounds": 3, "model": "mlp", "progress": "off", "checkpoint-every": 0,
                                     "results-dir": str(tmp_path / str(resident))} | overrides, num_clients=5,
                                    direct=resident)
        runs.append(_lines(run_dir))
        if not resident:
            assert not any(isinstance(a, arrays.TensorArray) for a in made)
    if "compressor" not in overrides and overrides.get("strategy") != "fedbuff":
        # (a compressed reply is payload bytes, decoded on the host; FedBuff sums its own way)
        assert any(isinstance(a, arrays.TensorArray) for a in made)
    for a, b in zip(*runs, strict=True):
        for key in ("bytes_up", "bytes_down", "loss", "accuracy", "failures"):
            assert a[key] == b[key], key
        assert [c["bytes_up"] for c in a.get("clients", [])] == [c["bytes_up"] for c in b.get("clients", [])]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA: the replies stay on the GPU there")
def test_a_cuda_run_keeps_replies_on_the_gpu_and_is_the_serialised_run(tmp_path, monkeypatch):
    """On a GPU, direct delivery keeps every reply's float tensors on the GPU by default
    and the server averages them there: the same bytes and the same losses, bit for bit,
    as the serialised run (the average's float operations are numpy's)."""
    from fededge import arrays

    made = []
    real = fi._array_of_average
    monkeypatch.setattr(fi, "_array_of_average", lambda v: made.append(real(v)) or made[-1])
    runs = []
    for direct in (False, True):
        run_dir = run_inprocess({"num-rounds": 3, "model": "cnn-bn", "progress": "off", "checkpoint-every": 0,
                                 "device": "cuda", "server-device": "cuda", "results-dir": str(tmp_path / str(direct))},
                                num_clients=4, direct=direct)
        runs.append(_lines(run_dir))
    resident = [a for a in made if isinstance(a, arrays.TensorArray)]
    assert resident and all(a.tensor.device.type == "cuda" for a in resident)
    for a, b in zip(*runs, strict=True):
        assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"], b["bytes_down"])
        assert a["loss"] == b["loss"]  # deterministic kernels, and the average's operations are numpy's
