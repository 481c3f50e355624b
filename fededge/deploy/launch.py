"""Run ``flwr run`` on Flower's local simulation SuperLink from a script, and clean up.

Two traps of ``flwr run`` on the default ``local`` connection (flwr 1.41):

- it starts a detached ``flower-superlink --simulation`` that keeps running after the
  run ends;
- it exits 0 even when the run failed (with or without ``--stream``).

:func:`flwr_run_local` uses a private ``FLWR_HOME``, reads the run's real status with
``flwr ls --format json`` before stopping that SuperLink, and then stops it together with
every process it started (found by the ``FLWR_HOME`` path on their command lines and by
parentage, :func:`fededge.deploy.procs.stop_processes_of`), also when the run fails or
times out. ``fededge simulate``, tests and benchmarks use it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fededge.deploy.procs import (
    DeploymentError, FlwrRun, flower_bin, flower_env, latest_run, list_runs, run_fields, stop_processes_of, stream,
)
from fededge.runconfig_text import format_run_config

__all__ = ["flwr_run_local"]


def flwr_run_local(
    app_dir: str | os.PathLike[str],
    *,
    flwr_home: str | os.PathLike[str],
    run_config: Mapping[str, Any] | None = None,
    num_supernodes: int = 10,
    cpus_per_client: float = 1,
    gpus_per_client: float = 0.0,
    timeout_s: float = 900,
    echo: TextIO | None = None,
) -> FlwrRun:
    """``flwr run APP_DIR --stream`` on a fresh local simulation SuperLink, then stop it.

    ``flwr_home`` should be a new, private directory: everything started under it is
    stopped afterwards. Runtime dependency installation is disabled (it needs the
    network, and would install a CUDA build of torch). With ``echo``, the run's output
    is copied there line by line as it comes.
    """
    home = Path(flwr_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    def num(v: float) -> str:  # Flower wants an int for whole CPUs
        return str(int(v)) if float(v).is_integer() else str(v)

    fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={num(cpus_per_client)} "
           f"client-resources-num-gpus={gpus_per_client}")
    cmd = [flower_bin("flwr"), "run", str(Path(app_dir).resolve()), "--stream", "--federation-config", fed]
    if run_config:
        cmd += ["--run-config", format_run_config(run_config)]
    t0 = time.perf_counter()
    try:
        rc, out = stream(cmd, env=env, timeout_s=timeout_s, echo=echo)
        wall = time.perf_counter() - t0
        try:
            info = latest_run(list_runs(None, env=env)) or {}
        except DeploymentError as err:  # the run's status is then unknown: not ok
            info = {}
            out += f"\n[fededge] {err}"
        status, run_id = run_fields(info)
    finally:
        leftover = stop_processes_of(str(home))
    return FlwrRun(rc, out, status, run_id, wall, leftover, info)
