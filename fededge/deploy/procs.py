"""Processes and Flower's command line: what every deployment tool of fededge does, once.

:mod:`fededge.deploy.launch` (``flwr run`` on Flower's local simulation SuperLink),
:mod:`fededge.deploy.local` (SuperLink and SuperNodes on loopback) and
:mod:`fededge.deploy.testbed` (SuperNodes in network namespaces) all start Flower's
programs, find and stop them through ``/proc``, and drive ``flwr``:

- Flower's programs: where they are (:func:`flower_bin`), the environment they run in
  (:func:`flower_env`), the SuperLink's and a SuperNode's command lines
  (:func:`superlink_command`, :func:`supernode_command`) and ``flwr``'s connection file
  (:func:`write_connection`);
- processes: ``/proc`` (:func:`cmdline`, :func:`parent_pid`, :func:`start_time`,
  :func:`alive`), everything started under a marker and its descendants
  (:func:`processes_of`), SIGTERM then SIGKILL (:func:`terminate`,
  :func:`stop_processes_of`), waiting for a port (:func:`wait_listening`), and a
  command's output streamed to a list, a log and a terminal at once (:func:`stream`);
- ``flwr``: one call (:func:`flwr_cli`), ``flwr ls`` and ``flwr supernode list`` read
  (:func:`list_runs`, :func:`latest_run`, :func:`list_nodes`), and one ``flwr run`` on a
  connection with the run's real status (:func:`submit_run`, :class:`FlwrRun`):
  ``flwr run`` exits 0 even when the run failed.

Imports nothing of Flower: ``fededge testbed`` starts without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fededge import keys
from fededge.runconfig_text import format_run_config

if TYPE_CHECKING:
    from fededge.deploy.certs import CertBundle

__all__ = [
    "FLOWER_DEFAULT_PORTS", "LOOPBACK", "MARKER_KEY", "DeploymentError", "FlwrRun",
    "alive", "cmdline", "flower_bin", "flower_env", "free_ports", "flwr_cli", "latest_run", "list_nodes", "list_runs",
    "listener_pids", "parent_pid", "proc_state", "processes_of", "run_fields", "start_time", "stop_processes_of",
    "stream", "stop_popen", "submit_run", "superlink_command", "supernode_command", "terminate", "wait_listening",
    "write_connection", "write_insecure_connection",
]

LOOPBACK = "127.0.0.1"
MARKER_KEY = "deploy-home"  # node-config key that puts FLWR_HOME on a SuperNode's command line
_RUN_ID = re.compile(r"Successfully started run (\d+)")
#: The last line of a traceback whose exception is fededge's ConfigError.
_CONFIG_ERROR_LINE = re.compile(r"^(?:fededge\.(?:errors|config)\.)?ConfigError: (.+)$", re.MULTILINE)


class DeploymentError(RuntimeError):
    """A process of the deployment did not start, did not listen, or died; or ``flwr``
    gave no answer that could be read."""


@dataclass
class FlwrRun:
    """One ``flwr run``: its exit code and output, and the run's real status."""

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


# --------------------------------------------------------------------------- Flower's programs


def flower_bin(name: str) -> str:
    """The path of a Flower (or fededge) executable: this interpreter's, else PATH's."""
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else (shutil.which(name) or name)


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


def superlink_command(*, host: str, port: int, home: str | os.PathLike[str],
                      certs: CertBundle | None = None, supernode_auth: bool = False) -> list[str]:
    """``flower-superlink`` on ``host:port``, its database under ``home``.

    Without ``certs`` it is ``--insecure``. With a :class:`~fededge.deploy.certs.CertBundle`
    it speaks TLS (``--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile
    server.key``); ``supernode_auth`` adds ``--enable-supernode-auth`` (Flower refuses it
    without TLS, and so does this function). The ``--database`` path puts ``home`` (the
    marker that :func:`stop_processes_of` looks for) on the command line.
    """
    if certs is None:
        if supernode_auth:
            raise ValueError("supernode_auth needs TLS: give certs (Flower refuses "
                             "--enable-supernode-auth with --insecure)")
        security = ["--insecure"]
    else:
        security = ["--ssl-ca-certfile", str(certs.ca_cert), "--ssl-certfile", str(certs.server_cert),
                    "--ssl-keyfile", str(certs.server_key)]
        if supernode_auth:
            security.append("--enable-supernode-auth")
    return [flower_bin("flower-superlink"), *security, "--host", host, "--port", str(port),
            "--database", str(Path(home) / "state.db"), "--disable-runtime-dependency-installation"]


def supernode_command(*, superlink: str, partition_id: int, num_partitions: int,
                      home: str | os.PathLike[str], node_config: Mapping[str, Any] | None = None,
                      runtime_host: str = LOOPBACK, runtime_port: int,
                      root_certificates: str | os.PathLike[str] | None = None,
                      auth_key: str | os.PathLike[str] | None = None, warm: bool = False) -> list[str]:
    """``flower-supernode`` dialling ``superlink`` (``HOST:PORT``) for one partition.

    With ``warm`` the command is ``fededge supernode ...`` with the same arguments: a
    warm worker (:mod:`fededge.clients.worker`) started and stopped with the SuperNode,
    which fededge's shim ClientApp (:mod:`fededge.clients.shim`) hands each message to.

    ``--node-config`` carries ``partition-id``, ``num-partitions``, the extra
    ``node_config`` keys and ``deploy-home=HOME`` (the marker on its command line);
    ``runtime_host:runtime_port`` is its runtime API for its ClientApp processes.
    Without ``root_certificates`` it is ``--insecure``; with it, it checks the
    SuperLink's certificate against that CA. ``auth_key`` (the node's private key,
    OpenSSH format; needs TLS) is passed as ``--auth-supernode-private-key``.
    """
    if root_certificates is None:
        if auth_key is not None:
            raise ValueError("auth_key needs TLS: give root_certificates (Flower refuses "
                             "SuperNode authentication with --insecure)")
        security = ["--insecure"]
    else:
        security = ["--root-certificates", str(root_certificates)]
        if auth_key is not None:
            security += ["--auth-supernode-private-key", str(auth_key)]
    config = {keys.PARTITION_ID: partition_id, keys.NUM_PARTITIONS: num_partitions, **(node_config or {}),
              MARKER_KEY: str(home)}
    head = [flower_bin("fededge"), "supernode", "--grace", "5"] if warm else [flower_bin("flower-supernode")]
    return [*head, *security, "--superlink", superlink,
            "--node-config", format_run_config(config), "--host", runtime_host, "--port", str(runtime_port)]


def write_connection(home: str | os.PathLike[str], connection: str, address: str, *,
                     root_certificates: str | os.PathLike[str] | None = None) -> Path:
    """``FLWR_HOME/config.toml`` with one connection, the default.

    With ``root_certificates`` (the CA's certificate) ``flwr`` speaks TLS and checks the
    SuperLink's certificate; without, the connection is ``insecure = true``.
    """
    path = Path(home) / "config.toml"
    security = ("insecure = true" if root_certificates is None
                else f"root-certificates = {json.dumps(str(root_certificates))}")
    path.write_text(
        f'[superlink]\ndefault = "{connection}"\n\n'
        f'[superlink.{connection}]\naddress = "{address}"\n{security}\n')
    return path


def write_insecure_connection(home: str | os.PathLike[str], connection: str, address: str) -> Path:
    """``FLWR_HOME/config.toml`` with one insecure connection, the default."""
    return write_connection(home, connection, address)


# --------------------------------------------------------------------------- processes


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
    """Live processes whose command line names the path ``marker`` (itself, or a path
    under it, quoted or not: ``/x/h`` matches ``/x/h``, ``/x/h/db`` and ``home="/x/h"``,
    not ``/x/h2`` nor ``/y/x/h``) and
    passes ``root``, when given, and all their descendants; never this process nor its
    ancestors (a wrapper whose command line names the path, ``timeout ... /x/h``)."""
    me = os.getpid()
    mine = {me}
    p = parent_pid(me)
    while p and p not in mine:
        mine.add(p)
        p = parent_pid(p)
    # (quoted too: a SuperNode names its home inside --node-config, deploy-home="/x/h")
    named = re.compile(r"(?:^|(?<=[\s=:\"']))" + re.escape(marker.rstrip("/")) + r"(?=[/\s\"']|$)")
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    family = {p for p in pids if p not in mine and named.search(c := cmdline(p)) and (root is None or root(c))
              and alive(p)}
    changed = True
    while changed:
        changed = False
        for p in pids:
            if p not in family and p not in mine and parent_pid(p) in family and alive(p):
                family.add(p)
                changed = True
    return sorted(family)


def listener_pids(port: int, *, among: Iterable[int] | None = None) -> list[int]:
    """The processes (of ``among``, else all this user can see) holding a TCP socket that
    listens on ``port``, on any address, IPv4 or IPv6; read from ``/proc/net/tcp*`` and
    ``/proc/PID/fd``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN; field 9 the inode
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return []
    pids = sorted(among) if among is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


#: Flower's default local ports (the local SuperLink's HTTP and control APIs): a plain
#: ``flwr run`` may start a SuperLink there at any moment, so no free-port pick returns them.
FLOWER_DEFAULT_PORTS = frozenset({39091, 39092, 39093})


def free_ports(count: int, *, host: str = "") -> list[int]:
    """``count`` distinct TCP ports free just now on ``host`` ("": every address, a
    bridge's included), none of :data:`FLOWER_DEFAULT_PORTS`."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)  # held until all are picked: the ports are distinct
            port = s.getsockname()[1]
            if port not in FLOWER_DEFAULT_PORTS:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def stop_popen(proc: subprocess.Popen, *, grace_s: float) -> None:
    """Stop one child this process started: SIGTERM, wait up to ``grace_s``, then SIGKILL
    and wait up to 5 s more. Nothing happens if it has exited already."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def terminate(pids: Iterable[int], *, grace_s: float,
              reap: Callable[[list[int]], None] | None = None) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, SIGKILL, wait again; return those still alive.

    ``reap`` is called with the pids still waited for at every look (a caller collects
    there the exit status of its own children, which would otherwise stay zombies).
    """
    left = set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while True:
            if reap is not None:
                reap(sorted(left))
            left = {p for p in left if alive(p)}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not left:
            return []
    return sorted(left)


def stop_processes_of(marker: str, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process :func:`processes_of` finds; return survivors."""
    return terminate(processes_of(marker), grace_s=grace_s)


def wait_listening(host: str, port: int, proc: subprocess.Popen[Any], *, timeout_s: float,
                   what: str, log: Callable[[], str]) -> None:
    """Return once ``host:port`` accepts TCP connections; raise if ``proc`` exits first.

    ``what`` names the process in the error (``"the SuperLink"``); ``log`` gives the tail
    of its log for the message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise DeploymentError(f"{what} exited with code {proc.returncode} before "
                                      f"listening\n{log()}") from None
            if time.monotonic() > deadline:
                raise DeploymentError(f"{what} did not listen on {host}:{port} "
                                      f"within {timeout_s} s\n{log()}") from None
            time.sleep(0.2)


def stream(cmd: list[str], *, env: Mapping[str, str], timeout_s: float,
           cwd: str | os.PathLike[str] | None = None, log_path: Path | None = None, echo: TextIO | None = None,
           dead: Callable[[], list[str]] | None = None,
           on_start: Callable[[subprocess.Popen[str] | None], None] | None = None) -> tuple[int, str]:
    """Run ``cmd`` (a ``flwr run``), its output collected, and copied as it comes to
    ``log_path`` and ``echo``; return its exit code and output.

    Return code 124 after ``timeout_s``, 125 as soon as ``dead()`` names a dead process
    (of the deployment the command runs on); the command is then killed. ``on_start`` is
    called with the process when it starts and with None when it is gone.
    """
    lines: list[str] = []
    log = None if log_path is None else open(log_path, "w")  # noqa: SIM115 - closed once the reader is done
    proc = subprocess.Popen(cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, bufsize=1, cwd=cwd)
    if on_start is not None:
        on_start(proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            for out in (log, echo):
                if out is not None:
                    out.write(line)
                    out.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    rc: int | None = None
    try:
        while rc is None:
            try:
                rc = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                gone = dead() if dead is not None else []
                if gone:
                    lines.append(f"\n[fededge] {'; '.join(gone)}: run abandoned\n")
                    rc = 125
                elif time.monotonic() > deadline:
                    lines.append(f"\n[fededge] flwr run timed out after {timeout_s} s\n")
                    rc = 124
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        if log is not None and not reader.is_alive():
            log.close()
        if on_start is not None:
            on_start(None)
    return rc, "".join(lines)


# --------------------------------------------------------------------------- flwr


def flwr_cli(args: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None,
             timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``flwr ARGS``, its output captured (no check of its exit code)."""
    return subprocess.run([flower_bin("flwr"), *args], check=False, env=dict(env), capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=cwd)


def _json_list(proc: subprocess.CompletedProcess[str], what: str, field_: str) -> list[dict[str, Any]]:
    try:
        items = json.loads(proc.stdout).get(field_, [])
    except (json.JSONDecodeError, AttributeError):
        raise DeploymentError(f"{what} gave no JSON (rc {proc.returncode}): "
                              f"{proc.stdout[-1000:]} {proc.stderr[-1000:]}") from None
    return [x for x in items if isinstance(x, dict)]


def list_runs(connection: str | None, *, env: Mapping[str, str],
              cwd: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """``flwr ls [CONNECTION] --format json``: every run the SuperLink knows (None: the
    default connection of ``FLWR_HOME``)."""
    return _json_list(flwr_cli(["ls", *([connection] if connection else []), "--format", "json"],
                               env=env, cwd=cwd), "flwr ls", "runs")


def list_nodes(connection: str, *, env: Mapping[str, str],
               cwd: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """``flwr supernode list CONNECTION --format json``: the SuperLink's nodes."""
    return _json_list(flwr_cli(["supernode", "list", connection, "--format", "json"], env=env, cwd=cwd),
                      "flwr supernode list", "nodes")


def latest_run(runs: Sequence[Mapping[str, Any]], run_id: int | None = None) -> dict[str, Any] | None:
    """The run ``run_id`` among ``runs`` (``flwr ls``), or the last submitted; None: not there."""
    if run_id is not None:
        runs = [r for r in runs if str(r.get("run-id", r.get("run_id"))) == str(run_id)]
    last = max(runs, key=lambda r: str(r.get("pending-at", r.get("pending_at", ""))), default=None)
    return None if last is None else dict(last)


def run_fields(info: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """A ``flwr ls`` entry's status and run id ({}: None, None)."""
    rid = info.get("run-id", info.get("run_id"))
    return (str(info.get("status", "")) or None), (int(rid) if rid is not None else None)


def _finished_run(connection: str, run_id: int | None, *, env: Mapping[str, str],
                  cwd: str | os.PathLike[str]) -> dict[str, Any] | None:
    # `flwr run --stream` may return a moment before the SuperLink marks the run finished.
    deadline = time.monotonic() + 20
    while True:
        try:
            last = latest_run(list_runs(connection, env=env, cwd=cwd), run_id)
        except (DeploymentError, subprocess.TimeoutExpired):
            last = None
        if (last is not None and str(last.get("status", "")).startswith("finished")) \
                or time.monotonic() > deadline:
            return last
        time.sleep(1)


def submit_run(
    app_dir: str | os.PathLike[str],
    connection: str,
    run_config: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    timeout_s: float = 600,
    echo: TextIO | None = None,
    dead: Callable[[], list[str]] = lambda: [],
    on_start: Callable[[subprocess.Popen[str] | None], None] | None = None,
) -> FlwrRun:
    """``flwr run APP_DIR CONNECTION --stream --run-config ...`` and the run's real status.

    Returns when ``flwr run`` exits, after ``timeout_s`` (return code 124; the run is then
    stopped on the SuperLink with ``flwr stop``), or as soon as ``dead()`` names a dead
    process of the deployment (return code 125). ``status`` is Flower's
    (``finished:completed`` when the run succeeded), read with ``flwr ls``: ``flwr run``
    exits 0 even when the run failed. ``on_start`` is called with the ``flwr run``
    process when it starts and with None when it is gone. ``leftover_pids`` is empty.
    """
    cfg = dict(run_config or {})
    cmd = [flower_bin("flwr"), "run", str(app_dir), connection, "--stream"]
    if cfg:
        cmd += ["--run-config", format_run_config(cfg)]
    t0 = time.perf_counter()
    try:
        rc, out = stream(cmd, env=env, cwd=cwd, log_path=Path(log_path), timeout_s=timeout_s, echo=echo,
                         dead=dead, on_start=on_start)
    except KeyboardInterrupt:
        # Ctrl-C stopped `flwr run`, not the run: it went on on the SuperLink, beside the next one
        m = _RUN_ID.search(Path(log_path).read_text(errors="replace")) if Path(log_path).is_file() else None
        if m is not None:
            with contextlib.suppress(Exception):  # (the interrupt is what the caller must see)
                flwr_cli(["stop", m.group(1), connection], env=env, cwd=cwd)
        raise
    wall = time.perf_counter() - t0
    m = _RUN_ID.search(out)
    run_id = int(m.group(1)) if m else None
    if rc == 124 and run_id is not None:
        stop = flwr_cli(["stop", str(run_id), connection], env=env, cwd=cwd)
        out += f"\n[fededge] flwr stop {run_id}: rc {stop.returncode} {stop.stdout[-300:]}"
    info = _finished_run(connection, run_id, env=env, cwd=cwd)
    if info is None:
        out += "\n[fededge] flwr ls did not list the run"
    status, listed_id = run_fields(info or {})
    if run_id is None:
        run_id = listed_id
    return FlwrRun(rc, out, status, run_id, wall, [], info or {})
