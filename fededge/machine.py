"""What of this machine a run may use: its cores, and how many runs share the machine.

- :func:`usable_cores`: the cores this process may run on (its CPU affinity, lowered to
  a cgroup's CPU quota), over the runs that share the machine.
- :func:`runs_sharing`: :data:`RUNS_SHARING_ENV`, how many runs go side by side on this
  machine (``fededge sweep`` sets it for its runs). A run then takes its share of the
  cores (``--workers auto``), of the memory (``client-states=auto``'s cap,
  :class:`~fededge.server.nodestates.AutoStates`) and of its GPU's memory (worker
  processes on one GPU, :func:`~fededge.clients.device.processes_that_fit`; replies kept
  on the GPU, :mod:`fededge.arrays`), not the whole. It changes how many processes run and
  where states and replies are kept, never a result.

Pure: no Flower, no torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from fededge.errors import ConfigError

__all__ = ["RUNS_SHARING_ENV", "cgroup_dirs", "runs_sharing", "usable_cores"]

#: How many runs share this machine at once (unset: 1).
RUNS_SHARING_ENV = "FEDEDGE_RUNS_SHARING"


def runs_sharing(environ: Mapping[str, str] | None = None) -> int:
    """:data:`RUNS_SHARING_ENV` (1 where unset); :class:`~fededge.errors.ConfigError`
    naming it where it is not a whole number >= 1."""
    raw = (os.environ if environ is None else environ).get(RUNS_SHARING_ENV, "").strip()
    if not raw:
        return 1
    n = int(raw) if raw.isascii() and raw.isdigit() else 0
    if n < 1:
        raise ConfigError(f"{RUNS_SHARING_ENV}={raw!r}: the number of runs sharing this machine must be a whole "
                          "number >= 1 (fededge sweep sets it to the runs it starts at once); unset it for a run alone")
    return n


def usable_cores(shared: bool = True) -> int:
    """The cores this process may run on: its CPU affinity (a container's cpuset,
    ``taskset``; ``os.cpu_count()`` where there is none), lowered to a cgroup's CPU quota
    (``docker --cpus``, a Kubernetes CPU limit), rounded up; where runs share the machine
    (``shared`` and :func:`runs_sharing`), this run's share of them. At least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores // (runs_sharing() if shared else 1))


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPUs the cgroups' quotas allow this process (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``): the smallest of its own cgroup's and
    those above it (:func:`cgroup_dirs`: ``systemd-run -p CPUQuota``, a scheduler's job
    cgroup) and the mount's root (a container's own); None where there is no quota."""
    quotas = []
    for d in cgroup_dirs("cpu", root, proc_cgroup):
        try:
            quota, period = Path(d, "cpu.max").read_text().split()[:2]
            if quota != "max" and int(quota) > 0 and int(period) > 0:
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        try:
            quota_us = int(Path(d, "cpu.cfs_quota_us").read_text())
            period_us = int(Path(d, "cpu.cfs_period_us").read_text())
            if quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
        except (OSError, ValueError):
            pass
    return min(quotas, default=None)


def cgroup_dirs(controller: str, root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> set[Path]:
    """The directories of this process's cgroup for ``controller`` (``cpu``, ``memory``)
    and of every cgroup above it, up to the mount, as ``proc_cgroup`` names them: under
    ``root`` for cgroup v2 (one hierarchy), under ``root/controller`` for v1; and both
    mounts' roots (a container's cgroup namespace makes its own cgroup the root). Where
    a limit is set, some of these hold its file."""
    dirs = {Path(root), Path(root, controller)}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        base = Path(root) if controllers == "" else Path(root, controller) if controller in controllers.split(",") \
            else None
        if base is None:
            continue
        here = base.joinpath(*[p for p in path.strip().split("/") if p])
        while True:  # the cgroup and every one above it, up to the mount
            dirs.add(here)
            if here == base:
                break
            here = here.parent
    return dirs
