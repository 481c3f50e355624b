"""Kernel backend: shape a real Linux interface with tc qdiscs, through netlink.

Build, then apply (mininet's ``TCIntf`` habit): :func:`plan_apply` and
:func:`plan_clear` turn a :class:`~fededge.netem.profiles.LinkProfile` into a list of
operations (frozen dataclasses, pure data, testable without root); :func:`apply`
executes such a list with pyroute2 (no ``tc`` binary) and rolls back everything it did
when one operation fails, so an interface is never left half-shaped.

Directions
----------
On a CLIENT host (``side="client"``, the default) an interface's egress carries the
uplink (``profile.up``) and its ingress the downlink (``profile.down``). On a server
(``side="server"``) the two swap.

The qdisc tree
--------------
Egress of ``DEV`` (or of the IFB, for ingress)::

    rate only (no delay, jitter or loss):
        root  fede:  tbf  rate R burst B limit L
    delay / jitter / loss (needs sch_netem), with or without a rate:
        root  fede:  netem  limit N delay D J  loss random P | loss gemodel p r
          parent fede:1  handle fedf:  tbf rate R burst B limit L     (only when rated)

fededge's qdiscs carry the major handle ``fede:`` (the child ``fedf:``), so
:func:`clear` can tell its own root qdisc from somebody else's.

Ingress cannot be queued in Linux, so it is redirected to an IFB device and shaped on
the IFB's egress, with the same tree as above::

    ip link add ifb-DEV type ifb ; ip link set dev ifb-DEV up
    <tree above on ifb-DEV>
    tc qdisc add dev DEV ingress
    tc filter add dev DEV parent ffff: protocol all prio 1 u32 match u32 0 0 \\
        action mirred egress redirect dev ifb-DEV

The IFB is shaped before the redirect is installed, so no packet ever crosses an
unshaped IFB. (u32 match-all rather than ``matchall``: u32 is in far more kernels.)

tbf sizing (:func:`tbf_params`)
-------------------------------
``burst`` (bucket depth, bytes) = max(rate / 250 Hz, 2 frames): tbf refills from a timer
that, on a CONFIG_HZ=250 kernel (the lowest common), may fire only every 4 ms, so the
bucket must hold at least 4 ms of rate or the link runs below its rate; it must also
hold a whole frame (MTU + 14 bytes of Ethernet header) or large packets are dropped.
``limit`` (queue, bytes) = burst + max(50 ms of rate, 16 frames): a few tens of ms of
queueing, enough for TCP to keep the link busy without a bufferbloated RTT, and at
least 16 frames so that slow links (400 kbit/s) do not drop every burst.

netem sizing and ordering
-------------------------
netem's ``limit`` is in packets and must hold everything in flight on the delayed
link: max(1000 (netem's default), 1.5 x rate x (delay + 4 jitter + 50 ms) / frame),
with 1 Gbit/s assumed for an unshaped rate. With jitter, netem sorts packets by their
send time and so REORDERS them, unless its own ``rate`` is set; fededge promises jitter
without reordering, so with jitter it sets netem's rate to its u32 maximum
(~34 Gbit/s): the order is kept and that rate never binds (tbf does the shaping).

Loss: ``loss_burst == 1`` is netem's random loss; ``loss_burst > 1`` is
``loss gemodel p r`` with (p, r) = :attr:`Direction.gilbert_elliott`, every packet
lost in the bad state and none in the good (netem's defaults for 1-h and 1-k).

Example
-------
>>> from fededge.netem.profiles import get_profile
>>> for op in plan_apply("eth0", get_profile("4g"), direction="egress"):
...     print(op.describe())  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Sequence, Union

from fededge.netem.profiles import Direction, LinkProfile, ProfileError, get_profile, load_profiles

__all__ = [
    "AddIfb", "LinkUp", "AddQdisc", "AddFilter", "DelQdisc", "DelFilter", "DelLink", "Op",
    "TbfParams", "NetemParams", "ShapingState",
    "KernelShapingError", "KernelFeatureMissing", "NeedsRootError", "DeviceNotFound",
    "ShapingConflict", "ApplyFailed", "TraceNotSupported",
    "ROOT_HANDLE", "CHILD_HANDLE", "INGRESS_HANDLE",
    "default_ifb_name", "tbf_params", "netem_params", "plan_apply", "plan_clear",
    "read_state", "apply", "clear", "register_cli",
]

log = logging.getLogger(__name__)

TC_H_ROOT = 0xFFFFFFFF
TC_H_INGRESS = 0xFFFFFFF1
ROOT_HANDLE = 0xFEDE0000  # "fede:" marks fededge's root qdisc
CHILD_HANDLE = 0xFEDF0000  # "fedf:" the tbf under netem
INGRESS_HANDLE = 0xFFFF0000  # "ffff:" the ingress qdisc (fixed by the kernel)
FILTER_PRIO = 1
ETH_P_ALL = 0x0003
ETH_HLEN = 14
IFNAMSIZ = 15  # usable characters
TBF_HZ = 250
TBF_QUEUE_S = 0.050
TBF_MIN_QUEUE_FRAMES = 16
NETEM_DEFAULT_LIMIT = 1000
NETEM_UNSHAPED_BPS = 1e9
U32_MAX = 0xFFFFFFFF
PROXY_HINT = "fededge netem proxy --profile NAME --listen HOST:PORT --upstream HOST:PORT"

Which = Literal["egress", "ingress", "both"]
Side = Literal["client", "server"]


# --------------------------------------------------------------------------- errors


class KernelShapingError(RuntimeError):
    """Base of the kernel backend's runtime errors."""


class KernelFeatureMissing(KernelShapingError):
    """The kernel lacks a qdisc, classifier, action or device type the plan needs.

    ``feature`` is the module name (``sch_netem``), ``config`` its kernel option.
    """

    def __init__(self, feature: str, config: str, detail: str = "") -> None:
        self.feature, self.config = feature, config
        msg = (
            f"the kernel has no {feature} ({config}){': ' + detail if detail else ''}. "
            f"Load it with `modprobe {feature}` or build the kernel with {config}=m; "
            "on Raspberry Pi OS the stock kernel ships it as a module (on Ubuntu/Debian "
            "images it may be in linux-modules-extra-$(uname -r)); in a container, load "
            "it on the host. Without kernel support, shape in userspace instead: "
            f"`{PROXY_HINT}`."
        )
        super().__init__(msg)


class NeedsRootError(KernelShapingError):
    """Netlink refused for lack of privilege (EPERM)."""


class DeviceNotFound(KernelShapingError):
    """The interface (or network namespace) does not exist."""


class ShapingConflict(KernelShapingError):
    """The interface already has a root/ingress qdisc or the IFB name is taken."""


class ApplyFailed(KernelShapingError):
    """An operation failed for another reason; what was applied has been rolled back."""


class TraceNotSupported(ProfileError):
    """tc cannot replay a Mahimahi trace; the proxy can."""


def _needs_root_message(what: str) -> str:
    return (
        f"{what}: operation not permitted. Kernel shaping needs root or CAP_NET_ADMIN: "
        "run with sudo, or in a container started with --cap-add NET_ADMIN. "
        f"No privileges? Use the userspace proxy: `{PROXY_HINT}`."
    )


# --------------------------------------------------------------------------- parameters


def _fmt_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale and (bps / scale) == int(bps / scale):
            return f"{int(bps / scale)}{unit}"
    return f"{int(round(bps))}bit"


def _fmt_time(s: float) -> str:
    us = s * 1e6
    if us >= 1000 and us % 1000 == 0:
        return f"{int(us // 1000)}ms"
    if us >= 1000:
        return f"{us / 1000:g}ms"
    return f"{int(round(us))}us"


def _fmt_pct(x: float) -> str:
    return f"{x * 100:.6g}%"


@dataclass(frozen=True, kw_only=True)
class TbfParams:
    """tbf's knobs, as the kernel takes them: rate in bit/s, burst and limit in bytes."""

    rate_bps: float
    burst_bytes: int
    limit_bytes: int

    def __post_init__(self) -> None:
        if not self.rate_bps > 0:
            raise ValueError(f"tbf rate must be > 0 bit/s, got {self.rate_bps}")
        if self.rate_bps / 8 > U32_MAX:
            raise ValueError(
                f"tbf rate {self.rate_bps:g} bit/s exceeds the 32-bit byte rate tbf takes "
                f"(~{U32_MAX * 8 / 1e9:.1f} Gbit/s); leave such a link unshaped"
            )
        if self.burst_bytes < 1 or self.limit_bytes < self.burst_bytes:
            raise ValueError(f"tbf needs 1 <= burst <= limit, got burst {self.burst_bytes}, limit {self.limit_bytes}")

    def describe(self) -> str:
        return f"rate {_fmt_rate(self.rate_bps)} burst {self.burst_bytes} limit {self.limit_bytes}"


@dataclass(frozen=True, kw_only=True)
class NetemParams:
    """netem's knobs: delay and jitter in seconds, loss as a fraction.

    ``gemodel`` is ``(p, r)`` for Gilbert–Elliott loss (then ``loss`` is 0), ``limit``
    is in packets, ``order_rate_Bps`` is netem's own rate in bytes/s, set only to keep
    packets in order under jitter (see the module docstring).
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    gemodel: tuple[float, float] | None = None
    limit: int = NETEM_DEFAULT_LIMIT
    order_rate_Bps: int | None = None

    def describe(self) -> str:
        parts = [f"limit {self.limit}"]
        if self.delay_s or self.jitter_s:
            parts.append(f"delay {_fmt_time(self.delay_s)}")
            if self.jitter_s:
                parts.append(_fmt_time(self.jitter_s))
        if self.gemodel is not None:
            p, r = self.gemodel
            parts.append(f"loss gemodel {_fmt_pct(p)} {_fmt_pct(r)}")
        elif self.loss:
            parts.append(f"loss random {_fmt_pct(self.loss)}")
        if self.order_rate_Bps:
            parts.append(f"rate {self.order_rate_Bps * 8}bit")
        return " ".join(parts)


def tbf_params(rate_bps: float, *, mtu: int = 1500) -> TbfParams:
    """tbf burst and limit for a rate (see "tbf sizing" in the module docstring).

    >>> tbf_params(10e6)
    TbfParams(rate_bps=10000000.0, burst_bytes=5000, limit_bytes=67500)
    """
    frame = mtu + ETH_HLEN
    rate_Bps = rate_bps / 8
    burst = max(math.ceil(rate_Bps / TBF_HZ), 2 * frame)
    limit = burst + max(math.ceil(rate_Bps * TBF_QUEUE_S), TBF_MIN_QUEUE_FRAMES * frame)
    return TbfParams(rate_bps=rate_bps, burst_bytes=burst, limit_bytes=limit)


def netem_params(d: Direction, *, mtu: int = 1500) -> NetemParams:
    """netem's parameters for one direction (delay, jitter, loss; never the rate)."""
    frame = mtu + ETH_HLEN
    rate = d.rate_bps if d.rate_bps is not None else NETEM_UNSHAPED_BPS
    in_flight_s = d.delay_s + 4 * d.jitter_s + TBF_QUEUE_S
    limit = max(NETEM_DEFAULT_LIMIT, math.ceil(1.5 * rate / 8 * in_flight_s / frame))
    gemodel = None
    loss = d.loss
    if d.loss > 0 and d.loss_burst > 1:
        gemodel, loss = d.gilbert_elliott, 0.0
    return NetemParams(
        delay_s=d.delay_s, jitter_s=d.jitter_s, loss=loss, gemodel=gemodel, limit=limit,
        order_rate_Bps=U32_MAX if d.jitter_s > 0 else None,
    )


def _hex_handle(h: int) -> str:
    major, minor = h >> 16, h & 0xFFFF
    return f"{major:x}:" if minor == 0 else f"{major:x}:{minor:x}"


def _parent_words(parent: int) -> str:
    if parent == TC_H_ROOT:
        return "root"
    if parent == TC_H_INGRESS:
        return "ingress"
    return f"parent {_hex_handle(parent)}"


# --------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class AddIfb:
    """Create an IFB device (``ip link add NAME type ifb``)."""

    name: str

    def describe(self) -> str:
        return f"ip link add {self.name} type ifb"

    def undo(self) -> "Op | None":
        return DelLink(self.name)


@dataclass(frozen=True)
class LinkUp:
    """Bring a link up (``ip link set dev NAME up``)."""

    name: str

    def describe(self) -> str:
        return f"ip link set dev {self.name} up"

    def undo(self) -> "Op | None":
        return None  # the only link fededge brings up is its own IFB, deleted on undo


@dataclass(frozen=True)
class AddQdisc:
    """``tc qdisc add dev DEV (root|ingress|parent P) handle H KIND PARAMS``."""

    dev: str
    kind: Literal["tbf", "netem", "ingress"]
    handle: int
    parent: int
    params: TbfParams | NetemParams | None = None

    def describe(self) -> str:
        tail = f" {self.params.describe()}" if self.params is not None else ""
        where = _parent_words(self.parent)
        if self.kind == "ingress":
            return f"tc qdisc add dev {self.dev} ingress"
        return f"tc qdisc add dev {self.dev} {where} handle {_hex_handle(self.handle)} {self.kind}{tail}"

    def undo(self) -> "Op | None":
        return DelQdisc(self.dev, handle=self.handle, parent=self.parent)


@dataclass(frozen=True)
class AddFilter:
    """A u32 match-all filter redirecting every packet to ``redirect_to``'s egress."""

    dev: str
    parent: int
    redirect_to: str
    kind: Literal["u32"] = "u32"
    prio: int = FILTER_PRIO

    def describe(self) -> str:
        return (
            f"tc filter add dev {self.dev} parent {_hex_handle(self.parent)} protocol all "
            f"prio {self.prio} u32 match u32 0 0 action mirred egress redirect dev {self.redirect_to}"
        )

    def undo(self) -> "Op | None":
        return DelFilter(self.dev, parent=self.parent, prio=self.prio)


@dataclass(frozen=True)
class DelQdisc:
    """``tc qdisc del dev DEV (root|ingress|parent P) handle H``."""

    dev: str
    handle: int
    parent: int

    def describe(self) -> str:
        if self.parent == TC_H_INGRESS:
            return f"tc qdisc del dev {self.dev} ingress"
        return f"tc qdisc del dev {self.dev} {_parent_words(self.parent)} handle {_hex_handle(self.handle)}"

    def undo(self) -> "Op | None":
        return None


@dataclass(frozen=True)
class DelFilter:
    """``tc filter del dev DEV parent P prio N``."""

    dev: str
    parent: int
    prio: int = FILTER_PRIO

    def describe(self) -> str:
        return f"tc filter del dev {self.dev} parent {_hex_handle(self.parent)} prio {self.prio}"

    def undo(self) -> "Op | None":
        return None


@dataclass(frozen=True)
class DelLink:
    """``ip link del NAME``."""

    name: str

    def describe(self) -> str:
        return f"ip link del {self.name}"

    def undo(self) -> "Op | None":
        return None


Op = Union[AddIfb, LinkUp, AddQdisc, AddFilter, DelQdisc, DelFilter, DelLink]


# --------------------------------------------------------------------------- planning


def default_ifb_name(dev: str) -> str:
    """The IFB fededge makes for ``dev``: ``ifb-DEV``, or a hash when that is too long."""
    name = f"ifb-{dev}"
    if len(name) <= IFNAMSIZ:
        return name
    return "ifb-" + hashlib.sha1(dev.encode()).hexdigest()[: IFNAMSIZ - 4]


def _shapes(d: Direction) -> bool:
    return d.rate_bps is not None or d.delay_s > 0 or d.jitter_s > 0 or d.loss > 0


def _tree(dev: str, d: Direction, *, mtu: int) -> list[Op]:
    """The qdisc tree on ``dev``'s egress for one direction (see the module docstring)."""
    needs_netem = d.delay_s > 0 or d.jitter_s > 0 or d.loss > 0
    if not needs_netem:
        assert d.rate_bps is not None
        return [AddQdisc(dev, "tbf", ROOT_HANDLE, TC_H_ROOT, tbf_params(d.rate_bps, mtu=mtu))]
    ops: list[Op] = [AddQdisc(dev, "netem", ROOT_HANDLE, TC_H_ROOT, netem_params(d, mtu=mtu))]
    if d.rate_bps is not None:
        ops.append(AddQdisc(dev, "tbf", CHILD_HANDLE, ROOT_HANDLE | 1, tbf_params(d.rate_bps, mtu=mtu)))
    return ops


def plan_apply(
    dev: str,
    profile: LinkProfile,
    direction: Which = "egress",
    *,
    side: Side = "client",
    ifb_name: str | None = None,
    mtu: int = 1500,
) -> list[Op]:
    """The operations that shape ``dev`` with ``profile``; pure, needs no root.

    Parameters
    ----------
    dev : str
        Interface name (in the namespace :func:`apply` will be given).
    profile : LinkProfile
        The link; on a client ``up`` shapes egress and ``down`` ingress.
    direction : {"egress", "ingress", "both"}
        Which side of the interface to shape. Ingress goes through an IFB.
    side : {"client", "server"}
        ``"server"`` swaps the directions: a server's egress is the downlink.
    ifb_name : str, optional
        Name of the IFB to create; default :func:`default_ifb_name`.
    mtu : int
        Interface MTU, for tbf's burst and netem's limit (frames are MTU + 14 bytes).

    Returns
    -------
    list of Op
        Empty when the chosen directions shape nothing.

    Raises
    ------
    TraceNotSupported
        A direction to be shaped is a Mahimahi trace: use the proxy.
    ValueError
        Bad ``direction``, ``side``, name or ``mtu``.
    """
    if direction not in ("egress", "ingress", "both"):
        raise ValueError(f"direction must be 'egress', 'ingress' or 'both', got {direction!r}")
    if side not in ("client", "server"):
        raise ValueError(f"side must be 'client' or 'server', got {side!r}")
    if not dev or len(dev) > IFNAMSIZ:
        raise ValueError(f"interface names are 1-{IFNAMSIZ} characters, got {dev!r}")
    if mtu < 68:
        raise ValueError(f"mtu must be >= 68 bytes, got {mtu}")
    egress_dir, ingress_dir = (profile.up, profile.down) if side == "client" else (profile.down, profile.up)
    wanted = []
    if direction in ("egress", "both"):
        wanted.append(("egress", egress_dir))
    if direction in ("ingress", "both"):
        wanted.append(("ingress", ingress_dir))
    for which, d in wanted:
        if d.trace is not None:
            raise TraceNotSupported(
                f"profile {profile.name!r}: its {which} direction replays the trace {str(d.trace)!r}, "
                f"which tc cannot do; replay it with the userspace proxy: `fededge netem proxy "
                f"--profile {profile.name} --listen HOST:PORT --upstream HOST:PORT`"
            )
    ops: list[Op] = []
    for which, d in wanted:
        if not _shapes(d):
            continue
        if which == "egress":
            ops += _tree(dev, d, mtu=mtu)
        else:
            ifb = ifb_name or default_ifb_name(dev)
            if len(ifb) > IFNAMSIZ:
                raise ValueError(f"IFB name {ifb!r} is longer than {IFNAMSIZ} characters")
            ops += [AddIfb(ifb), LinkUp(ifb)]
            ops += _tree(ifb, d, mtu=mtu)  # shaped before any packet is redirected to it
            ops += [
                AddQdisc(dev, "ingress", INGRESS_HANDLE, TC_H_INGRESS),
                AddFilter(dev, INGRESS_HANDLE, redirect_to=ifb),
            ]
    return ops


@dataclass(frozen=True, kw_only=True)
class ShapingState:
    """What :func:`clear` found on an interface (read by :func:`read_state`)."""

    root_handle: int | None = None  # handle of a non-default root qdisc, None if default
    root_kind: str | None = None
    has_ingress: bool = False
    ifb_exists: bool = False


def plan_clear(dev: str, *, ifb_name: str | None = None, state: ShapingState | None = None) -> list[Op]:
    """The operations that remove fededge's shaping from ``dev``.

    With ``state`` (what is there now) only what exists and is fededge's is removed: the
    root qdisc if its handle is ``fede:``, the ingress qdisc, and fededge's IFB. Without
    it (``--dry-run``) the plan lists everything fededge could have added. Ingress goes
    first, so no packet is redirected to an IFB that is being deleted.
    """
    ifb = ifb_name or default_ifb_name(dev)
    if state is None:
        state = ShapingState(root_handle=ROOT_HANDLE, root_kind="?", has_ingress=True, ifb_exists=True)
    ops: list[Op] = []
    if state.has_ingress:
        ops.append(DelQdisc(dev, handle=INGRESS_HANDLE, parent=TC_H_INGRESS))
    if state.root_handle == ROOT_HANDLE:
        ops.append(DelQdisc(dev, handle=ROOT_HANDLE, parent=TC_H_ROOT))
    if state.ifb_exists:
        ops.append(DelLink(ifb))
    return ops


# --------------------------------------------------------------------------- netlink


@lru_cache(maxsize=1)
def _netem_msg_class():
    """A tcmsg whose netem options also carry TCA_NETEM_LOSS (gemodel).

    pyroute2's netem plugin has no Gilbert–Elliott loss, so netem requests are encoded
    here; the layout is the kernel's ``struct tc_netem_qopt`` followed by attributes.
    """
    from pyroute2.netlink import nla
    from pyroute2.netlink.rtnl.tcmsg import tcmsg

    class netem_tcmsg(tcmsg):
        nla_map = tuple(
            (name, "netem_options") if name == "TCA_OPTIONS" else (name, fmt)
            for name, fmt in ((x[0], x[1]) for x in tcmsg.nla_map)
        )
        # pyroute2 compiles a class's nla_map on first use and marks the class compiled;
        # a subclass made after tcmsg was used (any earlier tc request in the process)
        # would inherit that mark and tcmsg's tables, and never compile its own map.
        _nlmsg_base__compiled_nla = False

        class netem_options(nla):
            _nlmsg_base__compiled_nla = False  # as above: compile this map, not nla's
            fields = (
                ("delay", "I"), ("limit", "I"), ("loss", "I"),
                ("gap", "I"), ("duplicate", "I"), ("jitter", "I"),
            )
            nla_map = (
                ("TCA_NETEM_UNSPEC", "none"),
                ("TCA_NETEM_CORR", "none"),
                ("TCA_NETEM_DELAY_DIST", "none"),
                ("TCA_NETEM_REORDER", "none"),
                ("TCA_NETEM_CORRUPT", "none"),
                ("TCA_NETEM_LOSS", "netem_loss"),
                ("TCA_NETEM_RATE", "netem_rate"),
            )

            class netem_loss(nla):
                _nlmsg_base__compiled_nla = False
                nla_flags = 0x8000  # NLA_F_NESTED
                nla_map = (
                    ("NETEM_LOSS_UNSPEC", "none"),
                    ("NETEM_LOSS_GI", "none"),
                    ("NETEM_LOSS_GE", "gemodel"),
                )

                class gemodel(nla):
                    fields = (("p", "I"), ("r", "I"), ("h", "I"), ("k1", "I"))

            class netem_rate(nla):
                fields = (
                    ("rate", "I"), ("packet_overhead", "i"),
                    ("cell_size", "I"), ("cell_overhead", "i"),
                )

    return netem_tcmsg


def _prob_u32(x: float) -> int:
    """A probability as netem's u32 fraction of 2**32 - 1 (iproute2's get_percent)."""
    return min(U32_MAX, max(0, int(round(x * U32_MAX))))


def _psched_ticks(seconds: float) -> int:
    from pyroute2.netlink.rtnl.tcmsg.common import time2tick

    return int(time2tick(seconds * 1e6))


def encode_netem(index: int, handle: int, parent: int, p: NetemParams):
    """The RTM_NEWQDISC message for a netem qdisc (built, not sent)."""
    cls = _netem_msg_class()
    msg = cls()
    msg["family"] = 0  # AF_UNSPEC
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    attrs: list[list[Any]] = []
    if p.gemodel is not None:
        gp, gr = p.gemodel
        # h = P(transmit | bad) = 0 and k1 = P(loss | good) = 0: iproute2's defaults
        attrs.append(["TCA_NETEM_LOSS", {"attrs": [["NETEM_LOSS_GE", {"p": _prob_u32(gp), "r": _prob_u32(gr), "h": 0, "k1": 0}]]}])
    if p.order_rate_Bps:
        attrs.append(["TCA_NETEM_RATE", {"rate": int(p.order_rate_Bps), "packet_overhead": 0, "cell_size": 0, "cell_overhead": 0}])
    options = {
        "delay": _psched_ticks(p.delay_s), "limit": int(p.limit), "loss": _prob_u32(p.loss),
        "gap": 0, "duplicate": 0, "jitter": _psched_ticks(p.jitter_s), "attrs": attrs,
    }
    msg["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", options]]
    return msg


def _open(netns: str | None):
    from pyroute2 import IPRoute

    try:
        if netns is None:
            return IPRoute()
        return IPRoute(netns=netns, flags=0)  # flags=0: never create a namespace by accident
    except PermissionError as err:
        raise NeedsRootError(_needs_root_message(f"entering network namespace {netns!r}")) from err
    except FileNotFoundError as err:
        raise DeviceNotFound(f"network namespace {netns!r} does not exist (see `ip netns list`)") from err


def _index(ipr, name: str, netns: str | None) -> int:
    found = ipr.link_lookup(ifname=name)
    if not found:
        where = f" in network namespace {netns!r}" if netns else ""
        raise DeviceNotFound(f"no network interface {name!r}{where} (see `ip link`)")
    return int(found[0])


def _execute(ipr, op: Op, netns: str | None) -> None:
    from pyroute2.netlink.rtnl import RTM_NEWQDISC
    from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST

    if isinstance(op, AddIfb):
        ipr.link("add", ifname=op.name, kind="ifb")
    elif isinstance(op, LinkUp):
        ipr.link("set", index=_index(ipr, op.name, netns), state="up")
    elif isinstance(op, DelLink):
        ipr.link("del", index=_index(ipr, op.name, netns))
    elif isinstance(op, AddQdisc):
        idx = _index(ipr, op.dev, netns)
        if op.kind == "tbf":
            p = op.params
            assert isinstance(p, TbfParams)
            ipr.tc("add", "tbf", idx, handle=op.handle, parent=op.parent,
                   rate=int(p.rate_bps / 8), burst=p.burst_bytes, limit=p.limit_bytes)
        elif op.kind == "netem":
            assert isinstance(op.params, NetemParams)
            msg = encode_netem(idx, op.handle, op.parent, op.params)
            msg["header"]["type"] = RTM_NEWQDISC
            msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
            # nlm_request_batch: pyroute2 0.9's sync nlm_request trips on a missing
            # 'nlm_generator' status key; the batch call sends the same single message.
            ipr.nlm_request_batch([msg])
        elif op.kind == "ingress":
            ipr.tc("add", "ingress", idx, handle=op.handle)
        else:  # pragma: no cover - the dataclass admits only the kinds above
            raise ValueError(f"unknown qdisc kind {op.kind!r}")
    elif isinstance(op, DelQdisc):
        ipr.tc("del", index=_index(ipr, op.dev, netns), handle=op.handle, parent=op.parent)
    elif isinstance(op, AddFilter):
        idx = _index(ipr, op.dev, netns)
        target = _index(ipr, op.redirect_to, netns)
        ipr.tc("add-filter", "u32", idx, parent=op.parent, prio=op.prio, protocol=ETH_P_ALL,
               target=0x1, keys=["0x0/0x0+0"],
               action={"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": target})
    elif isinstance(op, DelFilter):
        ipr.tc("del-filter", index=_index(ipr, op.dev, netns), parent=op.parent, prio=op.prio,
               protocol=ETH_P_ALL)
    else:
        raise TypeError(f"not a kernel operation: {op!r}")


_FEATURES = {
    "netem": ("sch_netem", "CONFIG_NET_SCH_NETEM"),
    "tbf": ("sch_tbf", "CONFIG_NET_SCH_TBF"),
    "ingress": ("sch_ingress", "CONFIG_NET_SCH_INGRESS"),
}


def _translate(op: Op, err: BaseException) -> KernelShapingError:
    """A netlink error on ``op`` -> the named exception that explains it."""
    if isinstance(err, KernelShapingError):
        return err
    code = getattr(err, "code", None)
    if code is None and isinstance(err, OSError):
        code = err.errno
    text = f"{op.describe()!r} failed: {err}"
    if code in (errno.EPERM, errno.EACCES):
        return NeedsRootError(_needs_root_message(op.describe()))
    missing = code in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENOTSUP)
    if isinstance(op, AddQdisc) and missing:
        feature, config = _FEATURES[op.kind]
        return KernelFeatureMissing(feature, config, f"adding the {op.kind} qdisc failed ({err})")
    if isinstance(op, AddFilter) and missing:
        return KernelFeatureMissing("cls_u32", "CONFIG_NET_CLS_U32 and CONFIG_NET_ACT_MIRRED",
                                    f"the ingress redirect filter failed ({err})")
    if isinstance(op, AddIfb) and code in (errno.EOPNOTSUPP, errno.ENOENT, errno.ENODEV):
        return KernelFeatureMissing("ifb", "CONFIG_IFB", f"creating the IFB {op.name!r} failed ({err})")
    if code == errno.EEXIST:
        if isinstance(op, AddIfb):
            return ShapingConflict(f"{text}: a link named {op.name!r} exists; pick another ifb_name or clear it")
        return ShapingConflict(
            f"{text}: the interface already has a qdisc there; run `fededge netem clear --dev DEV` first "
            "(it removes fededge's own shaping only)"
        )
    return ApplyFailed(text)


def apply(plan: Sequence[Op], *, netns: str | None = None, _ipr: Any = None) -> list[Op]:
    """Execute ``plan`` through netlink; all or nothing.

    Each operation is logged (logger ``fededge.netem.kernel``) as its tc equivalent. If
    one fails, the operations already applied are undone in reverse order and the
    failure is raised as a named :class:`KernelShapingError` (``KernelFeatureMissing``,
    ``NeedsRootError``, ``DeviceNotFound``, ``ShapingConflict`` or ``ApplyFailed``),
    with any rollback failure listed in its ``rollback_errors`` and message.

    Parameters
    ----------
    plan : sequence of Op
        From :func:`plan_apply` or :func:`plan_clear`.
    netns : str, optional
        Name of a network namespace (as ``ip netns``) to work in.

    Returns
    -------
    list of Op
        The operations applied, in order.
    """
    ipr = _ipr if _ipr is not None else _open(netns)
    applied: list[Op] = []
    try:
        for op in plan:
            try:
                _execute(ipr, op, netns)
            except Exception as err:  # noqa: BLE001 - translated and re-raised below
                failure = _translate(op, err)
                rollback_errors = _rollback(ipr, applied, netns)
                failure.rollback_errors = rollback_errors  # type: ignore[attr-defined]
                failure.applied = []  # type: ignore[attr-defined]
                if rollback_errors:
                    failure.args = (
                        f"{failure.args[0]} ROLLBACK INCOMPLETE, check the interface: "
                        + "; ".join(rollback_errors),
                    )
                elif applied:
                    failure.args = (f"{failure.args[0]} (rolled back the {len(applied)} operation(s) "
                                    "already applied: nothing is left shaped)",)
                raise failure from err
            log.info("applied: %s%s", f"ip netns exec {netns} " if netns else "", op.describe())
            applied.append(op)
    finally:
        if _ipr is None:
            ipr.close()
    return applied


def _rollback(ipr, applied: list[Op], netns: str | None) -> list[str]:
    errors = []
    for op in reversed(applied):
        inverse = op.undo()
        if inverse is None:
            continue
        try:
            _execute(ipr, inverse, netns)
            log.info("rolled back: %s", inverse.describe())
        except Exception as err:  # noqa: BLE001 - collected, reported with the failure
            errors.append(f"{inverse.describe()}: {err}")
    return errors


def read_state(dev: str, *, ifb_name: str | None = None, netns: str | None = None, _ipr: Any = None) -> ShapingState:
    """What is on ``dev`` now: its root qdisc, its ingress qdisc, fededge's IFB."""
    ipr = _ipr if _ipr is not None else _open(netns)
    try:
        idx = _index(ipr, dev, netns)
        root_handle = root_kind = None
        has_ingress = False
        for q in ipr.get_qdiscs(idx):
            kind = q.get_attr("TCA_KIND")
            if q["parent"] == TC_H_INGRESS and kind in ("ingress", "clsact"):
                has_ingress = kind == "ingress"
            elif q["parent"] == TC_H_ROOT and q["handle"] != 0:
                root_handle, root_kind = int(q["handle"]), kind
        ifb = ifb_name or default_ifb_name(dev)
        links = ipr.link_lookup(ifname=ifb)
        ifb_exists = False
        if links:
            info = ipr.get_links(links[0])[0].get_attr("IFLA_LINKINFO")
            ifb_exists = info is not None and info.get_attr("IFLA_INFO_KIND") == "ifb"
        return ShapingState(root_handle=root_handle, root_kind=root_kind, has_ingress=has_ingress, ifb_exists=ifb_exists)
    except Exception as err:
        if isinstance(err, KernelShapingError):
            raise
        code = getattr(err, "code", None)
        if code in (errno.EPERM, errno.EACCES):
            raise NeedsRootError(_needs_root_message(f"reading the qdiscs of {dev}")) from err
        raise
    finally:
        if _ipr is None:
            ipr.close()


def clear(dev: str, *, ifb_name: str | None = None, netns: str | None = None) -> list[Op]:
    """Remove fededge's shaping from ``dev``; a clean interface is left as it is.

    Removes the root qdisc if it is fededge's (handle ``fede:``), the ingress qdisc, and
    fededge's IFB. Returns the operations applied (empty when there was nothing).
    """
    with _open(netns) as ipr:
        state = read_state(dev, ifb_name=ifb_name, netns=netns, _ipr=ipr)
        if state.root_handle is not None and state.root_handle != ROOT_HANDLE:
            log.warning("%s: root qdisc %s %s is not fededge's; left in place", dev,
                        state.root_kind, _hex_handle(state.root_handle))
        return apply(plan_clear(dev, ifb_name=ifb_name, state=state), netns=netns, _ipr=ipr)


# --------------------------------------------------------------------------- CLI


def _cmd_apply(args: argparse.Namespace) -> int:
    try:
        profile = get_profile(args.profile, load_profiles(args.profiles_file))
        plan = plan_apply(args.dev, profile, args.direction, side=args.side, mtu=args.mtu)
    except (ProfileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prefix = f"ip netns exec {args.netns} " if args.netns else ""
    if not plan:
        print(f"profile {profile.name!r} shapes nothing in direction {args.direction}; nothing to do")
        return 0
    if args.dry_run:
        for op in plan:
            print(prefix + op.describe())
        return 0
    try:
        applied = apply(plan, netns=args.netns)
    except KernelShapingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for op in applied:
        print(prefix + op.describe())
    print(f"{args.dev}: shaped with profile {profile.name!r} ({args.direction}); undo with "
          f"`fededge netem clear --dev {args.dev}{' --netns ' + args.netns if args.netns else ''}`")
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    prefix = f"ip netns exec {args.netns} " if args.netns else ""
    if args.dry_run:
        for op in plan_clear(args.dev):
            print(prefix + op.describe())
        return 0
    try:
        done = clear(args.dev, netns=args.netns)
    except KernelShapingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for op in done:
        print(prefix + op.describe())
    if not done:
        print(f"{args.dev}: no fededge shaping; nothing to clear")
    return 0


def register_cli(netem_subparsers: Any) -> None:
    """Add ``apply`` and ``clear`` to the ``fededge netem`` subcommands."""
    ap = netem_subparsers.add_parser(
        "apply", help="shape a real interface with tc qdiscs via netlink (root or CAP_NET_ADMIN)",
    )
    ap.add_argument("--dev", required=True, help="interface to shape, e.g. eth0")
    ap.add_argument("--profile", required=True, help="link profile name (see `fededge netem profiles`)")
    ap.add_argument("--profiles-file", default=None, help="TOML file with extra profiles")
    ap.add_argument("--direction", choices=("egress", "ingress", "both"), default="egress",
                    help="egress (uplink on a client), ingress (downlink, via an IFB) or both")
    ap.add_argument("--side", choices=("client", "server"), default="client",
                    help="client: egress is the uplink; server: egress is the downlink")
    ap.add_argument("--mtu", type=int, default=1500, help="interface MTU, for tbf's burst (default 1500)")
    ap.add_argument("--netns", default=None, help="network namespace (as in `ip netns`) of the interface")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as tc commands; apply nothing")
    ap.set_defaults(func=_cmd_apply)

    cl = netem_subparsers.add_parser("clear", help="remove fededge's shaping from an interface")
    cl.add_argument("--dev", required=True)
    cl.add_argument("--netns", default=None)
    cl.add_argument("--dry-run", action="store_true", help="print what clear could remove; do nothing")
    cl.set_defaults(func=_cmd_clear)
