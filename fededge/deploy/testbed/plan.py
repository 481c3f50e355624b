"""The testbed as data: what a user asks for (:class:`TestbedConfig`), and everything ``up``
will do (:func:`plan_testbed`) or ``down`` will remove (:func:`plan_teardown`); pure.

Names, addresses, ``ip`` operations, qdisc operations and command lines, computed without
root and without touching the machine, so that they are unit tested as they are; the
rest of the package applies them (:mod:`fededge.deploy.testbed.lifecycle`). The errors
of the whole testbed live here too, since the plan raises the first of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fededge import keys
from fededge.deploy.procs import LOOPBACK, MARKER_KEY, flower_bin, superlink_command, supernode_command
from fededge.netem import kernel
from fededge.netem.assign import assign_links
from fededge.netem.profiles import Direction, LinkProfile

__all__ = [
    "CONNECTION", "DEFAULT_SUBNET", "PREFIX", "SHAPINGS", "STATE_FILE", "STATE_VERSION",
    "IpOp", "KernelStep", "NodePlan", "ProcessSpec", "TestbedConfig", "TestbedPlan",
    "TestbedError", "PreflightError", "AlreadyUp", "NotPrivileged", "ToolMissing", "NetemUnavailable",
    "SubnetInUse",
    "default_state_dir", "needs_netem", "testbed_tag", "plan_testbed", "plan_teardown",
]

PREFIX = "fdg"  # every namespace and link the testbed makes starts with it
TAG_LEN = 6
STATE_FILE = "testbed.json"
STATE_VERSION = 1
CONNECTION = "fededge-testbed"
DEFAULT_SUBNET = "10.213.0.0/24"
NODE_DEV = "eth0"
NODE_RUNTIME_PORT = 9094  # each namespace has its own loopback: the same port everywhere
SHAPINGS = ("proxy", "kernel", "none")
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
    superlink_port : int
        The SuperLink's port (``--port``); 0 (default): a free one.
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
    superlink_port: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.clients, bool) or not isinstance(self.clients, int) or self.clients < 1:
            raise ValueError(f"clients must be an integer >= 1, got {self.clients!r}")
        if isinstance(self.superlink_port, bool) or not isinstance(self.superlink_port, int) \
                or not 0 <= self.superlink_port <= 65535:
            raise ValueError(f"superlink_port (--port) must be a TCP port, or 0 for a free one; got "
                             f"{self.superlink_port!r}")
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
        given = Path(self.state_dir).expanduser()
        if given.is_symlink() and given.lstat().st_uid != os.geteuid():
            # (a link another user planted at /tmp/fededge-testbed redirected root's deletes)
            raise ValueError(f"state_dir {str(given)!r} is a symbolic link of another user (uid "
                             f"{given.lstat().st_uid}): give a directory of your own (--state-dir)")
        object.__setattr__(self, "state_dir", given.resolve())
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


def needs_netem(d: Direction) -> bool:
    """Whether shaping ``d`` in the kernel takes sch_netem (delay, jitter or loss)."""
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
        needy = sorted({p.name for p in profiles if p is not None and (needs_netem(p.up) or needs_netem(p.down))})
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
