#!/usr/bin/env python
"""DGA against FedAvg on the namespace testbed: real seconds per round, and simulated.

``fededge testbed up`` (:mod:`fededge.deploy.testbed`) with ``--clients`` SuperNodes
(default 4), each in its own network namespace and shaped by its own userspace proxy
(``--shaping proxy``) at a profile drawn from ``--profiles`` (default
``wifi:0.5,4g:0.25,3g:0.25``) with ``--seed``. Through that one testbed, one after the
other, with the same rounds and local steps: FedAvg, then DGA with each delay of
``--delays`` (default ``1,2``), and with ``--ahead also|only`` DGA with
``dga-compute-ahead=true`` (fededge.clients.preview). Every run gets ``netem=PROFILES seed=SEED``, so fededge's
simulated clock assigns each partition the link the testbed really applies, and its
``sim_s`` is what the clock predicts for the same run.

Per run, from ``metrics.jsonl``: the real wall seconds per round in the steady state
``(wall at R - wall at 1) / (R - 1)`` (round 1 carries the ServerApp's start-up and the
SuperNodes' first poll), the simulated seconds per round over the same rounds
``(sim at R - sim at 1) / (R - 1)``, their ratio (real / sim), FedAvg's per-round
seconds over the run's (above 1x: faster than FedAvg) for both clocks, the final
accuracy and the mean staleness; and the CPU seconds of the Flower processes during the
run (sampled from ``/proc``; the proxies are not counted). The testbed is torn down
(:func:`fededge.deploy.testbed.down`) in a ``finally`` block, also on errors and Ctrl-C.

Needs root (network namespaces). Example::

    sudo .venv/bin/python benchmarks/bench_testbed.py                 # 4 clients, 5 rounds, K=5
    sudo .venv/bin/python benchmarks/bench_testbed.py --rounds 4 --delays 2 --json testbed.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dga_deploy import CpuMeter, fmt, print_provenance, read_run, require_positive, write_json

from fededge.deploy import testbed as tb
from fededge.deploy.procs import parent_pid, proc_state
from fededge.deploy.testbed import host
from fededge.deploy.testbed.plan import PREFIX
from fededge.runconfig_text import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
CONTROLLED = ("strategy", "num-rounds", "local-steps", "dga-delay", "dga-compute-ahead", "netem", "seed", "results-dir", "run-name",
              "progress", "save-model", "min-available-nodes")
PR_SET_CHILD_SUBREAPER = 36


def _subreaper(on: bool) -> bool:
    """Adopt the testbed's orphaned grandchildren, so that they can be reaped after ``down``."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_zombies() -> int:
    me, n = os.getpid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit() and parent_pid(int(name)) == me and proc_state(int(name)) == "Z":
            try:
                os.waitpid(int(name), os.WNOHANG)
                n += 1
            except OSError:
                pass
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4, help="SuperNodes, one namespace each (default 4)")
    p.add_argument("--profiles", default="wifi:0.5,4g:0.25,3g:0.25",
                   help="profile mix, the netem run-config syntax (default wifi:0.5,4g:0.25,3g:0.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the profile assignment and the runs (default 0)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every run (default 5)")
    p.add_argument("--local-steps", type=int, default=5, help="local steps K per round (default 5)")
    p.add_argument("--delays", default="1,2", help="DGA delays D to run after FedAvg (default 1,2)")
    p.add_argument("--subnet", default=tb.DEFAULT_SUBNET, help=f"the testbed's subnet (default {tb.DEFAULT_SUBNET})")
    p.add_argument("--ahead", choices=("off", "also", "only"), default="off",
                   help="DGA with dga-compute-ahead=true (the warm workers compute each round from the "
                        "preview the previous message brought): 'also' adds a row per delay, 'only' replaces "
                        "the plain DGA rows (default off)")
    p.add_argument("--run-config", default=None, metavar='"k=v ..."', help="further overrides for every run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per flwr run (default 900)")
    p.add_argument("--state-dir", default=None,
                   help="the testbed's state directory, kept with logs and results (default: a temporary one)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    args = p.parse_args(argv)
    require_positive(p, args, "clients", "rounds", "local_steps")
    if args.rounds < 2:
        p.error("--rounds must be >= 2: the steady state leaves round 1 out")
    try:
        args.delay_list = [int(x) for x in args.delays.split(",") if x.strip()]
    except ValueError:
        p.error(f"--delays must be integers separated by commas, got {args.delays!r}")
    if any(d < 0 for d in args.delay_list):
        p.error(f"--delays must be >= 0, got {args.delays}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    user = parse_run_config(args.run_config)
    taken = [k for k in user if k in CONTROLLED]
    if taken:
        print(f"bench_testbed: --run-config may not set {', '.join(taken)}: use the flags", file=sys.stderr)
        return 2

    own_state = args.state_dir is None
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="bench-testbed-")).resolve()
    try:
        config = tb.TestbedConfig(clients=args.clients, profiles=args.profiles, shaping="proxy", seed=args.seed,
                                  subnet=args.subnet, state_dir=state_dir, app_dir=ROOT)
    except ValueError as err:
        print(f"bench_testbed: {err}", file=sys.stderr)
        return 2
    runs = [("fedavg", {"strategy": "fedavg"})]
    for d in args.delay_list:
        if args.ahead != "only":
            runs.append((f"dga D={d}", {"strategy": "dga", "dga-delay": d}))
        if args.ahead != "off":
            runs.append((f"dga D={d} ahead", {"strategy": "dga", "dga-delay": d, "dga-compute-ahead": True}))
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    nodes: list[dict[str, Any]] = []
    adopted = _subreaper(True)
    down_report = None
    results = state_dir / "results"
    try:
        t0 = time.perf_counter()
        try:
            state = tb.up(config, wait_s=120, echo=sys.stderr)
        except tb.PreflightError as err:
            print(f"bench_testbed: {err}", file=sys.stderr)
            return 2
        nodes = state["nodes"]
        print(f"[bench] testbed up in {time.perf_counter() - t0:.1f} s: "
              + ", ".join(f"node {n['index']} {n['profile']}" for n in nodes), file=sys.stderr, flush=True)
        meter = CpuMeter(str(state["home"]))
        for i, (label, over) in enumerate(runs):
            name = f"bench{i}"
            cfg = {**user, **over, "num-rounds": args.rounds, "local-steps": args.local_steps,
                   "netem": args.profiles, "seed": args.seed, "results-dir": str(results), "run-name": name,
                   "progress": "lines", "save-model": False}
            print(f"[bench] {label}", file=sys.stderr, flush=True)
            cpu0 = meter.snapshot()
            run = tb.run(state_dir, cfg, app_dir=ROOT, timeout_s=args.timeout, echo=sys.stderr)
            cpu = CpuMeter.delta(cpu0, meter.snapshot())
            row: dict[str, Any] = {"ok": run.ok, "status": run.status, "run_wall_s": run.wall_s, "cpu_s": cpu}
            try:
                row.update(read_run(results, name))
            except (OSError, ValueError, KeyError) as err:
                row["error"] = f"{type(err).__name__}: {err}"
            if not run.ok:
                print(f"[bench] {label} FAILED\n{run.output[-3000:]}", file=sys.stderr, flush=True)
            rows[label] = row
        meter.stop()
    finally:
        try:
            down_report = tb.down(state_dir)
        finally:
            time.sleep(0.5)
            _reap_zombies()
            if adopted:
                _subreaper(False)
    left_ns = [ns for ns in host.list_netns() if ns.startswith(PREFIX + tb.testbed_tag(state_dir))]
    if own_state and not left_ns:
        shutil.rmtree(state_dir, ignore_errors=True)
    load_after = os.getloadavg()

    base = rows.get("fedavg", {})
    ok = bool(rows) and all(r.get("ok") and "error" not in r for r in rows.values())
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    print()
    print(f"Testbed: {args.clients} SuperNodes in network namespaces, proxy shaping, profiles "
          f"`{args.profiles}` (seed {args.seed}): "
          + ", ".join(f"node {n['index']} {n['profile']}" for n in nodes)
          + f"; {args.rounds} rounds, K={args.local_steps}; sim_s from the same runs with netem={args.profiles}")
    print()
    print("| run | total wall s | real s/round, steady | sim s/round, steady | real / sim "
          "| FedAvg/run, real | FedAvg/run, sim | final acc | staleness | CPU s (clientapp / all) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        good = r.get("ok") and "error" not in r
        real, sim = r.get("steady_s"), r.get("sim_steady_s")
        rr = base.get("steady_s") / real if good and base.get("steady_s") and real else None
        rs = base.get("sim_steady_s") / sim if good and base.get("sim_steady_s") and sim else None
        note = "" if good else f" (FAILED: status {r.get('status')} {r.get('error', '')})"
        print(f"| {label}{note} | {fmt(r.get('run_wall_s'), '.1f')} | {fmt(real, '.2f')} | {fmt(sim, '.2f')} "
              f"| {fmt(real / sim if real and sim else None, '.1f')}{'×' if real and sim else ''} "
              f"| {fmt(rr, '.2f')}{'×' if rr else ''} | {fmt(rs, '.2f')}{'×' if rs else ''} "
              f"| {fmt(r.get('final_accuracy'), '.4f')} | {fmt(r.get('staleness'), '.2f')} "
              f"| {r['cpu_s']['clientapp']:.0f} / {sum(r['cpu_s'].values()):.0f} |")
    print()
    print("real: metrics.jsonl's wall_s; sim: its sim_s (fededge's simulated clock for the same links and the "
          "measured compute time); steady = (value at R - value at 1)/(R - 1). FedAvg/run: FedAvg's seconds per "
          "round over the run's (above 1x: faster than FedAvg). CPU s: Flower processes during the run, "
          "sampled from /proc (proxies not counted).")
    print()
    if down_report is not None:
        print(f"teardown: {len(down_report.killed)} processes stopped, {len(down_report.removed)} namespaces/links "
              f"removed; namespaces left: {left_ns or 'none'}")
    print_provenance(command, started, load_before, load_after)
    if args.json:
        write_json(args.json, command, started, args, load_before, load_after, nodes=nodes, runs=rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
