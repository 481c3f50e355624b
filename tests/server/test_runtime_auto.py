"""What ``fededge run`` picks without flags (issue 35, item 6): ``--workers auto`` (every
usable core, up to a round's clients) and ``client-states=auto`` (memory up to a
budget, then disk), each said in the run's first line and config.json."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fededge.cli import main
from fededge.config import ConfigError, RunConfig
from fededge.server import grid as grid_module
from fededge.server.grid import InProcessGrid
from fededge.server.inprocess import auto_workers, run_inprocess
from fededge.server.nodestates import AutoStates, DiskStates, make_states, state_nbytes, state_to_bytes

MIB = 2**20


@pytest.fixture(autouse=True)
def _alone_on_the_machine(monkeypatch):
    """These tests size memory, cores and GPUs for a run alone, whatever the caller's
    environment says (FEDEDGE_RUNS_SHARING)."""
    monkeypatch.delenv("FEDEDGE_RUNS_SHARING", raising=False)


def _state(seed: int, floats: int = 1000) -> RecordDict:
    g = torch.Generator().manual_seed(seed)
    return RecordDict({"ef": ArrayRecord({"w": torch.randn(floats, generator=g)}),
                       "sampler": ConfigRecord({"pos": seed, "blob": b"x" * 24})})


def test_state_nbytes_counts_the_arrays_and_byte_strings():
    # An Array's bytes are numpy's .npy serialisation: the 4,000 data bytes and a header.
    n = state_nbytes(_state(0))
    assert 4000 + 24 <= n <= 4000 + 24 + 256
    assert state_nbytes(RecordDict()) == 0


def test_auto_states_stay_in_memory_under_the_budget_then_move_every_state_to_disk_once(tmp_path, caplog):
    per = state_nbytes(_state(0))
    store = AutoStates(tmp_path, budget_bytes=3 * per + per // 2)  # three states fit, the fourth does not
    caplog.set_level(logging.INFO, logger="fededge.server.nodestates")
    try:
        for node in range(3):
            store.put(node, _state(node))
        assert store.kind == "memory" and store.disk is None and not list(tmp_path.iterdir())
        assert store.take(1) is store.take(1)  # the live objects: no copy while in memory
        # A node's new state replaces its old one in the count: no move.
        store.put(1, _state(11))
        assert store.kind == "memory"
        before = {n: state_to_bytes(store.take(n)) for n in store.nodes()}
        store.put(3, _state(3))  # over the budget: everything moves, once
        assert store.kind == "disk" and isinstance(store.disk, DiskStates) and store.disk.dir.parent == tmp_path
        after = {n: store.take_bytes(n) for n in store.nodes()}
        assert after == {**before, 3: state_to_bytes(_state(3))}  # bit for bit, nothing lost
        moved = [r for r in caplog.records if "client-states=auto" in r.getMessage()]
        assert len(moved) == 1 and "the states of 4 clients" in moved[0].getMessage()
        for node in range(4, 8):  # on disk for the rest of the run, said no more
            store.put(node, _state(node))
        store.put_bytes(9, state_to_bytes(_state(9)))
        store.put(0, RecordDict())  # an empty state is no state, on disk as in memory
        assert sorted(store.nodes()) == [1, 2, 3, 4, 5, 6, 7, 9] and len(store) == 8
        assert len([r for r in caplog.records if "client-states=auto" in r.getMessage()]) == 1
        directory = store.disk.dir
    finally:
        store.close()
    assert not directory.exists()


def test_auto_states_keep_one_rounds_clients_in_memory_whatever_the_budget_up_to_the_cap(tmp_path, caplog):
    """A round of 3 clients whose states outgrow the budget alone (a ResNet's error
    feedback: 45 MB each against 256 MiB) stays in memory; a fourth state moves them;
    the memory cap bounds the round's share."""
    from fededge.server.nodestates import _physical_memory

    per = state_nbytes(_state(0))
    caplog.set_level(logging.INFO, logger="fededge.server.nodestates")
    store = AutoStates(tmp_path, budget_bytes=per, round_clients=3, memory_cap=100 * per)
    try:
        for node in range(3):
            store.put(node, _state(node))
        assert store.kind == "memory" and store.budget == 3 * per
        store.put(3, _state(3))
        assert store.kind == "disk" and sorted(store.nodes()) == [0, 1, 2, 3]
        said = [r.getMessage() for r in caplog.records if "client-states=auto" in r.getMessage()]
        assert len(said) == 1 and "3 clients of a round x" in said[0]
    finally:
        store.close()
    # At most four times the budget: a round of all 10,000 clients stays near it.
    many = AutoStates(tmp_path, budget_bytes=per // 2, round_clients=10_000, memory_cap=100 * per)
    try:
        many.put(0, _state(0))
        assert many.budget == 4 * (per // 2)
    finally:
        many.close()
    capped = AutoStates(tmp_path, budget_bytes=per, round_clients=3, memory_cap=per + per // 2)
    try:
        capped.put(0, _state(0))
        assert capped.kind == "memory" and capped.budget == per + per // 2
        capped.put(1, _state(1))
        assert capped.kind == "disk"
    finally:
        capped.close()
    # The budget is a floor: a large one keeps more than a round.
    big = AutoStates(tmp_path, budget_bytes=10 * per, round_clients=1)
    try:
        for node in range(9):
            big.put(node, _state(node))
        assert big.kind == "memory" and big.memory_cap == _physical_memory() // 4
    finally:
        big.close()
    with pytest.raises(ValueError, match="round_clients must be >= 0"):
        AutoStates(tmp_path, round_clients=-1)
    # A budget of 0 is disk from the first state, as asked, whatever the round.
    zero = AutoStates(tmp_path, budget_bytes=0, round_clients=3)
    try:
        zero.put(0, _state(0))
        assert zero.kind == "disk" and zero.budget == 0
    finally:
        zero.close()


def test_the_memory_cap_follows_a_cgroup_limit(tmp_path):
    from fededge.server.nodestates import _physical_memory

    nowhere = str(tmp_path / "no-proc")
    host = _physical_memory(str(tmp_path / "none"), nowhere)
    # The process's own cgroup and those above it (v2, then v1's memory controller).
    (tmp_path / "proc").write_text("0::/a/b\n4:memory:/x/y\n5:cpu:/z\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "memory.max").write_text(f"{2**30}\n")
    (tmp_path / "a" / "b" / "memory.max").write_text("max\n")
    assert _physical_memory(str(tmp_path), str(tmp_path / "proc")) == min(host, 2**30)
    (tmp_path / "memory" / "x" / "y").mkdir(parents=True)
    (tmp_path / "memory" / "x" / "y" / "memory.limit_in_bytes").write_text(f"{2**28}\n")
    assert _physical_memory(str(tmp_path), str(tmp_path / "proc")) == min(host, 2**28)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "memory.max").write_text(f"{2**20}\n")  # not this process's cgroup
    assert _physical_memory(str(tmp_path), str(tmp_path / "proc")) == min(host, 2**28)
    import shutil

    for d in ("a", "memory", "z", "proc"):
        shutil.rmtree(tmp_path / d) if (tmp_path / d).is_dir() else (tmp_path / d).unlink()
    assert host > 0
    # At the mount's root (a container's own, under its cgroup namespace).
    (tmp_path / "memory.max").write_text("max\n")
    assert _physical_memory(str(tmp_path), nowhere) == host
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    assert _physical_memory(str(tmp_path), nowhere) == min(host, 2**30)
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2**29}\n")
    assert _physical_memory(str(tmp_path), nowhere) == min(host, 2**29)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert _physical_memory(str(tmp_path), nowhere) == host


@pytest.mark.parametrize(("per_round", "spills"), [(4, False), (2, True)])
def test_the_runtime_keeps_a_rounds_states_in_memory_and_spills_past_them(tmp_path, caplog, per_round, spills):
    """run_inprocess gives the store its round: 4 clients a round of signSGD residuals
    (0.2 MB each, 0.9 MB) stay in memory under a 0.3 MiB budget (4 x 0.3 MiB at most);
    with 2 clients a round (0.44 MB) the third client's state spills."""
    caplog.set_level(logging.INFO, logger="fededge.server.nodestates")
    run_inprocess({"num-rounds": 3, "local-steps": 2, "model": "mlp", "compressor": "signsgd", "error-feedback": True,
                   "progress": "off", "clients-per-round": per_round, "client-states-memory-mb": 0.3,
                   "results-dir": str(tmp_path)}, num_clients=4, client_states="auto", states_dir=str(tmp_path))
    moved = [r.getMessage() for r in caplog.records if "client-states=auto" in r.getMessage()]
    assert bool(moved) == spills, moved


def test_auto_states_count_each_way_in_and_a_zero_budget_is_disk_from_the_first_state(tmp_path):
    per = state_nbytes(_state(0))
    for put in ("put", "put_bytes", "put_objects"):
        store = AutoStates(tmp_path, budget_bytes=per + per // 2)
        try:
            value = {"put": _state, "put_bytes": lambda i: state_to_bytes(_state(i)),
                     "put_objects": lambda i: __import__("fededge._flwr_internals", fromlist=["x"])
                     .recorddict_to_objects(_state(i))}[put]
            getattr(store, put)(0, value(0))
            assert store.kind == "memory", put
            getattr(store, put)(1, value(1))
            assert store.kind == "disk", put
            assert store.take_bytes(0) == state_to_bytes(_state(0))
        finally:
            store.close()
    store = make_states("auto", tmp_path, budget_bytes=0)
    try:
        store.put(5, RecordDict())  # an empty state holds nothing: still memory
        assert store.kind == "memory"
        store.put(5, _state(5))
        assert store.kind == "disk"
    finally:
        store.close()
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        AutoStates(tmp_path, budget_bytes=-1)


@pytest.mark.parametrize("case", ["memory", "memory over the inline size", "moved"])
def test_a_checkpoint_of_auto_states_reads_back_into_any_store(tmp_path, monkeypatch, case):
    """Before the move the checkpoint holds the states' bytes, or a side file where they
    pass INLINE_STATES_MAX; after it, a side file (as client-states=disk's). Each reads
    back into a grid of any kind, equal bit for bit."""
    moved = case == "moved"
    if case == "memory over the inline size":
        monkeypatch.setattr(grid_module, "INLINE_STATES_MAX", state_nbytes(_state(0)) * 3)  # 4 states held
    budget = 0.001 if moved else 1.0  # MiB
    grid = InProcessGrid("fededge.clients.app:app", num_nodes=5, run_config={}, client_states="auto",
                         states_budget_mb=budget)
    try:
        nodes = list(grid.get_node_ids())
        for i, nid in enumerate(nodes[:4]):
            grid.states.put(nid, _state(i))
        assert grid.states.kind == ("disk" if moved else "memory")
        saved = grid.state_dict(states_file=tmp_path / "round-000001.states")
        side = case != "memory"
        assert ("states_file" in saved) == side and ("state_bytes" in saved) != side
        want = {nid: grid.states.take_bytes(nid) for nid in nodes[:4]}
    finally:
        grid.close()
    for kind in ("memory", "disk", "auto"):
        back = InProcessGrid("fededge.clients.app:app", num_nodes=5, run_config={}, client_states=kind,
                             states_budget_mb=budget)
        try:
            back.load_state_dict(saved, states_dir=tmp_path)
            assert {nid: back.states.take_bytes(nid) for nid in back.states.nodes()} == want, kind
        finally:
            back.close()


@pytest.mark.parametrize("kind", ["memory", "auto"])
def test_a_checkpoint_of_many_states_in_memory_serialises_one_at_a_time(tmp_path, kind):
    """24 states of 1 MiB held in memory, with INLINE_STATES_MAX set just under what they
    hold (and, for the comparison, at it): the checkpoint writes them to its side file one at a time, so
    the Python heap's peak during state_dict stays near one state, where inline it holds
    all their bytes (and the checkpoint's serialised body would hold them again)."""
    import tracemalloc

    grid = InProcessGrid("fededge.clients.app:app", num_nodes=24, run_config={}, client_states=kind,
                         states_budget_mb=1024)
    try:
        for i, nid in enumerate(grid.get_node_ids()):
            grid.states.put(nid, _state(i, floats=1 << 18))  # 1 MiB of float32
        held = grid.states.held_bytes()
        assert 24 << 20 < held < 25 << 20 and grid.states.disk is None

        def peak(inline_max: int) -> tuple[int, dict]:
            grid_module.INLINE_STATES_MAX, before = inline_max, grid_module.INLINE_STATES_MAX
            tracemalloc.start()
            try:
                saved = grid.state_dict(states_file=tmp_path / f"round-{inline_max}.states")
                return tracemalloc.get_traced_memory()[1], saved
            finally:
                tracemalloc.stop()
                grid_module.INLINE_STATES_MAX = before

        side_peak, side = peak(held - 1)
        inline_peak, inline = peak(held)
        assert "states_file" in side and "state_bytes" in inline
        assert inline_peak > held and side_peak < 3 << 20, (inline_peak, side_peak)
        want = {int(nid): bytes(t.numpy().tobytes()) for nid, t in inline["state_bytes"].items()}
    finally:
        grid.close()
    back = InProcessGrid("fededge.clients.app:app", num_nodes=24, run_config={}, client_states="memory")
    try:
        back.load_state_dict(side, states_dir=tmp_path)
        assert {nid: back.states.take_bytes(nid) for nid in back.states.nodes()} == want
    finally:
        back.close()


def test_auto_workers_take_every_core_up_to_a_rounds_clients_and_one_process_where_clients_cannot_spread():
    cfg = RunConfig(clients_per_round=100)
    assert auto_workers(cfg, 10_000, cores=2, cuda=False) == (2, "2 usable cores, 100 clients a round")
    assert auto_workers(RunConfig(clients_per_round=3), 10, cores=16, cuda=False)[0] == 3
    assert auto_workers(RunConfig(clients_per_round=0.25), 10, cores=16, cuda=False)[0] == 2  # Flower's int(2.5)
    assert auto_workers(RunConfig(clients_per_round=1.0), 4, cores=16, cuda=False)[0] == 4
    assert auto_workers(cfg, 10_000, cores=1, cuda=False) == (1, "1 usable core, 100 clients a round")
    for got, why in (
        (auto_workers(cfg, 10_000, cores=16, cuda=True), "CUDA"),
        (auto_workers(RunConfig(clients_per_round=100, device="cuda"), 10_000, cores=16, cuda=False), "CUDA"),
        (auto_workers(RunConfig(clients_per_round=100, cohort=True), 10_000, cores=16, cuda=False), "cohort"),
        (auto_workers(cfg, 10_000, by_reference=False, cores=16, cuda=False), "module:attribute"),
    ):
        assert got[0] == 1 and why in got[1]
    # device=cpu on a CUDA machine spreads over the cores.
    assert auto_workers(RunConfig(clients_per_round=100, device="cpu"), 10_000, cores=16, cuda=True)[0] == 16


def test_the_defaults_give_the_same_run_as_one_process_in_memory_and_say_what_they_chose(tmp_path, monkeypatch):
    """workers=auto and client-states=auto (with a budget the run's error-feedback
    residuals pass in round 1, mid-batch) give the rounds of workers=1 with states in
    memory, bit for bit; config.json and the run's first line name the choice."""
    import fededge.server.inprocess as inprocess

    monkeypatch.setattr(inprocess, "usable_cores", lambda: 3)
    config = {"num-rounds": 3, "local-steps": 3, "model": "mlp", "progress": "off", "clients-per-round": 4,
              "compressor": "signsgd", "error-feedback": True, "checkpoint-every": 0}
    ref = run_inprocess({**config, "client-states": "memory", "results-dir": str(tmp_path / "ref")},
                        num_clients=8, workers=1)
    out = run_inprocess({**config, "client-states-memory-mb": 0.5, "results-dir": str(tmp_path / "auto")},
                        num_clients=8, workers="auto", states_dir=str(tmp_path / "states"))

    def rounds(run_dir):
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["accuracy"], r["loss"], r["bytes_up"], r["bytes_down"],
                 [(c["partition"], c["bytes_up"]) for c in r.get("clients", [])]) for r in lines]

    assert rounds(out) == rounds(ref)
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["client-states"] == "auto"
    assert meta["inprocess_runtime"] == ("clients on cpu (auto: no CUDA device); 3 processes (auto: 3 usable "
                                         "cores, 4 clients a round); client states in memory up to 0.5 MiB or 4 "
                                         "clients' states (a round's, at most 2 MiB), then on disk")
    assert json.loads((ref / "config.json").read_text())["inprocess_runtime"] == \
        ("clients on cpu (auto: no CUDA device); 1 process (as given); client states in memory; messages handed "
         "over directly, their bytes counted from the format")
    assert list((tmp_path / "states").iterdir()) == []  # the store moved to disk, and removed its files


def test_fededge_run_names_its_choices_and_refuses_a_bad_worker_count(tmp_path, capsys):
    assert main(["run", "--num-clients", "3", "--run-config",
                 f'num-rounds=1 local-steps=2 model="mlp" compressor="signsgd" results-dir="{tmp_path}"']) == 0
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith("[fededge] run "))
    assert "; in-process, " in first and "(auto: " in first and "client states in memory up to 256 MiB or 3 " \
        "clients' states (a round's, at most 1024 MiB)" in first
    assert "[fededge] update plan (signsgd)" in err  # fededge's INFO lines are shown by the command
    assert logging.getLogger("fededge").handlers == []  # and the handler is gone afterwards
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as stop:
            main(["run", "--workers", bad])
        assert stop.value.code == 2
        assert "expected 'auto' or a number of processes >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="workers must be an int >= 1 or 'auto'"):
        run_inprocess({"num-rounds": 1}, num_clients=2, workers="all")


def test_the_budget_key_is_checked():
    assert RunConfig().client_states == "auto" and RunConfig().client_states_memory_mb == 256.0
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="'client-states-memory-mb' must be a finite number"):
            RunConfig.from_mapping({"client-states-memory-mb": bad})


# -- device=auto by measurement (issue 35, item 5) ------------------------------------

def _fake_timer(cuda_s: float, cpu_s: float, calls: list):
    def timer(model_fn, input_shape, num_classes, batch, device, *, threads=1, steps=5, give_up_above_s=None):
        calls.append({"device": device, "batch": batch, "threads": threads, "give_up": give_up_above_s,
                      "model": type(model_fn()).__name__})
        return cuda_s if device == "cuda" else cpu_s
    return timer


def test_device_auto_keeps_the_faster_device_per_client_counting_the_cpu_processes():
    from fededge.clients.device import choose_by_measurement

    def model():
        return torch.nn.Linear(4, 3)

    calls: list = []
    # One GPU step of 1 ms against a CPU step of 1.5 ms on each of 2 processes: 0.75 ms a client.
    got = choose_by_measurement(model, (4,), 3, 32, cpu_processes=2, cuda=True, timer=_fake_timer(1e-3, 1.5e-3, calls))
    assert got.device == "cpu" and got.per_client_step_s == pytest.approx({"cuda": 1e-3, "cpu": 0.75e-3})
    assert "1 ms a client on cuda, 0.75 ms on cpu (2 processes x 1 thread)" in got.reason
    assert [c["device"] for c in calls] == ["cuda", "cpu"] and calls[1]["give_up"] == pytest.approx(4e-3)
    calls.clear()
    # The same CPU step on one process: CUDA's 1 ms wins.
    assert choose_by_measurement(model, (4,), 3, 32, cpu_processes=1, cuda=True,
                                 timer=_fake_timer(1e-3, 1.5e-3, calls)).device == "cuda"
    calls.clear()
    # A cohort of 10 is timed on its whole batch on CUDA and shared by its clients; the
    # CPU, linear in the examples, is timed on one client's batch.
    got = choose_by_measurement(model, (4,), 3, 32, cpu_processes=1, cpu_threads=8, cohort_clients=10, cuda=True,
                                timer=_fake_timer(2e-3, 3e-3, calls))
    assert [c["batch"] for c in calls] == [320, 32] and calls[1]["threads"] == 8
    assert got.device == "cuda" and got.per_client_step_s == pytest.approx({"cuda": 2e-4, "cpu": 3e-3})
    assert "a cohort of 10 clients x 32 examples" in got.reason
    # Without CUDA nothing is timed.
    assert choose_by_measurement(model, (4,), 3, 32, cpu_processes=2, cuda=False,
                                 timer=lambda *a, **k: pytest.fail("timed")).reason == "no CUDA device"


def test_a_real_training_step_is_timed_on_the_cpu_and_the_threads_are_put_back():
    from fededge.clients.device import time_sgd_step
    from fededge.models.zoo import build_model

    threads = torch.get_num_threads()
    s = time_sgd_step(lambda: build_model("mlp", input_shape=(64,), num_classes=10, seed=0), (64,), 10, 32, "cpu",
                      threads=1, steps=3)
    assert 0 < s < 5 and torch.get_num_threads() == threads
    # A step above give_up_above_s ends the timing at once and returns that step.
    assert time_sgd_step(lambda: build_model("mlp", input_shape=(64,), num_classes=10, seed=0), (64,), 10, 32,
                         "cpu", give_up_above_s=1e-9) > 1e-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device=auto times the step on both devices")
def test_device_auto_times_both_devices_where_cuda_is():
    from fededge.clients.device import choose_by_measurement
    from fededge.models.zoo import build_model

    got = choose_by_measurement(lambda: build_model("mlp", input_shape=(64,), num_classes=10, seed=0), (64,), 10,
                                32, cpu_processes=2)
    assert got.device in ("cpu", "cuda") and set(got.per_client_step_s) == {"cpu", "cuda"}


def test_the_runtime_gives_every_client_the_measured_device_and_spreads_them_when_it_is_the_cpu(
        tmp_path, monkeypatch):
    """On a (pretend) CUDA machine where the timing favours the CPU, the clients train on
    the CPU over every core, and the run's first line gives the timings; a choice of
    CUDA reaches each node's config, and the process count drops to one."""
    import fededge.clients.device as device
    import fededge.server.inprocess as inprocess
    from fededge import keys

    calls: list = []
    monkeypatch.setattr(inprocess, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(inprocess, "usable_cores", lambda: 2)
    monkeypatch.setattr(device, "time_sgd_step", _fake_timer(1e-3, 0.2e-3, calls))
    out = run_inprocess({"num-rounds": 1, "local-steps": 2, "model": "mlp", "progress": "off", "clients-per-round": 4,
                         "results-dir": str(tmp_path)}, num_clients=4, workers="auto")
    note = json.loads((out / "config.json").read_text())["inprocess_runtime"]
    assert note.startswith("clients on cpu (auto: timed one client's step of 32 examples: 1 ms a client on cuda, "
                           "0.1 ms on cpu (2 processes x 1 thread)); 2 processes (auto: 2 usable cores")
    assert [c["model"] for c in calls] == ["MLP", "MLP"]
    assert inprocess.auto_workers(RunConfig(clients_per_round=4), 4, cores=2, cuda=True)[0] == 1
    grid = InProcessGrid("fededge.clients.app:app", num_nodes=2, run_config={}, client_device="cuda:0")
    try:
        assert {grid.node_config(n)[keys.CLIENT_DEVICE] for n in grid.get_node_ids()} == {"cuda:0"}
    finally:
        grid.close()
    # No CUDA: the CPU, untimed; a device asked for is taken as asked.
    assert inprocess.client_device_choice(RunConfig(), 4, cuda=False).reason == "auto: no CUDA device"
    assert inprocess.client_device_choice(RunConfig(device="cpu"), 4, cuda=True).reason == "as asked"


def test_a_move_to_disk_that_fails_keeps_the_states_in_memory_and_says_so_once(tmp_path, monkeypatch, caplog):
    import fededge.server.nodestates as nodestates

    def full(directory):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nodestates, "DiskStates", full)
    store = AutoStates(tmp_path, budget_bytes=1)
    caplog.set_level(logging.INFO, logger="fededge.server.nodestates")
    try:
        for node in range(3):
            store.put(node, _state(node))
        assert store.kind == "memory" and sorted(store.nodes()) == [0, 1, 2]
        assert store.take_bytes(2) == state_to_bytes(_state(2))
        warned = [r for r in caplog.records if "could not move to disk" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING and "No space left" in warned[0].getMessage()
    finally:
        store.close()


def test_usable_cores_follow_a_cgroup_cpu_quota(tmp_path):
    from fededge.machine import _cgroup_cpu_quota

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpu_quota(str(tmp_path)) is None
    assert _cgroup_cpu_quota(str(tmp_path / "nothing")) is None
    # The process's own cgroup and those above it, not the mount's root alone (a nested
    # cgroup without its own namespace: systemd-run -p CPUQuota=, a scheduler's job):
    # the smallest quota of them, v2 and v1's cpu controller.
    (tmp_path / "proc").write_text("0::/a/b\n4:cpu,cpuacct:/x/y\n5:memory:/z\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path), str(tmp_path / "proc")) == 3.0
    (tmp_path / "cpu" / "x" / "y").mkdir(parents=True)
    (tmp_path / "cpu" / "x" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "x" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(str(tmp_path), str(tmp_path / "proc")) == 0.5
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "cpu.max").write_text("10000 100000\n")  # the memory controller's cgroup: not this one
    assert _cgroup_cpu_quota(str(tmp_path), str(tmp_path / "proc")) == 0.5


def test_a_sweeps_runs_share_the_cores_and_a_resume_keeps_the_runs_device(tmp_path):
    from fededge.sweep import _command, plan

    sweep = plan(tmp_path / "sw", {"compressor": ["none"]}, [0], base={"num-rounds": 1}, num_clients=4)
    cmd = _command(sweep.runs[0], sweep, "run")
    assert cmd[cmd.index("--workers") + 1] == "auto"  # the run's share (FEDEDGE_RUNS_SHARING)
    out = run_inprocess({"num-rounds": 1, "local-steps": 2, "model": "mlp", "progress": "off",
                         "results-dir": str(tmp_path / "r")}, num_clients=2, client_device="cpu")
    meta = json.loads((out / "config.json").read_text())
    assert meta["inprocess_client_device"] == "cpu" and meta["inprocess_workers"] == 1
    assert meta["inprocess_runtime"].startswith("clients on cpu (auto: the run's own choice); 1 process (as given)")


def test_a_sweeps_runs_share_the_memory_and_the_gpu(tmp_path, monkeypatch):
    """The sweep tells its runs how many run side by side (its jobs, at most the runs
    left; times its own sharing); a run's client-states=auto cap is its share of a quarter
    of the memory; a bad value stops with the variable named."""
    import fededge.server.nodestates as nodestates
    from fededge.machine import RUNS_SHARING_ENV, runs_sharing
    from fededge.sweep import plan, run_env, run_sweep

    assert runs_sharing({}) == 1 and runs_sharing({RUNS_SHARING_ENV: " 3 "}) == 3
    for bad in ("0", "-2", "two", "1.5", "\u00b2"):
        with pytest.raises(ConfigError, match=f"FEDEDGE_RUNS_SHARING='{bad}': the number of runs sharing"):
            runs_sharing({RUNS_SHARING_ENV: bad})
    env = run_env(4, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "FLWR_TELEMETRY_ENABLED": "0", RUNS_SHARING_ENV: "4"}
    assert run_env(2, {RUNS_SHARING_ENV: "3"})[RUNS_SHARING_ENV] == "6"  # a sweep inside a share
    monkeypatch.setattr(nodestates, "_physical_memory", lambda: 64 * 2**30)
    monkeypatch.setenv(RUNS_SHARING_ENV, "4")
    store = AutoStates(tmp_path)
    try:
        assert store.memory_cap == 4 * 2**30 and store.sharing == 4
    finally:
        store.close()
    monkeypatch.delenv(RUNS_SHARING_ENV)
    store = AutoStates(tmp_path)
    try:
        assert store.memory_cap == 16 * 2**30 and store.sharing == 1
    finally:
        store.close()
    # Cores: this run's share (its workers=auto, a sweep's own jobs); replies kept on a GPU.
    import fededge.arrays as arrays
    import fededge.machine as machine

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(machine, "_cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (100 * MIB, 100 * MIB))
    gpu = torch.device("cuda", 0)  # mem_get_info replaced: no GPU needed
    assert machine.usable_cores() == 8 and arrays._within_budget(gpu, 20 * MIB)
    monkeypatch.setenv(RUNS_SHARING_ENV, "3")
    assert machine.usable_cores() == 2 and machine.usable_cores(shared=False) == 8
    assert auto_workers(RunConfig(clients_per_round=100), 1000, cuda=False) == (
        2, "2 usable cores (this run's share: 3 runs share the machine), 100 clients a round")
    assert not arrays._within_budget(gpu, 20 * MIB) and arrays._within_budget(gpu, 8 * MIB)  # 25 MiB / 3
    # A bad value stops a sweep before it writes anything, and a run before it starts.
    monkeypatch.setenv(RUNS_SHARING_ENV, "many")
    with pytest.raises(ConfigError, match="FEDEDGE_RUNS_SHARING='many'"):
        run_sweep(plan(tmp_path / "bad", {"local-steps": [1]}, [0], base={"num-rounds": 1}, num_clients=4),
                  report=lambda line: None)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="FEDEDGE_RUNS_SHARING='many'"):
        run_inprocess({"num-rounds": 1, "results-dir": str(tmp_path / "r")}, num_clients=2)
    monkeypatch.delenv(RUNS_SHARING_ENV)
    # A sweep of two runs at --jobs 8: both side by side, each told 2 (its workers=auto: half the cores).
    seen = []

    def fake_run(cmd, *, env, **kw):  # noqa: ANN001, ANN202
        seen.append((cmd[cmd.index("--workers") + 1] if "--workers" in cmd else None, env[RUNS_SHARING_ENV]))
        return __import__("subprocess").CompletedProcess(cmd, 1)

    monkeypatch.setattr("fededge.sweep.subprocess.run", fake_run)
    monkeypatch.setattr("fededge.sweep.usable_cores", lambda: 8)
    sweep = plan(tmp_path / "sw", {"local-steps": [1, 2]}, [0], base={"num-rounds": 1}, num_clients=4)
    with pytest.raises(Exception, match="2 of 2 runs failed"):
        run_sweep(sweep, jobs=8, report=lambda line: None)
    assert seen == [("auto", "2"), ("auto", "2")]


# ---------------------------------------------------------------- several processes on one GPU (item 4)

def test_the_processes_on_a_gpu_are_as_many_as_its_free_memory_holds():
    from fededge.clients.device import CudaFootprint, processes_that_fit

    gib = 2**30
    # 80 GiB free of 80; a process: 0.5 GiB context, 1.5 GiB step, 45 MB models, no data.
    fp = CudaFootprint(context=gib // 2, step=3 * gib // 2, model=45 * MIB, free=80 * gib, total=80 * gib)
    own = fp.step + 2 * fp.model
    room = 72 * gib - own - 3 * fp.model  # 10 % kept free; the server's three models here
    more = int(room // (fp.context + own))
    assert processes_that_fit(64, fp, server_on_gpu=True) == (
        1 + more, f"{1 + more} of 64 fit in the GPU (80.0 GiB free, {(fp.context + own) / gib:.1f} GiB a process)")
    assert processes_that_fit(8, fp)[0] == 8 and processes_that_fit(8, fp)[1].startswith("8 fit in the GPU")
    # The server on the CPU leaves its three models' room; each process's cached data takes room.
    assert processes_that_fit(64, fp)[0] == 1 + int((room + 3 * fp.model) // (fp.context + own))
    with_data = processes_that_fit(64, fp, data_bytes=2 * gib, server_on_gpu=True)[0]
    assert with_data == 1 + int((room - 2 * gib) // (fp.context + own + 2 * gib)) and with_data < 1 + more
    small = CudaFootprint(context=1000 * MIB, step=0, model=0, free=4000 * MIB, total=4000 * MIB)
    assert processes_that_fit(8, small)[1] == "4 of 8 fit in the GPU (3.9 GiB free, 1000 MiB a process)"
    # Fewer processes the less is free, never fewer than this one.
    counts = [processes_that_fit(64, CudaFootprint(fp.context, fp.step, fp.model, free * gib, 80 * gib),
                                 server_on_gpu=True)[0]
              for free in (80, 40, 20, 10, 8, 4, 1, 0)]
    assert counts == sorted(counts, reverse=True) and counts[-3:] == [1, 1, 1]
    with pytest.raises(ValueError, match="asked must be >= 1"):
        processes_that_fit(0, fp)
    # Runs sharing the machine (a sweep's): each takes at most its share of the 90 %, free or not.
    share = 72 * gib / 4 - own - 3 * fp.model
    got = processes_that_fit(64, fp, server_on_gpu=True, sharing=4)
    assert got[0] == 1 + int(share // (fp.context + own)) < 1 + more
    assert got[1].endswith(f"(80.0 GiB free, its share 18.0 GiB of 4 runs, {(fp.context + own) / gib:.1f} GiB a process)")
    # ... and no more than is free when it starts (the others' processes already there).
    half_taken = CudaFootprint(fp.context, fp.step, fp.model, free=20 * gib, total=80 * gib)
    assert processes_that_fit(64, half_taken, server_on_gpu=True, sharing=2) == processes_that_fit(
        64, half_taken, server_on_gpu=True)
    assert processes_that_fit(64, fp, sharing=1) == processes_that_fit(64, fp)
    with pytest.raises(ValueError, match="sharing must be >= 1"):
        processes_that_fit(8, fp, sharing=0)


def test_the_gpu_processes_are_sized_with_the_runs_model_batch_and_largest_partitions(monkeypatch):
    import fededge.clients.device as device
    import fededge.server.inprocess as inprocess
    from fededge.clients.device import CudaFootprint
    from fededge.server.inprocess import gpu_workers
    from fededge.workload import CLIENT_TENSORS_CACHED, partition_indices

    seen: list = []

    def measure(model_fn, input_shape, num_classes, batch, dev):
        seen.append(("measure", type(model_fn()).__name__, input_shape, num_classes, batch, dev))
        return CudaFootprint(context=MIB, step=MIB, model=MIB, free=56 * MIB, total=56 * MIB)

    monkeypatch.setattr(device, "measure_cuda_footprint", measure)
    monkeypatch.setattr(device, "resolve_device", torch.device)  # a (pretend) GPU machine
    # cuBLAS reads its workspace setting at the first CUDA matmul: the run's, before the step.
    monkeypatch.setattr(inprocess, "set_cuda_determinism", lambda dev, det: seen.append(("determinism", str(dev), det)))
    cfg = RunConfig.from_mapping({"dataset": "synthetic", "synthetic-samples": 20000, "model": "mlp", "batch-size": 16,
                                  "partition": "dirichlet", "alpha": 1.0, "deterministic": False})
    example = 32 * 4 + 8  # synthetic: 32 float32 features, an int64 label
    fp = measure(lambda: torch.nn.Linear(1, 1), (1,), 1, 1, "x")
    seen.clear()

    def nodes(*splits):
        return [(i, n, None) for n in splits for i in range(n)]

    def top64(*splits):
        return example * sum(sorted((len(p) for n in splits for p in partition_indices(cfg, n)),
                                    reverse=True)[:CLIENT_TENSORS_CACHED])

    # A process caches up to 64 clients' data: the largest 64 of the nodes' partitions,
    # whatever split each node's comes from.
    for splits in ((100,), (10, 100)):
        n, why = gpu_workers(cfg, 200, "cuda:0", nodes(*splits))
        assert (n, why) == device.processes_that_fit(200, fp, data_bytes=top64(*splits), server_on_gpu=True)
        assert 1 < n < 200
    assert seen == [("determinism", "cuda:0", False), ("measure", "MLP", (32,), 10, 16, "cuda:0")] * 2
    assert example * 16000 * 0.64 < top64(100) < example * 16000  # 64 of the 100 clients, not all
    assert top64(10, 100) > top64(10)  # the ten large ones and 54 small ones, not the ten alone
    assert gpu_workers(cfg, 200, "cuda", nodes(100))[0] > device.processes_that_fit(
        200, fp, data_bytes=example * 16000, server_on_gpu=True)[0]
    # The server on the CPU leaves its model, accumulator and scratch buffer's room.
    on_cpu = RunConfig.from_mapping({**cfg.to_mapping(), "server-device": "cpu"})
    got = gpu_workers(on_cpu, 200, "cuda", nodes(100))
    assert got == device.processes_that_fit(200, fp, data_bytes=top64(100), server_on_gpu=False)
    assert got[0] > gpu_workers(cfg, 200, "cuda", nodes(100))[0]


def test_workers_on_a_gpu_are_lowered_to_what_fits_before_anything_starts(monkeypatch):
    """The run asks for 4 processes with its clients on CUDA; 2 fit. The grid is rebuilt
    with 2 before any worker starts, and the run's first line says why; where all fit
    it is built once."""
    import fededge.server.inprocess as inprocess
    from fededge.clients.device import DeviceChoice

    grids: list = []

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    class FakeGrid:
        def __init__(self, app, **kw):
            self.workers, self.direct, self.closed = kw["workers"], kw["direct"], False
            grids.append(self)

        def data_splits(self):
            return [(4, None)]

        def get_node_ids(self):
            return [11, 12, 13, 14]

        def node_config(self, nid):
            return {"partition-id": nid - 11, "num-partitions": 4}

        def close(self):
            self.closed = True

        start_workers = stop

    monkeypatch.setattr(inprocess, "InProcessGrid", FakeGrid)
    monkeypatch.setattr(inprocess, "client_device_choice", lambda *a, **k: DeviceChoice("cuda", "as asked"))
    asked: list = []

    def fits(n):
        def gpu_workers(cfg, workers, dev, nodes):
            asked.append((workers, dev, list(nodes)))
            return min(n, workers), f"{min(n, workers)} of {workers} fit in the GPU (test)"
        return gpu_workers

    monkeypatch.setattr(inprocess, "gpu_workers", fits(2))
    with pytest.raises(Stop):
        run_inprocess({"num-rounds": 1, "device": "cuda", "progress": "off"}, num_clients=4, workers=4)
    assert asked == [(4, "cuda", [(0, 4, None), (1, 4, None), (2, 4, None), (3, 4, None)])]
    assert [(g.workers, g.closed) for g in grids] == [(4, True), (2, True)] and not grids[1].direct
    assert "2 processes (as given; 2 of 4 fit in the GPU (test))" in grids[1].runtime_note
    # All fit: one grid. One process left: the grid hands messages over directly again.
    for n, want in ((8, [(4, True)]), (1, [(4, True), (1, True)])):
        grids.clear()
        monkeypatch.setattr(inprocess, "gpu_workers", fits(n))
        if n == 1:
            monkeypatch.setattr(FakeGrid, "start_workers", lambda self: pytest.fail("no worker to start"))
            monkeypatch.setattr(inprocess, "run_server", stop)
        with pytest.raises(Stop):
            run_inprocess({"num-rounds": 1, "device": "cuda", "progress": "off"}, num_clients=4, workers=4)
        assert [(g.workers, g.closed) for g in grids] == want
    assert grids[-1].direct and grids[-1].runtime_note.endswith("handed over directly, their bytes counted from the "
                                                                "format")
    # A sizing that fails closes the grid, and its error is the one raised.
    grids.clear()
    monkeypatch.setattr(inprocess, "gpu_workers", lambda *a: (_ for _ in ()).throw(ConfigError("no split")))
    with pytest.raises(ConfigError, match="no split"):
        run_inprocess({"num-rounds": 1, "device": "cuda", "progress": "off"}, num_clients=4, workers=4)
    assert [(g.workers, g.closed) for g in grids] == [(4, True)]
    # One process on CUDA, or a CPU run, is not sized.
    monkeypatch.setattr(FakeGrid, "start_workers", stop)
    monkeypatch.setattr(inprocess, "gpu_workers", lambda *a: pytest.fail("sized"))
    with pytest.raises(Stop):
        run_inprocess({"num-rounds": 1, "device": "cuda", "progress": "off"}, num_clients=4, workers=1)
    monkeypatch.setattr(inprocess, "client_device_choice", lambda *a, **k: DeviceChoice("cpu", "as asked"))
    with pytest.raises(Stop):
        run_inprocess({"num-rounds": 1, "progress": "off"}, num_clients=4, workers=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the run would start")
def test_workers_on_a_gpu_this_machine_lacks_stop_before_round_one_by_name(tmp_path):
    with pytest.raises(RuntimeError, match=r"device='cuda' was asked for but torch.cuda.is_available\(\) is False"):
        run_inprocess({"num-rounds": 1, "device": "cuda", "progress": "off", "results-dir": str(tmp_path)},
                      num_clients=4, workers=2)
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: measures a training step's memory on a GPU")
def test_a_cuda_training_step_is_measured_and_sized():
    from fededge.clients.device import CONTEXT_MAX_BYTES, CONTEXT_MIN_BYTES, measure_cuda_footprint, processes_that_fit
    from fededge.models.zoo import build_model

    fp = measure_cuda_footprint(lambda: build_model("resnet18", input_shape=(3, 32, 32), num_classes=10, seed=0),
                                (3, 32, 32), 10, 32)
    assert 42 * MIB < fp.model < 43 * MIB and fp.step > 3 * fp.model  # weights, gradients, momentum, activations
    assert CONTEXT_MIN_BYTES <= fp.context <= CONTEXT_MAX_BYTES and 0 < fp.free <= fp.total
    assert torch.cuda.memory_allocated() < fp.model  # the step's memory is given back
    assert processes_that_fit(4, fp)[0] >= 1


def test_the_first_line_gives_the_rounds_share_as_the_memory_caps_it(tmp_path, monkeypatch):
    import fededge.server.nodestates as nodestates

    monkeypatch.setattr(nodestates, "_physical_memory", lambda: 2 * 2**30)  # a 2 GiB container: a 512 MiB cap
    out = run_inprocess({"num-rounds": 1, "local-steps": 1, "model": "mlp", "progress": "off",
                         "results-dir": str(tmp_path)}, num_clients=2, client_states="auto")
    note = json.loads((out / "config.json").read_text())["inprocess_runtime"]
    assert "client states in memory up to 256 MiB or 2 clients' states (a round's, at most 512 MiB)" in note
