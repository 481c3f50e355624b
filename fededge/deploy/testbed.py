"""A testbed of hosts on one machine: SuperNodes in network namespaces (issue 7).

``fededge testbed up --clients N --profiles wifi:0.5,4g:0.5 [--shaping proxy|kernel|none]``
builds, on one Linux machine (root), what docker/compose.yaml builds with containers:

- a Linux bridge ``fdgTAGbr`` in the host's network namespace holding the gateway
  address (``10.213.0.1/24`` by default, ``--subnet``);
- per client ``i`` a network namespace ``fdgTAG-ni`` joined to the bridge by a veth pair:
  ``eth0`` inside the namespace (``10.213.0.(i+2)``), ``fdgTAGhi`` on the bridge;
- one ``flower-superlink --insecure`` in the host namespace;
- per client one ``flower-supernode`` run inside its namespace (``ip netns exec``) with
  ``--node-config 'partition-id=i num-partitions=N'``; each namespace has its own
  loopback, so every SuperNode's runtime API is ``127.0.0.1:9094``, as on a real host;
- the link profile of client ``i`` (:func:`fededge.netem.assign.assign_links` over the
  ``--profiles`` mix with ``--seed``: the same assignment the simulated clock makes for
  partition ``i`` with ``netem = MIX`` and ``seed = SEED``), applied by one of

  ``proxy`` (default): a ``fededge netem proxy`` process per client on the gateway
      address; the SuperNode dials its proxy, which forwards to the SuperLink. The
      SuperLink then listens on the host's 127.0.0.1 only, which no namespace can
      reach, so a node cannot bypass its proxy (compose's ``internal`` networks).
  ``kernel``: tc qdiscs (:mod:`fededge.netem.kernel`, through netlink): the uplink on
      ``eth0``'s egress inside the namespace, the downlink on the egress of the veth's
      host end (which carries SuperLink -> node; no IFB needed). The SuperLink listens
      on the gateway address. Delay, jitter and loss need the kernel's ``sch_netem``:
      where it is missing, ``up`` refuses with an error naming the module and the fix,
      unless ``--rate-only`` asks for the rates alone (tbf), in which case the state
      file and ``up``'s output list, per node, what is NOT emulated.
  ``none``: no shaping (also what an empty ``--profiles`` gives).

Build, then run: :func:`plan_testbed` turns a :class:`TestbedConfig` (and the ports and
kernel facts found by the caller) into a :class:`TestbedPlan` -- names, addresses, ``ip``
operations, qdisc operations and command lines, as data, unit tested without root.
:func:`up` checks the machine (root or CAP_NET_ADMIN + CAP_SYS_ADMIN, the ``ip`` tool,
a subnet no route uses, ``sch_netem`` when needed), writes the plan to the state file
``STATE_DIR/testbed.json`` BEFORE it creates anything, applies it, and records every
process it starts (pid, start time, command line) as it goes. If anything fails, it
tears down what it made and re-raises.

:func:`down` (``fededge testbed down``, any process) reads the state file and removes
exactly what it names: the processes (only when pid AND start time match, so a reused
pid is never killed), their descendants and anything else running in the testbed's
namespaces, then the namespaces (which takes the veth pairs and qdiscs with them), the
remaining host links and the bridge. It checks that none is left, then removes the state
file. Every name must carry the testbed's prefix ``fdg`` + the 6-hex tag of its state
directory, or ``down`` refuses to touch it. With no state file it does nothing and
succeeds, so it is idempotent. Logs (``STATE_DIR/logs``) and results stay.

:func:`run` (``fededge testbed run``) submits the app with ``flwr run APP fededge-testbed
--stream`` (FLWR_HOME = ``STATE_DIR/flwr-home``) and reads the run's real status with
``flwr ls`` (``flwr run`` exits 0 even when a run fails), exactly as
:meth:`fededge.server.deploy.LocalDeployment.run` does: both use
:func:`fededge.server.deploy.submit_run`.

Example
-------
>>> cfg = TestbedConfig(clients=2, profiles="wifi:0.5,4g:0.5", shaping="kernel",
...                     rate_only=True, state_dir="/tmp/tb")
>>> plan = plan_testbed(cfg, superlink_port=9092)
>>> print("\\n".join(plan.commands()))  # doctest: +SKIP
>>> up(cfg)                                                  # doctest: +SKIP
>>> run("/tmp/tb", {"num-rounds": 2}).ok                     # doctest: +SKIP
>>> down("/tmp/tb")                                          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fededge import keys
from fededge.netem import kernel
from fededge.netem.assign import assign_links
from fededge.netem.profiles import Direction, LinkProfile
from fededge.server.deploy import (
    MARKER_KEY, DeploymentError, flower_bin, flower_env, submit_run, superlink_command, supernode_command,
    wait_listening, write_insecure_connection,
)
from fededge.server.launch import FlwrRun, alive, parent_pid, proc_state, processes_of, start_time

__all__ = [
    "CONNECTION", "DEFAULT_SUBNET", "SHAPINGS", "STATE_FILE",
    "IpOp", "KernelStep", "NodePlan", "ProcessSpec", "TestbedConfig", "TestbedPlan",
    "TestbedError", "PreflightError", "AlreadyUp", "NotPrivileged", "ToolMissing", "NetemUnavailable",
    "SubnetInUse",
    "default_state_dir", "testbed_tag", "plan_testbed", "plan_teardown",
    "up", "down", "run", "status", "register_cli",
]

PREFIX = "fdg"  # every namespace and link this module makes starts with it
TAG_LEN = 6
STATE_FILE = "testbed.json"
STATE_VERSION = 1
CONNECTION = "fededge-testbed"
DEFAULT_SUBNET = "10.213.0.0/24"
NODE_DEV = "eth0"
NODE_RUNTIME_PORT = 9094  # each namespace has its own loopback: the same port everywhere
LOOPBACK = "127.0.0.1"
SHAPINGS = ("proxy", "kernel", "none")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
_RESERVED_NODE_KEYS = {keys.PARTITION_ID, keys.NUM_PARTITIONS, MARKER_KEY}


# --------------------------------------------------------------------------- errors


class TestbedError(RuntimeError):
    """The machine cannot host the testbed, or a step of ``up``/``down``/``run`` failed."""

    __test__ = False  # not a pytest class


class PreflightError(TestbedError):
    """The machine cannot host the testbed as asked; raised before anything is created."""


class AlreadyUp(PreflightError):
    """The state directory already holds a testbed (or its names exist)."""


class NotPrivileged(PreflightError):
    """Neither root nor CAP_NET_ADMIN + CAP_SYS_ADMIN."""


class ToolMissing(PreflightError):
    """A program the testbed runs (``ip``, Flower's) is not installed."""


class NetemUnavailable(PreflightError):
    """``--shaping kernel`` needs sch_netem for delay/jitter/loss and the kernel has none."""


class SubnetInUse(PreflightError):
    """The testbed's subnet overlaps a route of the host."""


# --------------------------------------------------------------------------- configuration


def default_state_dir() -> Path:
    """``$XDG_RUNTIME_DIR/fededge-testbed`` when that is set, else ``/tmp/fededge-testbed``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / "fededge-testbed"


def testbed_tag(state_dir: str | os.PathLike[str]) -> str:
    """Six hex digits of the state directory's path: the testbed's part of every name."""
    return hashlib.sha1(str(Path(state_dir).resolve()).encode()).hexdigest()[:TAG_LEN]


@dataclass(frozen=True, kw_only=True)
class TestbedConfig:
    """What a user asks for; validated here, before anything is planned or touched.

    Parameters
    ----------
    clients : int
        Number of SuperNodes (and namespaces); node ``i`` gets partition ``i`` of ``N``.
    profiles : str
        ``""`` (no shaping), a profile name for every client (``"4g"``), a seeded mix
        (``"wifi:0.5,4g:0.5"``) or ``"file"`` (``[assign]`` table of ``profiles_file``):
        the ``netem`` run-config syntax of :mod:`fededge.netem.assign`.
    shaping : {"proxy", "kernel", "none"}
        How the profiles are applied (see the module docstring).
    seed : int
        Seeds the profile assignment and the proxies' jitter and loss draws.
    subnet : str
        IPv4 network of the bridge: the gateway (SuperLink side) is its first host,
        node ``i`` the ``i + 2``-th. It must hold ``clients + 1`` hosts.
    state_dir : path
        Where the state file, logs, ``flwr-home`` and (relative) results go.
    app_dir : path or None
        Default Flower app of :func:`run` (a directory with ``pyproject.toml``).
    profiles_file : str or None
        TOML file with more profiles (and the ``[assign]`` table for ``"file"``).
    rate_only : bool
        Kernel shaping: apply only the rates (tbf), not delay, jitter or loss.
    node_config : mapping
        Extra ``--node-config`` keys for every SuperNode (e.g. ``data-dir``).
    warm : bool
        True (default): each node runs ``fededge supernode`` (a warm worker beside its
        SuperNode, docs/deployment.md); False (``--cold``): ``flower-supernode`` alone.
    """

    __test__ = False  # not a pytest class

    clients: int
    profiles: str = ""
    shaping: str = "proxy"
    seed: int = 0
    subnet: str = DEFAULT_SUBNET
    state_dir: Path = field(default_factory=default_state_dir)
    app_dir: Path | None = None
    profiles_file: str | None = None
    rate_only: bool = False
    node_config: Mapping[str, Any] = field(default_factory=dict)
    warm: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.clients, bool) or not isinstance(self.clients, int) or self.clients < 1:
            raise ValueError(f"clients must be an integer >= 1, got {self.clients!r}")
        if self.shaping not in SHAPINGS:
            raise ValueError(f"shaping must be one of {', '.join(SHAPINGS)}, got {self.shaping!r}")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as err:
            raise ValueError(f"subnet must be an IPv4 network such as {DEFAULT_SUBNET}, "
                             f"got {self.subnet!r}: {err}") from None
        hosts = max(net.num_addresses - 2, 0)
        if hosts < self.clients + 1:
            raise ValueError(f"subnet {net} holds {hosts} host addresses; {self.clients} clients need "
                             f"{self.clients + 1} (one for the SuperLink side): give a larger --subnet")
        if self.rate_only and self.shaping != "kernel":
            raise ValueError("rate_only (--rate-only) only applies to shaping='kernel'")
        reserved = _RESERVED_NODE_KEYS & set(self.node_config)
        if reserved:
            raise ValueError(f"node_config must not set {', '.join(sorted(reserved))}: the testbed sets them")
        object.__setattr__(self, "state_dir", Path(self.state_dir).resolve())
        if self.app_dir is not None:
            app = Path(self.app_dir).resolve()
            if not (app / "pyproject.toml").is_file():
                raise ValueError(f"app_dir {str(app)!r} has no pyproject.toml: not a Flower app")
            object.__setattr__(self, "app_dir", app)
        object.__setattr__(self, "node_config", dict(self.node_config))
        # Unknown profile names, bad mixes and bad files fail here, naming the profile.
        object.__setattr__(self, "_links", tuple(link.profile for link in assign_links(
            self.profiles, self.clients, seed=self.seed, netem_file=self.profiles_file or "")))

    @property
    def link_profiles(self) -> tuple[LinkProfile | None, ...]:
        """The profile of every client, by partition id (None: unshaped)."""
        return self._links  # type: ignore[attr-defined, no-any-return]

    def to_dict(self) -> dict[str, Any]:
        return {"clients": self.clients, "profiles": self.profiles, "shaping": self.shaping,
                "seed": self.seed, "subnet": self.subnet, "state_dir": str(self.state_dir),
                "app_dir": None if self.app_dir is None else str(self.app_dir),
                "profiles_file": self.profiles_file, "rate_only": self.rate_only,
                "node_config": dict(self.node_config)}


# --------------------------------------------------------------------------- plan (pure)


@dataclass(frozen=True)
class IpOp:
    """One ``ip`` command (arguments after ``ip``) and the command that undoes it, if any."""

    args: tuple[str, ...]
    undo: tuple[str, ...] | None = None

    def argv(self) -> list[str]:
        return ["ip", *self.args]

    def describe(self) -> str:
        return shlex.join(self.argv())


@dataclass(frozen=True)
class KernelStep:
    """tc operations (:mod:`fededge.netem.kernel`) on one interface, in a namespace or the host's."""

    netns: str | None
    ops: tuple[kernel.Op, ...]

    def describe(self) -> list[str]:
        prefix = f"ip netns exec {self.netns} " if self.netns else ""
        return [prefix + op.describe() for op in self.ops]


@dataclass(frozen=True)
class ProcessSpec:
    """A process of the testbed: its command, its namespace (None: the host's), its port."""

    name: str
    argv: tuple[str, ...]
    netns: str | None = None
    listen: tuple[str, int] | None = None  # wait until this accepts TCP (from the host)

    def command(self) -> list[str]:
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + list(self.argv)


@dataclass(frozen=True)
class NodePlan:
    """One client host: namespace, link ends, address, profile, shaping and processes."""

    index: int
    netns: str
    host_veth: str
    address: str
    profile: str | None
    dial: str  # HOST:PORT the SuperNode dials (its proxy, or the SuperLink)
    shaping: tuple[KernelStep, ...]
    not_applied: tuple[str, ...]  # parts of the profile that are NOT emulated, and why
    proxy: ProcessSpec | None
    supernode: ProcessSpec


@dataclass(frozen=True)
class TestbedPlan:
    """Everything :func:`up` will do, as data (see :func:`plan_testbed`)."""

    __test__ = False  # not a pytest class

    tag: str
    state_dir: Path
    home: Path
    log_dir: Path
    bridge: str
    gateway: str
    prefixlen: int
    subnet: str
    shaping: str
    rate_only: bool
    netem_available: bool | None
    links: tuple[IpOp, ...]
    superlink: ProcessSpec
    superlink_address: str  # where `flwr` (on the host) reaches the SuperLink
    connection: str
    nodes: tuple[NodePlan, ...]
    app_dir: Path | None
    config: dict[str, Any]

    @property
    def namespaces(self) -> list[str]:
        return [n.netns for n in self.nodes]

    @property
    def host_links(self) -> list[str]:
        """Links made in the host namespace: the bridge and the veths' host ends."""
        return [self.bridge] + [n.host_veth for n in self.nodes]

    @property
    def processes(self) -> list[ProcessSpec]:
        """In start order: SuperLink, proxies, SuperNodes."""
        return ([self.superlink] + [n.proxy for n in self.nodes if n.proxy is not None]
                + [n.supernode for n in self.nodes])

    def commands(self) -> list[str]:
        """The plan as shell lines, in the order :func:`up` applies it."""
        lines = [op.describe() for op in self.links]
        for node in self.nodes:
            for step in node.shaping:
                lines += step.describe()
        lines += [shlex.join(p.command()) + " &" for p in self.processes]
        return lines

    def to_state(self) -> dict[str, Any]:
        """The state file's content (processes are added as they start)."""
        return {
            "version": STATE_VERSION, "tag": self.tag, "state_dir": str(self.state_dir),
            "home": str(self.home), "log_dir": str(self.log_dir), "bridge": self.bridge,
            "gateway": self.gateway, "prefixlen": self.prefixlen, "subnet": self.subnet,
            "shaping": self.shaping, "rate_only": self.rate_only, "netem_available": self.netem_available,
            "connection": self.connection, "superlink_address": self.superlink_address,
            "app_dir": None if self.app_dir is None else str(self.app_dir),
            "namespaces": self.namespaces, "links": self.host_links,
            "nodes": [{"index": n.index, "netns": n.netns, "host_veth": n.host_veth, "address": n.address,
                       "profile": n.profile, "dial": n.dial, "not_applied": list(n.not_applied),
                       "shaping": [line for s in n.shaping for line in s.describe()]} for n in self.nodes],
            "config": self.config, "processes": [], "status": "starting",
        }


def _needs_netem(d: Direction) -> bool:
    return d.delay_s > 0 or d.jitter_s > 0 or d.loss > 0


def _dropped(which: str, d: Direction) -> str | None:
    parts = []
    if d.delay_s > 0:
        parts.append(f"delay {d.delay_s * 1000:g} ms")
    if d.jitter_s > 0:
        parts.append(f"jitter {d.jitter_s * 1000:g} ms")
    if d.loss > 0:
        burst = f" (bursts of {d.loss_burst:g})" if d.loss_burst > 1 else ""
        parts.append(f"loss {d.loss * 100:g}%{burst}")
    return f"{which}: {', '.join(parts)}" if parts else None


def _rate_only(d: Direction) -> Direction:
    return dataclasses.replace(d, delay_s=0.0, jitter_s=0.0, loss=0.0, loss_burst=1.0)


def _netem_message(names: Sequence[str]) -> str:
    return (
        f"--shaping kernel: profile(s) {', '.join(repr(n) for n in names)} have delay, jitter or loss, "
        "which need the kernel's netem qdisc, and this kernel has no sch_netem (CONFIG_NET_SCH_NETEM; "
        "`tc qdisc add ... netem` fails with 'Specified qdisc kind is unknown'). Fix one of: "
        "`modprobe sch_netem` (Ubuntu/Debian: it is in linux-modules-extra-$(uname -r); in a container, "
        "load it on the host); or pass --rate-only to apply only the rates with tbf (delay, jitter and "
        "loss are then NOT emulated; up lists what is dropped per node); or use --shaping proxy "
        "(userspace, any kernel). Nothing was created."
    )


def plan_testbed(
    config: TestbedConfig,
    *,
    superlink_port: int,
    proxy_ports: Sequence[int] | None = None,
    netem_available: bool | None = None,
) -> TestbedPlan:
    """The testbed ``config`` describes, as data; pure (no root, touches nothing).

    Parameters
    ----------
    config : TestbedConfig
    superlink_port : int
        The SuperLink's port (:func:`up` picks a free one).
    proxy_ports : sequence of int, optional
        With proxy shaping, the port of client ``i``'s proxy on the gateway address;
        default ``superlink_port + 1 + i``.
    netem_available : bool or None
        Whether the kernel has sch_netem (:func:`up` probes it). False with kernel
        shaping of a profile that has delay, jitter or loss raises
        :class:`NetemUnavailable`, unless ``config.rate_only``. None: not known (a dry
        run); the plan then uses netem where the profiles need it.

    Raises
    ------
    NetemUnavailable
        See ``netem_available``.
    ValueError
        Bad ports; a trace profile with kernel shaping (tc cannot replay traces).
    """
    n = config.clients
    if not 1 <= superlink_port <= 65535:
        raise ValueError(f"superlink_port must be in 1..65535, got {superlink_port}")
    tag = testbed_tag(config.state_dir)
    net = ipaddress.IPv4Network(config.subnet)
    hosts = net.hosts()
    gateway = str(next(hosts))
    addresses = [str(next(hosts)) for _ in range(n)]
    bridge = f"{PREFIX}{tag}br"
    home = config.state_dir / "flwr-home"
    profiles = config.link_profiles
    shaped = any(p is not None for p in profiles)
    shaping = config.shaping if shaped else "none"

    if shaping == "proxy":
        ports = list(proxy_ports) if proxy_ports is not None else [superlink_port + 1 + i for i in range(n)]
        if len(ports) != n or len(set(ports)) != n or superlink_port in ports \
                or not all(1 <= p <= 65535 for p in ports):
            raise ValueError(f"proxy_ports must be {n} distinct ports in 1..65535 other than the "
                             f"SuperLink's {superlink_port}, got {ports}")
        # The SuperLink on the host's loopback: no namespace reaches it but through a proxy.
        sl_host = LOOPBACK
    else:
        ports = []
        sl_host = gateway

    if shaping == "kernel" and netem_available is False and not config.rate_only:
        needy = sorted({p.name for p in profiles if p is not None and (_needs_netem(p.up) or _needs_netem(p.down))})
        if needy:
            raise NetemUnavailable(_netem_message(needy))

    links: list[IpOp] = [
        IpOp(("link", "add", bridge, "type", "bridge"), undo=("link", "del", bridge)),
        IpOp(("addr", "add", f"{gateway}/{net.prefixlen}", "dev", bridge)),
        IpOp(("link", "set", bridge, "up")),
    ]
    nodes: list[NodePlan] = []
    superlink = ProcessSpec("superlink", tuple(superlink_command(host=sl_host, port=superlink_port, home=home)),
                            listen=(sl_host, superlink_port))
    for i, (addr, profile) in enumerate(zip(addresses, profiles)):
        ns, veth = f"{PREFIX}{tag}-n{i}", f"{PREFIX}{tag}h{i}"
        links += [
            IpOp(("netns", "add", ns), undo=("netns", "del", ns)),
            IpOp(("link", "add", veth, "type", "veth", "peer", "name", NODE_DEV, "netns", ns),
                 undo=("link", "del", veth)),
            IpOp(("link", "set", veth, "master", bridge)),
            IpOp(("link", "set", veth, "up")),
            IpOp(("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", NODE_DEV)),
            IpOp(("-n", ns, "link", "set", NODE_DEV, "up")),
            IpOp(("-n", ns, "link", "set", "lo", "up")),
        ]
        steps: list[KernelStep] = []
        dropped: list[str] = []
        proxy = None
        dial = f"{sl_host}:{superlink_port}"
        if shaping == "kernel" and profile is not None:
            effective = profile
            if config.rate_only:
                effective = dataclasses.replace(profile, up=_rate_only(profile.up), down=_rate_only(profile.down))
                dropped = [d for d in (_dropped("up", profile.up), _dropped("down", profile.down)) if d]
                dropped = [f"{d} (not applied: --rate-only)" for d in dropped]
            # Uplink on the node's egress; downlink on the host end's egress (SuperLink -> node).
            up_ops = kernel.plan_apply(NODE_DEV, effective, "egress", side="client")
            down_ops = kernel.plan_apply(veth, effective, "egress", side="server")
            steps = [s for s in (KernelStep(ns, tuple(up_ops)), KernelStep(None, tuple(down_ops))) if s.ops]
        elif shaping == "proxy" and profile is not None:
            port = ports[i]
            argv = [flower_bin("fededge"), "netem", "proxy", "--profile", profile.name,
                    "--listen", f"{gateway}:{port}", "--upstream", f"{LOOPBACK}:{superlink_port}",
                    "--seed", str(config.seed + i)]
            if config.profiles_file:
                argv += ["--profiles-file", str(Path(config.profiles_file).resolve())]
            proxy = ProcessSpec(f"proxy-{i}", tuple(argv), listen=(gateway, port))
            dial = f"{gateway}:{port}"
        supernode = ProcessSpec(f"supernode-{i}", tuple(supernode_command(
            superlink=dial, partition_id=i, num_partitions=n, home=home, node_config=config.node_config,
            runtime_host=LOOPBACK, runtime_port=NODE_RUNTIME_PORT, warm=config.warm)), netns=ns)
        nodes.append(NodePlan(index=i, netns=ns, host_veth=veth, address=addr,
                              profile=None if profile is None else profile.name, dial=dial,
                              shaping=tuple(steps), not_applied=tuple(dropped), proxy=proxy,
                              supernode=supernode))
    return TestbedPlan(
        tag=tag, state_dir=config.state_dir, home=home, log_dir=config.state_dir / "logs", bridge=bridge,
        gateway=gateway, prefixlen=net.prefixlen, subnet=str(net), shaping=shaping,
        rate_only=config.rate_only, netem_available=netem_available, links=tuple(links),
        superlink=superlink, superlink_address=f"{sl_host}:{superlink_port}", connection=CONNECTION,
        nodes=tuple(nodes), app_dir=config.app_dir, config=config.to_dict(),
    )


def _name_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"^{PREFIX}{re.escape(tag)}(br|h\d+|-n\d+)$")


def plan_teardown(state: Mapping[str, Any], *, existing_netns: Sequence[str],
                  existing_links: Sequence[str]) -> list[IpOp]:
    """The ``ip`` commands that remove what ``state`` names and still exists; pure.

    Namespaces first (deleting one deletes its veth pair, the host end included, and the
    qdiscs on them), then the host links still there, the bridge last. Every name must
    match the testbed's own pattern (``fdg`` + tag + ``br`` / ``hI`` / ``-nI``): a state
    file that names anything else (``eth0``) is refused with ValueError, so ``down``
    never deletes what it did not make.
    """
    tag = str(state.get("tag", ""))
    if not re.fullmatch(r"[0-9a-f]{%d}" % TAG_LEN, tag):
        raise ValueError(f"state file has no valid testbed tag (got {tag!r}): refusing to delete anything")
    pattern = _name_pattern(tag)
    namespaces = [str(x) for x in state.get("namespaces", [])]
    links = [str(x) for x in state.get("links", [])]
    foreign = [x for x in namespaces + links if not pattern.match(x)]
    if foreign:
        raise ValueError(f"state file names {', '.join(repr(x) for x in foreign)}, which are not this "
                         f"testbed's ({PREFIX}{tag}...): refusing to delete them")
    ops = [IpOp(("netns", "del", ns)) for ns in namespaces if ns in existing_netns]
    bridge = [x for x in links if x.endswith("br")]
    ops += [IpOp(("link", "del", x)) for x in links if x not in bridge and x in existing_links]
    ops += [IpOp(("link", "del", x)) for x in bridge if x in existing_links]
    return ops


# --------------------------------------------------------------------------- the machine


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{shlex.join(['ip', *args])}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the links of the host namespace (``ip link``)."""
    out = _ip("-o", "link", "show", check=False).stdout
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


def _check_ip() -> None:
    if shutil.which("ip") is None:
        raise ToolMissing("the `ip` tool (iproute2) is not installed or not on PATH: the testbed makes its "
                          "namespaces, veth pairs and bridge with it. Install it (apt-get install iproute2, "
                          "dnf install iproute).")


def _check_privileges() -> None:
    caps = _capabilities()
    if os.geteuid() != 0 and not (caps >> CAP_NET_ADMIN & 1 and caps >> CAP_SYS_ADMIN & 1):
        raise NotPrivileged(
            "fededge testbed needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, "
            "veth pairs, a bridge and qdiscs: run it as root, e.g. sudo \"$(command -v fededge)\" testbed ... "
            "Without root: fededge.server.deploy.LocalDeployment runs SuperLink and SuperNodes on loopback "
            "with userspace proxies, and docker/compose.yaml runs the same topology in containers.")


def check_machine() -> None:
    """The ``ip`` tool, the privileges namespaces need, and Flower's programs; else a named error."""
    _check_ip()
    _check_privileges()
    for name in ("flower-superlink", "flower-supernode", "flwr"):
        path = flower_bin(name)
        if not os.path.isabs(path) or not os.access(path, os.X_OK):
            raise ToolMissing(f"Flower's `{name}` was not found next to {sys.executable} nor on PATH: "
                              "install flwr in this environment (pip install -e .)")


def _routes() -> list[tuple[str, str]]:
    out = _ip("-j", "-4", "route", "show", check=False).stdout
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
    _ip("netns", "del", ns, check=False)  # left by a probe that was interrupted
    try:
        _ip("netns", "add", ns)
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
        _ip("netns", "del", ns, check=False)


def _is_recorded(rec: Mapping[str, Any]) -> bool:
    """The recorded process is still that process (pid and start time match) and alive."""
    pid = int(rec.get("pid", 0))
    return pid > 0 and start_time(pid) == rec.get("starttime") and alive(pid)


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid is not None and pid > 1:
        out.add(pid)
        pid = parent_pid(pid)
    return out


def flower_processes_of(home: str) -> set[int]:
    """Live Flower processes with ``home`` on their command line, and all their descendants.

    Like :func:`fededge.server.launch.processes_of`, but a root must also be a Flower
    program (``flower-*``, ``flwr*``), so that a shell or an editor that merely names a
    file under ``home`` is never signalled.
    """
    return set(processes_of(home, root=lambda c: "/flower-" in c or "/flwr" in c))


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
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


def _kill(pids: set[int], *, grace_s: float) -> list[int]:
    """SIGTERM, wait, SIGKILL, wait; return those still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while True:
            _reap(list(pids))
            pids = {p for p in pids if alive(p)}
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not pids:
            return []
    return sorted(pids)


# --------------------------------------------------------------------------- state file


def state_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir).resolve() / STATE_FILE


def read_state(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state file's content, or None when there is none."""
    path = state_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    owner = path.stat().st_uid
    if owner != os.geteuid():  # `down` kills and deletes what it lists: trust only our own
        raise TestbedError(f"{path} belongs to uid {owner}, not to you (uid {os.geteuid()}): refusing to "
                           "act on a state file somebody else wrote")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as err:
        raise TestbedError(f"{path} is not valid JSON ({err}): check it, remove what it lists by hand "
                           f"(ip netns del {PREFIX}..., ip link del {PREFIX}...), then delete it") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise TestbedError(f"{path} is not a fededge testbed state file (version {STATE_VERSION})")
    return state


def _write_state(state: Mapping[str, Any], *, create: bool = False) -> None:
    path = state_path(state["state_dir"])
    text = json.dumps(state, indent=2) + "\n"
    if create:  # claim the directory atomically: a second `up` fails here
        with open(path, "x") as f:
            f.write(text)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prepare_state_dir(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = state_dir.stat()
    if st.st_uid != os.geteuid():
        raise PreflightError(f"state directory {state_dir} belongs to uid {st.st_uid}, not to you "
                           f"(uid {os.geteuid()}): `down` would trust its state file; pick another --state-dir")


# --------------------------------------------------------------------------- up


def _spawn(spec: ProcessSpec, *, env: Mapping[str, str], cwd: Path, log_dir: Path) -> subprocess.Popen[bytes]:
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


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}"
    except OSError:
        return f"--- {path.name}: no log"


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))  # free on every address, the bridge's included
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def online_nodes(state: Mapping[str, Any]) -> int:
    """How many SuperNodes the SuperLink lists as online (``flwr supernode list``)."""
    proc = subprocess.run([flower_bin("flwr"), "supernode", "list", state["connection"], "--format", "json"],
                          env=flower_env(state["home"]), cwd=state["state_dir"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, check=False)
    try:
        nodes = json.loads(proc.stdout).get("nodes", [])
    except (json.JSONDecodeError, AttributeError):
        return 0
    return sum(1 for node in nodes if isinstance(node, dict) and node.get("status") == "online")


def dead_processes(state: Mapping[str, Any]) -> list[str]:
    """``"NAME (pid P) is not running"`` for every recorded process that is gone."""
    return [f"{rec['name']} (pid {rec['pid']}) is not running" for rec in state.get("processes", [])
            if not _is_recorded(rec)]


def up(config: TestbedConfig, *, wait_s: float = 90.0, echo: TextIO | None = None) -> dict[str, Any]:
    """Check the machine, then build the testbed; return its state (also in the state file).

    Waits until the SuperLink lists every SuperNode as online (at most ``wait_s``; 0:
    do not wait). On any failure, everything made so far is torn down (:func:`down`)
    and the error re-raised.

    Raises
    ------
    ToolMissing, NotPrivileged, AlreadyUp, NetemUnavailable, TestbedError
    """
    check_machine()
    existing = read_state(config.state_dir)
    if existing is not None:
        raise AlreadyUp(f"a testbed is already up in {config.state_dir} (namespaces "
                        f"{', '.join(existing.get('namespaces', []))}): run `fededge testbed down "
                        f"--state-dir {config.state_dir}` first, or give another --state-dir")
    check_subnet(config.subnet)
    tag = testbed_tag(config.state_dir)
    clash = [x for x in list_netns() if x.startswith(PREFIX + tag) and not x.endswith("-probe")] + \
            [x for x in list_links() if x.startswith(PREFIX + tag)]
    if clash:
        raise AlreadyUp(f"{', '.join(clash)} exist but {state_path(config.state_dir)} does not: left over from a "
                        f"testbed whose state file was removed? Delete them (ip netns del / ip link del) first")
    profiles = [p for p in config.link_profiles if p is not None]
    netem = None
    if config.shaping == "kernel" and not config.rate_only and any(
            _needs_netem(p.up) or _needs_netem(p.down) for p in profiles):
        netem = probe_netem(tag)
    ports = _free_ports(config.clients + 1)
    plan = plan_testbed(config, superlink_port=ports[0], proxy_ports=ports[1:], netem_available=netem)

    _prepare_state_dir(plan.state_dir)
    state = plan.to_state()
    try:
        _write_state(state, create=True)
    except FileExistsError:
        raise AlreadyUp(f"another `fededge testbed up` claimed {plan.state_dir} meanwhile") from None
    try:
        for d in (plan.home, plan.log_dir):  # a fresh SuperLink database and fresh logs
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        _apply(plan, state, wait_s=wait_s, echo=echo)
    except BaseException as err:
        try:
            down(plan.state_dir)
        except Exception as cleanup:  # noqa: BLE001 - reported with the original error
            if isinstance(err, Exception):
                raise TestbedError(f"{err}\nAND the teardown after it failed: {cleanup}") from err
        raise
    return state


def _say(echo: TextIO | None, text: str) -> None:
    if echo is not None:
        echo.write(text + "\n")
        echo.flush()


def _apply(plan: TestbedPlan, state: dict[str, Any], *, wait_s: float, echo: TextIO | None) -> None:
    for op in plan.links:
        _ip(*op.args)
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
        proc = _spawn(spec, env=env, cwd=plan.state_dir, log_dir=plan.log_dir)
        procs[spec.name] = proc
        state["processes"].append({"name": spec.name, "pid": proc.pid, "starttime": start_time(proc.pid),
                                   "netns": spec.netns, "argv": spec.command()})
        _write_state(state)
        if spec.listen is not None:
            host, port = spec.listen
            try:
                wait_listening(host, port, proc, timeout_s=60, what=spec.name,
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
    _write_state(state)


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
        return DownReport(nothing=True)
    plan_teardown(state, existing_netns=[], existing_links=[])  # refuses foreign names before anything
    _check_ip()
    _check_privileges()
    report = DownReport()
    namespaces = [str(x) for x in state.get("namespaces", [])]

    # Processes: the recorded ones (pid + start time), everything carrying the marker and
    # its descendants (flwr-serverapp, flwr-clientapp), and anything in our namespaces.
    mine = _ancestors()
    targets = {int(rec["pid"]) for rec in state.get("processes", []) if _is_recorded(rec)}
    home = str(state.get("home", ""))
    if home.endswith("/flwr-home"):
        targets |= flower_processes_of(home)
    existing_ns = list_netns()
    for ns in namespaces:
        if ns in existing_ns:
            targets |= set(_netns_pids(ns))
    targets -= mine
    family = set(targets)
    if targets:
        left = _kill(targets, grace_s=grace_s)
        # Children of killed processes may have been reparented meanwhile: one more sweep.
        again = set()
        if home.endswith("/flwr-home"):
            again |= flower_processes_of(home)
        for ns in namespaces:
            if ns in list_netns():
                again |= set(_netns_pids(ns))
        again -= mine
        family |= again
        left = sorted(set(left) | set(_kill(again, grace_s=grace_s) if again else []))
        if left:
            raise TestbedError(f"processes {left} of the testbed in {state_dir} survived SIGKILL; "
                               f"the state file is kept: run `fededge testbed down` again")
        report.killed = sorted(family)
    report.zombies = sorted(p for p in family if proc_state(p) == "Z")

    errors = []

    def apply(ops: list[IpOp]) -> None:
        for op in ops:
            proc = _ip(*op.args, check=False)
            if proc.returncode == 0:
                report.removed.append(op.args[-1])
            elif "No such" not in proc.stderr and "Cannot find" not in proc.stderr:
                errors.append(f"{op.describe()}: {proc.stderr.strip()}")

    # Namespaces first: deleting one deletes its veth pair (host end included) and qdiscs,
    # which the kernel finishes shortly after; then whatever host link is still there.
    apply([op for op in plan_teardown(state, existing_netns=list_netns(), existing_links=[])])
    host_veths = [x for x in state.get("links", []) if not str(x).endswith("br")]
    deadline = time.monotonic() + 2.0
    while any(x in list_links() for x in host_veths) and time.monotonic() < deadline:
        time.sleep(0.05)
    apply(plan_teardown(state, existing_netns=[], existing_links=list_links()))
    left_ns = [ns for ns in namespaces if ns in list_netns()]
    left_links = [x for x in state.get("links", []) if x in list_links()]
    if left_ns or left_links or errors:
        raise TestbedError(f"could not remove namespaces {left_ns} / links {left_links} of the testbed in "
                           f"{state_dir}: {'; '.join(errors) or 'still present'}; the state file is kept")
    state_path(state_dir).unlink(missing_ok=True)
    for pid, child in list(_CHILDREN.items()):  # started by this interpreter and now gone
        if child.poll() is not None:
            del _CHILDREN[pid]
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
    waits for every SuperNode (as ``LocalDeployment.run``). A relative ``results-dir``
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
        rec["alive"] = _is_recorded(rec)
    existing = set(list_netns())
    state["namespaces_present"] = [ns for ns in state.get("namespaces", []) if ns in existing]
    return state


# --------------------------------------------------------------------------- CLI


def describe_state(state: Mapping[str, Any]) -> str:
    """``up``'s and ``status``'s summary of a testbed."""
    shaping = state["shaping"] + (" (rates only)" if state.get("rate_only") else "")
    pids = {rec["name"]: rec for rec in state.get("processes", [])}

    def pid(name: str) -> str:
        rec = pids.get(name)
        if rec is None:
            return "not started"
        alive = rec.get("alive")
        return f"pid {rec['pid']}" + ("" if alive is None else (" alive" if alive else " NOT RUNNING"))

    lines = [f"testbed {PREFIX}{state['tag']} ({state['status']}): {len(state['nodes'])} SuperNode(s) in network "
             f"namespaces on bridge {state['bridge']} {state['gateway']}/{state['prefixlen']}; shaping: {shaping}",
             f"  SuperLink   {state['superlink_address']}  {pid('superlink')}"]
    for node in state["nodes"]:
        i = node["index"]
        proxy = f"  proxy {pid(f'proxy-{i}')}" if f"proxy-{i}" in pids else ""
        lines.append(f"  node {i:<3}    netns {node['netns']}  {node['address']}  profile "
                     f"{node['profile'] or '-'}  dials {node['dial']}  SuperNode {pid(f'supernode-{i}')}{proxy}")
        for line in node.get("not_applied", []):
            lines.append(f"              NOT emulated: {line}")
    sd = state["state_dir"]
    lines += [
        f"  state {sd}/{STATE_FILE}; logs {state['log_dir']}",
        f"run:  fededge testbed run --state-dir {sd} --run-config \"num-rounds=3\"",
        f"  or: FLWR_HOME={state['home']} flwr run . {state['connection']} --stream",
        f"down: fededge testbed down --state-dir {sd}",
    ]
    return "\n".join(lines)


def _config_from_args(args: argparse.Namespace) -> TestbedConfig:
    from fededge.cli import parse_run_config

    return TestbedConfig(clients=args.clients, profiles=args.profiles, shaping=args.shaping, seed=args.seed,
                         subnet=args.subnet, state_dir=args.state_dir, app_dir=args.app_dir,
                         profiles_file=args.profiles_file, rate_only=args.rate_only,
                         node_config=parse_run_config(args.node_config), warm=not args.cold)


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
        if args.dry_run:
            plan = plan_testbed(config, superlink_port=args.port or 9092)
            print("\n".join(plan.commands()))
            for node in plan.nodes:
                for line in node.not_applied:
                    print(f"# node {node.index}: NOT emulated: {line}")
            if config.shaping == "kernel" and not config.rate_only:
                print("# dry run: sch_netem was not checked; up refuses when it is missing (see --rate-only)")
            return 0
        state = up(config, wait_s=args.wait, echo=sys.stdout)
    except (ValueError, PreflightError) as err:
        print(f"fededge testbed up: {err}", file=sys.stderr)
        return 2
    except TestbedError as err:
        print(f"fededge testbed up: {err}\n(everything it had made was removed)", file=sys.stderr)
        return 1
    print(describe_state(status(state["state_dir"]) or state))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        report = down(args.state_dir)
    except (ValueError, TestbedError) as err:
        print(f"fededge testbed down: {err}", file=sys.stderr)
        return 1
    where = Path(args.state_dir or default_state_dir()).resolve()
    if report.nothing:
        print(f"no testbed in {where}: nothing to do")
        return 0
    print(f"testbed in {where} removed: {len(report.killed)} processes stopped; deleted "
          f"{', '.join(report.removed) or 'nothing (already gone)'}")
    if report.zombies:
        print(f"note: {len(report.zombies)} stopped processes are zombies until their parent reaps them "
              "(an init that does not reap orphans; run containers with --init)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from fededge.cli import parse_run_config

    try:
        cfg = parse_run_config(args.run_config)
        result = run(args.state_dir, cfg, app_dir=args.app_dir, timeout_s=args.timeout, echo=sys.stdout)
    except (ValueError, TestbedError) as err:
        print(f"fededge testbed run: {err}", file=sys.stderr)
        return 2
    print(f"[fededge] flwr run: exit {result.returncode}, run {result.run_id} status {result.status}, "
          f"{result.wall_s:.1f} s")
    failure = result.failure()
    if failure:  # a client's configuration error stops the run by name (fededge.server.metering)
        print(f"fededge: {failure}", file=sys.stderr)
    return 0 if result.ok else 1


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        state = status(args.state_dir)
    except TestbedError as err:
        print(f"fededge testbed status: {err}", file=sys.stderr)
        return 2
    if state is None:
        print(f"no testbed in {Path(args.state_dir or default_state_dir()).resolve()}")
        return 1
    if args.json:
        print(json.dumps(state, indent=2))
    else:
        print(describe_state(state))
    return 0 if not any(not r["alive"] for r in state["processes"]) else 1


def register_cli(sub: Any) -> None:
    """Add ``fededge testbed up | run | status | down``."""
    tb = sub.add_parser("testbed", help="SuperLink + SuperNodes in network namespaces on this machine (root)",
                        description="A testbed of hosts on one machine: each SuperNode in its own network "
                                    "namespace behind a veth pair on a bridge, its link shaped by a proxy or "
                                    "by the kernel. up, run, down. docs/deployment.md.")
    tsub = tb.add_subparsers(dest="testbed_command", required=True)
    state_help = f"state directory (default {default_state_dir()}; $XDG_RUNTIME_DIR/fededge-testbed when set)"

    u = tsub.add_parser("up", help="create the namespaces and links, start SuperLink, proxies and SuperNodes")
    u.add_argument("--clients", type=int, required=True, help="number of SuperNodes (namespaces)")
    u.add_argument("--profiles", default="",
                   help='link profiles: a name ("4g"), a seeded mix ("wifi:0.5,4g:0.5"), "file", or "" (none)')
    u.add_argument("--shaping", choices=SHAPINGS, default="proxy",
                   help="proxy: a fededge netem proxy per client (default); kernel: tc qdiscs; none")
    u.add_argument("--rate-only", action="store_true",
                   help="kernel shaping: apply the rates only (tbf); delay, jitter and loss are NOT emulated. "
                        "Needed where the kernel has no sch_netem")
    u.add_argument("--seed", type=int, default=0, help="seed of the profile assignment and the proxies")
    u.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"IPv4 subnet of the bridge (default {DEFAULT_SUBNET})")
    u.add_argument("--profiles-file", default=None, help="TOML file with extra profiles / an [assign] table")
    u.add_argument("--app-dir", default=None, help="default Flower app for `fededge testbed run`")
    u.add_argument("--node-config", default=None, help='extra SuperNode node-config, e.g. "data-dir=\\"/data\\""')
    u.add_argument("--port", type=int, default=0, help="SuperLink port (default: a free one)")
    u.add_argument("--cold", action="store_true",
                   help="flower-supernode alone, no warm fededge worker beside it (every message in a fresh "
                        "process)")
    u.add_argument("--wait", type=float, default=90.0,
                   help="seconds to wait for every SuperNode to come online (0: do not wait)")
    u.add_argument("--state-dir", default=default_state_dir(), type=Path, help=state_help)
    u.add_argument("--dry-run", action="store_true", help="print the plan (ip, tc and process commands); do nothing")
    u.set_defaults(func=_cmd_up)

    r = tsub.add_parser("run", help="flwr run an app on the testbed; exit 1 when the run failed")
    r.add_argument("--run-config", default=None, help='overrides: "num-rounds=5 alpha=0.1" or a .toml file')
    r.add_argument("--app-dir", default=None, help="Flower app (default: up's --app-dir, else .)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is stopped")
    r.add_argument("--state-dir", default=default_state_dir(), type=Path, help=state_help)
    r.set_defaults(func=_cmd_run)

    s = tsub.add_parser("status", help="what is up: namespaces, addresses, profiles, processes")
    s.add_argument("--state-dir", default=default_state_dir(), type=Path, help=state_help)
    s.add_argument("--json", action="store_true", help="print the state file (with `alive` per process)")
    s.set_defaults(func=_cmd_status)

    d = tsub.add_parser("down", help="remove every namespace, link and process the testbed made (idempotent)")
    d.add_argument("--state-dir", default=default_state_dir(), type=Path, help=state_help)
    d.set_defaults(func=_cmd_down)
