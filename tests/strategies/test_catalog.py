"""One record per strategy (fededge.catalog) and the own-loop template (OwnLoop).

A strategy added through one :class:`StrategyRecord` is selectable by name in the run
config, built by the server's registry and run; a toy strategy written on
:class:`OwnLoop` (its rounds' logic only) equals Flower's FedAvg bit for bit, and is
checkpointed and resumed by the base's declared state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fededge.catalog import StrategyRecord, register_strategy, strategy_names, strategy_record, unregister_strategy
from fededge.clients.app import client_mods
from fededge.config import STRATEGIES, ConfigError, RunConfig
from fededge.server.inprocess import run_inprocess
from fededge.strategies.compressed import Compressed
from fededge.strategies.ownloop import OwnLoop
from fededge.strategies.registry import build_strategy
from fededge.strategies.resume import ResumeError

BASE = {"num-rounds": 3, "local-steps": 2, "progress": "off", "partition": "iid", "model": "mlp",
        "sim-step-s": 0.05, "seed": 3}
NODES = 3


class CountingFedAvg(FedAvg):
    """FedAvg that counts its aggregations (to see that it, and not FedAvg, ran)."""

    calls = 0

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        type(self).calls += 1
        return super().aggregate_train(server_round, replies)


class LockStep(OwnLoop):
    """A toy own-loop strategy: FedAvg's rounds, written on OwnLoop (round logic only)."""

    label = "lockstep"
    resume_settings = ("tag",)
    state_attrs = ("_model", "rounds_seen")

    crash_after: int | None = None  # a simulated crash after this round (its checkpoint written)

    def __init__(self, *, tag: str = "a", **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.tag = tag
        self.rounds_seen: list[int] = []
        self._model: ArrayRecord | None = None

    def _fresh(self, grid: Grid, initial_arrays: ArrayRecord) -> None:
        self._model = initial_arrays

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        self._result.arrays = self._model
        return int(state["round"])

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        for t in range(done + 1, num_rounds + 1):
            msgs = list(self.configure_train(t, self._model, self._train_config, grid))
            replies: list[Message] = list(grid.send_and_receive(msgs, timeout=timeout))
            arrays, metrics = self.aggregate_train(t, replies)
            if arrays is not None:
                self._model = self._result.arrays = arrays
            if metrics is not None:
                self._result.train_metrics_clientapp[t] = metrics
            self.rounds_seen.append(t)
            self._evaluate(t)
            self._round_done(t)
            if t == self.crash_after:
                raise SimulatedCrash(f"crashed after round {t}")


class SimulatedCrash(RuntimeError):
    pass


@pytest.fixture
def registered():
    names: list[str] = []

    def add(record: StrategyRecord) -> StrategyRecord:
        names.append(record.name)
        return register_strategy(record)

    yield add
    for name in names:
        unregister_strategy(name)


def _accuracies(run_dir: Path) -> list[float | None]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x.get("accuracy") for x in lines if "round" in x]


def test_the_built_in_names_are_the_records():
    assert strategy_names()[:len(STRATEGIES)] == STRATEGIES
    assert strategy_record("dga").compression == "own" and strategy_record("dga").client_side == "dga"
    assert strategy_record("fedbuff").compression == "none"
    assert strategy_record("fedavg").compression == "wrapped"


def test_a_toy_strategy_added_through_one_record_runs_and_equals_fedavg(tmp_path, registered):
    registered(StrategyRecord(name="toy-count", build=lambda cfg, kw: CountingFedAvg(**kw),
                              summary="FedAvg that counts"))
    assert "toy-count" in strategy_names()
    cfg = RunConfig.from_mapping({**BASE, "strategy": "toy-count"})  # the name is valid now
    assert type(build_strategy(cfg)) is CountingFedAvg
    CountingFedAvg.calls = 0
    toy = run_inprocess({**BASE, "strategy": "toy-count", "results-dir": str(tmp_path / "toy")}, num_clients=NODES)
    assert CountingFedAvg.calls == BASE["num-rounds"]
    fedavg = run_inprocess({**BASE, "results-dir": str(tmp_path / "fedavg")}, num_clients=NODES)
    assert _accuracies(toy) == _accuracies(fedavg)
    assert all(a is not None for a in _accuracies(toy))


def test_the_record_says_how_compression_goes(registered):
    registered(StrategyRecord(name="toy-wrapped", build=lambda cfg, kw: FedAvg(**kw)))
    registered(StrategyRecord(name="toy-refuses", build=lambda cfg, kw: FedAvg(**kw), compression="none"))
    wrapped = build_strategy(RunConfig.from_mapping({"strategy": "toy-wrapped", "compressor": "topk"}))
    assert isinstance(wrapped, Compressed)
    assert [type(m).__name__ for m in client_mods(RunConfig(strategy="toy-wrapped", compressor="topk"))][-1:] \
        == ["CompressionMod"]
    with pytest.raises(ConfigError, match="not supported with strategy='toy-refuses'"):
        RunConfig.from_mapping({"strategy": "toy-refuses", "compressor": "topk"})


class SeesTags(FedAvg):
    """FedAvg that keeps what its replies' ``toy-tag`` metric said."""

    seen: list[float] = []

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        type(self).seen += [float(r.content["metrics"]["toy-tag"]) for r in replies if r.has_content()]
        return super().aggregate_train(server_round, replies)


def tag_mod(msg: Message, context: Any, call_next: Any) -> Message:
    """A client mod of a user's strategy: its train replies carry ``toy-tag`` = local-steps."""
    reply = call_next(msg, context)
    if reply.has_content() and "metrics" in reply.content:
        reply.content["metrics"]["toy-tag"] = float(context.run_config["local-steps"])
    return reply


def test_a_record_adds_its_own_client_mods_to_fededges_clientapp(tmp_path, registered):
    registered(StrategyRecord(name="toy-tagged", build=lambda cfg, kw: SeesTags(**kw),
                              client_mods=lambda cfg: [tag_mod]))
    mods = client_mods(RunConfig(strategy="toy-tagged", compressor="topk"))
    assert [getattr(m, "__name__", type(m).__name__) for m in mods][-2:] == ["CompressionMod", "tag_mod"]
    SeesTags.seen = []
    run_inprocess({**BASE, "strategy": "toy-tagged", "results-dir": str(tmp_path / "tagged")}, num_clients=NODES)
    assert SeesTags.seen == [float(BASE["local-steps"])] * (NODES * BASE["num-rounds"])
    registered(StrategyRecord(name="toy-bad-mods", build=lambda cfg, kw: FedAvg(**kw), client_mods=lambda cfg: [3]))
    with pytest.raises(TypeError, match="toy-bad-mods.*not a Flower mod"):
        client_mods(RunConfig(strategy="toy-bad-mods"))
    with pytest.raises(ValueError, match="client_mods must be a callable"):
        StrategyRecord(name="x", build=lambda cfg, kw: FedAvg(**kw), client_mods=3)


def test_a_record_check_stops_a_bad_run_config(registered):
    def needs_steps(cfg: RunConfig) -> None:
        if cfg.local_steps < 10:
            raise ConfigError("run-config key 'local-steps' must be >= 10 with strategy='toy-check'")

    registered(StrategyRecord(name="toy-check", build=lambda cfg, kw: FedAvg(**kw), check=needs_steps))
    with pytest.raises(ConfigError, match="local-steps"):
        RunConfig.from_mapping({"strategy": "toy-check", "local-steps": 2})
    RunConfig.from_mapping({"strategy": "toy-check", "local-steps": 10})


def test_bad_records_and_names_are_refused_by_name(registered):
    with pytest.raises(ConfigError, match="register_strategy"):
        strategy_record("no-such")
    with pytest.raises(ValueError, match="compression must be one of"):
        StrategyRecord(name="x", build=lambda cfg, kw: FedAvg(**kw), compression="some")
    with pytest.raises(ValueError, match="client_side"):
        StrategyRecord(name="x", build=lambda cfg, kw: FedAvg(**kw), client_side="mine")
    with pytest.raises(ValueError, match="one word"):
        StrategyRecord(name="two words", build=lambda cfg, kw: FedAvg(**kw))
    with pytest.raises(ValueError, match="registered already"):
        register_strategy(StrategyRecord(name="fedavg", build=lambda cfg, kw: FedAvg(**kw)))
    with pytest.raises(ValueError, match="built-in"):
        unregister_strategy("fedavg")
    registered(StrategyRecord(name="toy-not-a-strategy", build=lambda cfg, kw: object()))
    with pytest.raises(TypeError, match="not a flwr.serverapp.strategy.Strategy"):
        build_strategy(RunConfig.from_mapping({"strategy": "toy-not-a-strategy"}))


def test_a_toy_own_loop_equals_fedavg_and_resumes_equal(tmp_path, registered, monkeypatch):
    """Round logic only: the base evaluates, checkpoints (declared state) and resumes it."""
    registered(StrategyRecord(name="toy-lockstep", build=lambda cfg, kw: LockStep(**kw)))
    run = {**BASE, "num-rounds": 4, "checkpoint-every": 1}
    whole = run_inprocess({**run, "strategy": "toy-lockstep", "results-dir": str(tmp_path / "whole")},
                          num_clients=NODES)
    fedavg = run_inprocess({**run, "results-dir": str(tmp_path / "fedavg")}, num_clients=NODES)
    assert _accuracies(whole) == _accuracies(fedavg)
    assert len(_accuracies(whole)) == 5 and all(a is not None for a in _accuracies(whole))

    monkeypatch.setattr(LockStep, "crash_after", 2)
    crashed = tmp_path / "crashed"
    with pytest.raises(SimulatedCrash):
        run_inprocess({**run, "strategy": "toy-lockstep", "results-dir": str(crashed)}, num_clients=NODES)
    monkeypatch.setattr(LockStep, "crash_after", None)
    (run_dir,) = [p for p in crashed.iterdir() if p.is_dir()]
    assert len(_accuracies(run_dir)) == 3  # rounds 0..2
    run_inprocess({**run, "strategy": "toy-lockstep", "resume-from": str(run_dir)}, num_clients=NODES)
    assert _accuracies(run_dir) == _accuracies(whole)


def test_the_declared_state_round_trips_and_other_settings_are_refused():
    s = LockStep(tag="a")
    s._model = ArrayRecord()
    s.rounds_seen = [1, 2]
    s._done = 2
    state = s.state_dict()
    assert state["settings"] == {"tag": "a"} and state["round"] == 2
    other = LockStep(tag="b")
    with pytest.raises(ResumeError, match=r"lockstep: the checkpoint ran with \{'tag': 'a'\}"):
        other.load_state_dict(state)
    same = LockStep(tag="a")
    same.load_state_dict(state)
    assert same._resume is state


def test_checkpoints_written_before_ownloop_still_load():
    """The state formats of ecf749b and older (DGA's ``config``/``resync``/``participants``,
    gossip's ``algorithm``/``topology``/``synced``/``resync``/``partition``, the async
    loop's ``mode``) load, their settings are still checked, and their sets come back as
    sets."""
    from fededge.strategies.dga import DGA
    from fededge.strategies.fedbuff import FedBuff
    from fededge.strategies.gossip import Gossip
    from fededge.strategies.resume import from_plain

    dga = DGA(delay=1)
    dga.load_state_dict({"round": 3, "config": {"delay": 1, "warmup": 0, "correction": True},
                         "resync": [5, 2], "participants": [2, 5, 9], "globals": {}, "arrays_of": {},
                         "timeline": None})
    assert dga._resume["settings"] == dga.settings()
    assert from_plain(dga._resume["attrs"]["_resync"]) == {2, 5}
    assert from_plain(dga._resume["attrs"]["participants"]) == [2, 5, 9]
    with pytest.raises(ResumeError, match="DGA: the checkpoint ran with"):
        DGA(delay=2).load_state_dict({"round": 3, "config": {"delay": 1, "warmup": 0, "correction": True},
                                      "resync": [], "participants": []})

    gossip = Gossip(topology="ring", algorithm="choco")
    gossip.load_state_dict({"round": 2, "algorithm": "choco", "topology": "ring", "nodes": [1, 2, 3],
                            "synced": [1, 0], "resync": [], "partition": {0: 0, 1: 1}})
    assert from_plain(gossip._resume["attrs"]["_synced"]) == {0, 1}
    with pytest.raises(ResumeError, match="gossip"):
        Gossip(topology="torus").load_state_dict({"round": 2, "algorithm": "dpsgd", "topology": "ring",
                                                   "synced": [], "resync": [], "partition": {}})

    with pytest.raises(ResumeError, match="fedasync"):
        FedBuff().load_state_dict({"mode": "fedasync"})


def test_a_set_is_saved_sorted_and_a_set_of_mixed_types_is_named_not_raised(caplog):
    from fededge.strategies.resume import from_plain, load_strategy_state, strategy_state, to_plain

    assert to_plain({3, 1, 2}) == {"__set__": [1, 2, 3]} and from_plain(to_plain({3, 1})) == {1, 3}
    # numeric numpy scalars keep their dtype; others (a string) are their Python value, as before
    import numpy as np

    assert to_plain(np.str_("best")) == "best" and type(to_plain(np.str_("best"))) is str
    assert type(from_plain(to_plain(np.uint16(7)))) is np.uint16
    s = FedAvg()
    s.seen = {3, 1}
    s.odd = {1, "a"}
    with caplog.at_level("WARNING", logger="fededge"):
        state = strategy_state(s)
    assert "odd" not in state["attrs"] and any("FedAvg.odd" in r.getMessage() for r in caplog.records)
    t = FedAvg()
    load_strategy_state(t, state)
    assert t.seen == {1, 3}


def test_a_frozen_settings_object_is_not_state_and_is_not_warned_about(caplog):
    """Compressed(update=UpdateConfig(...)) keeps its settings in a frozen dataclass: fixed
    when built (a resumed run builds it again), so the checkpoint leaves it out, silently."""
    from fededge.compress.update import UpdateConfig
    from fededge.strategies.resume import strategy_state

    s = Compressed(FedAvg(), update=UpdateConfig(compressor="topk"))
    with caplog.at_level("WARNING", logger="fededge"):
        state = strategy_state(s)
    assert "update" not in state["attrs"] and not caplog.records
    s.mutable = _Mutable()  # a plain object is still named: it may be state
    with caplog.at_level("WARNING", logger="fededge"):
        strategy_state(s)
    assert any("Compressed.mutable" in r.getMessage() for r in caplog.records)


class _Mutable:
    pass
