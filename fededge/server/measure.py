"""The former home of :class:`~fededge.server.experiment.Experiment` and its names.

``Experiment`` now lives in :mod:`fededge.server.experiment`, a module of its name, and
fededge's own ``run_experiment`` in :mod:`fededge.server.runner`. This module re-exports
the names it used to define, so that a ServerApp written against it still imports, and
says once (a ``DeprecationWarning``) where they went. New code imports them from
:mod:`fededge.api` (the library's one import) or :mod:`fededge.server.experiment`.
"""

from __future__ import annotations

import warnings

from fededge.server.experiment import (
    PROGRESS_MODES, RESUME_MAY_CHANGE, CheckpointError, EvaluateFn, Experiment, ExperimentResult,
    NotEnoughNodesError, ResumeError, RoundFailedError, seeded_sampling, wait_for_nodes,
)

__all__ = [
    "CheckpointError", "EvaluateFn", "Experiment", "RESUME_MAY_CHANGE", "ResumeError", "ExperimentResult",
    "NotEnoughNodesError", "PROGRESS_MODES", "RoundFailedError", "seeded_sampling", "wait_for_nodes",
]

warnings.warn("fededge.server.measure is now fededge.server.experiment (Experiment and its names); "
              "import them from there or from fededge.api", DeprecationWarning, stacklevel=2)
