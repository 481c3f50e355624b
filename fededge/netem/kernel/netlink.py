"""The kernel backend's executor: a plan (:mod:`fededge.netem.kernel.plan`) applied
through netlink with pyroute2 (no ``tc`` binary), all or nothing.

:func:`apply` executes a list of operations and rolls back everything it did when one
fails, so an interface is never left half-shaped; each failure is raised as a named
:class:`KernelShapingError` that says what to do. pyroute2 is imported only by the
functions that talk to the kernel.
"""

from __future__ import annotations

import errno
import logging
from functools import lru_cache
from typing import Any, Sequence

from fededge.netem.kernel.plan import (
    ROOT_HANDLE, TC_H_INGRESS, TC_H_ROOT, U32_MAX, AddFilter, AddIfb, AddQdisc, DelFilter, DelLink,
    DelQdisc, LinkUp, NetemParams, Op, ShapingState, TbfParams, default_ifb_name, hex_handle,
    plan_clear,
)

__all__ = [
    "KernelShapingError", "KernelFeatureMissing", "NeedsRootError", "DeviceNotFound",
    "ShapingConflict", "ApplyFailed", "encode_netem", "encode_tbf", "device_mtu", "read_state", "apply", "clear",
]

#: The logger of the kernel backend, named as when it was one module.
log = logging.getLogger("fededge.netem.kernel")

ETH_P_ALL = 0x0003
PROXY_HINT = "fededge netem proxy --profile NAME --listen HOST:PORT --upstream HOST:PORT"


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


def _needs_root_message(what: str) -> str:
    return (
        f"{what}: operation not permitted. Kernel shaping needs root or CAP_NET_ADMIN: "
        "run with sudo, or in a container started with --cap-add NET_ADMIN. "
        f"No privileges? Use the userspace proxy: `{PROXY_HINT}`."
    )


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


@lru_cache(maxsize=1)
def _tbf_msg_class():
    """A tcmsg whose tbf options also carry ``TCA_TBF_BURST`` (the bucket in bytes).

    pyroute2's tbf plugin sends the bucket only as ``buffer``, a u32 count of ticks that
    the kernel caps at 2**32 - 1 ns (4.3 s): below about 2.8 kbit/s the bucket then holds
    less than a 1500-byte frame, and tbf drops every full-size frame (nb-iot's 264 bit/s
    passed nothing over 141 bytes). With ``TCA_TBF_BURST`` the kernel derives the bucket
    time from the bytes (a u64), as ``tc`` does.
    """
    from pyroute2.netlink.rtnl.tcmsg import sched_tbf, tcmsg

    class tbf_tcmsg(tcmsg):
        nla_map = tuple(
            (name, "tbf_options") if name == "TCA_OPTIONS" else (name, fmt)
            for name, fmt in ((x[0], x[1]) for x in tcmsg.nla_map)
        )
        _nlmsg_base__compiled_nla = False  # (see _netem_msg_class)

        class tbf_options(sched_tbf.options):
            _nlmsg_base__compiled_nla = False
            nla_map = (
                *sched_tbf.options.nla_map,
                ("TCA_TBF_RATE64", "uint64"),
                ("TCA_TBF_PRATE64", "uint64"),
                ("TCA_TBF_BURST", "uint32"),
            )

    return tbf_tcmsg


def encode_tbf(index: int, handle: int, parent: int, p: TbfParams):
    """The RTM_NEWQDISC message for a tbf qdisc (built, not sent): pyroute2's encoding of
    rate, buffer and limit, plus ``TCA_TBF_BURST`` (:func:`_tbf_msg_class`)."""
    from pyroute2.netlink.rtnl.tcmsg import sched_tbf

    options = sched_tbf.get_parameters({"rate": int(p.rate_bps / 8), "burst": p.burst_bytes,
                                        "limit": p.limit_bytes})
    parms = dict(options["attrs"][0][1])
    parms["buffer"] = min(U32_MAX, int(parms["buffer"]))  # (the kernel uses TCA_TBF_BURST)
    options["attrs"][0] = ["TCA_TBF_PARMS", parms]
    options["attrs"].append(["TCA_TBF_BURST", int(p.burst_bytes)])
    msg = _tbf_msg_class()()
    msg["family"] = 0  # AF_UNSPEC
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    msg["attrs"] = [["TCA_KIND", "tbf"], ["TCA_OPTIONS", options]]
    return msg


def _send_new_qdisc(ipr, msg) -> None:
    from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
    from pyroute2.netlink.rtnl import RTM_NEWQDISC

    msg["header"]["type"] = RTM_NEWQDISC
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    # nlm_request_batch: pyroute2 0.9's sync nlm_request trips on a missing
    # 'nlm_generator' status key; the batch call sends the same single message.
    ipr.nlm_request_batch([msg])


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
        # (entering a namespace takes CAP_SYS_ADMIN, which NET_ADMIN alone does not give)
        raise NeedsRootError(
            f"entering network namespace {netns!r}: operation not permitted. Entering a namespace needs root or "
            f"CAP_SYS_ADMIN (CAP_NET_ADMIN is not enough): run with sudo, or run the command inside it "
            f"(`ip netns exec {netns} fededge netem ...`, without --netns). No privileges? Use the userspace "
            f"proxy: `{PROXY_HINT}`.") from err
    except FileNotFoundError as err:
        raise DeviceNotFound(f"network namespace {netns!r} does not exist (see `ip netns list`)") from err


def _index(ipr, name: str, netns: str | None) -> int:
    found = ipr.link_lookup(ifname=name)
    if not found:
        where = f" in network namespace {netns!r}" if netns else ""
        raise DeviceNotFound(f"no network interface {name!r}{where} (see `ip link`)")
    return int(found[0])


def device_mtu(dev: str, *, netns: str | None = None, _ipr: Any = None) -> int:
    """The MTU of interface ``dev`` (for :func:`~fededge.netem.kernel.plan.plan_apply`'s ``mtu``)."""
    ipr = _ipr if _ipr is not None else _open(netns)
    try:
        return _mtu(ipr, _index(ipr, dev, netns))
    finally:
        if _ipr is None:
            ipr.close()


def _mtu(ipr, idx: int) -> int:
    return int(ipr.get_links(idx)[0].get_attr("IFLA_MTU"))


def _check_bursts_fit(ipr, plan: Sequence[Op], netns: str | None) -> None:
    """tbf drops every packet larger than its bucket: a plan sized for a 1500-byte MTU on
    loopback (65536) or a jumbo-frame interface passed nothing of a bulk transfer. Each
    tbf's burst must hold a frame of the largest MTU of the plan's interfaces (an IFB
    carries what its interface redirects to it), checked before anything is applied."""
    created = {op.name for op in plan if isinstance(op, AddIfb)}
    devs = sorted({op.dev for op in plan if isinstance(op, (AddQdisc, AddFilter)) and op.dev not in created})
    mtus = {dev: _mtu(ipr, _index(ipr, dev, netns)) for dev in devs}
    if not mtus:
        return
    dev, mtu = max(mtus.items(), key=lambda x: x[1])
    for op in plan:
        if isinstance(op, AddQdisc) and isinstance(op.params, TbfParams) and op.params.burst_bytes < mtu + 14:
            raise ApplyFailed(f"{op.describe()!r}: its burst ({op.params.burst_bytes} bytes) is smaller than a frame "
                              f"of {dev}'s MTU ({mtu} + 14 bytes), so tbf would drop every full-size packet; plan "
                              f"with mtu={mtu} (`fededge netem apply` reads it from the interface unless --mtu "
                              "is given)")


def _execute(ipr, op: Op, netns: str | None) -> None:
    if isinstance(op, AddIfb):
        ipr.link("add", ifname=op.name, kind="ifb")
    elif isinstance(op, LinkUp):
        ipr.link("set", index=_index(ipr, op.name, netns), state="up")
    elif isinstance(op, DelLink):
        ipr.link("del", index=_index(ipr, op.name, netns))
    elif isinstance(op, AddQdisc):
        idx = _index(ipr, op.dev, netns)
        if op.kind == "tbf":
            assert isinstance(op.params, TbfParams)
            _send_new_qdisc(ipr, encode_tbf(idx, op.handle, op.parent, op.params))
        elif op.kind == "netem":
            assert isinstance(op.params, NetemParams)
            _send_new_qdisc(ipr, encode_netem(idx, op.handle, op.parent, op.params))
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


def _translate(op: Op, err: BaseException, netns: str | None = None) -> KernelShapingError:
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
    ns = f" --netns {netns}" if netns else ""
    if code == errno.EEXIST:
        if isinstance(op, AddIfb):
            return ShapingConflict(
                f"{text}: a link named {op.name!r} exists. An IFB fededge left behind is removed by `fededge netem "
                f"clear --dev DEV{ns}` (DEV: the interface it served); any other link of that name must be "
                f"renamed or removed (`ip link del {op.name}`)")
        dev = getattr(op, "dev", "DEV")
        return ShapingConflict(
            f"{text}: the interface already has a qdisc there; run `fededge netem clear --dev {dev}{ns}` first "
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
        _check_bursts_fit(ipr, plan, netns)
        for op in plan:
            try:
                _execute(ipr, op, netns)
            except BaseException as err:  # noqa: BLE001 - translated and re-raised below
                if not isinstance(err, Exception):  # Ctrl-C: nothing left half-shaped either
                    # (the operation in flight too: the kernel may have applied it before the
                    # interrupt came, waiting for its ack; undoing one it did not apply fails, ignored)
                    _rollback(ipr, [*applied, op], netns)
                    raise
                failure = _translate(op, err, netns)
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
            applied.append(op)  # (before anything else can be interrupted)
            log.info("applied: %s%s", f"ip netns exec {netns} " if netns else "", op.describe())
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
        ifb_exists = _is_ifb(ipr, ifb_name or default_ifb_name(dev))
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


def _is_ifb(ipr, name: str) -> bool:
    """Whether a link named ``name`` exists and is an IFB."""
    links = ipr.link_lookup(ifname=name)
    if not links:
        return False
    info = ipr.get_links(links[0])[0].get_attr("IFLA_LINKINFO")
    return info is not None and info.get_attr("IFLA_INFO_KIND") == "ifb"


def clear(dev: str, *, ifb_name: str | None = None, netns: str | None = None) -> list[Op]:
    """Remove fededge's shaping from ``dev``; a clean interface is left as it is.

    Removes the root qdisc if it is fededge's (handle ``fede:``), the ingress qdisc, and
    fededge's IFB. Returns the operations applied (empty when there was nothing).
    """
    with _open(netns) as ipr:
        try:
            state = read_state(dev, ifb_name=ifb_name, netns=netns, _ipr=ipr)
        except DeviceNotFound:
            # The interface is gone (a container's veth, a USB modem), its IFB may not be.
            ifb = ifb_name or default_ifb_name(dev)
            if not _is_ifb(ipr, ifb):
                raise
            log.warning("%s is gone; removing the IFB %s fededge made for it", dev, ifb)
            return apply([DelLink(ifb)], netns=netns, _ipr=ipr)
        if state.root_handle is not None and state.root_handle != ROOT_HANDLE:
            log.warning("%s: root qdisc %s %s is not fededge's; left in place", dev,
                        state.root_kind, hex_handle(state.root_handle))
        return apply(plan_clear(dev, ifb_name=ifb_name, state=state), netns=netns, _ipr=ipr)
