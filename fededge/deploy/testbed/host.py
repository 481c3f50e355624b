"""The machine the testbed runs on: ``ip``, its checks, and the processes it starts and stops.

What ``up`` checks before it creates anything (the ``ip`` tool, root or CAP_NET_ADMIN +
CAP_SYS_ADMIN, Flower's programs, a subnet no route uses, the kernel's ``sch_netem``),
the namespaces and links that exist, and the testbed's processes: started in sessions of
their own (:func:`spawn`), found by their recorded pid and start time, by the
``FLWR_HOME`` on their command lines or by their namespace, and stopped with SIGTERM then
SIGKILL (:func:`stop_pids`), every child of this interpreter reaped.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fededge.deploy.procs import alive, flower_bin, free_ports, parent_pid, processes_of, start_time, terminate
from fededge.deploy.testbed.plan import (
    PREFIX, NotPrivileged, PreflightError, ProcessSpec, SubnetInUse, TestbedError, ToolMissing,
)
from fededge.netem import kernel
from fededge.netem.profiles import Direction, LinkProfile

__all__ = [
    "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "ancestors", "check_ip", "check_machine", "check_privileges",
    "check_subnet", "flower_processes_of", "forget_exited", "free_ports", "is_recorded", "list_links",
    "list_netns", "netns_pids", "probe_netem", "run_ip", "spawn", "stop_pids",
]

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


def run_ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; with ``check``, a failure raises TestbedError quoting its message."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{shlex.join(['ip', *args])}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = run_ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the links of the host namespace (``ip link``)."""
    out = run_ip("-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _capabilities() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_ip() -> None:
    """The ``ip`` tool is installed, else ToolMissing."""
    if shutil.which("ip") is None:
        raise ToolMissing("the `ip` tool (iproute2) is not installed or not on PATH: the testbed makes its "
                          "namespaces, veth pairs and bridge with it. Install it (apt-get install iproute2, "
                          "dnf install iproute).")


def check_privileges() -> None:
    """Root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, else NotPrivileged."""
    caps = _capabilities()
    if os.geteuid() != 0 and not (caps >> CAP_NET_ADMIN & 1 and caps >> CAP_SYS_ADMIN & 1):
        raise NotPrivileged(
            "fededge testbed needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, "
            "veth pairs, a bridge and qdiscs: run it as root, e.g. sudo \"$(command -v fededge)\" testbed ... "
            "Without root: fededge.deploy.local.LocalDeployment runs SuperLink and SuperNodes on loopback "
            "with userspace proxies, and docker/compose.yaml runs the same topology in containers.")


def check_machine() -> None:
    """The ``ip`` tool, the privileges namespaces need, and Flower's programs; else a named error."""
    check_ip()
    check_privileges()
    for name in ("flower-superlink", "flower-supernode", "flwr"):
        path = flower_bin(name)
        if not os.path.isabs(path) or not os.access(path, os.X_OK):
            raise ToolMissing(f"Flower's `{name}` was not found next to {sys.executable} nor on PATH: "
                              "install flwr in this environment (pip install -e .)")


def _routes() -> list[tuple[str, str]]:
    out = run_ip("-j", "-4", "route", "show", check=False).stdout
    try:
        routes = json.loads(out or "[]")
    except json.JSONDecodeError:
        return []
    return [(str(r.get("dst", "")), str(r.get("dev", ""))) for r in routes if isinstance(r, dict)]


def check_subnet(subnet: str) -> None:
    """Refuse a subnet that overlaps a route of the host (a LAN, a VPN, another testbed)."""
    net = ipaddress.IPv4Network(subnet)
    for dst, dev in _routes():
        if dst in ("", "default"):
            continue
        try:
            other = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            continue
        if other.overlaps(net):
            raise SubnetInUse(f"subnet {net} overlaps the route {dst} on {dev or '?'} (another testbed, "
                               "a LAN or a VPN): pick another one with --subnet, e.g. 10.214.0.0/24")


def probe_netem(tag: str) -> bool:
    """Whether the kernel can create a netem qdisc: tried on ``lo`` of a throwaway namespace."""
    ns = f"{PREFIX}{tag}-probe"
    profile = LinkProfile(name="probe", up=Direction(delay_s=0.001), down=Direction(), source="probe")
    run_ip("netns", "del", ns, check=False)  # left by a probe that was interrupted
    try:
        run_ip("netns", "add", ns)
    except TestbedError as err:
        raise PreflightError(f"cannot create a network namespace, so no testbed either: {err}") from None
    try:
        kernel.apply(kernel.plan_apply("lo", profile, "egress"), netns=ns)
        return True
    except kernel.KernelFeatureMissing as err:
        return err.feature != "sch_netem"
    except kernel.KernelShapingError as err:
        raise PreflightError(f"probing the kernel for sch_netem failed: {err}") from None
    finally:
        run_ip("netns", "del", ns, check=False)


def is_recorded(rec: Mapping[str, Any]) -> bool:
    """The recorded process is still that process (pid and start time match) and alive."""
    pid = int(rec.get("pid", 0))
    return pid > 0 and start_time(pid) == rec.get("starttime") and alive(pid)


def ancestors() -> set[int]:
    """This process and its ancestors (never signalled by ``down``)."""
    out, pid = set(), os.getpid()
    while pid is not None and pid > 1:
        out.add(pid)
        pid = parent_pid(pid)
    return out


def flower_processes_of(home: str) -> set[int]:
    """Live Flower processes with ``home`` on their command line, and all their descendants.

    Like :func:`fededge.deploy.procs.processes_of`, but a root must also be a Flower
    program (``flower-*``, ``flwr*``), so that a shell or an editor that merely names a
    file under ``home`` is never signalled.
    """
    return set(processes_of(home, root=lambda c: "/flower-" in c or "/flwr" in c))


def netns_pids(ns: str) -> list[int]:
    """The processes running in namespace ``ns``."""
    out = run_ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


# Processes this interpreter started (``up`` in-process): reaped through their Popen, so
# that an in-process ``down`` leaves no zombie and Popen never warns about a live child.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _reap(pids: Sequence[int]) -> None:
    """Collect the exit status of those of ``pids`` that are our children (no zombies)."""
    for pid in pids:
        child = _CHILDREN.get(pid)
        if child is not None:
            if child.poll() is not None:
                del _CHILDREN[pid]
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:  # not our child (ECHILD): its parent reaps it
            pass


def stop_pids(pids: set[int], *, grace_s: float) -> list[int]:
    """SIGTERM, wait, SIGKILL, wait; return those still alive (our own children reaped)."""
    return terminate(pids, grace_s=grace_s, reap=_reap)


def forget_exited() -> None:
    """Drop the children of this interpreter that have exited (and been reaped)."""
    for pid, child in list(_CHILDREN.items()):
        if child.poll() is not None:
            del _CHILDREN[pid]


def spawn(spec: ProcessSpec, *, env: Mapping[str, str], cwd: Path, log_dir: Path) -> subprocess.Popen[bytes]:
    """Start ``spec`` in a session of its own, its output appended to ``LOG_DIR/NAME.log``."""
    log_path = log_dir / f"{spec.name}.log"
    cmd = spec.command()
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        # A session of its own: the testbed outlives `up` and a Ctrl-C in its terminal.
        proc = subprocess.Popen(cmd, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    return proc


