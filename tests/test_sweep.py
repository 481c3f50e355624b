"""fededge sweep (issue 39): a grid times seeds gives the runs made one by one, a table
whose figures are those runs' recomputed, every invalid cell named before anything runs,
and a killed sweep that finishes with no run made twice."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fededge.server.inprocess import run_inprocess
from fededge.sweep import SweepError, format_table, parse_grid, plan, run_sweep

BASE = {"model": "mlp", "num-rounds": 2, "local-steps": 1, "checkpoint-every": 1, "progress": "off",
        "save-model": False, "target-accuracy": 0.3, "sim-step-s": 0.01}  # sim_s from steps: reproducible
NODES = 3


def _rounds(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in ("wall_s", "clients")} for x in lines]


def test_the_grid_reads_typed_values_and_refuses_what_it_cannot_read():
    assert parse_grid("strategy=fedavg,dga dga-delay=1,2 local-lr=0.1") == \
        {"strategy": ["fedavg", "dga"], "dga-delay": [1, 2], "local-lr": [0.1]}
    assert parse_grid("""compute-speed="lognormal:0.5",'1.0' netem='wifi:0.5,4g:0.5',3g""") == \
        {"compute-speed": ["lognormal:0.5", "1.0"], "netem": ["wifi:0.5,4g:0.5", "3g"]}
    for bad, match in [("strategy", "not key=v1"), ("a=1 a=2", "given twice"), ("seed=1,2", "--seeds"),
                       ("a=1,,2", "empty value"), ("a=1,1", "repeats"), ("netem='4g", "unclosed quote")]:
        with pytest.raises(SweepError, match=match):
            parse_grid(bad)


def test_every_invalid_cell_is_named_before_anything_runs(tmp_path):
    grid = parse_grid("strategy=fedavg,fedbuff compressor=none,topk batch-size=32,0")
    with pytest.raises(SweepError) as err:
        plan(tmp_path / "sweep", grid, [0, 1], base=BASE)
    text = str(err.value)
    assert "5 of 8 cells cannot run; nothing was started" in text
    assert "strategy=fedbuff compressor=topk batch-size=32: run-config keys 'compressor'" in text
    assert "strategy=fedavg compressor=none batch-size=0: run-config key 'batch-size'" in text
    assert not (tmp_path / "sweep").exists()
    with pytest.raises(SweepError, match="'seed'"):
        plan(tmp_path / "s", grid, [0], base={**BASE, "seed": 3})
    with pytest.raises(SweepError, match="both the grid and --run-config"):
        plan(tmp_path / "s", parse_grid("local-lr=0.1,0.2"), [0], base={**BASE, "local-lr": 0.3})
    # keys the sweep sets for each run were overridden without a word in a grid or cell
    for key, values in (("results-dir", "a,b"), ("progress", "bar,off"), ("resume-from", "x")):
        with pytest.raises(SweepError, match=f"the grid must not set '{key}': the sweep sets it"):
            plan(tmp_path / "s", parse_grid(f"{key}={values}"), [0], base=BASE)
    with pytest.raises(SweepError, match="the cells must not set 'results-dir'"):
        plan(tmp_path / "s", {}, [0], base=BASE, cells=[{"results-dir": "x"}])


def test_cells_that_differ_past_the_directory_names_cut_get_directories_of_their_own(tmp_path):
    """A cell's directory name was its keys and values cut to 150 characters: two cells
    that differed only after that shared one directory (the second deleted the first's
    runs and reported them as its own), as did values that differ in replaced characters."""
    from fededge.sweep import _slug

    long = {"compressor": "topk", "topk-ratio": 0.01, "error-feedback": True, "local-steps": 5,
            "lr-schedule": "cosine", "momentum": 0.9, "weight-decay": 0.0001, "compress-min-numel": 1000,
            "client-states-memory-mb": 64}
    base = {k: v for k, v in BASE.items() if k not in long}
    sweep = plan(tmp_path / "s", {}, [0], base=base, cells=[{**long, "dga-delay": 1, "strategy": "dga"},
                                                             {**long, "dga-delay": 2, "strategy": "dga"}])
    dirs = [r.directory for r in sweep.runs]
    assert len(set(dirs)) == 2 and all(len(d.parent.name) <= 150 for d in dirs)
    assert _slug({"netem": "wifi:0.5,3g:0.5"}) != _slug({"netem": "wifi_0.5,3g_0.5"})
    assert _slug({"strategy": "dga", "dga-delay": 1}) == "strategy=dga,dga-delay=1"  # short safe names as before


def test_a_list_of_cells_is_planned_as_given_and_checked_the_same(tmp_path):
    cells = [{"local-steps": 1, "dga-delay": 4, "strategy": "dga"}, {"local-steps": 2, "dga-delay": 2, "strategy": "dga"}]
    base = {k: v for k, v in BASE.items() if k != "local-steps"}
    sweep = plan(tmp_path / "s", {}, [0, 1], base=base, cells=cells)
    assert [(r.cell, r.seed) for r in sweep.runs] == [(cells[0], 0), (cells[0], 1), (cells[1], 0), (cells[1], 1)]
    assert sweep.runs[2].overrides["dga-delay"] == 2 and sweep.spec()["cells"] == cells
    with pytest.raises(SweepError, match="1 of 2 cells cannot run"):
        plan(tmp_path / "s", {}, [0], base=base, cells=[cells[0], {"local-steps": 0}])
    for bad, match in [([cells[0], cells[0]], "given twice"), ([], "empty"), ([{"seed": 1}], "'seed'"),
                       ([{"local-steps": 3, "num-rounds": 2}], "both the cells and --run-config")]:
        with pytest.raises(SweepError, match=match):
            plan(tmp_path / "s", {}, [0], base=base, cells=bad)
    with pytest.raises(SweepError, match="not both"):
        plan(tmp_path / "s", {"local-lr": [0.1]}, [0], base=base, cells=cells)


def test_a_sweep_is_its_runs_made_one_by_one_and_its_table_their_figures(tmp_path):
    sweep = plan(tmp_path / "sweep", parse_grid("local-lr=0.05,0.2 momentum=0.0,0.9"), [0, 1], base=BASE,
                 num_clients=NODES)
    assert len(sweep.runs) == 8
    lines: list[str] = []
    result = run_sweep(sweep, jobs=2, report=lines.append)
    assert sum("final accuracy" in x for x in lines) == 8
    for run in sweep.runs:  # the same run made alone, in this process
        alone = run_inprocess({**run.overrides, "results-dir": str(tmp_path / "alone")}, num_clients=NODES)
        assert _rounds(run.run_dir()) == _rounds(alone), run.label
    # The table: each cell's mean and sample sd over its seeds, recomputed from the summaries.
    summaries = {(r.cell["local-lr"], r.cell["momentum"], r.seed): json.loads((r.run_dir() / "summary.json").read_text())
                 for r in sweep.runs}
    assert [row["cell"] for row in result["cells"]] == [
        "local-lr=0.05 momentum=0.0", "local-lr=0.05 momentum=0.9", "local-lr=0.2 momentum=0.0",
        "local-lr=0.2 momentum=0.9"]
    for row in result["cells"]:
        finals = [summaries[(row["local-lr"], row["momentum"], s)]["final_accuracy"] for s in (0, 1)]
        assert row["final_accuracy"] == {"mean": statistics.fmean(finals), "sd": statistics.stdev(finals), "n": 2}
        if "paired" in row:
            base = [summaries[(0.05, 0.0, s)]["final_accuracy"] for s in (0, 1)]
            diffs = [a - b for a, b in zip(finals, base)]
            assert row["paired"]["final_accuracy"] == {"mean": statistics.fmean(diffs), "sd": statistics.stdev(diffs),
                                                      "n": 2}
    assert result["baseline"] == "local-lr=0.05 momentum=0.0" and "paired" not in result["cells"][0]
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text()) == json.loads(json.dumps(result))
    csv_rows = (tmp_path / "sweep" / "sweep.csv").read_text().splitlines()
    assert len(csv_rows) == 5 and csv_rows[0].startswith("cell,local-lr,momentum,seeds,final_accuracy_mean")
    assert "| local-lr=0.2 momentum=0.9 | 2 |" in format_table(result)
    # The same sweep again keeps every run; another sweep in its directory is refused.
    again: list[str] = []
    run_sweep(sweep, jobs=2, report=again.append)
    assert "8 finished before, kept" in again[0] and len(again) == 1
    other = plan(tmp_path / "sweep", parse_grid("local-lr=0.05,0.3"), [0], base=BASE, num_clients=NODES)
    with pytest.raises(SweepError, match="holds another sweep"):
        run_sweep(other)
    with pytest.raises(SweepError, match="baseline 'local-lr=9' is not a cell"):
        run_sweep(sweep, baseline="local-lr=9")
    from fededge.analysis.plot import plot_sweep

    assert plot_sweep(tmp_path / "sweep").stat().st_size > 10_000


def test_a_killed_sweep_finishes_with_no_run_made_twice(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fededge.cli", "sweep", "--grid", "local-lr=0.05,0.2", "--seeds", "0",
           "--jobs", "1", "--num-clients", str(NODES), "--out", str(out), "--run-config",
           "model='mlp' num-rounds=12 local-steps=5 checkpoint-every=1 progress='off' save-model=false sim-step-s=0.01"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        first = out / "runs" / "local-lr=0.05" / "seed-0"
        while time.monotonic() < deadline:  # kill it mid-run, once the first run has checkpoints
            ckpts = list(first.glob("*/checkpoints/round-*.ckpt"))
            if len(ckpts) >= 2 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    killed_at = json.loads(next(first.glob("*/summary.json")).read_text())
    assert killed_at["status"] == "running"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 to resume" in done.stdout and "local-lr=0.05 seed=0: resumed" in done.stdout
    for seed_dir in (out / "runs").glob("*/seed-0"):
        run_dirs = [p for p in seed_dir.iterdir() if p.is_dir()]
        assert len(run_dirs) == 1, run_dirs  # no run made twice
        assert [x["round"] for x in _rounds(run_dirs[0])] == list(range(13))
    # The resumed run equals the run made uninterrupted.
    alone = run_inprocess({"model": "mlp", "num-rounds": 12, "local-steps": 5, "checkpoint-every": 1,
                           "progress": "off", "save-model": False, "local-lr": 0.05, "seed": 0, "sim-step-s": 0.01,
                           "results-dir": str(tmp_path / "alone")}, num_clients=NODES)
    assert _rounds(next(p for p in first.iterdir() if p.is_dir())) == _rounds(alone)


def test_the_command_refuses_a_bad_sweep_with_one_line_and_exit_2(tmp_path, capsys):
    from fededge.cli import main

    assert main(["sweep", "--cell", "local-steps=0", "--cell", "local-steps=2", "--seeds", "0",
                 "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fededge sweep: 1 of 2 cells cannot run; nothing was started") and "local-steps=0:" in err
    assert main(["sweep", "--grid", "strategy=fedavg,nosuch", "--out", str(tmp_path / "s")]) == 2
    assert "strategy=nosuch: run-config key 'strategy' must be one of" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    assert main(["plot", "--sweep", str(tmp_path / "nothing")]) == 2
    assert "has no sweep.json" in capsys.readouterr().err


def _fake_runs(sweep, outcomes):
    """Each run's directory as a finished run would leave it: summary.json (completed with
    a final accuracy, or failed where ``outcomes`` gives None) and a short metrics.jsonl."""
    for r in sweep.runs:
        acc = outcomes[(r.cell["local-lr"], r.seed)]
        d = r.directory / "run"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "summary.json").write_text(json.dumps({
            "status": "failed" if acc is None else "completed", "final_accuracy": acc, "best_accuracy": acc,
            "rounds_to_target": None, "sim_s_to_target": None, "bytes_up_to_target": None, "total_bytes_up": 5000,
            "sim_s": 3.0, "wall_s": 1.0}))
        (d / "metrics.jsonl").write_text("".join(json.dumps({
            "round": i, "accuracy": (acc or 0.1) * i / 3, "loss": 1.0, "bytes_up": 1000 * bool(i), "bytes_down": 0,
            "wall_s": i, "sim_s": i, "num_clients": 3}) + "\n" for i in range(4)))


def test_one_seed_has_no_spread_and_a_cell_without_a_finished_run_no_bar(tmp_path):
    """A figure over one seed (a cell with one completed seed, a paired difference over one
    common seed) read '± 0.0000': no spread, where it is not known; a cell with no
    completed run was drawn as accuracy 0."""
    from fededge.analysis.plot import plot_sweep
    from fededge.sweep import table

    sweep = plan(tmp_path / "s", parse_grid("local-lr=0.05,0.1,0.2"), [0, 1], base=BASE, num_clients=NODES)
    _fake_runs(sweep, {(0.05, 0): 0.9, (0.05, 1): 0.8, (0.1, 0): 0.85, (0.1, 1): None, (0.2, 0): None, (0.2, 1): None})
    result = table(sweep)
    one = result["cells"][1]
    assert one["final_accuracy"] == {"mean": 0.85, "sd": None, "n": 1}
    assert one["paired"]["final_accuracy"]["sd"] is None and one["paired"]["final_accuracy"]["n"] == 1
    assert result["cells"][0]["final_accuracy"]["sd"] == pytest.approx(statistics.stdev([0.9, 0.8]))
    assert "0.8500 (n=1)" in format_table(result) and "± 0.0000" not in format_table(result)
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(result))
    assert plot_sweep(tmp_path / "s").stat().st_size > 10_000  # the cell with no run: named, not a bar at 0
