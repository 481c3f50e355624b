"""Weights & Biases: one W&B run per fededge run, offline by default.

Offline (the default, ``mode="offline"``) W&B writes the run under ``<run dir>/wandb/``
and needs no account and no network: an air-gapped cluster uploads it later with
``wandb sync <run dir>/wandb/offline-run-*``. ``mode="online"`` logs live (with ``wandb
login`` done). The run config is the W&B config, every figure of every ``metrics.jsonl``
line is logged with the round as W&B's step, ``summary.json``'s figures are the run
summary, and ``summary.json``, ``config.json``, ``metrics.jsonl`` and the run's plot are
saved as run files.

Resume: the W&B run id and the last round logged are kept in ``<run dir>/wandb.json``,
and a resumed run continues the same W&B run (``resume="allow"``). W&B keeps a run's
steps increasing and cannot take a step back, so the rounds a resumed run redoes (those
after its checkpoint that were logged before it died) are not logged again: no step
appears twice. They hold the values logged the first time, which equal
``metrics.jsonl``'s, the run being deterministic, except ``wall_s``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fededge.tracking.base import MetricSink, flat_config, numeric_items

__all__ = ["WANDB_MODES", "WandbSink"]

#: W&B's modes this sink takes.
WANDB_MODES = ("offline", "online")


class WandbSink(MetricSink):
    """A fededge run as a Weights & Biases run.

    Parameters
    ----------
    project : str, optional
        The W&B project (default: ``WANDB_PROJECT``, else ``fededge``).
    mode : str, optional
        ``offline`` (files only, synced later) or ``online`` (default: ``WANDB_MODE``,
        else ``offline``).
    entity : str, optional
        The W&B entity (team or user); None: the logged-in user's default.
    """

    name = "wandb"

    def __init__(self, project: str | None = None, mode: str | None = None, entity: str | None = None) -> None:
        project = project or os.environ.get("WANDB_PROJECT") or "fededge"
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        mode = "offline" if mode == "dryrun" else mode  # W&B's older name for offline
        if mode not in WANDB_MODES:
            raise ValueError(f"mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}")
        self.project, self.mode, self.entity = project, mode, entity
        self._run: Any = None
        self._state_file: Path | None = None
        self._state: dict[str, Any] = {}

    def open(self, run_dir: Path, run_id: str, config: Mapping[str, Any], *,
             resume_after: int | None = None, kept: Sequence[Mapping[str, Any]] = ()) -> None:
        import wandb

        run_dir = Path(run_dir)
        self._state_file = run_dir / "wandb.json"
        resumed = resume_after is not None and self._state_file.exists()
        if resumed:
            self._state = json.loads(self._state_file.read_text())
        else:
            self._state = {"id": secrets.token_hex(8), "logged_through": -1}
        self._run = wandb.init(
            project=self.project, entity=self.entity, dir=str(run_dir), id=self._state["id"], name=run_id,
            config=None if resumed else flat_config(config), mode=self.mode, resume="allow",
            reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        self._save_state()
        # The rounds before the checkpoint that W&B has not got (a sink added on resume, or
        # one dropped mid-run, a network blip, before the run died): log_round skips the rest.
        for line in kept:
            self.log_round(line)

    def _save_state(self) -> None:
        assert self._state_file is not None
        tmp = self._state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._state) + "\n")
        tmp.replace(self._state_file)

    def log_round(self, line: Mapping[str, Any]) -> None:
        step = int(line["round"])
        if step <= self._state["logged_through"]:
            return  # logged before the run died and was resumed: never twice
        self._run.log(numeric_items(line), step=step)
        self._state["logged_through"] = step
        self._save_state()

    def close(self, summary: Mapping[str, Any], *, status: str, artifacts: Sequence[Path] = ()) -> None:
        self._run.summary.update({k: v for k, v in summary.items() if v is not None})
        for path in artifacts:
            if Path(path).exists():
                self._run.save(str(path), base_path=str(Path(path).parent), policy="now")
        self._run.finish(exit_code=0 if status == "completed" else 1)
