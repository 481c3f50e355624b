"""The kernel backend's plan: link profile -> tc operations, as pure data.

:func:`plan_apply` and :func:`plan_clear` turn a
:class:`~fededge.netem.profiles.LinkProfile` into a list of operations (frozen
dataclasses, each able to describe itself as its tc command and to name its undo);
:mod:`fededge.netem.kernel.netlink` executes them. Nothing here needs root, pyroute2 or
Flower, so the plans are unit-tested on any machine.

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

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, Union

from fededge.netem.profiles import Direction, LinkProfile, ProfileError

__all__ = [
    "AddIfb", "LinkUp", "AddQdisc", "AddFilter", "DelQdisc", "DelFilter", "DelLink", "Op",
    "TbfParams", "NetemParams", "ShapingState", "TraceNotSupported",
    "ROOT_HANDLE", "CHILD_HANDLE", "INGRESS_HANDLE", "TC_H_ROOT", "TC_H_INGRESS", "U32_MAX",
    "default_ifb_name", "hex_handle", "tbf_params", "netem_params", "plan_apply", "plan_clear",
]

TC_H_ROOT = 0xFFFFFFFF
TC_H_INGRESS = 0xFFFFFFF1
ROOT_HANDLE = 0xFEDE0000  # "fede:" marks fededge's root qdisc
CHILD_HANDLE = 0xFEDF0000  # "fedf:" the tbf under netem
INGRESS_HANDLE = 0xFFFF0000  # "ffff:" the ingress qdisc (fixed by the kernel)
FILTER_PRIO = 1
ETH_HLEN = 14
IFNAMSIZ = 15  # usable characters
TBF_HZ = 250
TBF_QUEUE_S = 0.050
TBF_MIN_QUEUE_FRAMES = 16
NETEM_DEFAULT_LIMIT = 1000
NETEM_UNSHAPED_BPS = 1e9
U32_MAX = 0xFFFFFFFF

Which = Literal["egress", "ingress", "both"]
Side = Literal["client", "server"]

# --------------------------------------------------------------------------- errors


class TraceNotSupported(ProfileError):
    """tc cannot replay a Mahimahi trace; the proxy can."""


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
    # netem without a distribution table (fededge sends none) spreads each packet's delay
    # uniformly over delay +- jitter; the profile's jitter is a standard deviation (the
    # clock's and the proxy's normal samples), and a uniform half-width of jitter * sqrt(3)
    # has that standard deviation (with jitter as given it had 0.58 of it)
    return NetemParams(
        delay_s=d.delay_s, jitter_s=d.jitter_s * math.sqrt(3.0), loss=loss, gemodel=gemodel, limit=limit,
        order_rate_Bps=U32_MAX if d.jitter_s > 0 else None,
    )


def hex_handle(h: int) -> str:
    major, minor = h >> 16, h & 0xFFFF
    return f"{major:x}:" if minor == 0 else f"{major:x}:{minor:x}"


def _parent_words(parent: int) -> str:
    if parent == TC_H_ROOT:
        return "root"
    if parent == TC_H_INGRESS:
        return "ingress"
    return f"parent {hex_handle(parent)}"


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
        return f"tc qdisc add dev {self.dev} {where} handle {hex_handle(self.handle)} {self.kind}{tail}"

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
            f"tc filter add dev {self.dev} parent {hex_handle(self.parent)} protocol all "
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
        return f"tc qdisc del dev {self.dev} {_parent_words(self.parent)} handle {hex_handle(self.handle)}"

    def undo(self) -> "Op | None":
        return None


@dataclass(frozen=True)
class DelFilter:
    """``tc filter del dev DEV parent P prio N``."""

    dev: str
    parent: int
    prio: int = FILTER_PRIO

    def describe(self) -> str:
        return f"tc filter del dev {self.dev} parent {hex_handle(self.parent)} prio {self.prio}"

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
