"""``fededge testbed up | run | status | down``: the command line of the testbed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fededge.deploy.testbed.lifecycle import down, run, status, up
from fededge.deploy.testbed.state import read_state
from fededge.deploy.testbed.plan import (
    DEFAULT_SUBNET, PREFIX, SHAPINGS, STATE_FILE, PreflightError, TestbedConfig, TestbedError, default_state_dir,
    plan_testbed,
)
from fededge.runconfig_text import parse_run_config

__all__ = ["describe_state", "register_cli"]


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
    return TestbedConfig(clients=args.clients, profiles=args.profiles, shaping=args.shaping, seed=args.seed,
                         subnet=args.subnet, state_dir=args.state_dir, app_dir=args.app_dir,
                         profiles_file=args.profiles_file, rate_only=args.rate_only,
                         node_config=parse_run_config(args.node_config), warm=not args.cold,
                         superlink_port=getattr(args, "port", 0) or 0)


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
        left = "AND the teardown after it failed" in str(err)
        print(f"fededge testbed up: {err}\n" + (f"(some of it may be left: run `fededge testbed down --state-dir "
                                               f"{config.state_dir}`)" if left else
                                               "(everything it had made was removed)"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # up tore down what it had made (its own handler), then re-raised
        left = read_state(config.state_dir) is not None  # (its teardown failed, or was interrupted too)
        print("fededge testbed up: interrupted; " + (f"some of it may be left: run `fededge testbed down "
                                                     f"--state-dir {config.state_dir}`" if left else
                                                     "what it had made was removed"), file=sys.stderr)
        return 130
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
