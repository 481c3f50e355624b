"""``fededge supernode``: a node's warm worker and ``flower-supernode``, started and stopped together.

Every argument this command does not know is passed to ``flower-supernode`` unchanged::

    fededge supernode --insecure --superlink 10.0.0.1:9092 \\
        --node-config 'partition-id=0 num-partitions=4'

1. It makes a private directory for the worker's socket (``mkdtemp``: mode 0700, under
   ``$XDG_RUNTIME_DIR`` when set, else the temporary directory; or ``--worker-socket``,
   whose directory must be the user's own and 0700) and starts the warm worker
   (``python -m fededge.clients.worker``).
2. It starts ``flower-supernode ARGS`` with ``FEDEDGE_WORKER_SOCKET`` (and, with
   ``--cache-dir``, ``FEDEDGE_CACHE_DIR``) in its environment, which Flower passes on
   to each ``flwr-clientapp`` process: fededge's shim ClientApp finds the worker there.
3. It waits. SIGTERM, SIGINT and SIGHUP are forwarded to both; when
   ``flower-supernode`` exits, the worker is stopped and this command exits with the
   SuperNode's code. Each child runs in its own session, and stopping one signals its
   whole process group (the SuperNode's SuperExec and ``flwr-clientapp`` children
   included), SIGKILL after ``--grace`` seconds. Both children also get
   ``PR_SET_PDEATHSIG``: if this command is killed outright, the kernel stops them.
4. A worker that dies is logged and started again, after 1 s, then 2 s, 4 s, ... (at
   most 60 s) for the restarts that follow, up to ``--worker-restarts`` times (default
   5; the environment variable ``FEDEDGE_WORKER_RESTARTS`` sets the default). A worker
   that ran for 10 minutes before it died starts the count and the wait afresh. Until
   it is back, and for good once the restarts are used up, the shim runs messages cold
   (in-process): slower, never lost.

``--cold`` starts ``flower-supernode`` alone (the shim then runs every message
in-process), for comparison.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fededge.clients.shim import ENV_SOCKET
from fededge.nodecache import ENV_CACHE_DIR

__all__ = ["main", "parse_args"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> Any:
    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
        except (OSError, AttributeError):  # not Linux: the signal forwarding still applies
            pass
    return preexec


def _exe(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else (shutil.which(name) or name)


#: The default of ``--worker-restarts``.
ENV_RESTARTS = "FEDEDGE_WORKER_RESTARTS"
#: A worker that lived this long before it died starts the restart count afresh.
_HEALTHY_S = 600.0
_MAX_BACKOFF_S = 60.0


def _restarts(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"--worker-restarts / ${ENV_RESTARTS} must be an integer >= 0, got {text!r}")
    return n


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="fededge supernode", allow_abbrev=False,
        description="Start a warm fededge worker and flower-supernode together; every other argument "
                    "goes to flower-supernode (see flower-supernode --help).")
    p.add_argument("--worker-socket", default=None,
                   help="the worker's Unix socket (its directory must be yours, mode 0700); default: "
                        "a fresh private directory, removed on exit")
    p.add_argument("--cache-dir", default=None,
                   help=f"the node's data cache (sets {ENV_CACHE_DIR}; 'off' disables it)")
    p.add_argument("--cold", action="store_true", help="no worker: every message runs in its own process")
    p.add_argument("--worker-restarts", type=_restarts, default=os.environ.get(ENV_RESTARTS, "5"),  # argparse applies type to it
                   help=f"how many times a worker that dies is started again (default 5, or ${ENV_RESTARTS}); "
                        "meanwhile messages run cold")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--worker-log", default=None, help="append the worker's log here (default: this stderr)")
    return p.parse_known_args(list(argv))


class _Children:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent(), **kw)
        self.procs[name] = proc
        return proc

    def signal(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, name: str | None = None) -> None:
        procs = [self.procs[name]] if name else list(self.procs.values())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                try:
                    os.killpg(proc.pid, sig)  # the child's whole group: SuperExec, flwr-clientapp
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            if all(p.poll() is not None for p in procs):
                break
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    args, flower_args = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    # flower-supernode starts flower-superexec, and that flwr-clientapp, by name from PATH:
    # this interpreter's bin first, so that an unactivated venv still finds its own Flower.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if args.cache_dir is not None:
        env[ENV_CACHE_DIR] = args.cache_dir
    # --cold: no worker, whatever the caller's environment names (an inherited socket sent
    # a "cold" node's messages to another node's worker)
    env.pop(ENV_SOCKET, None)
    own_dir: Path | None = None
    children = _Children(args.grace)
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_signal.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if not args.cold:
            from fededge.clients.worker import WorkerSecurityError, check_private_dir

            if args.worker_socket:
                sock = Path(args.worker_socket).resolve()
            else:
                base = os.environ.get("XDG_RUNTIME_DIR") or None
                try:
                    own_dir = Path(tempfile.mkdtemp(prefix="fededge-worker-", dir=base))
                except OSError:  # set but missing or another user's (after su, sudo -E; in containers)
                    own_dir = Path(tempfile.mkdtemp(prefix="fededge-worker-"))
                sock = own_dir / "worker.sock"
            try:
                check_private_dir(sock.parent)
            except WorkerSecurityError as err:
                print(f"fededge supernode: {err}", file=sys.stderr)
                return 2
            env[ENV_SOCKET] = str(sock)
            log = open(args.worker_log, "ab") if args.worker_log else None  # noqa: SIM115
            worker_cmd = [sys.executable, "-m", "fededge.clients.worker", "--socket", str(sock)]

            def start_worker() -> None:
                children.start("worker", worker_cmd, env, stdout=log or sys.stderr, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
                print(f"fededge supernode: warm worker pid {children.procs['worker'].pid} on {sock}",
                      file=sys.stderr, flush=True)

            start_worker()
        node = children.start("supernode", [_exe("flower-supernode"), *flower_args], env, stdin=subprocess.DEVNULL)
        restarts = 0  # since the last healthy worker
        started = time.monotonic()
        restart_at: float | None = None  # when the dead worker is to be started again
        while not stop_signal and node.poll() is None:
            w = children.procs.get("worker")
            now = time.monotonic()
            if w is not None and w.poll() is not None and restart_at is None:
                if now - started >= _HEALTHY_S:
                    restarts = 0
                if restarts < args.worker_restarts:
                    wait = min(2.0 ** restarts, _MAX_BACKOFF_S)
                    restarts += 1
                    restart_at = now + wait
                    print(f"fededge supernode: the warm worker exited with code {w.returncode}; restarting it "
                          f"in {wait:.0f} s (restart {restarts} of {args.worker_restarts}); messages run cold "
                          "meanwhile", file=sys.stderr, flush=True)
                else:
                    restart_at = float("inf")
                    print(f"fededge supernode: the warm worker exited with code {w.returncode}; no restarts "
                          f"left (--worker-restarts {args.worker_restarts}): messages run cold (in their own "
                          "processes) from now on", file=sys.stderr, flush=True)
            if restart_at is not None and now >= restart_at:
                restart_at = None
                started = now
                start_worker()
            time.sleep(0.2)
        if stop_signal:
            children.stop()
            return 128 + stop_signal[0]
        rc = node.returncode
        children.stop()
        return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N, as on the stop path
    finally:
        children.stop()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
