"""A real Flower deployment on loopback: one SuperLink, N SuperNodes, optional netem proxies.

:class:`LocalDeployment` starts ``flower-superlink --insecure`` and ``num_supernodes``
``flower-supernode`` processes on 127.0.0.1, each SuperNode with its own partition
(``--node-config 'partition-id=i num-partitions=N'``) and its own runtime API ``--port``.
With a ``profile`` each SuperNode dials its own userspace netem proxy
(:mod:`fededge.netem.proxy`, in a thread of this process), which shapes the bytes and
forwards them to the SuperLink; without one, SuperNodes dial the SuperLink directly.
With ``secure=True`` everything runs with TLS and SuperNode authentication instead of
``--insecure``: fresh certificates and node keys (:mod:`fededge.deploy.certs`) in
``WORKDIR/certs``, each node's public key registered before it starts
(docs/deployment.md, section 2).
:meth:`LocalDeployment.run` then submits the app with ``flwr run APP_DIR CONNECTION
--stream`` and reads the run's real status with ``flwr ls --format json`` (``flwr run``
exits 0 even when the run failed). Several runs may go through one deployment.

Unlike Flower's simulation, this is the runtime of real devices: each SuperNode runs its
messages one at a time, in order, each in a fresh ``flwr-clientapp`` process, and an idle
SuperNode polls the SuperLink every 3 s (shared/reference/flower-notes.md). A message
therefore costs seconds, and a strategy that pushes rounds ahead (DGA, pipelined) gets
its overlap in wall-clock time.

Everything the deployment starts runs with a private ``FLWR_HOME`` (``WORKDIR/flwr-home``)
whose path is on every command line it starts (the SuperLink's ``--database``, a
``deploy-home`` node-config key on each SuperNode), so that
:func:`fededge.deploy.procs.stop_processes_of` finds them and all their children
(``flwr-serverapp``, ``flwr-clientapp``). :meth:`LocalDeployment.stop` stops them, then
the ``Popen`` objects that are left, the proxies, and closes the logs; it runs on leaving
the ``with`` block, also on an exception or ``KeyboardInterrupt``, and is idempotent.
Runtime dependency installation is disabled (it needs the network and would install a
CUDA torch) and telemetry is off. Each process logs to ``WORKDIR/logs/NAME.log``; error
messages and :meth:`DeploymentRun.describe` quote their tails.

The command lines, the environment, waiting for a port and ``flwr run`` with its real
status are :mod:`fededge.deploy.procs`, which the namespace testbed
(:mod:`fededge.deploy.testbed`) uses as well.

Example
-------
>>> with LocalDeployment(".", num_supernodes=2, profile="4g", workdir="/tmp/dep") as dep:  # doctest: +SKIP
...     run = dep.run({"strategy": "dga", "dga-delay": 1, "num-rounds": 3,
...                    "results-dir": "/tmp/dep/results"}, timeout_s=300)
...     assert run.ok, run.describe()
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from fededge import keys
from fededge.deploy.procs import (
    LOOPBACK, MARKER_KEY, DeploymentError, FlwrRun, flower_env, free_ports, flwr_cli, list_nodes, list_runs,
    processes_of, stop_popen, stop_processes_of, submit_run, superlink_command, supernode_command, wait_listening,
    write_connection,
)
from fededge.netem.profiles import LinkProfile, get_profile
from fededge.netem.proxy import ProxyConfig, ProxyHandle, run_in_thread

if TYPE_CHECKING:
    from typing_extensions import Self

    from fededge.deploy.certs import CertBundle

__all__ = ["DeploymentError", "DeploymentRun", "LocalDeployment", "SHIM_CLIENTAPP", "write_app_variant"]

HOST = LOOPBACK  # every process of the deployment listens here
CONNECTION = "fededge-local"


@dataclass
class DeploymentRun(FlwrRun):
    """A :class:`~fededge.deploy.procs.FlwrRun` on a :class:`LocalDeployment`.

    ``leftover_pids`` is always empty: the deployment's processes outlive a run and are
    stopped by :meth:`LocalDeployment.stop`. ``log_tails`` holds the tails of the
    SuperLink's and SuperNodes' logs when the run ended; ``proxy_stats`` each proxy's
    counters then (cumulative over the deployment's runs; empty without a profile).
    """

    log_tails: str = ""
    proxy_stats: list[dict[str, int]] = field(default_factory=list)

    def describe(self, chars: int = 3000) -> str:
        """Status, return code, the tail of ``flwr run``'s output and of every log."""
        return (f"status={self.status} rc={self.returncode} run_id={self.run_id} "
                f"wall={self.wall_s:.1f}s\n--- flwr run\n{self.output[-chars:]}\n{self.log_tails}")


SHIM_CLIENTAPP = "fededge.clients.shim:app"


def write_app_variant(app_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                      clientapp: str = SHIM_CLIENTAPP) -> Path:
    """A Flower app directory ``dest`` that is ``app_dir``'s app with another ClientApp.

    Only ``pyproject.toml`` is written (its ``[tool.flwr.app.components] clientapp``
    replaced, its ``fab-include``/``fab-exclude`` dropped): the components are imported from the installed packages, so the app is
    the same code. Used to run fededge's shim (warm mode) beside the default app.
    """
    text = (Path(app_dir) / "pyproject.toml").read_text()
    new, n = re.subn(r'(?m)^clientapp\s*=\s*"[^"]*"', f'clientapp = "{clientapp}"', text)
    if n != 1:
        raise ValueError(f"{app_dir}/pyproject.toml has {n} clientapp lines, expected one")
    new = re.sub(r"(?m)^fab-(include|exclude)\s*=.*$", "", new)  # its patterns name files not copied
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pyproject.toml").write_text(new)
    return out


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class LocalDeployment:
    """SuperLink + ``num_supernodes`` SuperNodes on 127.0.0.1, optionally behind proxies.

    Parameters
    ----------
    app_dir : path
        The Flower app ``flwr run`` bundles (the directory with ``pyproject.toml``).
    num_supernodes : int
        SuperNodes to start; node ``i`` gets ``partition-id=i num-partitions=N``.
    profile : str, LinkProfile, a sequence of them, or None
        With a profile (a name from :func:`fededge.netem.profiles.get_profile` or a
        :class:`~fededge.netem.profiles.LinkProfile`) each SuperNode dials its own
        userspace proxy with that profile (``up`` is SuperNode -> SuperLink); a
        sequence gives one profile per SuperNode. None: SuperNodes dial the SuperLink.
    workdir : path or None
        Holds ``flwr-home`` (the private ``FLWR_HOME``) and ``logs/``. None makes a
        temporary directory that :meth:`stop` removes; a given directory is kept.
    env : mapping or None
        Extra environment variables for every process (after the deployment's own).
    node_config : mapping or None
        Extra node-config keys for every SuperNode (for example ``data-dir``).
    proxy_seed : int
        Seed of proxy ``i``'s jitter and loss draws is ``proxy_seed + i``.
    start_timeout_s : float
        How long the SuperLink may take to listen.
    secure : bool
        False (default): everything ``--insecure``. True: TLS and SuperNode
        authentication, as a real deployment (docs/deployment.md, section 2). On
        :meth:`start`, :func:`fededge.deploy.certs.generate_certs` writes a fresh CA, a
        server certificate for 127.0.0.1 and localhost, and one EC key pair per SuperNode
        into ``WORKDIR/certs`` (replacing any there; :attr:`certs`, valid one day); the
        SuperLink runs with ``--ssl-*`` and ``--enable-supernode-auth``; the connection
        in ``FLWR_HOME/config.toml`` carries ``root-certificates`` instead of
        ``insecure``; every public key is registered with ``flwr supernode register``
        (:attr:`node_ids`) before SuperNode ``i`` starts with ``--root-certificates`` and
        its private key. Through a ``profile`` the proxies forward the encrypted bytes.
        Costs about 1.5 s per SuperNode at start (one ``flwr`` call each).
    warm : bool
        True (default): each SuperNode is ``fededge supernode`` (docs/deployment.md), the
        documented way to run one: a warm worker per node beside its SuperNode; an app
        whose ClientApp is fededge's shim (``fededge.clients.shim:app``, fededge's own
        app) runs its messages there instead of paying torch and the node's data in every
        process, and any other app runs as on a plain SuperNode. False: each SuperNode is
        plain ``flower-supernode`` (every message cold).

    The processes run with ``WORKDIR`` as working directory: give ``results-dir`` as an
    absolute path. :meth:`run` adds ``min-available-nodes=N`` to the run config unless it
    is given, so that round 1 waits for every SuperNode.

    Example
    -------
    >>> with LocalDeployment(".", num_supernodes=2, secure=True) as dep:  # doctest: +SKIP
    ...     print(dep.certs.ca_cert, dep.node_ids)
    ...     assert dep.run({"num-rounds": 1, "results-dir": "/tmp/r"}).ok
    """

    def __init__(
        self,
        app_dir: str | os.PathLike[str],
        *,
        num_supernodes: int,
        profile: str | LinkProfile | Sequence[str | LinkProfile] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        node_config: Mapping[str, Any] | None = None,
        proxy_seed: int = 0,
        start_timeout_s: float = 60.0,
        secure: bool = False,
        warm: bool = True,
    ) -> None:
        if not isinstance(warm, bool):
            raise TypeError(f"warm must be True or False, got {warm!r}")
        self.warm = warm
        if not isinstance(secure, bool):
            raise TypeError(f"secure must be True or False, got {secure!r}")
        if not (isinstance(num_supernodes, int) and num_supernodes >= 1):
            raise ValueError(f"num_supernodes must be an integer >= 1, got {num_supernodes!r}")
        self.app_dir = Path(app_dir).resolve()
        if not (self.app_dir / "pyproject.toml").is_file():
            raise ValueError(f"app_dir {str(self.app_dir)!r} has no pyproject.toml: not a Flower app")
        self.num_supernodes = num_supernodes
        self.profiles = self._resolve_profiles(profile, num_supernodes)
        reserved = {keys.PARTITION_ID, keys.NUM_PARTITIONS, MARKER_KEY} & set(node_config or {})
        if reserved:
            raise ValueError(f"node_config must not set {', '.join(sorted(reserved))}: the deployment sets them")
        self.node_config = dict(node_config or {})
        self.proxy_seed = proxy_seed
        self.start_timeout_s = start_timeout_s
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="fededge-deploy-") if workdir is None else workdir).resolve()
        self.home = self.workdir / "flwr-home"
        self.log_dir = self.workdir / "logs"
        self.connection = CONNECTION
        self.secure = secure
        self.certs: CertBundle | None = None  # secure: the files generate_certs wrote
        self.node_ids: list[int] = []  # secure: node id of each SuperNode's registered key
        self.superlink_port: int | None = None
        self.proxies: list[ProxyHandle] = []
        self._extra_env = dict(env or {})
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[Any]] = []
        self._runs = 0
        self._lock = threading.Lock()
        self._started = self._stopped = False
        self.survivors: list[int] = []

    @staticmethod
    def _resolve_profiles(profile: Any, n: int) -> list[LinkProfile] | None:
        if profile is None:
            return None
        if isinstance(profile, (str, LinkProfile)):
            profile = [profile] * n
        profs = [get_profile(p) if isinstance(p, str) else p for p in profile]
        if len(profs) != n:
            raise ValueError(f"profile: {len(profs)} profiles given for {n} SuperNodes")
        for p in profs:
            if not isinstance(p, LinkProfile):
                raise TypeError(f"profile must be a name or a LinkProfile, got {type(p).__name__}")
        return profs

    # ----------------------------------------------------------------- environment
    @property
    def env(self) -> dict[str, str]:
        return flower_env(self.home, self._extra_env)

    @property
    def superlink_address(self) -> str:
        if self.superlink_port is None:
            raise RuntimeError("the deployment has not been started")
        return f"{HOST}:{self.superlink_port}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return f"--- {name} ({self.log_path(name)})\n{_tail(self.log_path(name), chars)}"

    def log_tails(self, chars: int = 3000) -> str:
        """The tail of every process's log (SuperLink, then SuperNodes)."""
        return "\n".join(self.log_tail(name, chars) for name in self._procs if name != "flwr-run")

    def proxy_stats(self) -> list[dict[str, int]]:
        return [p.stats.as_dict() for p in self.proxies]

    # ----------------------------------------------------------------- start
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Start the SuperLink, the proxies and the SuperNodes; stop them all on failure."""
        if self._started:
            raise RuntimeError("a LocalDeployment starts once; make a new one")
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - open until stop()
        self._logs.append(log)
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.workdir)
        self._procs[name] = proc
        return proc

    def _start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.superlink_port = free_ports(1, host=HOST)[0]
        if self.secure:
            from fededge.deploy.certs import generate_certs

            # Fresh every start: the keys must match this SuperLink's registrations.
            self.certs = generate_certs(self.workdir / "certs", hosts=f"{HOST},localhost",
                                        supernodes=self.num_supernodes, days=1, force=True)
        ca = None if self.certs is None else self.certs.ca_cert
        write_connection(self.home, self.connection, self.superlink_address, root_certificates=ca)
        # `--database` under FLWR_HOME puts the marker on the SuperLink's command line.
        link = self._spawn("superlink", superlink_command(host=HOST, port=self.superlink_port, home=self.home,
                                                          certs=self.certs, supernode_auth=self.secure))
        wait_listening(HOST, self.superlink_port, link, timeout_s=self.start_timeout_s, what="the SuperLink",
                       log=lambda: self.log_tail("superlink"))
        if self.certs is not None:
            # A SuperNode whose key is not registered is refused (exit code 305): register first.
            self.node_ids = [self.register_supernode(pub) for _, pub in self.certs.supernode_keys]
        # Every SuperNode's runtime port at once (free_ports holds each socket until all
        # are picked): one call per node could hand two nodes one port, which both then
        # bind (gRPC's SO_REUSEPORT) and share one node's ClientApp connections.
        runtime_ports = free_ports(self.num_supernodes, host=HOST)
        for i in range(self.num_supernodes):
            target = self.superlink_port
            if self.profiles is not None:
                proxy = run_in_thread(ProxyConfig(
                    listen_host=HOST, listen_port=0, upstream_host=HOST, upstream_port=self.superlink_port,
                    profile=self.profiles[i], seed=self.proxy_seed + i))
                self.proxies.append(proxy)
                target = proxy.address[1]
            self._spawn(f"supernode-{i}", supernode_command(
                superlink=f"{HOST}:{target}", partition_id=i, num_partitions=self.num_supernodes,
                home=self.home, node_config=self.node_config, runtime_port=runtime_ports[i],
                root_certificates=ca,
                auth_key=None if self.certs is None else self.certs.supernode_keys[i][0], warm=self.warm))
        time.sleep(0.5)  # a SuperNode that cannot start (port taken, bad flag) exits at once
        self._check_alive()

    def _dead(self) -> list[str]:
        return [f"{name} exited with code {p.returncode}" for name, p in self._procs.items()
                if name != "flwr-run" and p.poll() is not None]

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            raise DeploymentError("; ".join(dead) + "\n" + self.log_tails())

    # ----------------------------------------------------------------- run
    def _flwr(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return flwr_cli(args, env=self.env, cwd=self.workdir, timeout_s=timeout_s)

    def list_runs(self) -> list[dict[str, Any]]:
        """``flwr ls CONNECTION --format json``: every run the SuperLink knows."""
        return list_runs(self.connection, env=self.env, cwd=self.workdir)

    def list_nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode list CONNECTION --format json``: the SuperLink's nodes."""
        return list_nodes(self.connection, env=self.env, cwd=self.workdir)

    def register_supernode(self, public_key: str | os.PathLike[str]) -> int:
        """``flwr supernode register PUBLIC_KEY CONNECTION``; the node id it was given.

        Only meaningful for a ``secure`` deployment (its SuperLink checks node keys);
        :meth:`start` registers the deployment's own SuperNodes.
        """
        out = self._flwr("supernode", "register", str(public_key), self.connection, "--format", "json")
        try:
            return int(json.loads(out.stdout)["node-id"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise DeploymentError(f"flwr supernode register {public_key} failed (rc {out.returncode}): "
                                  f"{out.stdout[-1000:]} {out.stderr[-1000:]}\n"
                                  f"{self.log_tail('superlink')}") from None

    def run(self, run_config: Mapping[str, Any] | None = None, *, timeout_s: float = 600,
            echo: TextIO | None = None) -> DeploymentRun:
        """``flwr run APP_DIR CONNECTION --stream --run-config ...``; the run's real status.

        Returns when ``flwr run`` exits, after ``timeout_s`` (return code 124; the run is
        then stopped on the SuperLink with ``flwr stop``), or as soon as a process of the
        deployment dies (return code 125). ``status`` is Flower's (``finished:completed``
        when the run succeeded), read with ``flwr ls``. With ``echo`` the run's output is
        copied there line by line.
        """
        if not self._started or self._stopped:
            raise RuntimeError("run() needs a started deployment (use it in a with block)")
        self._check_alive()
        cfg = dict(run_config or {})
        cfg.setdefault("min-available-nodes", self.num_supernodes)
        self._runs += 1

        def track(proc: subprocess.Popen[str] | None) -> None:
            if proc is None:
                del self._procs["flwr-run"]
            else:
                self._procs["flwr-run"] = proc  # type: ignore[assignment]

        r = submit_run(self.app_dir, self.connection, cfg, env=self.env, cwd=self.workdir,
                       log_path=self.log_path(f"flwr-run-{self._runs}"), timeout_s=timeout_s, echo=echo,
                       dead=self._dead, on_start=track)
        return DeploymentRun(r.returncode, r.output, r.status, r.run_id, r.wall_s, [], r.info,
                             log_tails=self.log_tails(), proxy_stats=self.proxy_stats())

    # ----------------------------------------------------------------- a crash
    def kill_superlink(self) -> list[int]:
        """SIGKILL the SuperLink and every process it started (the ServerApp), as a crash
        or an out-of-memory kill would: nothing is flushed or closed. The SuperNodes
        keep running and retry. Returns the pids killed."""
        pids = processes_of(str(self.home), root=lambda c: "flower-superlink" in c)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        link = self._procs.get("superlink")
        if link is not None:
            link.wait(timeout=30)
        return pids

    def restart_superlink(self) -> None:
        """Start the SuperLink again after :meth:`kill_superlink`, on the same port and
        database (the SuperNodes reconnect to it)."""
        link = self._procs.get("superlink")
        if link is not None and link.poll() is None:
            raise RuntimeError("the SuperLink is still running: kill_superlink() first")
        assert self.superlink_port is not None
        link = self._spawn("superlink", superlink_command(host=HOST, port=self.superlink_port, home=self.home,
                                                          certs=self.certs, supernode_auth=self.secure))
        wait_listening(HOST, self.superlink_port, link, timeout_s=self.start_timeout_s, what="the SuperLink",
                       log=lambda: self.log_tail("superlink"))

    # ----------------------------------------------------------------- stop
    def stop(self) -> list[int]:
        """Stop every process, proxy and log of the deployment; return surviving pids.

        Idempotent: later calls return the first call's survivors.
        """
        with self._lock:
            if self._stopped:
                return self.survivors
            self._stopped = True
        survivors = stop_processes_of(str(self.home), grace_s=5)
        for proc in self._procs.values():
            stop_popen(proc, grace_s=5)
        for proxy in self.proxies:
            proxy.stop()
        for log in self._logs:
            log.close()
        self.survivors = [p for p in survivors if Path(f"/proc/{p}").exists()]
        if self._own_workdir and not self.survivors:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.survivors
