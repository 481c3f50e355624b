"""What a run writes and where: :class:`ResultsConfig`, the results knobs, declared once.

The run directory, the run's name, the target accuracy, the progress display, the saved
model, checkpoints and evaluation frequency. :class:`fededge.server.experiment.Experiment`
takes it (or its knobs as keywords) and :mod:`fededge.config` builds it from the run
config; it lives apart from :mod:`fededge.server.results` (what is written) so that the
run config reads it without importing the server side.

Pure: no Flower, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fededge.tracking import parse_log_to

__all__ = ["PROGRESS_MODES", "ResultsConfig"]


#: How a run shows its progress (:attr:`ResultsConfig.progress`).
PROGRESS_MODES: tuple[str, ...] = ("auto", "bar", "lines", "off")


@dataclass(frozen=True, kw_only=True)
class ResultsConfig:
    """What a run records and shows. Run-config keys in brackets; declared here once for
    :class:`~fededge.server.experiment.Experiment` and fededge's app.

    Parameters
    ----------
    results_dir : str
        [results-dir] Each run writes ``<results_dir>/<run id>/``. A relative path is
        relative to the ServerApp's working directory: with ``fededge simulate`` and
        ``fededge run`` that is where you ran them; with a plain ``flwr run`` it is
        wherever the detached local SuperLink was first started. The absolute path is
        printed at the start.
    run_name : str
        [run-name] Optional prefix of the run id: letters, digits, ``.``, ``_`` and ``-``.
    target_accuracy : float
        [target-accuracy] Accuracy, in (0, 1], at which ``summary.json`` records rounds,
        ``sim_s``, ``wall_s`` and uplink bytes "to target".
    progress : str
        [progress] ``auto`` (a live bar on a terminal, else one line per round), ``bar``,
        ``lines`` or ``off``.
    save_model : bool
        [save-model] Write the final global model to ``<run dir>/model.pt`` (a torch
        state dict).
    checkpoint_every : int
        [checkpoint-every] Write a checkpoint of the whole run into
        ``<run dir>/checkpoints/`` after every this many rounds (0: never), so that
        ``fededge resume <run dir>`` continues it after a crash or a kill, losing at most
        this many rounds. The first is always written after round 1, so that a run
        killed early resumes too. Atomic, the last two kept. One checkpoint costs about
        4-9 % of a round of the small digits runs in the in-process runtime with
        stateful clients, whose states it holds too, and nothing measurable without
        (BENCHMARKS.md, "A checkpoint after every round as the default?"), so the
        default, every 5 rounds, keeps the cost at 1-2 % there, and lower wherever
        rounds are longer (real devices, real networks, larger local work).
    evaluate_every : int
        [evaluate-every] The server evaluates the global model after every this many
        rounds, and always before round 1 and after the last round (1, the default:
        after every round). The rounds between are recorded with ``accuracy`` and
        ``loss`` null in ``metrics.jsonl``, and ``summary.json``'s figures "to target"
        count evaluated rounds only, so a target is seen at the first evaluation at or
        after the round that reached it. For runs whose evaluation costs more than a
        round: K = 1 runs of a CNN, or a large test set with many small rounds.
    log_to : str
        [log-to] Where every round also goes, comma-separated: ``tensorboard`` (event
        files in ``<run dir>/tensorboard/``), ``mlflow`` (an MLflow run; see
        ``mlflow_uri``), ``wandb`` (a Weights & Biases run, offline by default). ``""``
        (the default): ``metrics.jsonl`` only. Each tool is an extra (``pip install
        'fededge[tensorboard]'``); a missing one stops the run before round 1, naming
        it. See :mod:`fededge.tracking`.
    mlflow_uri : str
        [mlflow-uri] The MLflow tracking store for ``log_to = "mlflow"``: ``""`` (the
        default) is ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<results-dir>/mlflow.db``
        with artifacts in ``<results-dir>/mlruns/``; a server's ``http://...`` works too.
    resume_from : str
        [resume-from] A run directory to continue from its newest intact checkpoint
        instead of starting a new run (``fededge resume`` sets it). The run config must
        match the checkpoint's but for the keys that only change what is recorded or for
        how long (``num-rounds``, ``progress``, ...); a difference that matters is
        refused, naming the key.
    """

    results_dir: str = "results"
    run_name: str = ""
    target_accuracy: float = 0.9
    progress: str = "auto"
    save_model: bool = True
    checkpoint_every: int = 5
    evaluate_every: int = 1
    log_to: str = ""
    mlflow_uri: str = ""
    resume_from: str = ""

    def __post_init__(self) -> None:
        import re

        if not str(self.results_dir):
            raise ValueError("results_dir must not be empty")
        if not re.fullmatch(r"[A-Za-z0-9._-]*", self.run_name):
            raise ValueError(f"run_name may hold only letters, digits, '.', '_' and '-', got {self.run_name!r}")
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an integer >= 0 (rounds; 0: no checkpoints), "
                             f"got {self.checkpoint_every!r}")
        if isinstance(self.evaluate_every, bool) or not isinstance(self.evaluate_every, int) \
                or self.evaluate_every < 1:
            raise ValueError(f"evaluate_every must be an integer >= 1 (rounds; 1: after every round), "
                             f"got {self.evaluate_every!r}")
        parse_log_to(self.log_to)  # an unknown sink is named with the choices
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}")
