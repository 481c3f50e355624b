"""Idle nodes' state on disk (fededge.clients.statestore.StateSpillMod, issue 21): the state
round-trips bit for bit, the context holds none between messages, a run trains the same
model with it as without, and fededge's app adds it where the run config asks."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fededge import keys
from fededge import safefile
from fededge._flwr_internals import recorddict_to_objects, task_identity
from fededge.api import CompressionMod, StateSpillMod, StateStoreMod, config_error_mod
from fededge.clients.statestore import STATE_BYTES
from fededge.config import ConfigError, RunConfig
from fededge.protocol import recorddict_from_bytes, recorddict_to_bytes
from fededge.safefile import read_file, write_file

RUN, NODE = 5, 7


@pytest.fixture(autouse=True)
def _identity():
    with task_identity(run_id=RUN, node_id=NODE, task_id=1):  # replies (reply_to) need it; the mod does not
        yield


def _ctx(node: int = NODE, run: int = RUN, **node_config) -> Context:
    return Context(run_id=run, node_id=node, node_config={keys.PARTITION_ID: 2, **node_config},
                   state=RecordDict(), run_config={})


def _msg(t: int = 1, node: int = NODE) -> Message:
    return Message(RecordDict({keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: t})}), dst_node_id=node,
                   message_type="train")


def _file(root, run: int = RUN, node: int = NODE):
    return root / "spill" / str(run) / f"{node}.state"


class Stateful:
    """A train function that grows a residual-like tensor state (float32, float64, int8,
    odd values), a counter and a metric, and remembers what it found in ``context.state``."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __call__(self, msg: Message, ctx: Context) -> Message:
        self.seen.append(recorddict_to_objects(ctx.state) if len(ctx.state) else {})
        n = int(ctx.state["count"]["n"]) + 1 if "count" in ctx.state else 1
        g = torch.Generator().manual_seed(n)
        r = torch.randn(300, generator=g)
        if "residual" in ctx.state:
            r += torch.from_numpy(ctx.state["residual"]["r"].numpy())
        ctx.state["residual"] = ArrayRecord({
            "r": Array(r.numpy()), "d": Array(torch.randn(7, 3, generator=g, dtype=torch.float64).numpy()),
            "i": Array(torch.tensor([-128, 0, 127, n], dtype=torch.int8).numpy()),
            "odd": Array(torch.tensor([float("nan"), float("inf"), -0.0, 5e-45]).numpy())})
        ctx.state["count"] = ConfigRecord({"n": n, "blob": bytes(range(256)) * n, "who": f"node-{ctx.node_id}"})
        ctx.state["last"] = MetricRecord({"loss": 1.0 / 3 * n})
        return Message(RecordDict({keys.METRICS: MetricRecord({"n": n})}), reply_to=msg)


# ----------------------------------------------------------------- the mod


def test_state_round_trips_bit_for_bit_and_the_context_holds_none_between_messages(tmp_path):
    mod, train = StateSpillMod(tmp_path), Stateful()
    ctx = _ctx()
    for t in range(1, 5):
        reply = mod(_msg(t), ctx, train)
        assert reply.content[keys.METRICS]["n"] == t
        assert len(ctx.state) == 0  # idle: nothing in memory ...
        assert _file(tmp_path).is_file()  # ... all of it on disk
    # What message t+1 found is, object for object (content-addressed ids), what message t
    # left: replay the same train function in memory and compare.
    plain, mem = Stateful(), _ctx()
    for t in range(1, 5):
        plain(_msg(t), mem)
    assert train.seen == plain.seen and train.seen[0] == {} and len(train.seen[3]["objects"]) > 0
    assert oct(_file(tmp_path).parent.stat().st_mode & 0o777) == "0o700"


def test_nodes_and_runs_spill_to_their_own_files_and_an_empty_state_leaves_none(tmp_path):
    mod = StateSpillMod(tmp_path)
    a, b, other_run = _ctx(7), _ctx(8), _ctx(7, run=6)
    mod(_msg(node=7), a, Stateful())
    mod(_msg(node=8), b, Stateful())
    mod(_msg(node=7), other_run, Stateful())
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.state")) == [
        "spill/5/7.state", "spill/5/8.state", "spill/6/7.state"]

    def clear(msg, ctx):
        for name in list(ctx.state.keys()):
            del ctx.state[name]
        return Message(RecordDict(), reply_to=msg)

    mod(_msg(node=8), b, clear)
    assert not _file(tmp_path, node=8).exists() and len(b.state) == 0
    reply = mod(_msg(node=8), b, Stateful())  # no file: starts from the empty state
    assert reply.content[keys.METRICS]["n"] == 1


def test_an_error_reply_spills_what_the_context_holds_and_an_exception_keeps_the_state_before(tmp_path):
    mod, ctx = StateSpillMod(tmp_path), _ctx()
    mod(_msg(1), ctx, Stateful())

    def fails_softly(msg, c):
        c.state["count"] = ConfigRecord({"n": 41})
        return Message(Error(code=0, reason="no"), reply_to=msg)

    assert mod(_msg(2), ctx, fails_softly).has_error()
    assert len(ctx.state) == 0
    assert mod(_msg(3), ctx, Stateful()).content[keys.METRICS]["n"] == 42

    before = _file(tmp_path).read_bytes()

    def raises(msg, c):
        c.state["count"] = ConfigRecord({"n": 99})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mod(_msg(4), ctx, raises)
    assert len(ctx.state) == 0 and _file(tmp_path).read_bytes() == before  # as Flower keeps the context
    assert mod(_msg(5), ctx, Stateful()).content[keys.METRICS]["n"] == 43


def test_a_corrupt_file_is_refused_by_name_and_the_node_starts_empty(tmp_path, caplog):
    mod, ctx = StateSpillMod(tmp_path), _ctx()
    for t in (1, 2):
        mod(_msg(t), ctx, Stateful())
    f = _file(tmp_path)
    f.write_bytes(f.read_bytes()[:-5])
    train = Stateful()
    with caplog.at_level(logging.WARNING, logger="fededge"):
        reply = mod(_msg(3), ctx, train)
    assert reply.content[keys.METRICS]["n"] == 1 and train.seen == [{}]
    assert str(f) in caplog.text and "truncated" in caplog.text and "empty state" in caplog.text
    assert mod(_msg(4), ctx, Stateful()).content[keys.METRICS]["n"] == 2  # the file written again is good


def test_a_file_written_before_2026_11_26_still_reads(tmp_path):
    """Older fededge wrote the state as Flower's serialised objects under "state"."""
    first = Stateful()
    mem = _ctx()
    first(_msg(1), mem)
    f = _file(tmp_path)
    f.parent.mkdir(parents=True)
    write_file(f, {"run": str(RUN), "node": str(NODE), "state": recorddict_to_objects(mem.state)})
    train = Stateful()
    assert StateSpillMod(tmp_path)(_msg(2), _ctx(), train).content[keys.METRICS]["n"] == 2
    assert train.seen == [recorddict_to_objects(mem.state)]
    assert STATE_BYTES in read_file(f)  # written back in the new form


def test_a_state_that_names_a_class_is_refused_and_never_loaded(tmp_path, caplog):
    """The state's bytes are read as plain values only (as torch.load(weights_only=True)
    reads the rest of the file): a pickle that would call something is refused."""
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    f = _file(tmp_path)
    f.parent.mkdir(parents=True)
    evil = torch.frombuffer(bytearray(pickle.dumps(("fededge-state/1", [("k", "c", Boom())]))), dtype=torch.uint8)
    write_file(f, {"run": str(RUN), "node": str(NODE), STATE_BYTES: evil})
    train = Stateful()
    with caplog.at_level(logging.WARNING, logger="fededge"):
        assert StateSpillMod(tmp_path)(_msg(), _ctx(), train).content[keys.METRICS]["n"] == 1
    assert train.seen == [{}] and not (tmp_path / "pwned").exists()
    assert str(f) in caplog.text and "only plain values" in caplog.text and "empty state" in caplog.text


def test_spilled_states_are_not_fsynced_and_the_resume_store_is(tmp_path, monkeypatch):
    """A spilled state only has to outlive the process's next message; a state kept for a
    resume has to outlive the machine."""
    synced = []
    real = safefile.os.fsync
    monkeypatch.setattr(safefile.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    StateSpillMod(tmp_path)(_msg(), _ctx(), Stateful())
    assert synced == [] and _file(tmp_path).is_file()
    StateSpillMod(tmp_path, durable=True)(_msg(), _ctx(), Stateful())  # a SuperNode that must survive a power loss
    assert len(synced) == 2
    synced.clear()
    store_msg = Message(RecordDict({keys.CONFIG: ConfigRecord({
        keys.SERVER_ROUND: 1, keys.STATE_KEY: "k", keys.STATE_ATTEMPT: "a", keys.STATE_RESUMED_FROM: 0,
        keys.STATE_EVERY: 1})}), dst_node_id=NODE, message_type="train")
    StateStoreMod(tmp_path)(store_msg, _ctx(), Stateful())
    assert len(synced) == 2  # the file and its directory


def test_a_record_dicts_bytes_round_trip_bit_for_bit():
    import enum

    import numpy as np

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    ctx = _ctx()
    for t in (1, 2):
        Stateful()(_msg(t), ctx)
    # Values of subclasses Flower's records accept, stored as the plain types Flower's
    # serialisation makes of them (same object id); bool stays bool.
    ctx.state["odd"] = MetricRecord({"mean": np.float64(0.1), "level": Level.HIGH, "xs": [np.float64(1.5), np.float64(2.0)]})
    ctx.state["conf"] = ConfigRecord({"who": Name("a"), "flag": True, "big": 2**62, "flags": [True, False]})
    back = recorddict_from_bytes(recorddict_to_bytes(ctx.state))
    assert recorddict_to_objects(back) == recorddict_to_objects(ctx.state)
    assert type(back["odd"]["mean"]) is float and type(back["odd"]["level"]) is int
    assert type(back["conf"]["flag"]) is bool and type(back["conf"]["flags"][0]) is bool


@pytest.mark.parametrize("what", ["str", "int", "float tensor", "2-D tensor", "list body", "unknown kind",
                                  "not a tuple", "truncated pickle"])
def test_a_state_file_whose_state_is_malformed_is_refused_and_rewritten(tmp_path, caplog, what):
    import pickle

    def blob(obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    bad = {"str": "x", "int": 3, "float tensor": torch.zeros(4), "2-D tensor": torch.zeros(2, 2, dtype=torch.uint8),
           "list body": blob(("fededge-state/1", [("k", "c", [1])])),
           "unknown kind": blob(("fededge-state/1", [("k", "z", {})])),
           "not a tuple": blob([1, 2]),
           "truncated pickle": blob(("fededge-state/1", [("k", "c", {"a": 1})]))[:-3]}[what]
    f = _file(tmp_path)
    f.parent.mkdir(parents=True)
    write_file(f, {"run": str(RUN), "node": str(NODE), STATE_BYTES: bad})
    mod, ctx, train = StateSpillMod(tmp_path), _ctx(), Stateful()
    with caplog.at_level(logging.WARNING, logger="fededge"):
        assert mod(_msg(), ctx, train).content[keys.METRICS]["n"] == 1
    assert train.seen == [{}] and str(f) in caplog.text and "empty state" in caplog.text
    assert mod(_msg(2), ctx, Stateful()).content[keys.METRICS]["n"] == 2  # the file written again is good


def test_root_from_the_node_config_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDEDGE_STATE_DIR", str(tmp_path / "env"))
    mod = StateSpillMod()
    mod(_msg(), _ctx(), Stateful())
    mod(_msg(node=8), _ctx(8, **{keys.STATE_DIR: str(tmp_path / "node")}), Stateful())
    assert _file(tmp_path / "env").is_file() and _file(tmp_path / "node", node=8).is_file()


@pytest.mark.parametrize("how", ["argument", "node-config", "environment"])
def test_off_keeps_the_state_in_memory_and_says_so_once(tmp_path, monkeypatch, caplog, how):
    monkeypatch.setenv("FEDEDGE_STATE_DIR", "off" if how == "environment" else str(tmp_path))
    mod = StateSpillMod("OFF" if how == "argument" else None)
    ctx = _ctx(**({keys.STATE_DIR: "off"} if how == "node-config" else {}))
    with caplog.at_level(logging.WARNING, logger="fededge"):
        for t in (1, 2, 3):
            assert mod(_msg(t), ctx, Stateful()).content[keys.METRICS]["n"] == t
    assert int(ctx.state["count"]["n"]) == 3 and not list(tmp_path.rglob("*.state"))
    assert caplog.text.count("StateSpillMod is off") == 1


def test_other_runs_spilled_states_not_written_for_max_age_days_go_when_a_run_starts(tmp_path):
    def old_run(name: str, age_days: float) -> None:
        f = tmp_path / "spill" / name / "3.state"
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x")
        t = time.time() - age_days * 86400
        os.utime(f, (t, t))

    old_run("1", 2)
    old_run("2", 0.5)
    StateSpillMod(tmp_path, max_age_days=1)(_msg(), _ctx(), Stateful())
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == ["2", str(RUN)]
    # The state store's own collection (7 days) leaves the spill directory alone.
    t = time.time() - 30 * 86400
    for p in (tmp_path / "spill").rglob("*"):
        os.utime(p, (t, t))
    store_msg = Message(RecordDict({keys.CONFIG: ConfigRecord({
        keys.SERVER_ROUND: 1, keys.STATE_KEY: "k", keys.STATE_ATTEMPT: "a", keys.STATE_RESUMED_FROM: 0,
        keys.STATE_EVERY: 1})}), dst_node_id=NODE, message_type="train")
    StateStoreMod(tmp_path)(store_msg, _ctx(), Stateful())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k", "spill"]
    with pytest.raises(ValueError, match="max_age_days"):
        StateSpillMod(tmp_path, max_age_days=0)


def test_outside_the_state_store_it_changes_nothing_the_store_sees_or_writes(tmp_path):
    def msg(t: int) -> Message:
        return Message(RecordDict({keys.CONFIG: ConfigRecord({
            keys.SERVER_ROUND: t, keys.STATE_KEY: "run", keys.STATE_ATTEMPT: "a1", keys.STATE_RESUMED_FROM: 0,
            keys.STATE_EVERY: 2})}), dst_node_id=NODE, message_type="train")

    def wrap(mod, inner):
        return lambda msg_, c: mod(msg_, c, inner)

    def run(mods, root) -> tuple[list, list, list]:
        ctx, train = _ctx(), Stateful()
        app_fn = train
        for mod in reversed(mods):  # the first mod outermost, as Flower runs them
            app_fn = wrap(mod, app_fn)
        replies = [app_fn(msg(t), ctx).content[keys.METRICS]["n"] for t in range(1, 6)]
        files = sorted(p.name for p in (root / "store" / "run").rglob("*.state"))
        return replies, files, train.seen

    plain = run([StateStoreMod(tmp_path / "a" / "store")], tmp_path / "a")
    spilled = run([StateSpillMod(tmp_path / "b" / "spill-root"), StateStoreMod(tmp_path / "b" / "store")],
                  tmp_path / "b")
    assert plain == spilled and plain[0] == [1, 2, 3, 4, 5]


def test_client_states_is_memory_disk_or_auto():
    assert RunConfig().client_states == "auto" and RunConfig(client_states="disk").client_states == "disk"
    with pytest.raises(ConfigError, match=r"'client-states' must be one of memory, disk, auto; got 'swap'"):
        RunConfig.from_mapping({"client-states": "swap"})


# ----------------------------------------------------------------- fededge's app


def test_fededge_app_spills_where_the_run_config_asks_except_in_process(tmp_path):
    from fededge.clients.app import client_mods, run_config_mods

    names = [type(m).__name__ for m in client_mods(RunConfig(compressor="topk", client_states="disk"))]
    assert names == ["StateSpillMod", "StateStoreMod", "CompressionMod"]  # outermost of the stateful ones
    names = [type(m).__name__ for m in client_mods(RunConfig(compressor="topk", client_states="disk"), inprocess=True)]
    assert names == ["StateStoreMod", "CompressionMod"]

    def through_the_app(client_states: str, root: str, **node_config) -> Context:
        ctx = _ctx(**{keys.STATE_DIR: str(tmp_path / root), **node_config})
        ctx.run_config.update({keys.CLIENT_STATES: client_states, "checkpoint-every": 0})
        train = Stateful()
        for t in (1, 2, 3):
            reply = run_config_mods(_msg(t), ctx, train)
            assert reply.content[keys.METRICS]["n"] == t
        return ctx

    assert len(through_the_app("disk", "a").state) == 0 and _file(tmp_path / "a").is_file()
    ctx = through_the_app("memory", "b")
    assert int(ctx.state["count"]["n"]) == 3 and not (tmp_path / "b").exists()
    ctx = through_the_app("disk", "c", **{keys.INPROCESS_NODE: True})  # the in-process runtime spills itself
    assert int(ctx.state["count"]["n"]) == 3 and not (tmp_path / "c").exists()


def _untimed(value):
    """``value`` less its measured times (``*_s`` keys), at any depth."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not k.endswith("_s")}
    return [_untimed(v) for v in value] if isinstance(value, list) else value


def _rounds(run_dir) -> list[dict]:
    return [_untimed(json.loads(x)) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_trains_the_same_model_with_idle_states_on_disk(tmp_path):
    """signSGD with error feedback, 6 clients, 3 a round: each client's residual must come
    back bit for bit from disk whenever it is sampled again, or the models differ."""
    from fededge.clients.app import train as fededge_train
    from fededge.server.inprocess import run_inprocess

    conf = {"num-rounds": 3, "local-steps": 2, "model": "mlp", "progress": "off", "clients-per-round": 3,
            "compressor": "signsgd", "error-feedback": True, "checkpoint-every": 0}
    spill = tmp_path / "spill-root"

    def hand(*mods) -> ClientApp:
        app = ClientApp(mods=[config_error_mod])
        app.train(mods=list(mods))(fededge_train)  # fededge's train: plain local SGD
        return app

    def forget(msg, ctx, call_next):  # a node whose state is lost after every message
        reply = call_next(msg, ctx)
        ctx.state = RecordDict()
        return reply

    def run(name: str, *mods):
        run_dir = run_inprocess({**conf, "results-dir": str(tmp_path / name)}, num_clients=6,
                                client_app=hand(*mods, CompressionMod(compressor="signsgd", error_feedback=True)))
        return torch.load(run_dir / "model.pt"), _rounds(run_dir)

    (a, memory), (b, disk) = run("memory"), run("disk", StateSpillMod(spill))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert memory == disk and [r["round"] for r in disk] == [0, 1, 2, 3]
    files = list(spill.rglob("*.state"))
    assert 3 <= len(files) <= 6  # every client that trained left its residual there
    assert all(keys.STATE_COMPRESS in recorddict_from_bytes(read_file(f)[STATE_BYTES].numpy().tobytes())
               for f in files)
    c, _ = run("forgetful", forget)  # the residuals matter within these 3 rounds
    assert not all(torch.equal(a[k], c[k]) for k in a)
