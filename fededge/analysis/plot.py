"""Compare finished runs: accuracy against rounds, simulated time and uplink bytes.

Each run directory holds ``config.json`` (``{"run_id": ..., "config": {...}}``) and
``metrics.jsonl``, one JSON object per evaluated round with at least ``round``,
``accuracy``, ``loss``, ``bytes_up``, ``bytes_down`` (this round), ``wall_s``, ``sim_s``
(cumulative seconds) and ``num_clients``. :func:`load_run` reads and checks one directory;
:func:`plot_runs` draws several side by side in one image, three panels:

1. accuracy per round: sample efficiency, what FedAvg papers usually plot;
2. accuracy against simulated seconds: what a slow or lossy network costs;
3. accuracy against cumulative uplink bytes (log scale): what compression buys.

The figure is drawn with :class:`matplotlib.figure.Figure` and saved directly, so no
pyplot state is created and the caller's matplotlib backend is left alone.

Examples
--------
>>> from fededge.analysis.plot import load_run, plot_runs      # doctest: +SKIP
>>> run = load_run("results/fedavg-digits-0")                 # doctest: +SKIP
>>> run.cum_bytes_up[-1]                                      # doctest: +SKIP
>>> plot_runs(["results/a", "results/b"], "compare.png")      # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

__all__ = ["RunData", "load_run", "plot_runs", "plot_sweep", "CONFIG_FILE", "METRICS_FILE"]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"

# key -> kind; "count" values must be non-negative integers.
_REQUIRED: dict[str, str] = {
    "round": "count",
    "accuracy": "accuracy",
    "loss": "number",
    "bytes_up": "count",
    "bytes_down": "count",
    "wall_s": "seconds",
    "sim_s": "seconds",
    "num_clients": "count",
}

_BYTE_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))
_LINESTYLES = ("-", "--", ":", "-.")
# A legend that names more than this many differing config keys is worse than a dir name.
_MAX_LABEL_KEYS = 3


@dataclass(frozen=True, eq=False)
class RunData:
    """One run's metrics as numpy arrays, one entry per line of ``metrics.jsonl``.

    Attributes
    ----------
    run_dir : Path
        The directory the run was read from.
    label : str
        Short legend label: ``"strategy/dataset"`` from the run config when both keys are
        there, else the ``run_id``, else the directory name. :func:`plot_runs` extends it
        when several runs would share a label.
    run_id : str or None
        ``run_id`` from ``config.json``; None when the file has none.
    config : Mapping[str, Any]
        The resolved run config (kebab-case keys), ``{}`` when ``config.json`` is absent.
    rounds : numpy.ndarray of int64
        Round numbers, strictly increasing; round 0 is the initial evaluation if logged.
    accuracy, loss : numpy.ndarray of float64
        Evaluation accuracy in [0, 1] and loss; NaN for a round not evaluated
        (``null`` in metrics.jsonl: ``evaluate-every``).
    wall_s, sim_s : numpy.ndarray of float64
        Cumulative wall-clock and simulated seconds since the start of the run.
    bytes_up, bytes_down : numpy.ndarray of int64
        Bytes sent to and from the server in each round.
    cum_bytes_up, cum_bytes_down : numpy.ndarray of int64
        Running totals of ``bytes_up`` and ``bytes_down`` up to and including each round.
    num_clients : numpy.ndarray of int64
        Clients that took part in each round.
    """

    run_dir: Path
    label: str
    run_id: str | None
    config: Mapping[str, Any] = field(repr=False)
    rounds: np.ndarray = field(repr=False)
    accuracy: np.ndarray = field(repr=False)
    loss: np.ndarray = field(repr=False)
    wall_s: np.ndarray = field(repr=False)
    sim_s: np.ndarray = field(repr=False)
    bytes_up: np.ndarray = field(repr=False)
    bytes_down: np.ndarray = field(repr=False)
    cum_bytes_up: np.ndarray = field(repr=False)
    cum_bytes_down: np.ndarray = field(repr=False)
    num_clients: np.ndarray = field(repr=False)


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_value(path: Path, lineno: int, key: str, kind: str, value: object) -> None:
    where = f"{path}, line {lineno}"
    number = float(value) if _is_number(value) else None  # type: ignore[arg-type]
    if kind == "count":
        # Writers may emit 1024.0 for a byte count; a fractional byte is a bug upstream.
        if number is None or not math.isfinite(number) or number < 0 or not number.is_integer():
            raise ValueError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    elif kind == "accuracy":
        if number is None or not (math.isnan(number) or 0.0 <= number <= 1.0):
            raise ValueError(
                f"{where}: 'accuracy' must be a fraction in [0, 1] (not a percentage), "
                f"got {value!r}"
            )
    elif kind == "seconds":
        if number is None or not number >= 0:  # "not >=" also rejects NaN
            raise ValueError(f"{where}: {key!r} must be a number of seconds >= 0, got {value!r}")
    elif number is None:
        raise ValueError(f"{where}: {key!r} must be a number, got {value!r}")


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    prev_round: tuple[int, int] | None = None  # (round, line)
    with path.open(encoding="utf-8") as fh:
        text = fh.read()
    lines = text.splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                # The last line cut short by a kill (a resume drops it too): the rounds before
                # it are drawn.
                log.warning("%s, line %d: an unfinished last line (the run was killed while writing "
                            "it?): left out", path, lineno)
                break
            raise ValueError(
                f"{path}, line {lineno}: malformed JSON ({exc.msg} at column "
                f"{exc.colno}); each line must be one JSON object"
            ) from exc
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}, line {lineno}: expected a JSON object, got "
                f"{type(row).__name__}"
            )
        missing = [k for k in _REQUIRED if k not in row]
        if missing:
            raise ValueError(
                f"{path}, line {lineno}: missing key(s) {', '.join(map(repr, missing))}; "
                f"every line needs {', '.join(_REQUIRED)}"
            )
        unevaluated = row["accuracy"] is None and row["loss"] is None  # evaluate-every: NaN
        for key, kind in _REQUIRED.items():
            if not (unevaluated and key in ("accuracy", "loss")):
                _check_value(path, lineno, key, kind, row[key])
        rnd = int(row["round"])
        if prev_round is not None and rnd <= prev_round[0]:
            raise ValueError(
                f"{path}, line {lineno}: round {rnd} does not follow round "
                f"{prev_round[0]} (line {prev_round[1]}); rounds must increase, so a "
                "resumed run should not append repeated rounds"
            )
        prev_round = (rnd, lineno)
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no rounds to plot")
    return rows


def _read_config(run_dir: Path) -> tuple[str | None, dict[str, Any]]:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        # A run killed before writing its config can still be plotted; it is named by dir.
        return None, {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: malformed JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    run_id = doc.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise ValueError(f"{path}: 'run_id' must be a string, got {run_id!r}")
    config = doc.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"{path}: 'config' must be a JSON object, got {config!r}")
    return run_id, config


def _base_label(run_dir: Path, run_id: str | None, config: Mapping[str, Any]) -> str:
    strategy, dataset = config.get("strategy"), config.get("dataset")
    if strategy is not None and dataset is not None:
        return f"{strategy}/{dataset}"
    return run_id or run_dir.name


def load_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Read and check one run directory.

    Parameters
    ----------
    run_dir : str or os.PathLike
        Directory holding ``metrics.jsonl`` and normally ``config.json`` (optional: when
        absent the run is labelled by its directory name). Blank lines in
        ``metrics.jsonl`` are skipped; extra keys on a line are allowed and not read.

    Returns
    -------
    RunData

    Raises
    ------
    FileNotFoundError
        ``run_dir`` does not exist or is not a directory, or it has no ``metrics.jsonl``.
    ValueError
        ``metrics.jsonl`` is empty, or a line is not a JSON object, lacks a required key,
        holds a value of the wrong kind, or does not increase the round number; the
        message names the file and line. Also for a malformed ``config.json``.

    Examples
    --------
    >>> run = load_run("results/fedavg-digits")                # doctest: +SKIP
    >>> run.rounds, run.cum_bytes_up                            # doctest: +SKIP
    """
    path = Path(run_dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"run directory {path} {what}; pass the directory of one run")
    metrics_path = path / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"{path} has no {METRICS_FILE}; is it a run directory, and did the run finish "
            "at least one evaluation?"
        )
    run_id, config = _read_config(path)
    rows = _read_metrics(metrics_path)

    def column(key: str, dtype: type) -> np.ndarray:
        return np.asarray([np.nan if row[key] is None else row[key] for row in rows], dtype=dtype)

    bytes_up = column("bytes_up", np.int64)
    bytes_down = column("bytes_down", np.int64)
    return RunData(
        run_dir=path,
        label=_base_label(path, run_id, config),
        run_id=run_id,
        config=config,
        rounds=column("round", np.int64),
        accuracy=column("accuracy", np.float64),
        loss=column("loss", np.float64),
        wall_s=column("wall_s", np.float64),
        sim_s=column("sim_s", np.float64),
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        cum_bytes_up=np.cumsum(bytes_up),
        cum_bytes_down=np.cumsum(bytes_down),
        num_clients=column("num_clients", np.int64),
    )


# ---------------------------------------------------------------------------
# Plotting
# ---------------------------------------------------------------------------


def _disambiguate(runs: Sequence[RunData]) -> list[str]:
    """Default legend labels, extended where two runs would share one.

    Runs sharing a base label get the config keys whose values differ among them
    (``fedavg/digits (local-steps=5)``) when there are at most three such keys, otherwise
    their directory names. Any label still repeated (the same directory twice) gets
    ``#n``.
    """
    labels = [r.label for r in runs]
    for base in set(labels):
        group = [i for i, r in enumerate(runs) if r.label == base]
        if len(group) < 2:
            continue
        keys = sorted(set().union(*(runs[i].config.keys() for i in group)))
        differing = [
            k for k in keys
            if len({json.dumps(runs[i].config.get(k), sort_keys=True) for i in group}) > 1
        ]
        for i in group:
            if 0 < len(differing) <= _MAX_LABEL_KEYS:
                extra = ", ".join(f"{k}={runs[i].config.get(k)}" for k in differing)
            else:
                extra = runs[i].run_dir.name
            labels[i] = f"{base} ({extra})"
    counts = {label: labels.count(label) for label in labels}
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if counts[label] > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[i] = f"{label} #{seen[label]}"
    return labels


def _byte_unit(max_bytes: float) -> tuple[str, float]:
    for unit, factor in _BYTE_UNITS:
        if max_bytes >= factor:
            return unit, factor
    return "B", 1.0


def plot_runs(
    run_dirs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Draw several runs in one image: accuracy vs round, simulated time and uplink bytes.

    Parameters
    ----------
    run_dirs : sequence of str or os.PathLike
        Run directories, each read with :func:`load_run`. One line per run, the same
        colour in all three panels.
    out : str or os.PathLike
        Image file to write; the format follows the suffix (PNG at 150 dpi by default,
        e.g. ``compare.png``). Missing parent directories are created.
    labels : sequence of str, optional
        Legend labels, one per run. By default ``"strategy/dataset"`` from each run's
        config, extended by the config keys that tell runs apart (or the directory name)
        when two would otherwise match.
    title : str, optional
        Title over the three panels.

    Returns
    -------
    pathlib.Path
        ``out``.

    Raises
    ------
    ValueError
        No run directories, ``labels`` of the wrong length, or a run that fails to load
        (see :func:`load_run`).
    FileNotFoundError
        A run directory or its ``metrics.jsonl`` is missing.

    Notes
    -----
    The bytes panel plots cumulative ``bytes_up`` on a log axis in decimal units (kB, MB,
    GB: 10^3, 10^6, 10^9 bytes), picked from the largest total; points with zero bytes
    so far (the initial evaluation) cannot sit on a log axis and are left out of that
    panel only.

    Examples
    --------
    >>> plot_runs(["results/fedavg", "results/qsgd"], "compare.png",
    ...           title="digits, 10 clients")                   # doctest: +SKIP
    PosixPath('compare.png')
    """
    if isinstance(run_dirs, (str, bytes, os.PathLike)):
        raise ValueError(
            "run_dirs must be a sequence of run directories, e.g. [run_dir]; got a single "
            f"path {run_dirs!r}"
        )
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ValueError("run_dirs is empty: pass at least one run directory")
    if labels is not None:
        labels = list(labels)
        if len(labels) != len(run_dirs):
            raise ValueError(
                f"labels must have one entry per run directory: got {len(labels)} labels "
                f"for {len(run_dirs)} runs"
            )
    runs = [load_run(d) for d in run_dirs]
    if labels is None:
        labels = _disambiguate(runs)

    max_bytes = max(float(r.cum_bytes_up[-1]) for r in runs)
    unit, factor = _byte_unit(max_bytes)

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    ax_round, ax_time, ax_bytes = fig.subplots(1, 3, sharey=True)
    handles = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        style = {
            "color": f"C{i % 10}",
            "linestyle": _LINESTYLES[(i // 10) % len(_LINESTYLES)],
            "marker": "o" if len(run.rounds) <= 40 else None,
            "markersize": 3,
            "linewidth": 1.5,
            "label": label,
        }
        # Only the evaluated rounds: NaN rounds (evaluate-every) would break the line.
        seen = ~np.isnan(run.accuracy)
        handles.extend(ax_round.plot(run.rounds[seen], run.accuracy[seen], **style))
        ax_time.plot(run.sim_s[seen], run.accuracy[seen], **style)
        sent = seen & (run.cum_bytes_up > 0)
        ax_bytes.plot(run.cum_bytes_up[sent] / factor, run.accuracy[sent], **style)

    ax_round.set_xlabel("round")
    ax_round.set_title("accuracy per round")
    ax_round.set_ylabel("accuracy")
    ax_time.set_xlabel("simulated time (s)")
    ax_time.set_title("accuracy vs simulated time")
    ax_bytes.set_xlabel(f"cumulative uplink ({unit})")
    ax_bytes.set_title("accuracy vs uplink bytes")
    if max_bytes > 0:
        ax_bytes.set_xscale("log")
        # "0.1, 1, 10" reads faster than "10^-1, 10^0, 10^1" next to a unit label.
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax_bytes.xaxis.set_major_formatter(plain)
        ax_bytes.xaxis.set_minor_formatter(plain)
    for ax in (ax_round, ax_time, ax_bytes):
        ax.grid(True, which="major", alpha=0.3)
    if title:
        fig.suptitle(title)

    # Explicit handles and labels: get_legend_handles_labels() drops labels starting "_".
    fig.legend(
        handles, labels, loc="outside lower center", ncols=min(len(runs), 4),
        frameon=False,
    )
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=150)
    return out_path


def plot_sweep(sweep_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
               title: str | None = None) -> Path:
    """Draw a sweep (``fededge sweep``'s ``sweep.json``): each cell's final accuracy, mean
    ± sd over its seeds, and its mean accuracy per round with a ± sd band.

    ``out`` defaults to ``<sweep_dir>/sweep.png``. Raises ``FileNotFoundError`` when the
    directory holds no ``sweep.json`` (the sweep has not finished once).
    """
    sweep_dir = Path(sweep_dir)
    table_path = sweep_dir / "sweep.json"
    if not table_path.is_file():
        raise FileNotFoundError(f"{sweep_dir} has no sweep.json: give the --out directory of a fededge sweep "
                                "(it is written when the sweep's runs have ended)")
    result = json.loads(table_path.read_text())
    cells = result["cells"]
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax_bar, ax_round = fig.subplots(1, 2, width_ratios=[1, 1.6])
    # A cell with no completed seed has no bar (drawn at 0 it read as accuracy 0 and pulled
    # the axis down); its name says so.
    names = [row["cell"] + ("" if row["final_accuracy"]["mean"] is not None else "  (no completed run)")
             for row in cells]
    means = [row["final_accuracy"]["mean"] for row in cells]
    sds = [row["final_accuracy"]["sd"] or 0.0 for row in cells]
    drawn = [i for i, m in enumerate(means) if m is not None]
    ax_bar.barh(drawn, [means[i] for i in drawn], xerr=[sds[i] for i in drawn],
                color=[f"C{i % 10}" for i in drawn], capsize=3)
    ax_bar.set_yticks(range(len(cells)), names, fontsize=8)
    ax_bar.set_ylim(len(cells) - 0.5, -0.5)  # (inverted: the first cell on top)
    low = min((means[i] - sds[i] for i in drawn), default=0.0)
    ax_bar.set_xlim(max(0.0, low - 0.05), 1.0)
    ax_bar.set_xlabel("final accuracy (mean ± sd over seeds)")
    ax_bar.set_title(f"baseline: {result['baseline']}", fontsize=9)
    for i, row in enumerate(cells):
        curves = [load_run(d) for d in (r["run_dir"] for r in result["runs"].get(row["cell"], {}).values())]
        if not curves:
            continue
        n = min(len(c.rounds) for c in curves)
        acc = np.vstack([c.accuracy[:n] for c in curves])
        rounds = curves[0].rounds[:n]
        seen = ~np.isnan(acc).any(axis=0)
        mean = acc[:, seen].mean(axis=0)
        sd = acc[:, seen].std(axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        ax_round.plot(rounds[seen], mean, color=f"C{i % 10}", label=f"{row['cell']} (n={len(curves)})")
        ax_round.fill_between(rounds[seen], mean - sd, mean + sd, color=f"C{i % 10}", alpha=0.15)
    ax_round.set_xlabel("round")
    ax_round.set_ylabel("accuracy")
    ax_round.set_title("mean accuracy per round (± sd)")
    ax_round.grid(True, alpha=0.3)
    ax_round.legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    out_path = Path(out) if out is not None else sweep_dir / "sweep.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=150)
    return out_path
