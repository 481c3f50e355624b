"""``fededge netem ...``: list and show link profiles, shape an interface with the kernel
backend (``apply``, ``clear``); the proxy adds its own subcommand (``proxy``) through
``fededge.netem.proxy.register_cli``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fededge.netem import kernel
from fededge.netem.profiles import ProfileError, get_profile, load_profiles

__all__ = ["register"]


def _cmd_profiles(args: argparse.Namespace) -> int:
    try:
        profiles = load_profiles(args.profiles_file)
    except ProfileError as err:
        print(f"fededge netem: {err}", file=sys.stderr)
        return 2
    rows = [p.to_row() for p in profiles.values()]
    head = f"{'name':<17}{'down':>14}{'up':>14}{'RTT ms':>9}{'jitter':>8}{'loss':>7}  source"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<17}{r['down']:>14}{r['up']:>14}{r['rtt_ms']:>9g}{r['jitter_ms']:>8g}"
              f"{r['loss'] * 100:>6g}%  {r['source']}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        p = get_profile(args.name, load_profiles(args.profiles_file))
    except ProfileError as err:
        print(f"fededge netem: {err}", file=sys.stderr)
        return 2
    print(f"{p.name}: {p.description}")
    print(f"  source: {p.source}")
    for label, d in (("up (client -> server)", p.up), ("down (server -> client)", p.down)):
        rate = "unshaped" if d.rate_bps is None else f"{d.rate_bps / 1e6:g} Mbit/s"
        if d.trace is not None:
            rate = f"Mahimahi trace {d.trace}"
        burst = f", mean burst {d.loss_burst:g} packets" if d.loss_burst > 1 else ""
        print(f"  {label}: {rate}, delay {d.delay_s * 1000:g} ms, jitter {d.jitter_s * 1000:g} ms, "
              f"loss {d.loss * 100:g}%{burst}")
    print(f"  base RTT {p.rtt_s * 1000:g} ms")
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    mtu = args.mtu
    if mtu is None:  # the interface's own: tbf drops every packet larger than its burst
        try:
            mtu = kernel.device_mtu(args.dev, netns=args.netns)
        except kernel.KernelShapingError as err:
            if not args.dry_run:
                print(f"error: {err}", file=sys.stderr)
                return 1
            mtu = 1500
    try:
        profile = get_profile(args.profile, load_profiles(args.profiles_file))
        plan = kernel.plan_apply(args.dev, profile, args.direction, side=args.side, mtu=mtu)
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
        applied = kernel.apply(plan, netns=args.netns)
    except kernel.KernelShapingError as err:
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
        for op in kernel.plan_clear(args.dev):
            print(prefix + op.describe())
        return 0
    try:
        done = kernel.clear(args.dev, netns=args.netns)
    except kernel.KernelShapingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for op in done:
        print(prefix + op.describe())
    if not done:
        print(f"{args.dev}: no fededge shaping; nothing to clear")
    return 0


def _register_kernel(netem_subparsers: Any) -> None:
    """``apply`` and ``clear``: the kernel backend (:mod:`fededge.netem.kernel`)."""
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
    ap.add_argument("--mtu", type=int, default=None,
                    help="interface MTU, for tbf's burst (default: the interface's own; 1500 with --dry-run "
                         "where it cannot be read)")
    ap.add_argument("--netns", default=None, help="network namespace (as in `ip netns`) of the interface")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as tc commands; apply nothing")
    ap.set_defaults(func=_cmd_apply)

    cl = netem_subparsers.add_parser("clear", help="remove fededge's shaping from an interface")
    cl.add_argument("--dev", required=True)
    cl.add_argument("--netns", default=None)
    cl.add_argument("--dry-run", action="store_true", help="print what clear could remove; do nothing")
    cl.set_defaults(func=_cmd_clear)


def register(sub: argparse._SubParsersAction) -> None:
    netem = sub.add_parser("netem", help="link profiles and network emulation")
    nsub = netem.add_subparsers(dest="netem_command", required=True)
    lst = nsub.add_parser("profiles", help="list the link profiles with their numbers and sources")
    lst.add_argument("--profiles-file", help="a TOML file of extra profiles")
    lst.set_defaults(func=_cmd_profiles)
    show = nsub.add_parser("show", help="show one profile")
    show.add_argument("name")
    show.add_argument("--profiles-file", help="a TOML file of extra profiles")
    show.set_defaults(func=_cmd_show)
    from fededge.netem import proxy

    proxy.register_cli(nsub)
    _register_kernel(nsub)
