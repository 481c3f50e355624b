"""``up``, ``down``, ``run`` and ``status``: the plan applied to the machine, and undone.

:func:`up` checks the machine, writes the plan to the state file BEFORE it creates
anything, applies it and records every process it starts; on any failure it tears down
what it made (:func:`down`) and re-raises. :func:`down` removes exactly what the state
file names and checks that none is left. :func:`run` submits an app with ``flwr run``
and reads the run's real status (:func:`fededge.deploy.procs.submit_run`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fededge.deploy.procs import (
    DeploymentError, FlwrRun, flower_env, list_nodes, proc_state, start_time, submit_run, wait_listening,
    write_insecure_connection,
)
from fededge.deploy.testbed import host
from fededge.deploy.testbed.plan import (
    PREFIX, AlreadyUp, IpOp, ProcessSpec, TestbedConfig, TestbedError, TestbedPlan,
    default_state_dir, needs_netem, plan_teardown, plan_testbed, testbed_tag,
)
from fededge.deploy.testbed.state import prepare_state_dir, read_state, state_path, write_state

#: A file in each directory ``up`` makes under the state directory (``flwr-home``,
#: ``logs``): only such a directory is deleted by the next ``up``.
OWN_MARKER = ".fededge-testbed"
from fededge.netem import kernel

__all__ = ["DownReport", "dead_processes", "down", "online_nodes", "run", "status", "up"]


# --------------------------------------------------------------------------- up


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}"
    except OSError:
        return f"--- {path.name}: no log"


def online_nodes(state: Mapping[str, Any]) -> int:
    """How many SuperNodes the SuperLink lists as online (``flwr supernode list``)."""
    try:
        nodes = list_nodes(state["connection"], env=flower_env(state["home"]), cwd=state["state_dir"])
    except DeploymentError:  # no answer that could be read: none online yet
        return 0
    return sum(1 for node in nodes if node.get("status") == "online")


def dead_processes(state: Mapping[str, Any]) -> list[str]:
    """``"NAME (pid P) is not running"`` for every recorded process that is gone."""
    return [f"{rec['name']} (pid {rec['pid']}) is not running" for rec in state.get("processes", [])
            if not host.is_recorded(rec)]


def up(config: TestbedConfig, *, wait_s: float = 90.0, echo: TextIO | None = None) -> dict[str, Any]:
    """Check the machine, then build the testbed; return its state (also in the state file).

    Waits until the SuperLink lists every SuperNode as online (at most ``wait_s``; 0:
    do not wait). On any failure, everything made so far is torn down (:func:`down`)
    and the error re-raised.

    Raises
    ------
    ToolMissing, NotPrivileged, AlreadyUp, NetemUnavailable, TestbedError
    """
    host.check_machine()
    existing = read_state(config.state_dir)
    if existing is not None:
        raise AlreadyUp(f"a testbed is already up in {config.state_dir} (namespaces "
                        f"{', '.join(existing.get('namespaces', []))}): run `fededge testbed down "
                        f"--state-dir {config.state_dir}` first, or give another --state-dir")
    host.check_subnet(config.subnet)
    tag = testbed_tag(config.state_dir)
    clash = [x for x in host.list_netns() if x.startswith(PREFIX + tag) and not x.endswith("-probe")] + \
            [x for x in host.list_links() if x.startswith(PREFIX + tag)]
    if clash:
        raise AlreadyUp(f"{', '.join(clash)} exist but {state_path(config.state_dir)} does not: left over from a "
                        f"testbed whose state file was removed? Delete them (ip netns del / ip link del) first")
    profiles = [p for p in config.link_profiles if p is not None]
    netem = None
    if config.shaping == "kernel" and not config.rate_only and any(
            needs_netem(p.up) or needs_netem(p.down) for p in profiles):
        netem = host.probe_netem(tag)
    if config.superlink_port:  # the port asked for (--port); the proxies' free ones
        ports = [config.superlink_port, *(p for p in host.free_ports(config.clients + 1)
                                          if p != config.superlink_port)][:config.clients + 1]
    else:
        ports = host.free_ports(config.clients + 1)
    plan = plan_testbed(config, superlink_port=ports[0], proxy_ports=ports[1:], netem_available=netem)

    prepare_state_dir(plan.state_dir)
    for d in (plan.home, plan.log_dir):
        if d.exists() and not (d / OWN_MARKER).exists() and (not d.is_dir() or any(d.iterdir())):
            # Not made by this version's `up` (an older testbed's, or --state-dir ~/project's
            # own logs/, which `up` used to delete): kept, under another name.
            aside = d.with_name(f"{d.name}.before-{datetime.datetime.now():%Y%m%d-%H%M%S}")
            d.rename(aside)
            _say(echo, f"{d} was not made by `fededge testbed` (an older version's, or not a testbed's): "
                       f"moved to {aside}, not deleted")
    state = plan.to_state()
    try:
        write_state(state, create=True)
    except FileExistsError:
        raise AlreadyUp(f"another `fededge testbed up` claimed {plan.state_dir} meanwhile") from None
    try:
        with _interrupted_by_term():
            for d in (plan.home, plan.log_dir):  # a fresh SuperLink database and fresh logs (ours only, above)
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
                (d / OWN_MARKER).touch()
            _apply(plan, state, wait_s=wait_s, echo=echo)
    except BaseException as err:
        try:
            down(plan.state_dir)
        except Exception as cleanup:  # noqa: BLE001 - reported with the original error
            if isinstance(err, Exception):
                raise TestbedError(f"{err}\nAND the teardown after it failed: {cleanup}") from err
        raise
    return state


@contextlib.contextmanager
def _interrupted_by_term() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt meanwhile (in the main thread), so that
    ``up`` tears down what it made, as on Ctrl-C (a SIGTERM left a half-built testbed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def interrupt(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            # A child forked meanwhile (pyroute2 forks one to work in a namespace, and stops
            # it with SIGTERM): it dies of the signal, as it would have. Raised there, the
            # interrupt unwound the child's copy of `up` and tore the testbed down.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    # (a signal ignored, as under nohup, stays ignored; a handler set outside Python is left alone)
    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) not in (signal.SIG_IGN, None)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _say(echo: TextIO | None, text: str) -> None:
    if echo is not None:
        echo.write(text + "\n")
        echo.flush()


def _apply(plan: TestbedPlan, state: dict[str, Any], *, wait_s: float, echo: TextIO | None) -> None:
    for op in plan.links:
        host.run_ip(*op.args)
    for node in plan.nodes:
        for step in node.shaping:
            try:
                kernel.apply(step.ops, netns=step.netns)
            except kernel.KernelShapingError as err:
                raise TestbedError(f"node {node.index}: kernel shaping failed: {err}") from err
            for line in step.describe():
                _say(echo, f"[testbed] {line}")
    write_insecure_connection(plan.home, plan.connection, plan.superlink_address)
    env = flower_env(plan.home)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(spec: ProcessSpec) -> subprocess.Popen[bytes]:
        proc = host.spawn(spec, env=env, cwd=plan.state_dir, log_dir=plan.log_dir)
        procs[spec.name] = proc
        state["processes"].append({"name": spec.name, "pid": proc.pid, "starttime": start_time(proc.pid),
                                   "netns": spec.netns, "argv": spec.command()})
        write_state(state)
        if spec.listen is not None:
            addr, port = spec.listen
            try:
                wait_listening(addr, port, proc, timeout_s=60, what=spec.name,
                               log=lambda: _tail(plan.log_dir / f"{spec.name}.log"))
            except DeploymentError as err:
                raise TestbedError(str(err)) from None
        return proc

    start(plan.superlink)
    for node in plan.nodes:
        if node.proxy is not None:
            start(node.proxy)
    for node in plan.nodes:
        start(node.supernode)
    time.sleep(0.5)  # a SuperNode that cannot start (bad flag, namespace gone) exits at once
    deadline = time.monotonic() + wait_s
    while True:
        gone = [f"{name} exited with code {p.returncode}" for name, p in procs.items() if p.poll() is not None]
        if gone:
            tails = "\n".join(_tail(plan.log_dir / f"{name}.log") for name in procs)
            raise TestbedError("; ".join(gone) + "\n" + tails)
        if wait_s <= 0:
            break
        online = online_nodes(state)
        if online >= len(plan.nodes):
            _say(echo, f"[testbed] the SuperLink lists {online} SuperNode(s) online")
            break
        if time.monotonic() > deadline:
            tails = "\n".join(_tail(plan.log_dir / f"{name}.log") for name in procs)
            raise TestbedError(f"only {online} of {len(plan.nodes)} SuperNodes came online within {wait_s} s\n"
                               + tails)
        time.sleep(1.0)
    state["status"] = "up"
    state["up_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_state(state)


# --------------------------------------------------------------------------- down


@dataclass
class DownReport:
    """What :func:`down` did. ``nothing``: there was no testbed."""

    nothing: bool = False
    killed: list[int] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    zombies: list[int] = field(default_factory=list)  # dead, but their parent has not reaped them


def down(state_dir: str | os.PathLike[str] | None = None, *, grace_s: float = 5.0) -> DownReport:
    """Remove every process, namespace and link the testbed in ``state_dir`` made; idempotent.

    Raises TestbedError naming what is left when something could not be removed (the
    state file is then kept, so ``down`` can be run again).
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    state = read_state(state_dir)
    if state is None:
        # No state file: nothing to do, unless this state directory's testbed left names
        # behind (its state file lost: another $XDG_RUNTIME_DIR under sudo, a wiped /run/user).
        # Named, not removed: without the file, nothing says which processes are its own.
        tag = PREFIX + testbed_tag(state_dir)
        try:
            left = [x for x in host.list_netns() if x.startswith(tag) and not x.endswith("-probe")] + \
                [x for x in host.list_links() if x.startswith(tag)]
        except (TestbedError, OSError):  # no `ip` tool: nothing of a testbed can be there either
            left = []
        if left:
            raise TestbedError(
                f"no state file in {state_dir}, but {', '.join(left)} of its testbed exist (the state file was "
                f"lost?): stop what runs in each namespace and delete them (`ip netns pids NS | xargs -r kill; "
                f"ip netns del NS`, then `ip link del LINK`)")
        return DownReport(nothing=True)
    plan_teardown(state, existing_netns=[], existing_links=[])  # refuses foreign names before anything
    host.check_ip()
    host.check_privileges()
    report = DownReport()
    namespaces = [str(x) for x in state.get("namespaces", [])]

    # Processes: the recorded ones (pid + start time), everything carrying the marker and
    # its descendants (flwr-serverapp, flwr-clientapp), and anything in our namespaces.
    mine = host.ancestors()
    targets = {int(rec["pid"]) for rec in state.get("processes", []) if host.is_recorded(rec)}
    home = str(state.get("home", ""))
    if home.endswith("/flwr-home"):
        targets |= host.flower_processes_of(home)
    existing_ns = host.list_netns()
    for ns in namespaces:
        if ns in existing_ns:
            targets |= set(host.netns_pids(ns))
    targets -= mine
    family = set(targets)
    if targets:
        left = host.stop_pids(targets, grace_s=grace_s)
        # Children of killed processes may have been reparented meanwhile: one more sweep.
        again = set()
        if home.endswith("/flwr-home"):
            again |= host.flower_processes_of(home)
        for ns in namespaces:
            if ns in host.list_netns():
                again |= set(host.netns_pids(ns))
        again -= mine
        family |= again
        left = sorted(set(left) | set(host.stop_pids(again, grace_s=grace_s) if again else []))
        if left:
            raise TestbedError(f"processes {left} of the testbed in {state_dir} survived SIGKILL; "
                               f"the state file is kept: run `fededge testbed down` again")
        report.killed = sorted(family)
    report.zombies = sorted(p for p in family if proc_state(p) == "Z")

    errors = []

    def apply(ops: list[IpOp]) -> None:
        for op in ops:
            proc = host.run_ip(*op.args, check=False)
            if proc.returncode == 0:
                report.removed.append(op.args[-1])
            elif "No such" not in proc.stderr and "Cannot find" not in proc.stderr:
                errors.append(f"{op.describe()}: {proc.stderr.strip()}")

    # Namespaces first: deleting one deletes its veth pair (host end included) and qdiscs,
    # which the kernel finishes shortly after; then whatever host link is still there.
    apply([op for op in plan_teardown(state, existing_netns=host.list_netns(), existing_links=[])])
    host_veths = [x for x in state.get("links", []) if not str(x).endswith("br")]
    deadline = time.monotonic() + 2.0
    while any(x in host.list_links() for x in host_veths) and time.monotonic() < deadline:
        time.sleep(0.05)
    apply(plan_teardown(state, existing_netns=[], existing_links=host.list_links()))
    left_ns = [ns for ns in namespaces if ns in host.list_netns()]
    left_links = [x for x in state.get("links", []) if x in host.list_links()]
    if left_ns or left_links or errors:
        raise TestbedError(f"could not remove namespaces {left_ns} / links {left_links} of the testbed in "
                           f"{state_dir}: {'; '.join(errors) or 'still present'}; the state file is kept")
    state_path(state_dir).unlink(missing_ok=True)
    host.forget_exited()  # started by this interpreter and now gone
    return report


# --------------------------------------------------------------------------- run, status


def run(
    state_dir: str | os.PathLike[str] | None = None,
    run_config: Mapping[str, Any] | None = None,
    *,
    app_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 3600.0,
    echo: TextIO | None = None,
) -> FlwrRun:
    """``flwr run APP fededge-testbed --stream`` on the testbed; the run's real status.

    ``app_dir`` defaults to the one given to ``up``, else the current directory. Adds
    ``min-available-nodes = N`` to the run config unless it is given, so that round 1
    waits for every SuperNode (as :meth:`fededge.deploy.local.LocalDeployment.run`). A relative ``results-dir``
    is relative to the state directory (the SuperLink's working directory). Return code
    125: a process of the testbed died during the run.
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    state = read_state(state_dir)
    if state is None:
        raise TestbedError(f"no testbed is up in {state_dir}: run `fededge testbed up` first")
    if state.get("status") != "up":
        raise TestbedError(f"the testbed in {state_dir} is not up (status {state.get('status')!r})")
    dead = dead_processes(state)
    if dead:
        raise TestbedError("; ".join(dead) + f" (logs in {state['log_dir']}): `fededge testbed down` and up again")
    app = Path(app_dir or state.get("app_dir") or ".").resolve()
    if not (app / "pyproject.toml").is_file():
        raise ValueError(f"app_dir {str(app)!r} has no pyproject.toml: not a Flower app")
    cfg = dict(run_config or {})
    cfg.setdefault("min-available-nodes", len(state["nodes"]))
    log_dir = Path(state["log_dir"])
    k = 1 + sum(1 for _ in log_dir.glob("flwr-run-*.log"))
    return submit_run(app, state["connection"], cfg, env=flower_env(state["home"]), cwd=state_dir,
                      log_path=log_dir / f"flwr-run-{k}.log", timeout_s=timeout_s, echo=echo,
                      dead=lambda: dead_processes(state))


def status(state_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The state file with, per process, ``alive``; None when no testbed is up."""
    state = read_state(Path(state_dir or default_state_dir()).resolve())
    if state is None:
        return None
    for rec in state.get("processes", []):
        rec["alive"] = host.is_recorded(rec)
    existing = set(host.list_netns())
    state["namespaces_present"] = [ns for ns in state.get("namespaces", []) if ns in existing]
    return state
