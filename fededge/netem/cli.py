"""``fededge netem ...``: list and show link profiles; the proxy and kernel backends add
their own subcommands (``proxy``, ``apply``, ``clear``) through ``register_cli``."""

from __future__ import annotations

import argparse
import sys

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
    from fededge.netem import kernel, proxy

    proxy.register_cli(nsub)
    kernel.register_cli(nsub)
