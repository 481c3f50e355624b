"""Many clients in-process (issue 21): idle clients' states on disk, clients on worker
processes, and the same results whatever the number of workers or where states live."""

from __future__ import annotations

import json
import logging
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fededge import _flwr_internals as fi
from fededge.server.grid import InProcessGrid, run_server
from fededge.server.inprocess import run_inprocess
from fededge.server.nodestates import (
    OWNER_LOCK,
    PREFIX,
    AutoStates,
    DiskStates,
    MemoryStates,
    collect_orphans,
    make_states,
    read_states_file,
    state_from_bytes,
    state_to_bytes,
    write_states_file,
)
from tests.clients import userapp

BASE = {"num-rounds": 3, "local-steps": 3, "model": "mlp", "progress": "off", "netem": "4g:0.5,3g:0.5",
        "sim-step-s": 0.01, "clients-per-round": 4, "client-threads": 1}
RUNS = {
    "fedavg-signsgd-ef": {"strategy": "fedavg", "compressor": "signsgd", "error-feedback": True},
    # Pipelined DGA pushes the next round before it pulls this one: a node's two
    # messages are in the batch at once, and must run in order.
    "dga-pipelined-ef": {"strategy": "dga", "dga-delay": 2, "compressor": "topk", "error-feedback": True,
                         "clients-per-round": 12},
    "gossip-choco": {"strategy": "gossip", "gossip-algorithm": "choco", "topology": "ring",
                     "compressor": "topk", "gossip-gamma": 0.5, "clients-per-round": 1.0},
}
#: Deterministic fields of a round's record (wall_s and measured compute are not).
FIELDS = ("round", "accuracy", "loss", "bytes_up", "bytes_down", "sim_s", "round_sim_s", "num_clients", "failures",
          "rejected")


def _state(seed: int) -> RecordDict:
    g = torch.Generator().manual_seed(seed)
    return RecordDict({"ef": ArrayRecord({"w": torch.randn(7, 3, generator=g), "b": torch.randn(3, generator=g)}),
                       "sampler": ConfigRecord({"pos": seed, "perm": [3, 1, 2]}),
                       "m": MetricRecord({"loss": 0.1 * seed})})


def _same(a: RecordDict, b: RecordDict) -> bool:
    return fi.recorddict_to_objects(a) == fi.recorddict_to_objects(b)


def test_a_state_spilled_to_disk_and_read_back_equals_the_state_kept_in_memory(tmp_path):
    memory, disk = MemoryStates(), DiskStates(tmp_path)
    nodes = [5, 2**63 + 11, 2**64 - 1, 2**62]  # Flower's node ids are unsigned 64-bit
    for i, node in enumerate(nodes):
        memory.put(node, _state(i))
        disk.put(node, _state(i))
    for i, node in enumerate(nodes):
        assert _same(disk.take(node), memory.take(node)) and _same(disk.take(node), _state(i))
        assert disk.take_objects(node) == memory.take_objects(node)
    assert sorted(disk.nodes()) == sorted(memory.nodes()) == sorted(nodes) and len(disk) == 4
    # An empty state is no state; a node without one gets an empty RecordDict.
    disk.put(nodes[0], RecordDict())
    memory.put(nodes[0], RecordDict())
    assert len(disk) == len(memory) == 3 and len(disk.take(nodes[0])) == 0 == len(memory.take(nodes[0]))
    assert disk.take_objects(123) is None and memory.take_objects(123) is None
    assert disk.dir.parent == tmp_path and (disk.dir.stat().st_mode & 0o777) == 0o700
    disk.close()
    assert not disk.dir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        disk.take(5)
    with pytest.raises(ValueError, match="'memory', on 'disk' or 'auto'"):
        make_states("ram")


def test_a_states_file_written_one_state_at_a_time_reads_back_into_any_store(tmp_path):
    """write_states_file (a checkpoint of states held in memory) writes what DiskStates
    reads, unsigned 64-bit node ids included; read_states_file hands the rows back one at
    a time after checking the file; a failed write leaves nothing behind."""
    nodes = [5, 2**63 + 11, 2**64 - 1, 2**62]
    blobs = {node: state_to_bytes(_state(i)) for i, node in enumerate(nodes)}
    # A results directory of the user's with SQLite's URI characters in its name: opened
    # as "file:.../results " (read-write: a stray empty database) before they were encoded.
    outer, tmp_path = tmp_path, tmp_path / "results #2?x=1%41"
    tmp_path.mkdir()
    path = tmp_path / "round-000001.states"
    digest = write_states_file(path, [(n, blobs[n]) for n in nodes] + [(7, None)])  # None: no state
    assert dict(read_states_file(path, digest)) == blobs
    disk = DiskStates(tmp_path)
    try:
        disk.load_file(path, digest)
        assert {n: disk.take_bytes(n) for n in disk.nodes()} == blobs
    finally:
        disk.close()
    # An AutoStates that passes its budget while reading moves to disk and loses nothing.
    auto = AutoStates(tmp_path, budget_bytes=len(blobs[5]) * 3 // 2)
    try:
        for n, blob in read_states_file(path, digest):
            auto.put_bytes(n, blob)
        assert auto.kind == "disk" and sorted(auto.nodes()) == sorted(nodes)
        # (a state held in memory before the move was re-serialised: equal, if not byte for byte)
        assert all(_same(auto.take(n), state_from_bytes(blobs[n])) for n in nodes)
    finally:
        auto.close()
    with pytest.raises(ValueError, match="round-000001.states: the states file is corrupt"):
        next(read_states_file(path, "0" * 64))

    def failing():
        yield 1, blobs[5]
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_states_file(tmp_path / "round-000002.states", failing())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == ["round-000001.states"]
    # DiskStates' own side file, through the same characters; nothing made outside.
    disk, back = DiskStates(tmp_path), DiskStates(tmp_path)
    try:
        for n in nodes:
            disk.put_bytes(n, blobs[n])
        digest = disk.save_file(tmp_path / "round-000003.states")
        back.load_file(tmp_path / "round-000003.states", digest)
        assert {n: back.take_bytes(n) for n in back.nodes()} == blobs
    finally:
        disk.close()
        back.close()
    assert [p.name for p in outer.iterdir()] == [tmp_path.name]


def test_a_state_as_bytes_reads_back_bit_for_bit_and_rows_of_flowers_objects_still_read(tmp_path):
    import pickle

    for i in range(3):
        state = _state(i)
        back = state_from_bytes(state_to_bytes(state))
        assert back.object_id == state.object_id and _same(back, state)
        assert [type(r) for r in back.values()] == [ArrayRecord, ConfigRecord, MetricRecord]
        assert back["sampler"]["perm"] == [3, 1, 2] and isinstance(back["m"]["loss"], float)
    # A row as fededge stored states before (Flower's serialised objects, pickled) reads.
    disk = DiskStates(tmp_path)
    try:
        disk.put_bytes(7, pickle.dumps(fi.recorddict_to_objects(_state(2))))
        assert _same(disk.take(7), _state(2)) and disk.take_objects(7) == fi.recorddict_to_objects(_state(2))
        disk.put(8, _state(1))  # written now: the new format, handed to a worker untouched
        assert state_from_bytes(disk.take_bytes(8)).object_id == _state(1).object_id
    finally:
        disk.close()
    with pytest.raises(ValueError, match="'fededge-state/9'.*does not read"):
        state_from_bytes(pickle.dumps(("fededge-state/9", [])))


_HOLD = """
import sys, time
from fededge.server.nodestates import DiskStates
d = DiskStates(sys.argv[1])
d.put_bytes(1, b"x" * 1000)
print(d.dir, flush=True)
time.sleep(600)
"""


def _store_in_a_process(parent: Path) -> tuple[subprocess.Popen, Path]:
    """A DiskStates held open by another process: (that process, its directory)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(parent)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().strip() if ready else ""
        assert line, f"the process holding a store did not start: {proc.poll()}"
    except BaseException:
        _stop(proc)
        raise
    return proc, Path(line)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate()  # reaps it and closes its pipes


@pytest.mark.skipif(sys.platform == "win32", reason="flock: a killed run's states stay on Windows")
def test_a_killed_runs_states_directory_is_removed_by_the_next_store_and_a_live_one_is_kept(tmp_path, caplog):
    alive, alive_dir = _store_in_a_process(tmp_path)
    try:
        killed, killed_dir = _store_in_a_process(tmp_path)
        killed.send_signal(signal.SIGKILL)
        _stop(killed)
        assert killed_dir.is_dir() and (killed_dir / OWNER_LOCK).exists()  # SIGKILL: nothing removed it
        legacy = tmp_path / f"{PREFIX}before"  # no lock file: not known to be an orphan
        legacy.mkdir()
        elsewhere = tmp_path / f"{PREFIX}elsewhere"  # unlocked, but another host's (a shared file system)
        elsewhere.mkdir()
        (elsewhere / OWNER_LOCK).write_text("another-host")
        with caplog.at_level(logging.INFO, logger="fededge.server.nodestates"):
            here = DiskStates(tmp_path)  # the next store collects the orphan
        assert not killed_dir.exists()
        assert alive_dir.is_dir() and legacy.is_dir() and elsewhere.is_dir()  # held; not known; not ours
        assert "removed 1 node-state directory left by killed runs" in caplog.text
        assert collect_orphans(tmp_path) == [] and here.dir.is_dir()  # this process holds its own
        here.put_bytes(3, b"y")
        assert here.take_bytes(3) == b"y"
        here.close()
        assert not here.dir.exists()
    finally:
        _stop(alive)
    assert collect_orphans(tmp_path) == [alive_dir] and not alive_dir.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="flock: none on Windows")
def test_a_store_that_cannot_start_leaves_nothing_and_one_without_file_locks_still_works(tmp_path, monkeypatch,
                                                                                          caplog):
    import errno
    import sqlite3

    import fededge.server.nodestates as nodestates

    def refused(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise sqlite3.OperationalError("unable to open database file")

    with monkeypatch.context() as m:
        m.setattr(nodestates.sqlite3, "connect", refused)
        with pytest.raises(sqlite3.OperationalError):
            DiskStates(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no directory, no lock file left

    def no_locks(fd, op):  # noqa: ANN001, ANN202 - a network file system without flock
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(nodestates.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="fededge.server.nodestates"):
        store = DiskStates(tmp_path)
    try:
        assert "no file lock here" in caplog.text and not (store.dir / OWNER_LOCK).exists()
        assert [p.name for p in store.dir.iterdir()] == ["states.sqlite"]
        store.put_bytes(1, b"z")
        assert store.take_bytes(1) == b"z" and collect_orphans(tmp_path) == []
    finally:
        store.close()
    assert list(tmp_path.iterdir()) == []


def _workers() -> list[int]:
    """This process's in-process worker children still alive."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"fededge.server.workers" in cmd:
            out.append(int(proc.name))
    return out


def _rounds(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in FIELDS} | {"clients": [(c["partition"], c["bytes_up"], c["bytes_down"], c["steps"]) for c in r.get("clients", [])]}
            for r in lines]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_same_run_on_one_two_or_four_workers_with_states_in_memory_or_on_disk_is_the_same(tmp_path, name):
    config = {**BASE, **RUNS[name]}
    ref = run_inprocess({**config, "results-dir": str(tmp_path / "w1")}, num_clients=12)
    expected = _rounds(ref)
    assert len(expected) == 4 and expected[-1]["accuracy"] > 0.1
    variants = [(2, "disk"), (4, "memory")] if name == "fedavg-signsgd-ef" else [(2, "disk")]
    for workers, states in variants:
        out = run_inprocess({**config, "results-dir": str(tmp_path / f"w{workers}{states}")}, num_clients=12,
                            workers=workers, client_states=states, states_dir=str(tmp_path / "states"))
        assert _rounds(out) == expected, (workers, states)
    # The grid removed its states and stopped its workers.
    assert list((tmp_path / "states").iterdir()) == []
    assert _workers() == []


def test_a_worker_that_dies_mid_message_gives_an_error_reply_and_the_run_goes_on(caplog):
    history: dict[int, tuple[float, float]] = {}
    grid = InProcessGrid("tests.server.dying_app:app", num_nodes=4, workers=5,
                         run_config={**userapp.RUN_CONFIG, "num-server-rounds": 3})
    random.seed(0)
    try:
        with caplog.at_level(logging.ERROR, logger="fededge.server.inprocess"):
            run_server(userapp.server_app(lambda _: FedAvg(fraction_evaluate=0.0, min_available_nodes=4), history),
                       grid)
        assert grid._pool is not None and grid._pool.restarts == 2  # node 1's second and third messages
        # Only node 1 failed: a message a dying worker held next went back and ran.
        assert grid.messages_run == 12
        calls = {int(ctx.node_config["partition-id"]): int(ctx.state["calls"]["n"])
                 for ctx in grid.contexts.values()}
        # Node 1's state is the one before the message that killed its worker.
        assert calls == {0: 3, 1: 1, 2: 3, 3: 3}
        assert history[3][1] > 0.5  # trained on the other nodes' replies
        assert "died with exit code 7" in caplog.text
    finally:
        grid.close()
    assert _workers() == []


def test_a_worker_holding_two_jobs_that_dies_loses_the_one_it_ran_and_is_replaced_once():
    """A worker holds the job it runs and the next one: when it dies, the one it ran comes
    back lost (the grid gives it an error reply), the next one unstarted (both came back
    lost: another node's message failed for a node that never ran), and one fresh worker
    takes its place and runs it."""
    from flwr.app import Message

    from fededge.server.workers import UNSTARTED, WorkerPool

    pool = WorkerPool("tests.server.dying_app:app", run_id=1, run_config=userapp.RUN_CONFIG, size=1)
    try:
        with fi.task_identity(run_id=1, node_id=1, task_id=1):
            msgs = [Message(RecordDict({"arrays": ArrayRecord(userapp.Net().state_dict())}), 100 + i, "train")
                    for i in range(3)]
        jobs = []
        for i, msg in enumerate(msgs):
            root, objects = fi.serialise(msg)
            # Node 1 (partition 1) dies on its second message: its state says one call done.
            state = state_to_bytes(RecordDict({"calls": ConfigRecord({"n": 1})})) if i == 0 else None
            jobs.append((root, 100 + i, root, objects, {"partition-id": 1 if i == 0 else 2}, state))
        (worker,) = pool.free()[:1]
        assert len(pool.free()) == 2  # room for the job it runs and the next
        pool.submit(worker, jobs[0])
        pool.submit(worker, jobs[1])
        done = []
        while pool.busy():
            done += pool.collect(timeout=60)
        assert [(job[1], result) for job, result in done] == [(100, None), (101, UNSTARTED)]
        assert pool.restarts == 1
        (fresh,) = set(pool.free())
        pool.submit(fresh, jobs[1])  # the new worker runs the unstarted job, then the next
        pool.submit(fresh, jobs[2])
        done = []
        while pool.busy():
            done += pool.collect(timeout=60)
        assert [job[1] for job, _ in done] == [101, 102]
        assert all(result is not None and result is not UNSTARTED and result[4] is None for _, result in done)
        # A worker that dies idle is replaced when the pool is next asked for workers
        # (it was skipped for good: the pool shrank, unsaid).
        (idle,) = set(pool.free())
        idle.proc.kill()
        idle.proc.wait()
        deadline = time.monotonic() + 30
        while idle.load() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.free()) == 2 and pool.restarts == 2 and idle not in pool.free()
    finally:
        pool.close()
    assert _workers() == []


def _signalled_round(grid, **config):
    from flwr.app import Message

    nodes = list(grid.get_node_ids())
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        msgs = [Message(RecordDict({"config": ConfigRecord(config)}), n, "train") for n in nodes]
    ids = list(grid.push_messages(msgs))
    replies = {r.metadata.reply_to_message_id: r for r in grid.pull_messages(ids)}
    return [replies[i] for i in ids]


def test_a_dying_worker_fails_only_the_message_it_ran():
    """A worker holds the message it runs and the next (another node's): both came back
    as errors, so that node failed a message it never ran, depending on timing and on
    the number of workers."""
    grid = InProcessGrid("tests.server.signalled_app:app", num_nodes=4, run_config={}, workers=2)
    try:
        replies = _signalled_round(grid, die=0, sleep=0.3)
        errors = [r for r in replies if r.has_error()]
        assert len(errors) == 1 and "worker running this message died" in errors[0].error.reason
        assert sorted(int(r.content["metrics"]["pid"]) for r in replies if not r.has_error()) == [1, 2, 3]
        assert all(int(r.content["metrics"]["calls"]) == 1 for r in replies if not r.has_error())
        replies = _signalled_round(grid, sleep=0.0)  # the next round: everyone, once more
        assert not any(r.has_error() for r in replies)
    finally:
        grid.close()
    assert _workers() == []


@pytest.mark.parametrize(("workers", "direct"), [(1, False), (1, True), (2, False)])
def test_a_client_app_that_returns_no_message_fails_its_node_only(workers, direct):
    """It returned None: with one worker the whole batch was lost (an AttributeError out
    of pull_messages); with workers, the worker died and took another node's message."""
    grid = InProcessGrid("tests.server.signalled_app:app", num_nodes=4, run_config={}, workers=workers,
                         direct=direct)
    try:
        replies = _signalled_round(grid, none=0)
        assert [r.has_error() for r in replies] == [True, False, False, False]
        assert "the ClientApp returned NoneType, not a flwr.app.Message" in replies[0].error.reason
        assert grid._pool is None or grid._pool.restarts == 0
    finally:
        grid.close()
    assert _workers() == []


def test_a_worker_that_cannot_start_stops_the_run_before_round_one_with_its_error(tmp_path):
    from fededge.server.workers import WorkerStartError

    with pytest.raises(WorkerStartError, match="(?s)could not start the ClientApp.*cannot start in a worker"):
        run_inprocess({**BASE, "results-dir": str(tmp_path)}, num_clients=4, workers=3,
                      client_app="tests.server.broken_in_workers:app")
    assert _workers() == [] and not any(tmp_path.iterdir())


def test_a_worker_imports_what_this_process_imported_not_a_package_in_the_working_directory(tmp_path, monkeypatch):
    from fededge.server.workers import WorkerPool

    shadow = tmp_path / "fededge"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the fededge in the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    pool = WorkerPool("tests.server.dying_app:app", run_id=1, run_config=userapp.RUN_CONFIG, size=1)
    pool.close()  # it started: the ClientApp and fededge.server.workers came from this process's path
    assert _workers() == []


def test_a_worker_finds_an_app_in_the_working_directory_when_this_process_has_it_on_its_path(tmp_path, monkeypatch):
    """A notebook or ``python -`` has "" (its working directory) on its path: its own app
    module there is the workers' too."""
    import sys

    from fededge.server.workers import WorkerPool

    (tmp_path / "notebook_app_21.py").write_text("from tests.server.dying_app import app  # noqa: F401\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    pool = WorkerPool("notebook_app_21:app", run_id=1, run_config=userapp.RUN_CONFIG, size=1)
    pool.close()
    assert _workers() == []


def test_workers_need_the_client_app_by_reference():
    with pytest.raises(ValueError, match="module:attribute"):
        InProcessGrid(userapp.client_app(), num_nodes=2, run_config=userapp.RUN_CONFIG, workers=2)
    with pytest.raises(ValueError, match="module:attribute"):
        InProcessGrid("tests.server.dying_app", num_nodes=2, run_config=userapp.RUN_CONFIG)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        InProcessGrid("tests.server.dying_app:app", num_nodes=2, run_config=userapp.RUN_CONFIG, workers=0)


def test_a_hundred_thousand_nodes_cost_their_ids_not_their_contexts():
    grid = InProcessGrid(userapp.client_app(), num_nodes=100_000, run_config=userapp.RUN_CONFIG,
                         client_states="disk")
    try:
        ids = list(grid.get_node_ids())
        assert len(ids) == len(set(ids)) == 100_000 and len(grid.contexts) == 100_000
        ctx = grid.contexts[ids[99_999]]
        assert ctx.node_config == {"partition-id": 99_999, "num-partitions": 100_000, "fededge-inprocess": True}
        assert len(ctx.state) == 0
        assert grid.data_splits() == [(100_000, None)]
    finally:
        grid.close()


@pytest.mark.parametrize("states", ["disk", "memory past INLINE_STATES_MAX"])
def test_a_checkpoint_keeps_the_disk_states_in_a_side_file_pruned_with_it(tmp_path, monkeypatch, states):
    from fededge.server import grid as grid_module
    from fededge.server.checkpoint import checkpoint_files, read_checkpoint

    if states != "disk":
        monkeypatch.setattr(grid_module, "INLINE_STATES_MAX", 0)
    run_dir = run_inprocess({**BASE, **RUNS["fedavg-signsgd-ef"], "num-rounds": 4, "checkpoint-every": 1,
                             "client-states": states.split()[0], "results-dir": str(tmp_path)}, num_clients=12)
    ckpts = checkpoint_files(run_dir)
    assert [p.name for p in ckpts] == ["round-000003.ckpt", "round-000004.ckpt"]
    sides = sorted(p.name for p in (run_dir / "checkpoints").glob("*.states"))
    assert sides == ["round-000003.states", "round-000004.states"]  # rounds 1-2's went with their checkpoints
    grid_state = read_checkpoint(ckpts[-1])["grid"]
    assert "states" not in grid_state and grid_state["states_file"] == "round-000004.states"

    # The side file reads back into a grid of the same nodes, in memory or on disk, and
    # holds the states of every client that trained (its error-feedback residual).
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = {c["partition"] for r in lines for c in r.get("clients", [])}
    assert len(trained) > 4
    for kind in ("memory", "disk"):
        grid = InProcessGrid("fededge.clients.app:app", num_nodes=12, run_config={}, client_states=kind)
        try:
            grid.load_state_dict(grid_state, states_dir=run_dir / "checkpoints")
            assert len(grid.states) == len(trained)
        finally:
            grid.close()
    side = run_dir / "checkpoints" / "round-000004.states"
    side.write_bytes(side.read_bytes()[:-10] + b"x" * 10)
    grid = InProcessGrid("fededge.clients.app:app", num_nodes=12, run_config={}, client_states="disk")
    try:
        with pytest.raises(ValueError, match="round-000004.states: the states file is corrupt"):
            grid.load_state_dict(grid_state, states_dir=run_dir / "checkpoints")
    finally:
        grid.close()


def test_a_checkpoint_keeps_memory_states_as_raw_bytes_and_reads_the_older_flower_objects(tmp_path):
    """States in memory go into the checkpoint as state_to_bytes in uint8 tensors (stored
    raw); a checkpoint written before, with Flower's serialised objects, reads the same."""
    from fededge.safefile import SafeFileError
    from fededge.server.checkpoint import checkpoint_files, read_checkpoint

    run_dir = run_inprocess({**BASE, **RUNS["fedavg-signsgd-ef"], "num-rounds": 2, "checkpoint-every": 1,
                             "results-dir": str(tmp_path)}, num_clients=6)
    grid_state = read_checkpoint(checkpoint_files(run_dir)[-1])["grid"]
    assert "states" not in grid_state and len(grid_state["state_bytes"]) >= 4
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in grid_state["state_bytes"].values())
    old = {**{k: v for k, v in grid_state.items() if k != "state_bytes"},
           "states": {nid: fi.recorddict_to_objects(state_from_bytes(t.numpy().tobytes()))
                      for nid, t in grid_state["state_bytes"].items()}}
    loaded = []
    for saved in (grid_state, old):
        grid = InProcessGrid("fededge.clients.app:app", num_nodes=6, run_config={})
        try:
            grid.load_state_dict(saved)
            loaded.append({nid: grid.states.take_objects(nid) for nid in grid.states.nodes()})
        finally:
            grid.close()
    assert loaded[0] == loaded[1] and len(loaded[0]) == len(grid_state["state_bytes"])
    bad = {**grid_state, "state_bytes": {**grid_state["state_bytes"], next(iter(grid_state["state_bytes"])): "x"}}
    grid = InProcessGrid("fededge.clients.app:app", num_nodes=6, run_config={})
    try:
        with pytest.raises(SafeFileError, match="the checkpoint's state of node .* is a str, not the 1-D uint8"):
            grid.load_state_dict(bad)
    finally:
        grid.close()


def test_a_batch_is_spread_over_this_process_and_every_worker_none_waiting_behind_another_at_its_end():
    """workers=3: this process and two workers run the messages. The workers take one
    job each before either takes a second (pool.free); with four messages one is left
    for this process, so no worker holds two while this process has none."""
    grid = InProcessGrid("tests.server.pid_app:app", num_nodes=4, workers=3, run_config=userapp.RUN_CONFIG)
    try:
        pool = grid.start_workers()
        a, b = pool._workers
        assert pool.free() == [a, b, a, b] and pool.free(depth=1) == [a, b]
        with fi.task_identity(run_id=1, node_id=1, task_id=1):
            content = RecordDict({"arrays": ArrayRecord(userapp.Net().state_dict()), "config": ConfigRecord()})
            msgs = [grid.create_message(content, "train", nid, "1") for nid in grid.get_node_ids()]
        replies = list(grid.send_and_receive(msgs))
        pids = {int(r.content["metrics"]["pid"]) for r in replies}
        assert len(replies) == 4 and not any(r.has_error() for r in replies)
        assert pids == {a.proc.pid, b.proc.pid, os.getpid()}
    finally:
        grid.close()
    assert _workers() == []


@pytest.mark.parametrize("direct", [False, True])
def test_a_push_refused_for_a_message_pushed_twice_queues_none_of_its_messages(direct):
    """The serialised path checked each message as it queued it: those before the
    duplicate stayed queued (run on the next pull, their bytes never metered)."""
    from flwr.app import Message

    grid = InProcessGrid("tests.server.signalled_app:app", num_nodes=2, run_config={}, direct=direct)
    try:
        a, b = list(grid.get_node_ids())
        with fi.task_identity(run_id=1, node_id=1, task_id=1):
            first = Message(RecordDict({"config": ConfigRecord({"x": 1})}), a, "train")
            twice = Message(RecordDict({"config": ConfigRecord({"x": 2})}), b, "train")
        with pytest.raises(ValueError, match="pushed twice"):
            grid.push_messages([first, twice, twice])
        assert not grid._pending
    finally:
        grid.close()
