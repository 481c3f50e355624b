"""Checkpoint and resume (issue 18): a run killed at any moment continues from its last
checkpoint and ends exactly as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fededge.cli import main as cli_main
from fededge.config import ConfigError, RunConfig, saved_run_config
from fededge.server.checkpoint import (
    CheckpointError, checkpoint_files, latest_checkpoint, read_checkpoint, write_checkpoint,
)
from fededge.server.inprocess import run_inprocess

ROOT = Path(__file__).resolve().parents[2]
BASE = {"num-rounds": 6, "local-steps": 3, "model": "mlp", "progress": "off", "netem": "4g:0.5,3g:0.5",
        "sim-step-s": 0.01, "checkpoint-every": 1}

#: Each strategy with a stateful compressor, as the issue asks.
RUNS = {
    "fedavg-ef": {"strategy": "fedavg", "compressor": "topk", "error-feedback": True},
    # The clients' states on disk (issue 21): the checkpoint keeps them in a side file.
    "fedavg-ef-disk": {"strategy": "fedavg", "compressor": "topk", "error-feedback": True, "client-states": "disk"},
    "fedadam-powersgd": {"strategy": "fedadam", "compressor": "powersgd", "error-feedback": True,
                         "server-lr": 0.05},
    "diloco-ef": {"strategy": "diloco", "compressor": "onebit", "error-feedback": True},
    # FedBuff takes no compressor (its replies are used one by one, against the version
    # each client trained on; config.py refuses one): its state is its own buffer, versions
    # and queue, and the clients' sampler positions.
    "fedbuff": {"strategy": "fedbuff"},
    # DGA pipelined (the in-process grid runs each node's messages in order), averages
    # two rounds in flight, and top-k with error feedback in the clients' state.
    "dga-ef": {"strategy": "dga", "dga-delay": 2, "compressor": "topk", "error-feedback": True},
    "dga-powersgd-lockstep": {"strategy": "dga", "dga-delay": 1, "dga-pipeline": "off",
                              "compressor": "powersgd", "error-feedback": True},
    # CHOCO-SGD on a ring, its messages top-k compressed: public estimates at the relay
    # and in every node's state.
    "gossip-choco": {"strategy": "gossip", "gossip-algorithm": "choco", "topology": "ring",
                     "compressor": "topk", "gossip-gamma": 0.5},
}
ASYNC = {"fedbuff"}


# -- the checkpoint file -----------------------------------------------------------------
def test_write_is_atomic_keeps_two_and_reads_back(tmp_path):
    for r in range(1, 5):
        path, size, seconds = write_checkpoint(tmp_path, r, {"round": r, "t": torch.arange(r)})
        assert path.stat().st_size == size and seconds >= 0
    assert [p.name for p in checkpoint_files(tmp_path)] == ["round-000003.ckpt", "round-000004.ckpt"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    got = read_checkpoint(tmp_path / "checkpoints" / "round-000004.ckpt")
    assert got["round"] == 4 and torch.equal(got["t"], torch.arange(4))
    # What a killed writer left goes with the next checkpoint, this pid's too (a container
    # restarts with the pid of the one killed), and SQLite's journal of a killed side file.
    import os

    d = tmp_path / "checkpoints"
    left = [d / f".round-000005.ckpt.{os.getpid()}.tmp", d / ".round-000005.states.1.tmp",
            d / ".round-000005.states.1.tmp-journal"]
    for p in left:
        p.write_bytes(b"partial")
    write_checkpoint(tmp_path, 6, {"round": 6})
    assert sorted(p.name for p in d.iterdir()) == ["round-000004.ckpt", "round-000006.ckpt"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic"])
def test_a_damaged_newest_checkpoint_is_refused_by_name_and_the_previous_used(tmp_path, damage, caplog):
    write_checkpoint(tmp_path, 1, {"round": 1})
    path, _, _ = write_checkpoint(tmp_path, 2, {"round": 2, "t": torch.ones(100)})
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    else:
        data[:4] = b"JUNK"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=path.name):
        read_checkpoint(path)
    used, payload = latest_checkpoint(tmp_path)
    assert used.name == "round-000001.ckpt" and payload["round"] == 1
    assert path.name in caplog.text


def test_no_checkpoint_is_a_named_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        latest_checkpoint(tmp_path)
    assert cli_main(["resume", str(tmp_path)]) == 2


def test_checkpoint_every_is_checked():
    with pytest.raises(ConfigError, match="checkpoint-every"):
        RunConfig.from_mapping({"checkpoint-every": -1})


# -- killed runs, resumed ----------------------------------------------------------------
def _lines(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.pop("wall_s")  # real time
        for c in rec.get("clients", []):
            c.pop("compute_s")  # measured; the clock charges sim-step-s
        out.append(rec)
    return out


def _summary(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in s.items() if not k.startswith(("wall_s", "checkpoint", "run_id"))}


def _assert_same_run(resumed: Path, whole: Path) -> None:
    a, b = _lines(resumed), _lines(whole)
    assert [r["round"] for r in a] == list(range(len(b)))  # no round duplicated, none missing
    assert a == b
    assert _summary(resumed) == _summary(whole)
    ma, mb = torch.load(resumed / "model.pt"), torch.load(whole / "model.pt")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def _killed_run(tmp_path: Path, when: str, at: int, overrides: dict) -> Path:
    results = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.server.resume_driver", str(results), when, str(at), json.dumps(overrides)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        # TMPDIR: the killed run's node states (its DiskStates directory) stay in tmp_path
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (run_dir,) = results.iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"  # it never finished
    return run_dir


@pytest.fixture(scope="module")
def whole_runs(tmp_path_factory):
    """Each configuration, uninterrupted."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = run_inprocess({**BASE, **RUNS[name], "results-dir": str(tmp_path_factory.mktemp(name))},
                                        num_clients=4)
        return cache[name]
    return get


@pytest.mark.parametrize("when, at", [("between", 3), ("mid-round", 4), ("mid-checkpoint", 3)])
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_killed_run_resumes_to_the_uninterrupted_run(tmp_path, whole_runs, name, when, at):
    run_dir = _killed_run(tmp_path, when, at, {**BASE, **RUNS[name]})
    last = int(checkpoint_files(run_dir)[-1].name[6:12])
    if when == "mid-round" and name in ASYNC:
        # A message of version ``at`` is sent once version at-1 exists; the other
        # clients' replies may make versions ``at``, at+1 .. before the killed one trains.
        assert last >= at - 1
    else:
        assert last == (at - 1 if when in ("mid-round", "mid-checkpoint") else at)
    assert cli_main(["resume", str(run_dir)]) == 0
    _assert_same_run(run_dir, whole_runs(name))


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before(tmp_path, whole_runs):
    run_dir = _killed_run(tmp_path, "between", 4, {**BASE, **RUNS["fedavg-ef"]})
    newest = checkpoint_files(run_dir)[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    assert cli_main(["resume", str(run_dir)]) == 0
    _assert_same_run(run_dir, whole_runs("fedavg-ef"))


def test_a_config_that_matters_is_refused_by_name_and_num_rounds_may_grow(tmp_path, whole_runs):
    run_dir = _killed_run(tmp_path, "between", 2, {**BASE, **RUNS["fedavg-ef"], "num-rounds": 6})
    with pytest.raises(ConfigError, match="local-lr"):
        run_inprocess({**BASE, **RUNS["fedavg-ef"], "local-lr": 0.5, "resume-from": str(run_dir)}, num_clients=4)
    assert cli_main(["resume", str(run_dir), "--num-rounds", "4"]) == 0
    assert [r["round"] for r in _lines(run_dir)] == [0, 1, 2, 3, 4]
    assert cli_main(["resume", str(run_dir)]) == 0  # the run's own num-rounds: on to 6
    _assert_same_run(run_dir, whole_runs("fedavg-ef"))


def test_pipelined_dga_resumes_with_rounds_in_flight_between_checkpoints(tmp_path):
    """Checkpoints every 3 rounds: DGA (delay 2) pushes rounds ahead between them, stops
    pushing at a due round, saves, and refills. The run equals one without checkpoints
    (the stops change when messages leave, not what they carry), and a run killed in
    round 5, with rounds 4-5 out, resumes from round 3 to the same end."""
    conf = {**BASE, **RUNS["dga-ef"], "checkpoint-every": 3}
    plain = run_inprocess({**conf, "checkpoint-every": 0, "results-dir": str(tmp_path / "plain")}, num_clients=4)
    assert all(r.get("pipelined") for r in _lines(plain)[1:])
    assert not (plain / "checkpoints").exists()
    run_dir = _killed_run(tmp_path, "mid-round", 5, conf)
    assert [p.name for p in checkpoint_files(run_dir)] == ["round-000001.ckpt", "round-000003.ckpt"]
    assert cli_main(["resume", str(run_dir)]) == 0
    _assert_same_run(run_dir, plain)


# -- a runtime that keeps no client state (Ray, a SuperLink): the nodes keep their own ----
@pytest.mark.parametrize("name, when, at, every", [
    ("fedavg-ef", "between", 3, 1), ("fedavg-ef", "mid-round", 5, 2), ("dga-ef", "mid-round", 4, 1),
    ("gossip-choco", "between", 4, 2), ("fedadam-powersgd", "mid-round", 5, 2)])
def test_nodes_keep_their_state_on_disk_when_the_checkpoint_cannot(tmp_path, whole_runs, monkeypatch,
                                                                    name, when, at, every):
    """The checkpoint holds no client state (keep_client_states=False, as under Ray); a
    resumed run's grid starts with empty contexts; each node takes up the state it saved
    at the checkpoint (fededge.clients.statestore), and the run ends as the uninterrupted one."""
    store = tmp_path / "state"
    monkeypatch.setenv("FEDEDGE_STATE_DIR", str(store))
    conf = {**BASE, **RUNS[name], "checkpoint-every": every}
    run_dir = _killed_run(tmp_path, when, at, {**conf, "__keep_client_states": False})
    assert read_checkpoint(checkpoint_files(run_dir)[-1])["grid"] is None
    kept = sorted(p.name for p in store.glob("*/partition-1/*.state"))
    assert kept and len(kept) <= every + 2, kept  # pruned to what either checkpoint needs
    run_inprocess({**conf, "resume-from": str(run_dir)}, num_clients=4, keep_client_states=False)
    # The uninterrupted run of the same runtime (its messages carry the state-* keys too).
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4,
                          keep_client_states=False)
    _assert_same_run(run_dir, whole)
    assert _lines(whole)[1:] != _lines(whole_runs(name))[1:]  # bytes_down: the state-* keys


def test_without_the_nodes_state_a_resumed_run_restarts_its_residuals(tmp_path, monkeypatch):
    """The control: the same kill and resume with the state store off differs (the
    error-feedback residuals start again), so the test above depends on the store."""
    monkeypatch.setenv("FEDEDGE_STATE_DIR", "off")
    conf = {**BASE, **RUNS["fedavg-ef"]}
    run_dir = _killed_run(tmp_path, "between", 3, {**conf, "__keep_client_states": False})
    run_inprocess({**conf, "resume-from": str(run_dir)}, num_clients=4, keep_client_states=False)
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4,
                          keep_client_states=False)
    a, b = _lines(run_dir), _lines(whole)
    assert a[:4] == b[:4] and a[4:] != b[4:]


def test_resume_keeps_an_lr_schedule_on_its_rounds_and_reads_older_run_configs(tmp_path):
    from fededge.server.runner import check_resumable

    def run_dir(config: dict) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"config": config}))
        return d

    cosine = RunConfig.from_mapping({"lr-schedule": "cosine", "num-rounds": 10})
    saved = run_dir(cosine.to_mapping())
    check_resumable(saved, cosine)
    with pytest.raises(ConfigError, match="num-rounds=12 but the run had 10.*lr-schedule='cosine'.*num-rounds=10"):
        check_resumable(saved, RunConfig.from_mapping({"lr-schedule": "cosine", "num-rounds": 12}))
    # a constant rate may still grow the run
    check_resumable(run_dir(RunConfig.from_mapping({"num-rounds": 10}).to_mapping()),
                    RunConfig.from_mapping({"num-rounds": 12}))
    # a run written before lr-schedule existed had the default's effect, so it resumes
    old = {k: v for k, v in RunConfig.from_mapping({}).to_mapping().items() if not k.startswith("lr-")}
    check_resumable(run_dir(old), RunConfig.from_mapping({}))
    with pytest.raises(ConfigError, match="lr-schedule='step' \\(the run had 'constant'\\)"):
        check_resumable(run_dir(old), RunConfig.from_mapping({"lr-schedule": "step"}))
    # a DGC run written before dgc-warmup-epochs existed warmed up over its rounds alone:
    # it resumes so (fededge resume fills the key in), not under today's default
    dgc = {k: v for k, v in RunConfig.from_mapping({"compressor": "dgc"}).to_mapping().items()
           if k != "dgc-warmup-epochs"}
    assert saved_run_config(dgc)["dgc-warmup-epochs"] == 0.0
    check_resumable(run_dir(dgc), RunConfig.from_mapping({"compressor": "dgc", "dgc-warmup-epochs": 0}))
    with pytest.raises(ConfigError, match="dgc-warmup-epochs=4.0 \\(the run had 0.0\\)"):
        check_resumable(run_dir(dgc), RunConfig.from_mapping({"compressor": "dgc"}))


def test_a_run_evaluating_every_few_rounds_resumes_to_the_uninterrupted_run(tmp_path):
    """``evaluate-every = 4``: killed after round 3 (not evaluated), resumed, the run is
    the uninterrupted one, nulls included; a resume may change ``evaluate-every``."""
    over = {**BASE, **RUNS["fedavg-ef"], "evaluate-every": 4}
    whole = run_inprocess({**over, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    run_dir = _killed_run(tmp_path, "between", 3, over)
    assert cli_main(["resume", str(run_dir)]) == 0
    _assert_same_run(run_dir, whole)
    assert [r["round"] for r in _lines(whole) if r["accuracy"] is not None] == [0, 4, 6]
    again = _killed_run(tmp_path / "again", "between", 3, over)
    run_inprocess({**over, "evaluate-every": 1, "resume-from": str(again)}, num_clients=4)
    assert [r["round"] for r in _lines(again) if r["accuracy"] is not None] == [0, 4, 5, 6]


# -- every strategy on Flower's own round loop (issue 37) ----------------------------------
#: fededge's app's strategies that run on Flower's loop (``FedAvgOuter`` for diloco), each
#: with what it keeps between rounds: FedAvgM's momentum (which a checkpoint once lost),
#: FedOpt's moments, the outer optimiser's buffers; the rest keep nothing, and must still
#: resume to the same run.
FLOWER_LOOP = {
    "fedavg": {}, "fedprox": {"proximal-mu": 0.1}, "fedmedian": {}, "fedtrimmedavg": {}, "krum": {},
    "fedavgm": {"server-lr": 1.0, "server-momentum": 0.9},
    "fedadam": {"server-lr": 0.05}, "fedadagrad": {"server-lr": 0.05}, "fedyogi": {"server-lr": 0.05},
    "diloco": {},
}


@pytest.mark.parametrize("name", sorted(FLOWER_LOOP))
def test_each_flower_loop_strategy_resumes_to_the_uninterrupted_run(tmp_path, name):
    """Stopped after round 3 of 6 (the run ends there, its checkpoint written), resumed
    to 6: the run equals the uninterrupted one, model bit for bit."""
    conf = {**BASE, "strategy": name, **FLOWER_LOOP[name], "checkpoint-every": 3}
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    part = run_inprocess({**conf, "num-rounds": 3, "results-dir": str(tmp_path / "part")}, num_clients=4)
    assert [p.name for p in checkpoint_files(part)] == ["round-000001.ckpt", "round-000003.ckpt"]
    assert cli_main(["resume", str(part), "--num-rounds", "6"]) == 0
    a, b = _lines(part), _lines(whole)
    assert a == b, name
    ma, mb = torch.load(part / "model.pt"), torch.load(whole / "model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in mb), name


def test_fedavgm_momentum_is_in_the_checkpoint_and_the_control_without_it_differs(tmp_path):
    """The control for the test above: FedAvgM resumed with its momentum dropped (as
    checkpoints before issue 37 did) ends elsewhere, so that test depends on it."""
    conf = {**BASE, "strategy": "fedavgm", **FLOWER_LOOP["fedavgm"], "checkpoint-every": 3}
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    part = run_inprocess({**conf, "num-rounds": 3, "results-dir": str(tmp_path / "part")}, num_clients=4)
    saved = read_checkpoint(checkpoint_files(part)[-1])
    fedavgm = saved["strategy"]["strategies"]["inner"]  # (inside PlainBuffers: its step on parameters only)
    assert fedavgm["attrs"]["momentum_vector"] is not None
    fedavgm["attrs"].pop("momentum_vector")
    write_checkpoint(part, 3, saved)
    assert cli_main(["resume", str(part), "--num-rounds", "6"]) == 0
    assert _lines(part)[:4] == _lines(whole)[:4] and _lines(part)[4:] != _lines(whole)[4:]


def test_a_checkpoint_of_fedavgm_before_its_plainbuffers_wrapper_resumes_to_the_same_run(tmp_path):
    """fedavgm is PlainBuffers(FedAvgM) now: a checkpoint written before (FedAvgM's class,
    its state at the top) was refused by class, and under Compressed its state landed on
    the wrapper, the optimiser silently restarted. It resumes into the inner strategy."""
    conf = {**BASE, "strategy": "fedavgm", **FLOWER_LOOP["fedavgm"], "checkpoint-every": 3}
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    part = run_inprocess({**conf, "num-rounds": 3, "results-dir": str(tmp_path / "part")}, num_clients=4)
    saved = read_checkpoint(checkpoint_files(part)[-1])
    assert saved["strategy"]["attrs"]["buffer_names"] is not None  # the wrapper's own, kept
    old = saved["strategy"]["strategies"]["inner"]
    assert old["attrs"]["momentum_vector"] is not None
    saved["strategy"] = old  # as fededge wrote it before the wrapper
    saved["strategy_class"] = "flwr.serverapp.strategy.fedavgm.FedAvgM"
    write_checkpoint(part, 3, saved)
    assert cli_main(["resume", str(part), "--num-rounds", "6"]) == 0
    assert _lines(part) == _lines(whole)


def test_the_first_checkpoint_is_written_after_round_1_whatever_checkpoint_every_is(tmp_path):
    """A run killed before its first periodic checkpoint resumes from round 1."""
    conf = {**BASE, **RUNS["fedavg-ef"], "checkpoint-every": 5}
    run_dir = _killed_run(tmp_path, "mid-round", 3, conf)
    assert [p.name for p in checkpoint_files(run_dir)] == ["round-000001.ckpt"]
    assert cli_main(["resume", str(run_dir)]) == 0
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    _assert_same_run(run_dir, whole)
    assert [p.name for p in checkpoint_files(run_dir)] == ["round-000001.ckpt", "round-000005.ckpt"]


def _flower_strategy_names() -> list[str]:
    from flwr.serverapp import strategy as fs

    return [n for n in fs.__all__ if isinstance(getattr(fs, n), type) and getattr(fs, n) is not fs.Strategy
            and issubclass(getattr(fs, n), fs.Strategy)]


def _flower_strategy(name: str, *, with_state: bool):  # noqa: ANN202
    """An instance of ``flwr.serverapp.strategy.<name>``; ``with_state``: holding state as
    it would between two rounds (a DP wrapper wraps a FedAdam, whose moments it holds)."""
    import numpy as np
    from flwr.app import ArrayRecord
    from flwr.serverapp import strategy as fs

    cls = getattr(fs, name)
    if name.startswith("DifferentialPrivacy"):
        s = cls(fs.FedAdam(), noise_multiplier=0.1, num_sampled_clients=4,
                **({"clipping_norm": 1.0} if "Fixed" in name else {}))
    elif name == "QFedAvg":
        s = cls(client_learning_rate=0.1)
    else:
        s = cls()
    if with_state:
        arrays = ArrayRecord({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
        vec = [np.full((2, 3), 0.25, dtype=np.float32)]
        for target in (s, getattr(s, "strategy", None)):
            for attr, value in (("current_arrays", arrays), ("momentum_vector", vec), ("m_t", vec),
                                ("v_t", vec), ("registered_nodes", {3: 1, 5: 2})):
                if target is not None and hasattr(target, attr):
                    setattr(target, attr, value)
        if "Adaptive" in name:
            s.clipping_norm = 0.37  # adapted during the run
    return s


def _plain(strategy) -> dict:  # noqa: ANN001
    """A strategy's data attributes, comparable (arrays as lists), wrapped ones followed."""
    import numpy as np
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import Strategy

    def conv(v):  # noqa: ANN001, ANN202
        if isinstance(v, ArrayRecord):
            return {k: a.numpy().tolist() for k, a in v.items()}
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return {k: (_plain(v) if isinstance(v, Strategy) else conv(v)) for k, v in vars(strategy).items()
            if not k.startswith("_") and not (callable(v) and not isinstance(v, Strategy))}


@pytest.mark.parametrize("name", _flower_strategy_names())
def test_every_flower_strategy_state_goes_through_a_checkpoint_file_whole(tmp_path, name):
    """Issue 37: every class of flwr.serverapp.strategy, with the state it keeps between
    rounds, written into a real checkpoint file (read back weights-only) and loaded into
    a fresh instance, holds the same state."""
    from fededge.strategies.resume import load_strategy_state, strategy_state

    saved = _flower_strategy(name, with_state=True)
    fresh = _flower_strategy(name, with_state=False)
    write_checkpoint(tmp_path, 1, {"strategy": strategy_state(saved)})
    load_strategy_state(fresh, read_checkpoint(checkpoint_files(tmp_path)[-1])["strategy"])
    assert _plain(fresh) == _plain(saved)
    if any(hasattr(t, a) for t in (saved, getattr(saved, "strategy", None)) if t is not None
           for a in ("current_arrays", "momentum_vector", "m_t", "registered_nodes", "clipping_norm")):
        assert _plain(_flower_strategy(name, with_state=False)) != _plain(saved)  # there was state to carry


@pytest.mark.parametrize("strategy", ["fedadam", "fedavgm"])
def test_a_server_optimizer_of_a_batchnorm_model_resumes(tmp_path, strategy):
    """Flower's FedAdam/FedAvgM keep a 0-d BatchNorm counter's moments as numpy float64
    scalars; to_plain kept them as numpy objects (np.float64 is a float), which
    torch.load(weights_only=True) refuses: the checkpoint was written and never read."""
    from fededge.strategies.resume import from_plain, to_plain

    conf = {**BASE, "model": "cnn-bn", "num-rounds": 3, "strategy": strategy, "server-lr": 0.05}
    whole = run_inprocess({**conf, "results-dir": str(tmp_path / "whole")}, num_clients=4)
    part = run_inprocess({**conf, "num-rounds": 2, "results-dir": str(tmp_path / "part")}, num_clients=4)
    again = run_inprocess({**conf, "resume-from": str(part)}, num_clients=4)
    _assert_same_run(again, whole)
    back = from_plain(torch.load(_buffer(to_plain({"m": [np.float64(0.25), np.int64(3)]})), weights_only=True))
    assert back["m"] == [0.25, 3] and [type(x) for x in back["m"]] == [np.float64, np.int64]


def _buffer(obj):  # noqa: ANN001, ANN202
    import io

    b = io.BytesIO()
    torch.save(obj, b)
    b.seek(0)
    return b
