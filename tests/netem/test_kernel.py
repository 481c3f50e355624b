"""Kernel backend: plans as data (no root), and real shaping in network namespaces (root).

The root tests build two namespaces joined by a veth pair (10.99.0.1/30 and 10.99.0.2/30,
assigned only to those veth ends); all traffic stays between them. Every namespace is
deleted in fixture teardown (which also deletes the veth and any IFB inside it).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from fededge.netem import kernel as k
from fededge.netem.kernel import (
    CHILD_HANDLE, INGRESS_HANDLE, ROOT_HANDLE, AddFilter, AddIfb, AddQdisc, DelFilter, DelLink,
    DelQdisc, LinkUp, NetemParams, ShapingState, TbfParams,
)
from fededge.netem import cli as netem_cli
from fededge.netem.kernel.netlink import _netem_msg_class
from fededge.netem.profiles import Direction, LinkProfile, get_profile

TC_H_ROOT, TC_H_INGRESS = 0xFFFFFFFF, 0xFFFFFFF1


def prof(up: Direction, down: Direction | None = None, name: str = "t") -> LinkProfile:
    return LinkProfile(name=name, up=up, down=down or Direction(), source="test")


# =========================================================================== plans (no root)


def test_rate_only_is_a_single_tbf_at_root():
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=10e6)), "egress")
    assert plan == [AddQdisc("eth0", "tbf", ROOT_HANDLE, TC_H_ROOT, TbfParams(rate_bps=10e6, burst_bytes=5000, limit_bytes=67500))]
    assert [op.describe() for op in plan] == [
        "tc qdisc add dev eth0 root handle fede: tbf rate 10mbit burst 5000 limit 67500"
    ]


@pytest.mark.parametrize("rate_bps", [400e3, 10e6, 1e9])
def test_tbf_sizing_follows_the_documented_rule(rate_bps):
    p = k.tbf_params(rate_bps, mtu=1500)
    frame = 1514
    # bucket: >= 4 ms of rate (timer at HZ=250) and >= 2 full frames; exactly the max
    assert p.burst_bytes >= rate_bps / 8 / 250 and p.burst_bytes >= 2 * frame
    assert p.burst_bytes == max(-(-rate_bps / 8 // 250), 2 * frame)
    # queue: burst + max(50 ms of rate, 16 frames)
    queue = p.limit_bytes - p.burst_bytes
    assert queue == max(-(-rate_bps / 8 * 0.05 // 1), 16 * frame)
    assert p.limit_bytes > p.burst_bytes


def test_tbf_sizing_grows_with_mtu_and_refuses_rates_tbf_cannot_hold():
    assert k.tbf_params(1e6, mtu=9000).burst_bytes == 2 * 9014
    with pytest.raises(ValueError, match="32-bit"):
        k.tbf_params(40e9)


def test_delay_jitter_loss_is_netem_root_with_tbf_child():
    d = Direction(rate_bps=6.3e6, delay_s=0.0275, jitter_s=0.005, loss=0.002)
    plan = k.plan_apply("wlan0", prof(d), "egress")
    assert [(op.dev, op.kind, op.handle, op.parent) for op in plan] == [
        ("wlan0", "netem", ROOT_HANDLE, TC_H_ROOT),
        ("wlan0", "tbf", CHILD_HANDLE, ROOT_HANDLE | 1),  # tbf under netem's only class
    ]
    netem = plan[0].params
    assert isinstance(netem, NetemParams)
    # netem's jitter is a uniform half-width (no distribution table): sqrt(3) x the
    # profile's standard deviation, so that the spread is the clock's and the proxy's
    assert (netem.delay_s, netem.loss, netem.gemodel) == (0.0275, 0.002, None)
    assert netem.jitter_s == pytest.approx(0.005 * 3**0.5)
    assert netem.order_rate_Bps == 0xFFFFFFFF  # jitter: netem keeps order only when its rate is set
    assert netem.limit >= 1000
    assert plan[1].params == k.tbf_params(6.3e6)
    assert plan[0].describe() == (
        "tc qdisc add dev wlan0 root handle fede: netem limit 1000 delay 27.5ms 8.66025ms "
        "loss random 0.2% rate 34359738360bit"
    )
    assert plan[1].describe() == (
        "tc qdisc add dev wlan0 parent fede:1 handle fedf: tbf rate 6300kbit burst 3150 limit 42525"
    )


def test_delay_without_rate_is_netem_alone_and_keeps_netem_unrated_without_jitter():
    plan = k.plan_apply("eth0", prof(Direction(delay_s=0.05)), "egress")
    assert len(plan) == 1 and plan[0].kind == "netem"
    assert plan[0].params.order_rate_Bps is None
    assert plan[0].describe() == "tc qdisc add dev eth0 root handle fede: netem limit 12385 delay 50ms"


def test_netem_limit_holds_the_delayed_bytes():
    d = Direction(rate_bps=1e9, delay_s=0.315)
    p = k.netem_params(d)
    in_flight_packets = 1e9 / 8 * (0.315 + 0.05) / 1514
    assert p.limit >= in_flight_packets


def test_burst_loss_uses_gemodel_from_gilbert_elliott():
    d = Direction(rate_bps=5e6, delay_s=0.025, jitter_s=0.04, loss=0.01, loss_burst=3)
    netem = k.plan_apply("eth0", prof(d), "egress")[0].params
    p, r = d.gilbert_elliott
    assert netem.gemodel == (p, r) and netem.loss == 0.0  # netem uses one loss model
    assert p / (p + r) == pytest.approx(0.01) and 1 / r == pytest.approx(3)
    assert f"loss gemodel {p * 100:.6g}% {r * 100:.6g}%" in k.AddQdisc("eth0", "netem", ROOT_HANDLE, TC_H_ROOT, netem).describe()


def test_ingress_goes_through_an_ifb_shaped_before_the_redirect():
    profile = prof(Direction(rate_bps=1e6), Direction(rate_bps=20e6))
    plan = k.plan_apply("eth0", profile, "ingress")
    assert plan == [
        AddIfb("ifb-eth0"),
        LinkUp("ifb-eth0"),
        AddQdisc("ifb-eth0", "tbf", ROOT_HANDLE, TC_H_ROOT, k.tbf_params(20e6)),  # the DOWN rate
        AddQdisc("eth0", "ingress", INGRESS_HANDLE, TC_H_INGRESS),
        AddFilter("eth0", INGRESS_HANDLE, redirect_to="ifb-eth0"),
    ]
    assert [op.describe() for op in plan] == [
        "ip link add ifb-eth0 type ifb",
        "ip link set dev ifb-eth0 up",
        "tc qdisc add dev ifb-eth0 root handle fede: tbf rate 20mbit burst 10000 limit 135000",
        "tc qdisc add dev eth0 ingress",
        "tc filter add dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 "
        "action mirred egress redirect dev ifb-eth0",
    ]


def test_both_shapes_up_on_egress_and_down_on_ingress_and_server_side_swaps():
    profile = prof(Direction(rate_bps=1e6), Direction(rate_bps=20e6))
    plan = k.plan_apply("eth0", profile, "both", ifb_name="ifbx")
    shaped = {(op.dev, op.params.rate_bps) for op in plan if isinstance(op, AddQdisc) and op.kind == "tbf"}
    assert shaped == {("eth0", 1e6), ("ifbx", 20e6)}
    server = k.plan_apply("eth0", profile, "both", side="server", ifb_name="ifbx")
    shaped = {(op.dev, op.params.rate_bps) for op in server if isinstance(op, AddQdisc) and op.kind == "tbf"}
    assert shaped == {("eth0", 20e6), ("ifbx", 1e6)}


def test_unshaped_direction_plans_nothing():
    assert k.plan_apply("eth0", prof(Direction(), Direction(rate_bps=1e6)), "egress") == []
    assert k.plan_apply("eth0", prof(Direction(rate_bps=1e6), Direction()), "ingress") == []


def test_trace_profile_is_refused_with_a_pointer_to_the_proxy(tmp_path):
    profile = prof(Direction(rate_bps=1e6, trace=tmp_path / "up.trace"), name="traced")
    with pytest.raises(k.TraceNotSupported, match="fededge netem proxy --profile traced"):
        k.plan_apply("eth0", profile, "egress")
    # the trace in the direction NOT applied does not matter
    assert k.plan_apply("eth0", prof(Direction(), Direction(rate_bps=1e6, trace=tmp_path / "x")), "egress") == []


def test_bad_arguments_are_value_errors():
    p = prof(Direction(rate_bps=1e6))
    with pytest.raises(ValueError, match="direction"):
        k.plan_apply("eth0", p, "sideways")
    with pytest.raises(ValueError, match="side"):
        k.plan_apply("eth0", p, "egress", side="middle")
    with pytest.raises(ValueError, match="interface names"):
        k.plan_apply("a-very-long-interface-name", p, "egress")


def test_default_ifb_name_fits_ifnamsiz_and_is_stable():
    assert k.default_ifb_name("eth0") == "ifb-eth0"
    long = k.default_ifb_name("enx00e04c680123")
    assert len(long) <= 15 and long == k.default_ifb_name("enx00e04c680123") and long.startswith("ifb-")


def test_undo_inverts_each_addition():
    assert AddIfb("i").undo() == DelLink("i")
    assert LinkUp("i").undo() is None
    assert AddQdisc("e", "tbf", ROOT_HANDLE, TC_H_ROOT, k.tbf_params(1e6)).undo() == DelQdisc("e", ROOT_HANDLE, TC_H_ROOT)
    assert AddFilter("e", INGRESS_HANDLE, "i").undo() == DelFilter("e", INGRESS_HANDLE, 1)
    assert DelQdisc("e", ROOT_HANDLE, TC_H_ROOT).describe() == "tc qdisc del dev e root handle fede:"
    assert DelQdisc("e", INGRESS_HANDLE, TC_H_INGRESS).describe() == "tc qdisc del dev e ingress"


def test_plan_clear_removes_only_what_is_fededges():
    full = k.plan_clear("eth0")
    assert [op.describe() for op in full] == [
        "tc qdisc del dev eth0 ingress",  # first: stop redirecting before the IFB goes
        "tc qdisc del dev eth0 root handle fede:",
        "ip link del ifb-eth0",
    ]
    assert k.plan_clear("eth0", state=ShapingState()) == []  # clean: idempotent
    foreign = ShapingState(root_handle=0x10000, root_kind="htb")
    assert k.plan_clear("eth0", state=foreign) == []  # somebody else's root qdisc stays


def test_netem_message_encodes_delay_loss_and_gemodel():
    """The netem request (pyroute2 has no gemodel) decodes back to what was asked."""
    from pyroute2.netlink.rtnl.tcmsg.common import tick_in_usec

    params = k.netem_params(Direction(delay_s=0.05, jitter_s=0.01, loss=0.01, loss_burst=4))
    msg = k.encode_netem(7, ROOT_HANDLE, TC_H_ROOT, params)
    msg.encode()
    back = _netem_msg_class()(msg.data)
    back.decode()
    assert (back["index"], back["handle"], back["parent"]) == (7, ROOT_HANDLE, TC_H_ROOT)
    assert back.get_attr("TCA_KIND") == "netem"
    opts = back.get_attr("TCA_OPTIONS")
    assert opts["delay"] == int(50_000 * tick_in_usec)
    # a uniform of the profile's standard deviation: half-width sqrt(3) x 10 ms (to a tick)
    assert opts["jitter"] == pytest.approx(10_000 * 3**0.5 * tick_in_usec, abs=16)
    assert opts["loss"] == 0 and opts["limit"] == params.limit
    ge = opts.get_attr("TCA_NETEM_LOSS").get_attr("NETEM_LOSS_GE")
    p, r = params.gemodel
    assert ge["p"] / 0xFFFFFFFF == pytest.approx(p) and ge["r"] / 0xFFFFFFFF == pytest.approx(r)
    assert (ge["h"], ge["k1"]) == (0, 0)  # all lost in bad, none in good
    assert opts.get_attr("TCA_NETEM_RATE")["rate"] == 0xFFFFFFFF


# --------------------------------------------------------------------------- errors, rollback (fake netlink)


class FakeNetlinkError(Exception):
    def __init__(self, code):
        super().__init__(code, os.strerror(code))
        self.code = code


class FakeIPR:
    """Records link/tc calls; raises on the call numbered ``fail_at`` (0-based)."""

    def __init__(self, fail_at=None, code=errno.ENOENT, links=("eth0",), mtu=1500):
        self.calls, self.fail_at, self.code, self.mtu = [], fail_at, code, mtu
        self.links = {name: i + 1 for i, name in enumerate(links)}

    def get_links(self, index):
        mtu = self.mtu

        class _Link:
            def get_attr(self, name):
                return mtu if name == "IFLA_MTU" else None
        return [_Link()]

    def link_lookup(self, ifname):
        return [self.links[ifname]] if ifname in self.links else []

    def _record(self, call):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            self.calls.append(("FAILED",) + call)
            raise FakeNetlinkError(self.code)
        self.calls.append(call)

    def link(self, cmd, **kw):
        self._record(("link", cmd, kw.get("ifname") or kw.get("index")))
        if cmd == "add":
            self.links[kw["ifname"]] = len(self.links) + 1

    def tc(self, cmd, kind=None, index=None, **kw):
        self._record(("tc", cmd, kind, index, kw.get("handle"), kw.get("parent")))

    def nlm_request_batch(self, msgs):  # the qdiscs fededge encodes itself (tbf, netem)
        m = msgs[0]
        self._record(("tc", "add", m["attrs"][0][1], m["index"], m["handle"], m["parent"]))
        return []


def test_failure_rolls_back_in_reverse_and_names_sch_netem():
    profile = prof(Direction(rate_bps=10e6), Direction(delay_s=0.05))
    plan = k.plan_apply("eth0", profile, "both")  # tbf eth0; ifb; up; netem on ifb (fails) ...
    fake = FakeIPR(fail_at=3)
    with pytest.raises(k.KernelFeatureMissing) as info:
        k.apply(plan, _ipr=fake)
    msg = str(info.value)
    for needle in ("sch_netem", "modprobe sch_netem", "CONFIG_NET_SCH_NETEM", "fededge netem proxy", "rolled back"):
        assert needle in msg
    assert info.value.rollback_errors == []
    assert fake.calls == [
        ("tc", "add", "tbf", 1, ROOT_HANDLE, TC_H_ROOT),
        ("link", "add", "ifb-eth0"),
        ("link", "set", 2),
        ("FAILED", "tc", "add", "netem", 2, ROOT_HANDLE, TC_H_ROOT),
        ("link", "del", 2),  # reverse order: the IFB, then eth0's tbf
        ("tc", "del", None, 1, ROOT_HANDLE, TC_H_ROOT),
    ]


@pytest.mark.parametrize("code,exc,needle", [
    (errno.EPERM, k.NeedsRootError, "CAP_NET_ADMIN"),
    (errno.EEXIST, k.ShapingConflict, "fededge netem clear"),
    (errno.EINVAL, k.ApplyFailed, "failed"),
])
def test_netlink_errors_become_named_exceptions(code, exc, needle):
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=1e6)), "egress")
    with pytest.raises(exc, match=needle):
        k.apply(plan, _ipr=FakeIPR(fail_at=0, code=code))


def test_a_tbf_whose_burst_cannot_hold_a_frame_of_the_mtu_is_refused_before_anything():
    """The plan sized for 1500 bytes on a 9000-byte (or loopback's 65536) interface: tbf
    dropped every full-size packet (a 2 MB transfer on lo delivered nothing)."""
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=1e6), Direction(rate_bps=1e6)), "both")
    fake = FakeIPR(mtu=9000)
    with pytest.raises(k.ApplyFailed, match=r"smaller than a frame of eth0's MTU \(9000 \+ 14 bytes\).*mtu=9000"):
        k.apply(plan, _ipr=fake)
    assert fake.calls == []  # nothing applied, nothing to roll back
    k.apply(k.plan_apply("eth0", prof(Direction(rate_bps=1e6), Direction(rate_bps=1e6)), "both", mtu=9000),
            _ipr=FakeIPR(mtu=9000))


def test_tbf_message_carries_the_burst_in_bytes():
    """pyroute2 sent the bucket only as a u32 tick count, capped by the kernel at 4.3 s:
    below ~2.8 kbit/s tbf then dropped every full-size frame (nb-iot passed nothing over
    141 bytes). TCA_TBF_BURST gives the kernel the bytes."""
    from fededge.netem.kernel.netlink import _tbf_msg_class

    for rate in (264, 10e6):
        params = k.tbf_params(rate)
        msg = k.encode_tbf(5, ROOT_HANDLE, TC_H_ROOT, params)
        msg.encode()
        back = _tbf_msg_class()(msg.data)
        back.decode()
        assert back.get_attr("TCA_KIND") == "tbf" and (back["index"], back["handle"]) == (5, ROOT_HANDLE)
        opts = back.get_attr("TCA_OPTIONS")
        assert opts.get_attr("TCA_TBF_BURST") == params.burst_bytes >= 2 * 1514
        parms = opts.get_attr("TCA_TBF_PARMS")
        assert parms["rate"] == int(rate / 8) and parms["limit"] == params.limit_bytes


def test_ctrl_c_halfway_rolls_back_and_propagates():
    """Only Exception was caught: a KeyboardInterrupt (or SIGTERM turned into one) while
    applying left the interface half-shaped."""
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=1e6), Direction(rate_bps=1e6)), "both")

    class Interrupted(FakeIPR):
        def nlm_request_batch(self, msgs):
            if len(self.calls) == 3:  # the IFB's tbf, after eth0's tbf, the IFB and its link up
                raise KeyboardInterrupt
            return super().nlm_request_batch(msgs)

    fake = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        k.apply(plan, _ipr=fake)
    # the operation in flight undone too (the kernel may have applied it before the
    # interrupt): the IFB's tbf, then the IFB, then eth0's tbf
    assert fake.calls[3:] == [("tc", "del", None, 2, ROOT_HANDLE, TC_H_ROOT), ("link", "del", 2),
                              ("tc", "del", None, 1, ROOT_HANDLE, TC_H_ROOT)]


def test_a_conflict_names_the_interface_and_namespace_to_clear():
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=1e6)), "egress")
    with pytest.raises(k.ShapingConflict, match=r"fededge netem clear --dev eth0 --netns ns1`"):
        k.apply(plan, netns="ns1", _ipr=FakeIPR(fail_at=0, code=errno.EEXIST))


def test_unknown_device_is_named():
    plan = k.plan_apply("nosuch0", prof(Direction(rate_bps=1e6)), "egress")
    with pytest.raises(k.DeviceNotFound, match="nosuch0"):
        k.apply(plan, _ipr=FakeIPR())


def test_rollback_failure_is_reported_not_swallowed():
    plan = k.plan_apply("eth0", prof(Direction(rate_bps=1e6), Direction(rate_bps=1e6)), "both")

    class Stubborn(FakeIPR):
        def tc(self, cmd, kind=None, index=None, **kw):
            if cmd == "del":
                raise FakeNetlinkError(errno.EBUSY)
            super().tc(cmd, kind, index, **kw)

    fake = Stubborn(fail_at=4)  # the ingress qdisc fails after tbf, ifb, up, ifb tbf
    with pytest.raises(k.KernelShapingError, match="ROLLBACK INCOMPLETE") as info:
        k.apply(plan, _ipr=fake)
    assert len(info.value.rollback_errors) == 2  # both tbf deletions refused


# --------------------------------------------------------------------------- CLI


def _cli(argv):
    parser = argparse.ArgumentParser()
    netem_cli.register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["netem", *argv])
    return args.func(args)


def test_cli_dry_run_prints_one_tc_line_per_op_and_applies_nothing(capsys):
    assert _cli(["apply", "--dev", "nosuch0", "--profile", "wifi-congested", "--direction", "both",
                 "--netns", "ns1", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = k.plan_apply("nosuch0", get_profile("wifi-congested"), "both")
    assert lines == ["ip netns exec ns1 " + op.describe() for op in plan]
    assert _cli(["clear", "--dev", "eth0", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [op.describe() for op in k.plan_clear("eth0")]


def test_cli_refuses_a_trace_profile(tmp_path, capsys):
    f = tmp_path / "p.toml"
    f.write_text('[mine]\nsource = "t"\nup = { trace = "x.trace" }\ndown = { rate-kbit = 100 }\n')
    assert _cli(["apply", "--dev", "eth0", "--profile", "mine", "--profiles-file", str(f), "--dry-run"]) == 2
    assert "fededge netem proxy" in capsys.readouterr().err


# =========================================================================== real (root, namespaces)


def _can_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and qdiscs)"
    if shutil.which("ip") is None:
        return "needs the `ip` tool to build the test namespaces"
    name = f"fdgprobe{os.getpid()}"
    try:
        ok = subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=10).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None if ok else "`ip netns add` does not work here"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


@pytest.fixture
def ns_pair():
    """Namespaces A (10.99.0.1, veth ``va``) and B (10.99.0.2, veth ``vb``), deleted after."""
    reason = _can_netns()
    if reason:
        pytest.skip(reason)
    a, b = f"fdg{os.getpid()}a", f"fdg{os.getpid()}b"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b)
        _ip("-n", a, "addr", "add", "10.99.0.1/30", "dev", "va")
        _ip("-n", b, "addr", "add", "10.99.0.2/30", "dev", "vb")
        for ns, dev in ((a, "va"), (b, "vb")):
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):  # deleting a namespace deletes its veth end and any IFB in it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        left = _netns_list()
        assert a not in left and b not in left, f"test namespaces left behind: {left}"


RECEIVER = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.99.0.2", 5201)); s.listen(1); s.settimeout(30)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(30)
    first = c.recv(65536); t0 = time.monotonic(); n = 0; t1 = t0
    while True:
        b = c.recv(65536)
        if not b: break
        n += len(b); t1 = time.monotonic()
    print(json.dumps({"bytes_after_first": n, "seconds": t1 - t0, "total": n + len(first)}), flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection(("10.99.0.2", 5201), timeout=30)
    s.sendall(b"x" * int(sys.argv[1])); s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
""")


def _goodput_bps(a: str, b: str, nbytes: int = 5_000_000) -> float:
    """Bytes per second of payload as the RECEIVER in B sees them, sent from A.

    Timed from the first received chunk to the last (sender-side timing would count data
    still sitting in socket buffers)."""
    rx = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", RECEIVER],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", SENDER, str(nbytes)],
                       check=True, timeout=60)
        out, _ = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    res = json.loads(out.strip().splitlines()[-1])
    assert res["total"] == nbytes
    return res["bytes_after_first"] * 8 / res["seconds"]


# 10 Mbit/s of frames on the wire: each full TCP segment is a 1514-byte frame (14 Ethernet +
# 20 IP + 20 TCP + 12 TCP timestamp option + 1448 payload); tbf counts the whole frame, so
# the payload (goodput) rate is 10 Mbit/s x 1448 / 1514 = 9.564 Mbit/s, ~4.4% below nominal.
EXPECTED_GOODPUT_BPS = 10e6 * 1448 / 1514


def _clean(ns: str, dev: str) -> ShapingState:
    return k.read_state(dev, netns=ns)


@pytest.mark.root
def test_tbf_egress_shapes_to_10mbit(ns_pair):
    a, b = ns_pair
    applied = k.apply(k.plan_apply("va", prof(Direction(rate_bps=10e6)), "egress"), netns=a)
    assert [op.kind for op in applied] == ["tbf"]
    goodput = _goodput_bps(a, b)
    print(f"tbf egress goodput: {goodput / 1e6:.3f} Mbit/s (expected {EXPECTED_GOODPUT_BPS / 1e6:.3f})")
    # The evidence of shaping is the cap: never above the shaped rate (veth alone carries
    # Gbit/s). Below it, the measurement also depends on the CPU: a CI run measured 9.02
    # Mbit/s (-5.7%) while another job shared the 2 cores. 15% below still catches a
    # wrong rate or a burst so small that tbf starves TCP.
    assert goodput <= EXPECTED_GOODPUT_BPS * 1.03
    assert goodput >= EXPECTED_GOODPUT_BPS * 0.85
    assert len(k.clear("va", netns=a)) == 1
    assert k.clear("va", netns=a) == []  # idempotent
    assert _clean(a, "va") == ShapingState()


@pytest.mark.root
def test_ingress_via_ifb_shapes_to_10mbit(ns_pair):
    a, b = ns_pair
    # B is the client: its ingress is the downlink
    k.apply(k.plan_apply("vb", prof(Direction(), Direction(rate_bps=10e6)), "ingress"), netns=b)
    assert _clean(b, "vb").ifb_exists
    goodput = _goodput_bps(a, b)
    print(f"tbf ingress (IFB) goodput: {goodput / 1e6:.3f} Mbit/s")
    # Unlike egress, where the local qdisc pushes back on TCP, the IFB queue drops what
    # does not fit, and TCP recovers: usually by fast retransmit (9.56 Mbit/s measured),
    # sometimes after a 200 ms retransmission timeout (9.06-9.09 Mbit/s measured on a
    # 4 s transfer). That is how a drop-tail downlink behaves, not a shaping error; CPU
    # contention costs a few percent more (see the egress test), hence 15% below.
    assert goodput >= EXPECTED_GOODPUT_BPS * 0.85
    assert goodput <= EXPECTED_GOODPUT_BPS * 1.02  # never faster than the shaped rate
    k.clear("vb", netns=b)
    assert _clean(b, "vb") == ShapingState()


@pytest.mark.root
def test_rollback_of_a_real_plan_whose_second_op_is_invalid(ns_pair):
    a, _ = ns_pair
    plan = [
        AddQdisc("va", "tbf", ROOT_HANDLE, TC_H_ROOT, k.tbf_params(10e6)),
        AddQdisc("nosuch0", "tbf", ROOT_HANDLE, TC_H_ROOT, k.tbf_params(10e6)),
    ]
    with pytest.raises(k.DeviceNotFound, match="nosuch0"):
        k.apply(plan, netns=a)
    assert _clean(a, "va") == ShapingState()  # the first tbf was removed again


@pytest.mark.root
def test_a_second_apply_conflicts_and_leaves_the_first(ns_pair):
    a, _ = ns_pair
    plan = k.plan_apply("va", prof(Direction(rate_bps=10e6)), "egress")
    k.apply(plan, netns=a)
    with pytest.raises(k.ShapingConflict, match="clear"):
        k.apply(plan, netns=a)
    assert _clean(a, "va").root_handle == ROOT_HANDLE
    k.clear("va", netns=a)


@pytest.mark.root
def test_missing_netem_rolls_back_everything(ns_pair):
    """Egress tbf and the IFB are applied before netem is needed on the IFB."""
    a, _ = ns_pair
    plan = k.plan_apply("va", prof(Direction(rate_bps=10e6), Direction(delay_s=0.05)), "both")
    try:
        k.apply(plan, netns=a)
    except k.KernelFeatureMissing as err:
        assert "sch_netem" in str(err) and "fededge netem proxy" in str(err)
        assert err.rollback_errors == []
    else:  # a kernel with netem: it applied; clear must then remove it all
        k.clear("va", netns=a)
    assert _clean(a, "va") == ShapingState()


ECHO = textwrap.dedent("""
    import socket
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.99.0.2", 5202)); s.listen(1); s.settimeout(30)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(30)
    while True:
        b = c.recv(64)
        if not b: break
        c.sendall(b)
""")
PINGER = textwrap.dedent("""
    import socket, statistics, time
    s = socket.create_connection(("10.99.0.2", 5202), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        t = time.monotonic(); s.sendall(b"p"); s.recv(64); rtts.append(time.monotonic() - t)
    print(statistics.median(rtts))
""")


def _median_rtt(a: str, b: str) -> float:
    echo = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", ECHO],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", PINGER],
                             check=True, capture_output=True, text=True, timeout=60).stdout
    finally:
        echo.kill()
        echo.wait()
    return float(out.strip())


@pytest.mark.root
def test_netem_delay_adds_100ms_rtt_or_fails_cleanly(ns_pair):
    a, b = ns_pair
    profile = prof(Direction(delay_s=0.05), Direction(delay_s=0.05))
    plan = k.plan_apply("va", profile, "both")
    try:
        k.apply(plan, netns=a)
    except k.KernelFeatureMissing as err:
        assert "sch_netem" in str(err) and "modprobe sch_netem" in str(err)
        assert _clean(a, "va") == ShapingState()  # no qdisc, no IFB left
        pytest.skip(f"kernel has no sch_netem (CONFIG_NET_SCH_NETEM); the RTT part runs where it has: {err}")
    try:
        rtt = _median_rtt(a, b)
    finally:
        k.clear("va", netns=a)
    assert rtt == pytest.approx(0.100, abs=0.005)


def test_netem_message_is_right_after_other_tc_messages_were_encoded():
    """pyroute2 marks tcmsg compiled on first use; the netem subclass made afterwards must
    still compile its own attribute map (it inherited tcmsg's before: no gemodel, in CI
    after the testbed tests had sent tc requests)."""
    import subprocess
    import sys

    code = (
        "from pyroute2.netlink.rtnl.tcmsg import tcmsg\n"
        "m = tcmsg(); m['attrs'] = [('TCA_KIND', 'tbf')]; m.encode()\n"
        "from fededge.netem import kernel as k\n"
        "from fededge.netem.kernel.netlink import _netem_msg_class\n"
        "from fededge.netem.profiles import Direction\n"
        "p = k.netem_params(Direction(delay_s=0.05, loss=0.01, loss_burst=4))\n"
        "msg = k.encode_netem(7, 0x10000, 0xFFFFFFFF, p); msg.encode()\n"
        "back = _netem_msg_class()(msg.data); back.decode()\n"
        "print(back.get_attr('TCA_OPTIONS').get_attr('TCA_NETEM_LOSS').get_attr('NETEM_LOSS_GE')['p'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) > 0


UDP_RECEIVER = textwrap.dedent("""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("10.99.0.2", 5202)); s.settimeout(3)
    print("ready", flush=True)
    try:
        print(len(s.recv(65536)), flush=True)
    except socket.timeout:
        print("nothing", flush=True)
""")


@pytest.mark.root
def test_a_very_slow_tbf_still_passes_a_full_size_frame(ns_pair):
    """At 2 kbit/s the bucket pyroute2 sent as ticks was capped at 4.3 s of rate (1,073
    bytes): a 1,442-byte frame never passed. With the burst in bytes it does (the bucket
    starts full: two frames)."""
    a, b = ns_pair
    k.apply(k.plan_apply("va", prof(Direction(rate_bps=2000)), "egress"), netns=a)
    rx = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", UDP_RECEIVER],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                "s.sendto(b'x' * 1400, ('10.99.0.2', 5202))")
        subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", send], check=True, timeout=30)
        out, _ = rx.communicate(timeout=30)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert out.strip().splitlines()[-1] == "1400"
    k.clear("va", netns=a)


@pytest.mark.root
def test_the_cli_sizes_tbf_for_the_interfaces_own_mtu(ns_pair, capsys):
    """--mtu defaulted to 1500: on loopback (MTU 65536) tbf's burst held no packet."""
    a, _ = ns_pair
    assert _cli(["apply", "--dev", "lo", "--netns", a, "--profile", "android-lte"]) == 0
    out = capsys.readouterr().out
    burst = int(out.split(" burst ")[1].split()[0])
    assert burst >= 65536 + 14, out
    assert _cli(["clear", "--dev", "lo", "--netns", a]) == 0


@pytest.mark.root
def test_clear_removes_the_ifb_of_an_interface_that_is_gone(ns_pair):
    """read_state raised DeviceNotFound before looking for the IFB: a veth deleted under
    an ingress shaping left its ifb-* behind for good."""
    _, b = ns_pair
    k.apply(k.plan_apply("vb", prof(Direction(), Direction(rate_bps=10e6)), "ingress"), netns=b)
    ifb = k.default_ifb_name("vb")
    _ip("-n", b, "link", "del", "vb")
    done = k.clear("vb", netns=b)
    assert [op.describe() for op in done] == [k.DelLink(ifb).describe()]
    links = subprocess.run(["ip", "-n", b, "link"], capture_output=True, text=True, timeout=10).stdout
    assert ifb not in links
    with pytest.raises(k.DeviceNotFound, match="vb"):  # nothing of fededge's left: the missing interface is named
        k.clear("vb", netns=b)
