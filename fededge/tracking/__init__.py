"""Metric sinks: every round of ``metrics.jsonl`` also where researchers look.

A run can send what it records to TensorBoard, MLflow and Weights & Biases as it goes
(run-config key ``log-to = "tensorboard,mlflow"``, or ``Experiment(log_to=...)`` /
``Experiment(sinks=[...])`` in a user's ServerApp):

- every line of ``metrics.jsonl`` (accuracy, loss, bytes up and down, ``sim_s``,
  ``wall_s``, the strategy's own figures, the compression ratio), its round as the step;
- the run config as hyperparameters;
- at the end, ``summary.json``'s figures, and the run's files (``summary.json``,
  ``config.json``, ``metrics.jsonl`` and a plot of the run) where the tool keeps files.

``metrics.jsonl`` stays the source of truth: a sink that fails (a tracking server gone)
is logged once and dropped, and the run goes on. A resumed run continues the same
TensorBoard run, MLflow run or W&B run, with no step twice (each sink says how).

Each tool is an optional extra (``pip install 'fededge[tensorboard]'``, ``[mlflow]``,
``[wandb]``, or ``[tracking]`` for all three). :func:`check_installed` names the missing
one before round 1. This package is pure (no Flower): the tools are imported only when
a sink opens.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable

from fededge.errors import ConfigError
from fededge.tracking.base import MetricSink, Sinks, numeric_items

_log = logging.getLogger(__name__)

__all__ = ["SINK_NAMES", "MetricSink", "MissingExtraError", "Sinks", "check_installed", "make_sinks",
           "numeric_items", "parse_log_to"]

#: The sinks ``log-to`` can name, and (module to import, extra, pip package) for each.
_TOOLS = {
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb", "wandb"),
}
SINK_NAMES: tuple[str, ...] = tuple(_TOOLS)


class MissingExtraError(ConfigError):
    """A sink's tool is not installed; the message names the extra that installs it."""


def parse_log_to(text: str | Iterable[str]) -> tuple[str, ...]:
    """The sink names of ``log-to`` (comma-separated, or a sequence), checked and deduplicated.

    >>> parse_log_to("tensorboard, mlflow")
    ('tensorboard', 'mlflow')
    >>> parse_log_to("")
    ()
    """
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(p.strip().lower() for p in parts if p.strip()))
    unknown = [n for n in names if n not in _TOOLS]
    if unknown:
        raise ValueError(f"log_to names {', '.join(map(repr, unknown))}; the sinks are "
                         f"{', '.join(SINK_NAMES)} (comma-separated, e.g. 'tensorboard,mlflow')")
    return names


def check_installed(names: Iterable[str]) -> None:
    """Raise :class:`MissingExtraError` naming the extra of the first sink whose tool is
    not installed (cheap: nothing is imported)."""
    for name in names:
        module, extra, package = _TOOLS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(
                f"log-to={name!r} needs {package}, which is not installed: pip install 'fededge[{extra}]' "
                f"(or drop {name!r} from log-to)")


def make_sinks(names: Iterable[str], *, mlflow_uri: str = "", mlflow_experiment: str = "fededge",
               wandb_project: str | None = None, wandb_mode: str | None = None) -> list[MetricSink]:
    """The sinks ``names`` asks for, with their settings (see each sink's class; W&B's
    project and mode default to ``WANDB_PROJECT`` and ``WANDB_MODE``, else ``fededge``
    and ``offline``)."""
    out: list[MetricSink] = []
    for name in parse_log_to(list(names)):
        if name == "tensorboard":
            from fededge.tracking.tensorboard_sink import TensorBoardSink

            out.append(TensorBoardSink())
        elif name == "mlflow":
            from fededge.tracking.mlflow_sink import MLflowSink

            out.append(MLflowSink(tracking_uri=mlflow_uri, experiment=mlflow_experiment))
        else:
            from fededge.tracking.wandb_sink import WandbSink

            if (wandb_mode or os.environ.get("WANDB_MODE", "")).strip().lower() == "disabled":
                # W&B's own switch (a common CI setting): no W&B sink, said once, the run goes on
                _log.warning("log-to names wandb but WANDB_MODE=disabled: this run logs nothing to W&B")
                continue
            out.append(WandbSink(project=wandb_project, mode=wandb_mode))
    return out
