"""The measurement spine: every run writes ``<results-dir>/<run-id>/``.

- ``config.json``: the resolved run config, the versions of fededge, flwr, torch and
  Python, and the device used.
- ``metrics.jsonl``: one JSON object per round (round 0 is the initial model), with
  ``round, accuracy, loss, bytes_up, bytes_down, wall_s, sim_s, num_clients`` and a few
  more (``failures``, ``round_sim_s``, cumulative bytes).
- ``summary.json``: final accuracy; rounds, ``wall_s``, ``sim_s`` and uplink bytes to
  ``target-accuracy`` (null if never reached); total bytes up and down.

``bytes_*`` are per round; ``wall_s`` and ``sim_s`` are cumulative since the run began.
This module is pure (no Flower): the ServerApp feeds it numbers.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from fededge.results_config import PROGRESS_MODES, ResultsConfig
from fededge.tracking.base import Sinks

__all__ = ["PROGRESS_MODES", "ResultsConfig", "RoundRecord", "RunRecorder", "METRIC_FIELDS", "new_run_id",
           "versions"]

# ResultsConfig and PROGRESS_MODES live in fededge.results_config (the run config reads
# them there, without importing the server side); named here for existing imports.


#: Fields every line of metrics.jsonl carries.
METRIC_FIELDS = (
    "round", "accuracy", "loss", "bytes_up", "bytes_down", "wall_s", "sim_s", "num_clients",
)


def versions() -> dict[str, str]:
    """Versions of what produced a result."""
    import numpy
    import torch

    import fededge

    try:
        import flwr

        flwr_version = flwr.__version__
    except Exception:  # noqa: BLE001 - results can be read without Flower installed
        flwr_version = "not installed"
    return {
        "fededge": fededge.__version__,
        "flwr": flwr_version,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def new_run_id(prefix: str = "", suffix: str | int | None = None) -> str:
    """A sortable, human-readable run id: ``[prefix-]YYYYmmdd-HHMMSS-<suffix or pid>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rid = f"{stamp}-{suffix if suffix is not None else os.getpid()}"
    return f"{prefix}-{rid}" if prefix else rid


@dataclass(frozen=True)
class RoundRecord:
    """One line of metrics.jsonl."""

    round: int
    accuracy: Optional[float]  # None: not evaluated this round (evaluate-every)
    loss: Optional[float]
    bytes_up: int
    bytes_down: int
    wall_s: float
    sim_s: float
    num_clients: int
    failures: int = 0
    round_sim_s: float = 0.0
    cum_bytes_up: int = 0
    cum_bytes_down: int = 0
    rejected: int = 0  # client updates that did not decode and were left out
    mismatched: int = 0  # of the rejected: in another codec than the server expects
    compression_ratio: Optional[float] = None  # float32 bytes of the update / payload bytes
    # Strategy-specific figures (DGA: dga_delay, staleness, wait_s, ...), written flat.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> "RoundRecord":
        """The record of one metrics.jsonl line (:meth:`to_json`'s inverse)."""
        names = set(cls.__dataclass_fields__) - {"extra"}
        return cls(**{k: v for k, v in line.items() if k in names},
                   extra={k: v for k, v in line.items() if k not in names})


class RunRecorder:
    """Writes a run's directory as the run goes, so a crashed run keeps its rounds.

    Parameters
    ----------
    results_dir : path
        Parent directory; the run writes ``results_dir/run_id/``.
    run_id : str
        Directory name. An existing directory is refused rather than overwritten.
    config : dict
        The resolved run config (kebab-case keys).
    target_accuracy : float
        Threshold for the "to target" figures of summary.json.
    extra : dict, optional
        Merged into config.json (device, number of clients, runtime...).
    sinks : Sinks, optional
        Where every round also goes (:mod:`fededge.tracking`: TensorBoard, MLflow, W&B):
        opened once config.json is written, given each metrics.jsonl line as it is
        written, and the summary and the run's files at :meth:`close`.
    """

    def __init__(
        self,
        results_dir: str | os.PathLike[str],
        run_id: str,
        config: dict[str, Any],
        *,
        target_accuracy: float,
        extra: Optional[dict[str, Any]] = None,
        sinks: Optional[Sinks] = None,
    ) -> None:
        # Never overwrite a run: two runs started in the same second get -2, -3, ...
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        base, n = run_id, 1
        while True:
            try:
                (Path(results_dir) / run_id).mkdir()
                break
            except FileExistsError:
                n += 1
                run_id = f"{base}-{n}"
        self.run_id = run_id
        self.run_dir = Path(results_dir) / run_id
        self.target_accuracy = target_accuracy
        self.records: list[RoundRecord] = []
        self._cum_up = 0
        self._cum_down = 0
        self._sim_s = 0.0
        self._t0 = time.perf_counter()
        meta = {"run_id": run_id, "config": config, "versions": versions(), **(extra or {})}
        (self.run_dir / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        self._metrics: TextIO = open(self.run_dir / "metrics.jsonl", "w", encoding="utf-8")
        # A run killed from outside (SIGKILL, flwr stop) still leaves a summary that says
        # it never finished.
        self._write_summary(self.summary() | {"status": "running"})
        self.sinks = sinks or Sinks()
        self.sinks.open(self.run_dir, run_id, config)

    @classmethod
    def reopen(cls, run_dir: str | os.PathLike[str], state: dict[str, Any], *,
               target_accuracy: float, sinks: Optional[Sinks] = None) -> "RunRecorder":
        """Continue an existing run directory from a checkpoint's :meth:`state_dict`.

        metrics.jsonl keeps its lines up to the checkpoint's round and loses those after
        it (written before the run died, they are recorded again as the resumed run
        makes them, so no round is duplicated and none is missing); a line cut short by
        the kill is dropped. The file is rewritten atomically, then appended to. The
        ``sinks`` continue their own runs from the checkpoint's round (each says how).
        """
        self = cls.__new__(cls)
        self.run_dir = Path(run_dir)
        self.run_id = self.run_dir.name
        self.target_accuracy = target_accuracy
        upto = int(state["round"])
        kept: list[str] = []
        path = self.run_dir / "metrics.jsonl"
        for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # the kill cut this line short: nothing after it was written whole
            if int(rec["round"]) <= upto:
                kept.append(line)
        self.records = [RoundRecord.from_json(json.loads(x)) for x in kept]
        if [r.round for r in self.records][-1:] != [upto]:
            raise ValueError(f"{path} lacks round {upto}, the checkpoint's: the run directory is not the one "
                             "the checkpoint was written in")
        tmp = self.run_dir / "metrics.jsonl.tmp"
        tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
        tmp.replace(path)
        self._cum_up, self._cum_down, self._sim_s = int(state["cum_up"]), int(state["cum_down"]), float(state["sim_s"])
        self._t0 = time.perf_counter() - float(state["wall_s"])  # wall_s goes on from where it was
        self._metrics = open(path, "a", encoding="utf-8")
        self._write_summary(self.summary() | {"status": "running"})
        self.sinks = sinks or Sinks()
        if self.sinks:
            config = json.loads((self.run_dir / "config.json").read_text()).get("config", {})
            self.sinks.open(self.run_dir, self.run_id, config, resume_after=upto,
                            kept=[json.loads(x) for x in kept])
        return self

    def state_dict(self) -> dict[str, Any]:
        """The counters a resumed run continues from (:meth:`reopen`)."""
        last = self.records[-1] if self.records else None
        return {"round": last.round if last else -1, "cum_up": self._cum_up, "cum_down": self._cum_down,
                "sim_s": self._sim_s, "wall_s": last.wall_s if last else 0.0}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def record_round(
        self,
        rnd: int,
        *,
        accuracy: float | None,
        loss: float | None,
        bytes_up: int,
        bytes_down: int,
        round_sim_s: float,
        num_clients: int,
        failures: int = 0,
        rejected: int = 0,
        compression_ratio: float | None = None,
        extra: dict[str, Any] | None = None,
        mismatched: int = 0,
    ) -> RoundRecord:
        """Append one round; ``round_sim_s`` is that round's simulated duration;
        ``mismatched``, of the ``rejected``, the updates refused for their codec;
        ``accuracy`` and ``loss`` None for a round the server did not evaluate."""
        self._cum_up += bytes_up
        self._cum_down += bytes_down
        self._sim_s += round_sim_s
        rec = RoundRecord(
            round=rnd, accuracy=accuracy, loss=loss, bytes_up=bytes_up, bytes_down=bytes_down,
            wall_s=round(self.elapsed, 6), sim_s=round(self._sim_s, 6), num_clients=num_clients,
            failures=failures, round_sim_s=round(round_sim_s, 6), rejected=rejected, mismatched=mismatched,
            compression_ratio=None if compression_ratio is None else round(compression_ratio, 4),
            cum_bytes_up=self._cum_up, cum_bytes_down=self._cum_down, extra=dict(extra or {}),
        )
        self.records.append(rec)
        line = rec.to_json()
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()
        self.sinks.log_round(line)
        return rec

    def summary(self) -> dict[str, Any]:
        """The figures of summary.json, computed from the recorded rounds."""
        recs = self.records
        evaluated = [r for r in recs if r.accuracy is not None]
        hit = next((r for r in evaluated if r.accuracy >= self.target_accuracy), None)
        last = recs[-1] if recs else None
        final = evaluated[-1] if evaluated else None  # the last round is always evaluated
        return {
            "run_id": self.run_id,
            "rounds": last.round if last else 0,
            "final_accuracy": final.accuracy if final else None,
            "final_loss": final.loss if final else None,
            "best_accuracy": max((r.accuracy for r in evaluated), default=None),
            "target_accuracy": self.target_accuracy,
            "rounds_to_target": hit.round if hit else None,
            "wall_s_to_target": hit.wall_s if hit else None,
            "sim_s_to_target": hit.sim_s if hit else None,
            "bytes_up_to_target": hit.cum_bytes_up if hit else None,
            "total_bytes_up": self._cum_up,
            "total_bytes_down": self._cum_down,
            "total_failures": sum(r.failures for r in recs),
            "total_rejected": sum(r.rejected for r in recs),
            "total_mismatched": sum(r.mismatched for r in recs),
            "wall_s": last.wall_s if last else 0.0,
            "sim_s": last.sim_s if last else 0.0,
        }

    def close(self, *, status: str = "completed", error: str | None = None,
              extra: dict[str, Any] | None = None, artifacts: tuple[Path, ...] = ()) -> dict[str, Any]:
        """Write summary.json (with ``extra`` figures), close metrics.jsonl, and hand the
        sinks the summary, the run's files and ``artifacts`` (a plot). Safe to call twice."""
        summ = self.summary() | dict(extra or {}) | {"status": status}
        if error:
            summ["error"] = error
        first = not self._metrics.closed
        if first:
            self._metrics.close()
        self._write_summary(summ)
        if first and self.sinks:
            files = tuple(self.run_dir / f for f in ("summary.json", "config.json", "metrics.jsonl"))
            self.sinks.close(summ, status=status, artifacts=files + tuple(artifacts))
        return summ

    def _write_summary(self, summ: dict[str, Any]) -> None:
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summ, indent=2) + "\n")
        tmp.replace(self.run_dir / "summary.json")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"  # pragma: no cover


class Progress:
    """Round-by-round progress the way terminal tools show it.

    On a terminal: one live bar (rich) with round, accuracy, uplink bytes and elapsed
    time. Elsewhere (a log, ``flwr run --stream``): one plain line per round.
    """

    def __init__(self, mode: str, total_rounds: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = total_rounds
        self._bar = None
        if mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeElapsedColumn

            self._bar = RichProgress(
                TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
                TextColumn("acc {task.fields[acc]}  up {task.fields[up]}  sim {task.fields[sim]}"),
                TimeElapsedColumn(), console=Console(file=self.stream), transient=False,
            )
            self._task = self._bar.add_task("train", total=total_rounds, acc="-", up="0 B", sim="0.0s")
            self._bar.start()

    def note(self, text: str) -> None:
        """A line of its own (run start, results directory, final summary)."""
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.console.print(f"[fededge] {text}")
        else:
            print(f"[fededge] {text}", file=self.stream, flush=True)

    def update(self, rec: RoundRecord) -> None:
        if self.mode == "off":
            return
        if rec.accuracy is None:
            acc, loss = "-", "-"  # not evaluated this round
        else:
            acc, loss = f"{rec.accuracy:.4f}", f"{rec.loss:.4f}"
        up, sim = human_bytes(rec.cum_bytes_up), f"{rec.sim_s:.1f}s"
        if self._bar is not None:  # a round not evaluated keeps the last accuracy shown
            self._bar.update(self._task, completed=rec.round, up=up, sim=sim,
                             **({} if rec.accuracy is None else {"acc": acc}))
            return
        print(
            f"[fededge] round {rec.round:>4}/{self.total}  acc {acc}  loss {loss}  "
            f"up {up}  down {human_bytes(rec.cum_bytes_down)}  clients {rec.num_clients}  "
            f"sim {sim}  wall {rec.wall_s:.1f}s",
            file=self.stream, flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
