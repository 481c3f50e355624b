"""``fededge sweep``: a grid of run-config values times seeds, N runs at a time, one table.

::

    fededge sweep --grid "strategy=fedavg,dga dga-delay=1,2" --seeds 0 1 2 \\
        --run-config "num-rounds=30" --out results/sweep-dga

- **The grid** is ``key=v1,v2,...`` items, as ``--run-config`` writes values (a value with
  a comma in it is quoted: ``netem='wifi:0.5,4g:0.5',3g``). Its cells are every
  combination of the values, in the order given; each cell runs once per seed
  (run-config key ``seed``).
- **Or a list of cells** (``--cell "local-steps=1 dga-delay=5" --cell "local-steps=5
  dga-delay=1"``), for settings a product does not express.
- **Every run is checked before any starts** (the whole run config, parsed as the run
  will parse it): an impossible combination is refused with every bad cell named.
- **Runs** go ``jobs`` at a time (default: one per core), each a ``fededge run``
  process (the in-process runtime, one torch thread per client), into
  ``<out>/runs/<cell>/seed-<s>/<run id>/``. Each takes its share of the machine
  (:data:`~fededge.machine.RUNS_SHARING_ENV`, the runs side by side being ``jobs`` or the
  runs left): of the cores (``--workers auto``: one process where its clients train on
  CUDA or as a cohort), the memory (``client-states=auto``'s cap) and the GPU's memory.
- **The table**, ``<out>/sweep.json`` and ``<out>/sweep.csv``: per cell, the mean and
  sample standard deviation over seeds of the final accuracy, and of rounds, simulated
  seconds and uplink bytes to ``target-accuracy`` (over the seeds that reached it,
  their count beside it); and each cell's paired differences from a baseline cell (the
  first, or ``baseline``), seed by seed. ``fededge plot --sweep <out>`` draws it.
- **A killed sweep resumes**: the same command again (the same ``--out``) keeps the
  finished runs, continues each interrupted run from its newest checkpoint (``fededge
  resume``) and starts the rest; no run is made twice. ``<out>/spec.json`` holds the
  sweep's definition, and another one in the same directory is refused.

Pure (no Flower): runs are separate processes.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fededge.config import ConfigError, RunConfig
from fededge.machine import RUNS_SHARING_ENV, runs_sharing, usable_cores
from fededge.runconfig_text import format_run_config, parse_run_config
from fededge.tracking import check_installed, parse_log_to

__all__ = ["SweepError", "SweepRunsFailed", "SweepRun", "Sweep", "parse_grid", "plan", "run_sweep", "table"]

#: The figures of summary.json a sweep's table summarises, per cell.
FIGURES = ("final_accuracy", "best_accuracy", "rounds_to_target", "sim_s_to_target", "bytes_up_to_target",
           "total_bytes_up", "sim_s", "wall_s")
#: Of those, the ones a run that never reached the target has none of (null).
TO_TARGET = ("rounds_to_target", "sim_s_to_target", "bytes_up_to_target")


class SweepError(ValueError):
    """A sweep that cannot run as given (a bad grid, invalid cells, another sweep's directory)."""


class SweepRunsFailed(SweepError):
    """Some of a sweep's runs failed; the table holds the others."""


def _split(text: str, is_separator: Callable[[str], bool]) -> list[str]:
    """``text`` cut at the separators outside quotes (``'...'`` or ``"..."``)."""
    out, cur, quote = [], "", ""
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
            cur += ch
        elif is_separator(ch):
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if quote:
        raise SweepError(f"unclosed quote in the grid: {text!r}")
    out.append(cur)
    return out


def _split_values(text: str) -> list[str]:
    """``a,'b,c',d`` -> ``["a", "'b,c'", "d"]``: commas outside quotes separate values."""
    return _split(text, lambda ch: ch == ",")


def parse_grid(text: str) -> dict[str, list[Any]]:
    """``"strategy=fedavg,dga dga-delay=1,2"`` -> ``{"strategy": ["fedavg", "dga"], "dga-delay": [1, 2]}``.

    >>> parse_grid("strategy=fedavg,dga dga-delay=1,2")
    {'strategy': ['fedavg', 'dga'], 'dga-delay': [1, 2]}
    >>> parse_grid("netem='wifi:0.5,4g:0.5',3g")
    {'netem': ['wifi:0.5,4g:0.5', '3g']}
    """
    grid: dict[str, list[Any]] = {}
    for item in (x for x in _split(text or "", str.isspace) if x):
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise SweepError(f"grid item {item!r} is not key=v1,v2,... (e.g. strategy=fedavg,dga)")
        if key in grid:
            raise SweepError(f"grid key {key!r} is given twice; list all its values once: {key}=a,b,c")
        if key == "seed":
            raise SweepError("the grid does not take 'seed': give the seeds with --seeds 0 1 2")
        parsed = []
        for value in _split_values(values):
            if value == "":
                raise SweepError(f"grid item {item!r} has an empty value")
            parsed.append(parse_run_config(f"{key}={value}")[key])
        if len(set(map(repr, parsed))) != len(parsed):
            raise SweepError(f"grid key {key!r} repeats a value: {values}")
        grid[key] = parsed
    return grid


def _slug(cell: Mapping[str, Any]) -> str:
    """A cell's directory name: ``strategy=dga,dga-delay=1``. Where characters had to be
    replaced or the name cut to 150, a hash of the cell ends it: two cells that differed
    only past the cut (or in replaced characters) shared one directory, and the second
    deleted the first's runs and reported them as its own."""
    text = ",".join(f"{k}={v}" for k, v in cell.items()) or "base"
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if safe == text and len(safe) <= 150:
        return safe
    digest = hashlib.sha1(json.dumps({k: repr(v) for k, v in cell.items()}, sort_keys=True).encode()).hexdigest()
    return f"{safe[:130]}-{digest[:12]}"


def cell_label(cell: Mapping[str, Any]) -> str:
    """How tables and plots name a cell: ``strategy=dga dga-delay=1`` (``base`` for none)."""
    return " ".join(f"{k}={v}" for k, v in cell.items()) or "base"


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: a cell of the grid and a seed."""

    cell: dict[str, Any]
    seed: int
    overrides: dict[str, Any]  # the whole run config: base, then the cell, then the seed
    directory: Path  # <out>/runs/<cell>/seed-<s>: the run's results-dir, holding one run dir

    @property
    def label(self) -> str:
        return f"{cell_label(self.cell)} seed={self.seed}"

    def run_dir(self) -> Path | None:
        """The run directory inside :attr:`directory`, if the run started."""
        found = sorted(p for p in self.directory.glob("*") if (p / "config.json").exists()) \
            if self.directory.is_dir() else []
        return found[-1] if found else None

    def status(self) -> str:
        """``done`` (summary.json says completed), ``resume`` (a checkpoint to continue
        from), ``start`` (nothing usable yet)."""
        run_dir = self.run_dir()
        if run_dir is None:
            return "start"
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
        if summary.get("status") == "completed":
            return "done"
        if any((run_dir / "checkpoints").glob("round-*.ckpt")):
            return "resume"
        return "start"


@dataclass
class Sweep:
    """A planned sweep: its runs, in order (cells in grid order, seeds within a cell)."""

    out: Path
    grid: dict[str, list[Any]]
    seeds: list[int]
    base: dict[str, Any]
    num_clients: int
    runs: list[SweepRun] = field(default_factory=list)
    cells: list[dict[str, Any]] | None = None  # explicit cells, in place of the grid's product

    def spec(self) -> dict[str, Any]:
        spec = {"grid": self.grid, "seeds": self.seeds, "base": self.base, "num_clients": self.num_clients}
        return spec | ({"cells": self.cells} if self.cells is not None else {})


def plan(out: str | os.PathLike[str], grid: Mapping[str, Sequence[Any]], seeds: Sequence[int], *,
         base: Mapping[str, Any] | None = None, num_clients: int = 10,
         cells: Sequence[Mapping[str, Any]] | None = None) -> Sweep:
    """Every run of the sweep, each checked as its run will check it; raises
    :class:`SweepError` naming every invalid cell (with its reason) before anything runs.

    The cells are the grid's combinations, or ``cells`` (a list of run-config mappings,
    ``grid`` then empty) for settings a product does not express, such as a delay tied
    to the local steps."""
    if not seeds:
        raise SweepError("no seeds: give at least one (--seeds 0)")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"seeds repeat: {list(seeds)}")
    base = dict(base or {})
    for key in ("seed", "results-dir", "resume-from"):
        if key in base:
            raise SweepError(f"--run-config must not set {key!r}: the sweep sets it for each run")
    if cells is not None:
        if grid:
            raise SweepError("give the grid or a list of cells, not both")
        cells = [dict(c) for c in cells]
        if not cells:
            raise SweepError("the list of cells is empty")
        labels = [cell_label(c) for c in cells]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise SweepError(f"cells given twice: {'; '.join(twice)}")
        if any("seed" in c for c in cells):
            raise SweepError("a cell does not take 'seed': give the seeds with --seeds 0 1 2")
        grid = {}
    combos = cells if cells is not None else [dict(zip(grid, values)) for values in
                                              (itertools.product(*grid.values()) if grid else [()])]
    # Keys the sweep sets for each run: in a cell they were overridden without a word.
    theirs = sorted({k for c in combos for k in c} & {"seed", "results-dir", "resume-from", "progress"})
    if theirs:
        raise SweepError(f"the {'cells' if cells is not None else 'grid'} must not set {', '.join(map(repr, theirs))}: "
                         "the sweep sets it for each run (seeds: --seeds 0 1 2; the sweep's directory: --out; "
                         "progress: --run-config progress=...)")
    clash = sorted(set(base) & {k for c in combos for k in c})
    if clash:
        raise SweepError(f"{', '.join(clash)} in both the {'cells' if cells is not None else 'grid'} and "
                         "--run-config; give each key in one")
    sweep = Sweep(Path(out), {k: list(v) for k, v in grid.items()}, list(seeds), base, num_clients, cells=cells)
    if _shared_mlflow(base, combos):
        # One MLflow store for the whole sweep (each run's default would be its own
        # results-dir's), made once by the sweep before its runs start.
        base = sweep.base = {**base, "mlflow-uri": f"sqlite:///{sweep.out.resolve() / 'mlflow.db'}"}
    bad: list[str] = []
    for cell in combos:
        overrides = {**base, **cell, "progress": base.get("progress", "off")}
        try:
            RunConfig.from_mapping({**overrides, "seed": seeds[0]})
            check_installed(parse_log_to(str(overrides.get("log-to", ""))))  # names the missing extra
        except ConfigError as err:
            bad.append(f"  {cell_label(cell)}: {err}")
            continue
        for seed in seeds:
            directory = sweep.out / "runs" / _slug(cell) / f"seed-{seed}"
            sweep.runs.append(SweepRun(cell, int(seed), {**overrides, "seed": int(seed),
                                                         "results-dir": str(directory.resolve())}, directory))
    if bad:
        raise SweepError(f"{len(bad)} of {len(bad) + len(sweep.runs) // len(seeds)} cells cannot run; "
                         "nothing was started:\n" + "\n".join(bad))
    seen: dict[Path, SweepRun] = {}
    for run in sweep.runs:  # (the slug makes them unique; a run must never share another's directory)
        other = seen.setdefault(run.directory, run)
        if other is not run:
            raise SweepError(f"cells {cell_label(other.cell)!r} and {cell_label(run.cell)!r} (seed {run.seed}) "
                             f"would share the directory {run.directory}; nothing was started")
    return sweep


def _shared_mlflow(base: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the sweep logs to MLflow with no store named (then it names one for all)."""
    log_to = [base.get("log-to", "")] + [c.get("log-to", "") for c in cells]
    return (any("mlflow" in parse_log_to(str(x)) for x in log_to) and not base.get("mlflow-uri")
            and not any("mlflow-uri" in c for c in cells) and not os.environ.get("MLFLOW_TRACKING_URI"))


def _prepare_mlflow(sweep: Sweep) -> None:
    """Create the sweep's MLflow store and experiment once, before runs start at once
    (MLflow's SQLite schema migrations must not run concurrently)."""
    uri = sweep.base.get("mlflow-uri", "")
    if not str(uri).startswith("sqlite:///") or not str(uri).endswith(str(sweep.out.resolve() / "mlflow.db")):
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name("fededge") is None:
        client.create_experiment("fededge", artifact_location=(sweep.out.resolve() / "mlruns").as_uri())


def _preexec() -> None:  # pragma: no cover - runs in the child
    """A run dies with the sweep (Linux): a killed sweep leaves no run going on alone,
    which its resumption would then start a second time. (The runs stay in the sweep's
    process group, so Ctrl-C stops them too.)"""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _command(run: SweepRun, sweep: Sweep, action: str, workers: str = "auto") -> list[str]:
    """The command of one run. ``workers``: its processes (``fededge run --workers``):
    ``auto`` takes the run's share of the cores (the sweep's runs side by side share them,
    :data:`~fededge.machine.RUNS_SHARING_ENV`), one process where its clients train on
    CUDA or as a cohort."""
    exe = [sys.executable, "-m", "fededge.cli"]
    if action == "resume":
        return [*exe, "resume", str(run.run_dir())]
    return [*exe, "run", "--num-clients", str(sweep.num_clients), "--workers", workers,
            "--run-config", format_run_config(run.overrides)]


def run_env(at_once: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a sweep's runs: Flower's telemetry off, and
    :data:`~fededge.machine.RUNS_SHARING_ENV` the runs side by side (``at_once``, times the
    sharing the sweep itself was given), so that each sizes its memory and GPU as its
    share of the machine, its cores too (``--workers auto``)."""
    environ = dict(os.environ if environ is None else environ)
    return {**environ, "FLWR_TELEMETRY_ENABLED": "0", RUNS_SHARING_ENV: str(at_once * runs_sharing(environ))}


def run_sweep(sweep: Sweep, *, jobs: int = 0, baseline: str | None = None,
              report: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or finish) every run of ``sweep``, ``jobs`` at a time (0: one per core), and
    write the table. Returns what ``sweep.json`` holds."""
    runs_sharing()  # a bad FEDEDGE_RUNS_SHARING stops here, before anything is written
    labels = list(dict.fromkeys(cell_label(r.cell) for r in sweep.runs))
    if baseline is not None and baseline not in labels:
        raise SweepError(f"baseline {baseline!r} is not a cell; the cells: {'; '.join(labels)}")
    sweep.out.mkdir(parents=True, exist_ok=True)
    spec_file = sweep.out / "spec.json"
    spec = json.loads(json.dumps(sweep.spec()))
    if spec_file.exists():
        old = json.loads(spec_file.read_text())
        if old != spec:
            raise SweepError(f"{sweep.out} holds another sweep ({spec_file}); give another --out, or the same "
                             "grid, seeds, --run-config and --num-clients to finish that one")
    else:
        spec_file.write_text(json.dumps(spec, indent=2) + "\n")
    _prepare_mlflow(sweep)
    jobs = jobs or usable_cores()  # this process's (its share, where the sweep itself shares the machine)
    todo = [(run, run.status()) for run in sweep.runs]
    kept = sum(1 for _, s in todo if s == "done")
    at_once = max(1, min(jobs, len(todo) - kept))  # runs side by side: each its share of the machine
    env = run_env(at_once)
    resumed = sum(1 for _, s in todo if s == "resume")
    report(f"sweep: {len(sweep.runs)} runs ({len(sweep.runs) // len(sweep.seeds)} cells x {len(sweep.seeds)} "
           f"seeds), {at_once} at a time, in {sweep.out.resolve()}"
           + (f"; {kept} finished before, kept" if kept else "") + (f"; {resumed} to resume" if resumed else ""))
    done = [kept]
    failures: list[str] = []
    t0 = time.perf_counter()

    def one(item: tuple[SweepRun, str]) -> None:
        run, status = item
        if status == "done":
            return
        if status == "start" and run.directory.exists():
            shutil.rmtree(run.directory)  # a start that wrote no checkpoint: nothing to keep
        run.directory.mkdir(parents=True, exist_ok=True)
        log = run.directory / "sweep-run.log"
        started = time.perf_counter()
        with open(log, "a", encoding="utf-8") as out:
            proc = subprocess.run(_command(run, sweep, status), stdout=out, stderr=subprocess.STDOUT, env=env,
                                  preexec_fn=_preexec if sys.platform.startswith("linux") else None)
        done[0] += 1
        bar = _bar(done[0], len(sweep.runs))
        run_dir = run.run_dir()
        summary = _summary(run_dir) if run_dir else {}
        if proc.returncode != 0 or summary.get("status") != "completed":
            failures.append(f"{run.label}: exit {proc.returncode}, see {log}")
            report(f"{bar} {run.label}: FAILED (exit {proc.returncode}; {log})")
            return
        verb = "resumed, " if status == "resume" else ""
        report(f"{bar} {run.label}: {verb}final accuracy "
               f"{summary['final_accuracy']:.4f} ({time.perf_counter() - started:.1f} s; "
               f"{time.perf_counter() - t0:.0f} s in all)")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, todo))
    result = table(sweep, baseline=baseline)
    (sweep.out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    _write_csv(sweep.out / "sweep.csv", result)
    if failures:
        raise SweepRunsFailed(f"{len(failures)} of {len(sweep.runs)} runs failed (the table has the others; the same "
                         "command again retries them):\n  " + "\n  ".join(failures))
    return result


def _bar(done: int, total: int, width: int = 20) -> str:
    """``[#####---------------] 3/12``: the runs finished so far."""
    filled = round(width * done / total) if total else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


def _summary(run_dir: Path | None) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text()) if run_dir else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample sd; the sd None (not known) from one value: 0.0 read as 'no spread'."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def table(sweep: Sweep, *, baseline: str | None = None) -> dict[str, Any]:
    """The sweep's table from its runs' ``summary.json`` files (finished runs only).

    ``baseline`` is a cell's label (``"strategy=fedavg"``; the first cell by default):
    each other cell's ``paired`` figures are its runs' minus the baseline's of the same
    seed, mean and sample sd over the seeds both have (and, for the figures to target,
    that both reached).
    """
    cells: dict[str, dict[str, Any]] = {}
    for run in sweep.runs:
        label = cell_label(run.cell)
        entry = cells.setdefault(label, {"cell": run.cell, "runs": {}})
        summary = _summary(run.run_dir())
        if summary.get("status") == "completed":
            entry["runs"][run.seed] = {"run_dir": str(run.run_dir()), **{f: summary.get(f) for f in FIGURES}}
    labels = list(cells)
    if not labels:
        raise SweepError("the sweep has no cells")
    base_label = labels[0] if baseline is None else baseline
    if base_label not in cells:
        raise SweepError(f"baseline {baseline!r} is not a cell; the cells: {'; '.join(labels)}")
    rows = []
    for label, entry in cells.items():
        runs = entry["runs"]
        row: dict[str, Any] = {"cell": label, **{k: v for k, v in entry["cell"].items()}, "seeds": sorted(runs)}
        for f in FIGURES:
            values = [r[f] for r in runs.values() if r[f] is not None]
            row[f] = dict(zip(("mean", "sd"), _mean_sd(values))) | {"n": len(values)}
        if label != base_label:
            base_runs = cells[base_label]["runs"]
            row["paired"] = {}
            for f in FIGURES:
                diffs = [runs[s][f] - base_runs[s][f] for s in sorted(set(runs) & set(base_runs))
                         if runs[s][f] is not None and base_runs[s][f] is not None]
                row["paired"][f] = dict(zip(("mean", "sd"), _mean_sd(diffs))) | {"n": len(diffs)}
        rows.append(row)
    return {"spec": json.loads(json.dumps(sweep.spec())), "baseline": base_label, "figures": list(FIGURES),
            "cells": rows, "runs": {label: {str(s): r for s, r in e["runs"].items()} for label, e in cells.items()}}


def _fmt(stat: Mapping[str, Any] | None, digits: int = 4) -> str:
    if not stat or stat.get("mean") is None:
        return ""
    mean, sd = stat["mean"], stat["sd"]
    if sd is None:  # one value: its spread is not known
        return (f"{mean:.4g}" if abs(mean) >= 1000 else f"{mean:.{digits}f}") + " (n=1)"
    if abs(mean) >= 1000:
        return f"{mean:.4g} ± {sd:.2g}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def _write_csv(path: Path, result: Mapping[str, Any]) -> None:
    spec = result["spec"]
    keys = list(dict.fromkeys(k for c in spec["cells"] for k in c)) if "cells" in spec else list(spec["grid"])
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        header = ["cell", *keys, "seeds"]
        for fig in FIGURES:
            header += [f"{fig}_mean", f"{fig}_sd", f"{fig}_n"]
        for fig in FIGURES:
            header += [f"paired_{fig}_mean", f"paired_{fig}_sd", f"paired_{fig}_n"]
        w.writerow(header)
        for row in result["cells"]:
            line = [row["cell"], *[row.get(k, "") for k in keys], " ".join(map(str, row["seeds"]))]
            for fig in FIGURES:
                line += [row[fig]["mean"], row[fig]["sd"], row[fig]["n"]]
            for fig in FIGURES:
                p = row.get("paired", {}).get(fig)
                line += [p["mean"], p["sd"], p["n"]] if p else ["", "", ""]
            w.writerow(["" if v is None else v for v in line])


def format_table(result: Mapping[str, Any]) -> str:
    """The table as text: final accuracy, figures to target, and the paired difference in
    final accuracy from the baseline, per cell."""
    lines = [f"| cell | seeds | final accuracy | Δ vs {result['baseline']} (paired) | reached target | "
             "rounds to target | sim s to target | uplink bytes to target |", "|---|---:|---|---|---:|---|---|---|"]
    for row in result["cells"]:
        paired = row.get("paired", {}).get("final_accuracy")
        lines.append(
            f"| {row['cell']} | {len(row['seeds'])} | {_fmt(row['final_accuracy'])} | "
            f"{_fmt(paired) if paired else '(baseline)'} | {row['rounds_to_target']['n']}/{len(row['seeds'])} | "
            f"{_fmt(row['rounds_to_target'], 1)} | {_fmt(row['sim_s_to_target'], 1)} | "
            f"{_fmt(row['bytes_up_to_target'], 0)} |")
    return "\n".join(lines)

