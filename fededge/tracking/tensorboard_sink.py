"""TensorBoard: event files in ``<run dir>/tensorboard/`` (``tensorboard --logdir results``
shows every run under its run id).

Each ``metrics.jsonl`` figure is a scalar of its own name, the round its step; the run
config goes to the HParams dashboard (its metric: ``accuracy``) and as a text table;
``summary.json`` as text at the end, and the run's plot as an image. A resumed run
opens the same directory with ``purge_step`` = the checkpoint's round + 1: TensorBoard
then hides what the run logged after its checkpoint before it died, so the rounds it
redoes appear once, with the values ``metrics.jsonl`` keeps. Scalars are float32, the
only kind TensorBoard's data server (its default, ``--load_fast``) shows: the values are
``metrics.jsonl``'s rounded to float32 (7 significant digits; byte counts above 2^24
lose their last digits), and ``metrics.jsonl`` keeps them exactly. Written with ``torch.utils.tensorboard`` (the extra ``tensorboard`` provides
the writer's protobufs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fededge.tracking.base import MetricSink, flat_config, numeric_items

__all__ = ["TensorBoardSink"]


class TensorBoardSink(MetricSink):
    """Scalars, hyperparameters and the summary of a run as TensorBoard event files.

    Parameters
    ----------
    log_dir : path, optional
        Where the event files go (default: ``<run dir>/tensorboard``).
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._writer: Any = None

    def open(self, run_dir: Path, run_id: str, config: Mapping[str, Any], *,
             resume_after: int | None = None, kept: Sequence[Mapping[str, Any]] = ()) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir or Path(run_dir) / "tensorboard"
        seen = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        if resume_after is not None and seen:
            self._writer = SummaryWriter(str(log_dir), purge_step=resume_after + 1)
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._writer = SummaryWriter(str(log_dir))
        # A session start, so that TensorBoard reads the resumed run's (purge_step) as a
        # restart and hides what was logged after the checkpoint (it treats only the
        # second START it sees as one).
        self._writer.file_writer.add_event(Event(step=0, session_log=SessionLog(status=SessionLog.START)))
        self._hparams(config)
        for line in kept:  # a sink added on resume: the rounds before the checkpoint first
            self.log_round(line)

    def _hparams(self, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: ("" if v is None else v) for k, v in flat_config(config).items()}
        experiment, start, _ = hparams(flat, {"accuracy": 0.0})
        self._writer.file_writer.add_summary(experiment)
        self._writer.file_writer.add_summary(start)
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(flat.items()))
        self._writer.add_text("run_config", "| key | value |\n|---|---|\n" + table, 0)

    def log_round(self, line: Mapping[str, Any]) -> None:
        step = int(line["round"])
        for key, value in numeric_items(line).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self, summary: Mapping[str, Any], *, status: str, artifacts: Sequence[Path] = ()) -> None:
        step = int(summary.get("rounds") or 0)
        self._writer.add_text("status", status, step)
        self._writer.add_text("summary", "```\n" + json.dumps(dict(summary), indent=2) + "\n```", step)
        for path in artifacts:
            if Path(path).suffix == ".png":
                import matplotlib.image

                image = matplotlib.image.imread(str(path))[..., :3]
                self._writer.add_image(Path(path).stem, image, step, dataformats="HWC")
        self._writer.close()
