"""MLflow: one MLflow run per fededge run, through ``MlflowClient`` (no global active run,
so a user's own ``mlflow.start_run`` is left alone).

Where: ``tracking_uri`` if given, else ``MLFLOW_TRACKING_URI``, else a local SQLite store
beside the runs, ``sqlite:///<results-dir>/mlflow.db`` (MLflow's recommended local
backend; its file store is in maintenance mode in MLflow 3), with the artifacts in
``<results-dir>/mlruns/``. See it with ``mlflow ui --backend-store-uri
sqlite:///results/mlflow.db``. Creating a new SQLite store takes MLflow about 10 s (its
schema migrations), once per results directory.

What: the run config as parameters (nested keys joined with ``.``), every figure of every
``metrics.jsonl`` line as a metric whose step is the round, ``summary.json``'s figures
as ``summary.*`` metrics, and ``summary.json``, ``config.json``, ``metrics.jsonl`` and
the run's plot as artifacts; the MLflow run ends FINISHED or FAILED with the fededge run.

Resume: the MLflow run's id is kept in ``<run dir>/mlflow.json``, and a resumed run logs
into the same MLflow run. MLflow has no way to remove a metric's points, so the rounds a
resumed run redoes (those after its checkpoint that were logged before it died) are not
logged again: no step appears twice. They hold the values logged the first time, which
equal ``metrics.jsonl``'s, the run being deterministic, except ``wall_s`` (the redone
rounds' wall time is the resumed run's).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fededge.tracking.base import MetricSink, flat_config, numeric_items

__all__ = ["MLflowSink"]

#: MLflow's limits: parameters per log_batch call and a parameter value's length.
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_MAX = 6000
#: A key of every metrics.jsonl line, read back to find the rounds MLflow already has.
_ALWAYS = "bytes_up"


class MLflowSink(MetricSink):
    """A fededge run as an MLflow run.

    Parameters
    ----------
    tracking_uri : str
        The tracking store (``""``: ``MLFLOW_TRACKING_URI``, else a SQLite store in the
        results directory; see the module docstring). A path without a scheme is a
        SQLite file.
    experiment : str
        The MLflow experiment the run goes into (created if missing).
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str = "", experiment: str = "fededge") -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client: Any = None
        self.run_id: str | None = None
        self._skip_through = -1  # rounds MLflow already holds (logged before a crash)

    def _uri(self, run_dir: Path) -> str:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            return f"sqlite:///{(run_dir.parent / 'mlflow.db').resolve()}"
        if "://" not in uri and not uri.startswith(("sqlite:", "databricks", "file:")):
            return f"sqlite:///{Path(uri).resolve()}"
        return uri

    def open(self, run_dir: Path, run_id: str, config: Mapping[str, Any], *,
             resume_after: int | None = None, kept: Sequence[Mapping[str, Any]] = ()) -> None:
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir)
        state_file = run_dir / "mlflow.json"
        if resume_after is not None and state_file.exists():
            state = json.loads(state_file.read_text())
            self._client = MlflowClient(tracking_uri=state["tracking_uri"])
            self.run_id = state["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
            history = self._client.get_metric_history(self.run_id, _ALWAYS)
            self._skip_through = max((m.step for m in history), default=-1)
            for line in kept:  # what MLflow has not got (a sink dropped mid-run before the run died)
                self.log_round(line)
            return
        uri = self._uri(run_dir)
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = None
            if uri.startswith("sqlite:///") and not self.tracking_uri and "MLFLOW_TRACKING_URI" not in os.environ:
                artifacts = (run_dir.parent / "mlruns").resolve().as_uri()
            experiment_id = self._client.create_experiment(self.experiment, artifact_location=artifacts)
        run = self._client.create_run(experiment_id, run_name=run_id, tags={"fededge.run_id": run_id})
        self.run_id = run.info.run_id
        state_file.write_text(json.dumps({"tracking_uri": uri, "experiment_id": experiment_id,
                                          "run_id": self.run_id}, indent=2) + "\n")
        self._log_params(config)
        for line in kept:  # a sink added on resume: the rounds before the checkpoint first
            self.log_round(line)

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:_PARAM_VALUE_MAX]) for k, v in sorted(flat_config(config).items())]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i:i + _PARAMS_PER_BATCH])

    def _log_metrics(self, figures: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def log_round(self, line: Mapping[str, Any]) -> None:
        step = int(line["round"])
        if step <= self._skip_through:
            return  # logged before the run died and was resumed: never twice
        self._log_metrics(numeric_items(line), step)

    def close(self, summary: Mapping[str, Any], *, status: str, artifacts: Sequence[Path] = ()) -> None:
        figures = {f"summary.{k}": v for k, v in numeric_items(summary).items()}
        if figures:
            self._log_metrics(figures, int(summary.get("rounds") or 0))
        for path in artifacts:
            if Path(path).exists():
                self._client.log_artifact(self.run_id, str(path))
        self._client.set_terminated(self.run_id, status="FINISHED" if status == "completed" else "FAILED")
