"""Run ``flwr run`` on Flower's local simulation SuperLink from a script, and clean up.

Three traps of ``flwr run`` on the default ``local`` connection (flwr 1.41):

- it starts a detached ``flower-superlink --simulation`` that keeps running after the
  run ends;
- it exits 0 even when the run failed (with or without ``--stream``);
- that SuperLink always listens on 127.0.0.1:39091, whatever ``FLWR_HOME`` says, and a
  ``flwr run`` that finds a SuperLink there submits to it: two runs on one machine
  cross (the second trains on the first's SuperLink, installed into the first's home,
  and reads the wrong status).

:func:`flwr_run_local` starts the local SuperLink itself, on a free port of its own
(:func:`start_local_superlink`; Flower's ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and
``FLWR_LOCAL_CONTROL_API_PORT`` then point ``flwr run`` and ``flwr ls`` at it), under a
private ``FLWR_HOME``; it checks that the process listening on that port is the one it
started, reads the run's real status with ``flwr ls --format json`` through that port,
and then stops that SuperLink together with every process it started (found by the
``FLWR_HOME`` path on their command lines and by parentage,
:func:`fededge.deploy.procs.stop_processes_of`), also when the run fails or times out.
``fededge simulate``, tests and benchmarks use it. A user's own ``flwr run`` gets the
same isolation from :func:`local_superlink_env` (docs/deployment.md, "Several runs on one
machine").
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fededge.deploy.procs import (
    LOOPBACK, DeploymentError, FlwrRun, alive, flower_bin, flower_env, free_ports, latest_run, list_runs,
    listener_pids, processes_of, run_fields, stop_popen, stop_processes_of, stream,
)
from fededge.runconfig_text import format_run_config

__all__ = ["LocalSuperLink", "flwr_run_local", "local_superlink_env", "start_local_superlink"]

#: Flower's environment variables for the local simulation SuperLink's ports
#: (flwr/cli/constant.py; defaults 39091 and 39093).
PORT_ENV = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"
CONTROL_PORT_ENV = "FLWR_LOCAL_CONTROL_API_PORT"
def local_superlink_env(home: str | os.PathLike[str], *, port: int | None = None,
                        control_port: int | None = None,
                        extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``flwr run`` / ``flwr ls`` on a local SuperLink of their own.

    :func:`fededge.deploy.procs.flower_env` (private ``FLWR_HOME``, no runtime dependency
    installation, no telemetry) plus Flower's ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and
    ``FLWR_LOCAL_CONTROL_API_PORT`` set to ports of this run (free ones when not given),
    and, unless ``RAY_ADDRESS`` names a cluster already, ``RAY_ADDRESS=local`` (Ray
    starts an instance of its own instead of joining one that ``ray start`` left on the
    machine). A user's own script can run
    ``flwr run`` with this environment; :func:`flwr_run_local` does.
    """
    if port is None or control_port is None:
        free = iter(free_ports(2, host=LOOPBACK))
        port = next(free) if port is None else port
        control_port = next(free) if control_port is None else control_port
    if port == control_port:
        raise ValueError(f"port and control_port must differ, both are {port}")
    env = flower_env(home, {PORT_ENV: str(port), CONTROL_PORT_ENV: str(control_port), **(extra or {})})
    if not env.get("RAY_ADDRESS"):  # a cluster named on purpose (docs/deployment.md, section 4) stays
        env["RAY_ADDRESS"] = "local"
    return env


class LocalSuperLink:
    """A ``flower-superlink --simulation`` of one run: its process, port, home and env.

    Made by :func:`start_local_superlink`; :meth:`stop` stops it and everything started
    under its home (idempotent), and returns the pids that survived.
    """

    def __init__(self, proc: subprocess.Popen[bytes], home: Path, env: dict[str, str]) -> None:
        self.proc = proc
        self.home = home
        self.env = env
        self.port = int(env[PORT_ENV])

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def stop(self, grace_s: float = 10.0) -> list[int]:
        left = stop_processes_of(str(self.home), grace_s=grace_s)
        stop_popen(self.proc, grace_s=grace_s)  # reaped: no zombie stays behind
        return left


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=0.5) as r:  # noqa: S310 - loopback
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_local_superlink(home: str | os.PathLike[str], *, timeout_s: float = 60, attempts: int = 5,
                          env_extra: Mapping[str, str] | None = None) -> LocalSuperLink:
    """Start Flower's local simulation SuperLink on a free port under ``home``.

    The command is the one ``flwr run`` itself starts for the ``local`` connection
    (``--simulation --isolation subprocess``, database and log under
    ``home/local-superlink``), on ports of its own. It returns once that port answers
    ``/health`` and the process listening there is this SuperLink (not another run's
    that took the port in between); a port taken meanwhile is retried on another, up to
    ``attempts`` times. Raises :class:`~fededge.deploy.procs.DeploymentError` with the
    tail of its log when it cannot start.
    """
    home_path = Path(home).resolve()
    runtime = home_path / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    log_path = runtime / "superlink.log"
    why = ""
    for _ in range(attempts):
        env = local_superlink_env(home_path, extra=env_extra)
        port, control = env[PORT_ENV], env[CONTROL_PORT_ENV]
        cmd = [flower_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
               "--control-api-address", f"{LOOPBACK}:{control}", "--host", LOOPBACK, "--port", port,
               "--database", str(runtime / "state.db"), "--log-file", str(log_path),
               "--disable-runtime-dependency-installation"]
        proc = subprocess.Popen(cmd, env={**env, "FLWR_DISABLE_UPDATE_CHECK": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        link = LocalSuperLink(proc, home_path, env)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if _healthy(int(port)):
                    # Ours only if one of our processes holds the listening socket.
                    ours = set(processes_of(str(home_path))) | {proc.pid}
                    if listener_pids(int(port), among=ours):
                        return link
                time.sleep(0.2)
        except BaseException:
            # Ctrl-C (or any error) while it starts: it is in a session of its own, so the
            # terminal's SIGINT never reached it, and nothing else would stop it.
            link.stop(grace_s=5)
            raise
        why = (f"exited with code {proc.returncode}" if proc.poll() is not None
               else f"did not answer on port {port} within {timeout_s} s, or another process held it")
        link.stop(grace_s=5)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise DeploymentError(f"the local SuperLink under {home_path} could not start ({attempts} tries; "
                          f"last: {why}); its log {log_path}:\n{tail}")


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
    stopped afterwards. The SuperLink listens on a free port of its own
    (:func:`start_local_superlink`), so runs started at once on one machine never meet.
    Runtime dependency installation is disabled (it needs the network, and would install
    a CUDA build of torch). With ``echo``, the run's output is copied there line by line
    as it comes.
    """
    home = Path(flwr_home).resolve()
    home.mkdir(parents=True, exist_ok=True)

    def num(v: float) -> str:  # Flower wants an int for whole CPUs
        return str(int(v)) if float(v).is_integer() else str(v)

    fed = (f"num-supernodes={num_supernodes} client-resources-num-cpus={num(cpus_per_client)} "
           f"client-resources-num-gpus={gpus_per_client}")
    cmd = [flower_bin("flwr"), "run", str(Path(app_dir).resolve()), "--stream", "--federation-config", fed]
    if run_config:
        cmd += ["--run-config", format_run_config(run_config)]
    t0 = time.perf_counter()
    try:
        link = start_local_superlink(home)
    except DeploymentError as err:  # no SuperLink: no run
        return FlwrRun(1, f"[fededge] {err}\n", None, None, time.perf_counter() - t0,
                       stop_processes_of(str(home)), {})
    try:
        if echo is not None:
            echo.write(f"[fededge] local SuperLink on {link.address} (FLWR_HOME {home})\n")
        rc, out = stream(cmd, env=link.env, timeout_s=timeout_s, echo=echo)
        wall = time.perf_counter() - t0
        if not alive(link.proc.pid):
            out += f"\n[fededge] the local SuperLink on {link.address} died during the run"
        try:
            info = latest_run(list_runs(None, env=link.env)) or {}
        except (DeploymentError, subprocess.TimeoutExpired) as err:  # the run's status is then unknown: not ok
            info = {}
            out += f"\n[fededge] {err}"
        status, run_id = run_fields(info)
    finally:
        leftover = link.stop()
    return FlwrRun(rc, out, status, run_id, wall, leftover, info)
