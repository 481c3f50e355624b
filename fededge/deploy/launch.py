"""Run ``flwr run`` on Flower's local simulation SuperLink from a script, and clean up.

Two traps of ``flwr run`` on the default ``local`` connection (flwr 1.41):

- it starts a detached ``flower-superlink --simulation`` that keeps running after the
  run ends;
- it exits 0 even when the run failed (with or without ``--stream``).

:func:`flwr_run_local` uses a private ``FLWR_HOME``, reads the run's real status with
``flwr ls --format json`` before stopping that SuperLink, and then stops it together with
every process it started (found by the ``FLWR_HOME`` path on their command lines and by
parentage), also when the run fails or times out. Tests and benchmarks use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "FlwrRun", "alive", "cmdline", "flower_env", "flwr_run_local", "format_run_config", "parent_pid",
    "proc_state", "processes_of", "start_time", "stop_processes_of",
]


@dataclass
class FlwrRun:
    returncode: int
    output: str
    status: str | None  # Flower's run status, e.g. "finished:completed", "finished:failed"
    run_id: int | None
    wall_s: float
    leftover_pids: list[int]
    info: dict[str, Any] = field(default_factory=dict)  # the run's entry in `flwr ls --format json`

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.status == "finished:completed"

    def failure(self) -> str | None:
        """Why the run failed, in one line; None when it succeeded.

        ``configuration error: ...`` when the ServerApp stopped on a
        :class:`~fededge.errors.ConfigError` (the last line of the traceback Flower logs
        into the run's output: Flower's run status keeps the message but not the
        exception's type), else ``run failed: `` and Flower's status details.
        """
        if self.ok:
            return None
        found = _CONFIG_ERROR_LINE.findall(self.output)
        if found:
            return f"configuration error: {found[-1].strip()}"
        if self.returncode == 124:
            return "run failed: flwr run timed out"
        details = str(self.info.get("status-details", "") or "").strip()
        return f"run failed: {details or f'status {self.status}, flwr run exit {self.returncode}'}"


#: The last line of a traceback whose exception is fededge's ConfigError.
_CONFIG_ERROR_LINE = re.compile(r"^(?:fededge\.(?:errors|config)\.)?ConfigError: (.+)$", re.MULTILINE)


def format_run_config(cfg: Mapping[str, Any]) -> str:
    """``{"num-rounds": 3, "dataset": "digits"}`` -> ``num-rounds=3 dataset="digits"``."""
    parts = []
    for key, value in cfg.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def flower_env(home: str | os.PathLike[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with a private ``FLWR_HOME`` and Flower's traps disarmed.

    Runtime dependency installation off (it needs the network and would install a CUDA
    torch), telemetry off, unbuffered output, and this interpreter's ``bin`` first on
    ``PATH`` (Flower starts ``flower-superlink``, ``flwr-serverapp`` and
    ``flwr-clientapp`` from ``PATH``: an unactivated venv then finds its own Flower).
    ``extra`` is applied last.
    """
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    })
    env.update(extra or {})
    return env


def _flwr_bin() -> str:
    exe = Path(sys.executable).with_name("flwr")
    return str(exe) if exe.exists() else (shutil.which("flwr") or "flwr")


def cmdline(pid: int) -> str:
    """``pid``'s command line, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (field 3 on), [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else None


def proc_state(pid: int) -> str:
    """The kernel's state letter (``R``, ``S``, ``Z``...), "" once the process is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else ""


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot: with the pid, it names a process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def alive(pid: int) -> bool:
    """Running or sleeping: neither gone nor a zombie."""
    return proc_state(pid) not in ("", "Z", "X")


def processes_of(marker: str, *, root: Callable[[str], bool] | None = None) -> list[int]:
    """Live processes whose command line contains ``marker`` (and passes ``root``, when
    given), and all their descendants."""
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    family = {p for p in pids if p != me and marker in (c := cmdline(p)) and (root is None or root(c))
              and alive(p)}
    changed = True
    while changed:
        changed = False
        for p in pids:
            if p not in family and parent_pid(p) in family and alive(p):
                family.add(p)
                changed = True
    return sorted(family)


def stop_processes_of(marker: str, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process :func:`processes_of` finds; return survivors."""
    pids = processes_of(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            if not pids:
                return []
            time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _run_streaming(cmd: list[str], env: dict[str, str], timeout_s: float,
                   echo: TextIO | None) -> tuple[int, str]:
    lines: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, bufsize=1)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo is not None:
                echo.write(line)
                echo.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = 124
        lines.append(f"\n[fededge] flwr run timed out after {timeout_s} s\n")
    reader.join(timeout=10)
    return rc, "".join(lines)


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
    cmd = [_flwr_bin(), "run", str(Path(app_dir).resolve()), "--stream", "--federation-config", fed]
    if run_config:
        cmd += ["--run-config", format_run_config(run_config)]
    t0 = time.perf_counter()
    status = run_id = None
    info: dict[str, Any] = {}
    try:
        rc, out = _run_streaming(cmd, env, timeout_s, echo)
        wall = time.perf_counter() - t0
        ls = subprocess.run([_flwr_bin(), "ls", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
        try:
            runs = json.loads(ls.stdout).get("runs", [])
        except json.JSONDecodeError:
            runs = []
            out += f"\n[fededge] flwr ls gave no JSON: {ls.stdout[-500:]} {ls.stderr[-500:]}"
        if runs:
            last = max(runs, key=lambda r: str(r.get("pending-at", r.get("pending_at", ""))))
            info = dict(last)
            status = str(last.get("status", "")) or None
            rid = last.get("run-id", last.get("run_id"))
            run_id = int(rid) if rid is not None else None
    finally:
        leftover = stop_processes_of(str(home))
    return FlwrRun(rc, out, status, run_id, wall, leftover, info)
