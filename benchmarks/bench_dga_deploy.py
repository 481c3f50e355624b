#!/usr/bin/env python
"""DGA against FedAvg in a real Flower deployment: wall-clock seconds per round.

One :class:`fededge.deploy.local.LocalDeployment` on 127.0.0.1: a SuperLink and
``--supernodes`` SuperNodes (default 4), each dialling its own userspace netem proxy at
``--profile`` (default ``4g``: 27.5 ms each way, 6.3 Mbit/s up, 21.3 Mbit/s down). In
that one deployment, one after the other, with the same rounds (``--rounds``, default 8)
and local steps (``--local-steps``, default 5):

``fedavg``
    Flower's FedAvg through ``Strategy.start``: round t+1 is sent after round t's
    replies are in; ``send_and_receive`` pulls replies every 3 s.
``dga D=...``
    DGA with ``--delay`` (default 2), pipelined: up to D + 1 rounds are pushed ahead,
    each SuperNode runs them in order, replies are pulled every 0.1 s.
``dga D=0`` (with ``--with-d0``)
    The same loop with no delay: synchronous like FedAvg but with DGA's 0.1 s polling,
    which separates what pipelining saves from what faster polling saves.

Per run: rounds, ``flwr run``'s total wall seconds, the server's wall seconds per round
from ``metrics.jsonl`` (``wall_s``), as the steady state ``(wall at R - wall at 1) /
(R - 1)`` (round 1 carries the ServerApp's and first ClientApps' start-up) and as the
mean ``wall at R / R``, the final accuracy, the mean staleness, and the ratio of FedAvg's
wall per round to each run's. Everything runs on this machine: the SuperLink, the
SuperNodes, a fresh ``flwr-clientapp`` process (torch import) per message, and the
proxies (threads of this process) share its cores; say which machine you quote.

Examples
--------
::

    python benchmarks/bench_dga_deploy.py                     # fedavg + dga D=2, 8 rounds
    python benchmarks/bench_dga_deploy.py --with-d0 --json dga-deploy.json
    python benchmarks/bench_dga_deploy.py --rounds 4 --delay 1 --profile wifi --supernodes 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fededge.deploy.local import LocalDeployment
from fededge.netem.profiles import get_profile
from fededge.runconfig_text import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
#: Run-config keys the benchmark sets itself.
CONTROLLED = ("strategy", "num-rounds", "local-steps", "dga-delay", "results-dir", "run-name",
              "progress", "save-model", "min-available-nodes")


KINDS = ("clientapp", "serverapp", "superlink", "supernode", "superexec", "worker")  # worker: fededge's warm one


class CpuMeter:
    """CPU seconds (user + system) of the deployment's processes, by kind.

    A thread samples ``/proc`` every ``interval_s``: every process whose command line has
    ``marker`` and all their descendants, zombies included (an exited ``flwr-clientapp``
    keeps its CPU times until its parent reaps it). A process reaped between two samples
    loses at most its last ``interval_s`` of CPU.
    """

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        self.marker, self.interval_s = marker, interval_s
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds last seen)
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _stat(self, pid: int) -> tuple[str, int, float] | None:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        comm = text[text.index("(") + 1:text.rindex(")")]
        rest = text.rsplit(")", 1)[1].split()
        return comm, int(rest[1]), (int(rest[11]) + int(rest[12])) / self._tick

    def sample(self) -> None:
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = self._stat(int(name))
                if st is not None:
                    stats[int(name)] = st
        family = set()
        for pid in stats:
            try:
                if self.marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    family.add(pid)
            except OSError:
                pass
        grew = True
        while grew:
            new = {p for p, (_, ppid, _) in stats.items() if ppid in family} - family
            family |= new
            grew = bool(new)
        with self._lock:
            for pid in family:
                comm, _, cpu = stats[pid]
                kind = next((k for k in KINDS if k[:8] in comm), self.cpu.get(pid, ("other",))[0])
                self.cpu[pid] = (kind, max(cpu, self.cpu.get(pid, ("", 0.0))[1]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def snapshot(self) -> dict[int, tuple[str, float]]:
        self.sample()
        with self._lock:
            return dict(self.cpu)

    @staticmethod
    def delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
        out = {k: 0.0 for k in (*KINDS, "other")}
        for pid, (kind, cpu) in after.items():
            out[kind] += cpu - before.get(pid, (kind, 0.0))[1]
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def steady_per_round(walls: list[float]) -> float | None:
    """Seconds per round after round 1, from cumulative walls at rounds 0..R."""
    rounds = len(walls) - 1
    if rounds < 1:
        return None
    return walls[1] - walls[0] if rounds == 1 else (walls[-1] - walls[1]) / (rounds - 1)


def read_run(results: Path, name: str) -> dict[str, Any]:
    (run_dir,) = [p for p in results.iterdir() if p.is_dir() and p.name.startswith(f"{name}-")]
    lines = sorted((json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if x.strip()), key=lambda r: r["round"])
    summary = json.loads((run_dir / "summary.json").read_text())
    walls = [float(r["wall_s"]) for r in lines]
    sims = [float(r["sim_s"]) for r in lines]
    stale = [r["staleness"] for r in lines[1:] if r.get("staleness") is not None]
    return {
        "rounds": len(lines) - 1,
        "walls": walls,
        "steady_s": steady_per_round(walls),
        "sims": sims,  # what fededge's simulated clock said of the same rounds
        "sim_steady_s": steady_per_round(sims),
        "sim_mean_s": sims[-1] / (len(sims) - 1) if len(sims) > 1 else None,
        "mean_s": walls[-1] / (len(walls) - 1) if len(walls) > 1 else None,
        "final_accuracy": summary.get("final_accuracy"),
        "accuracies": [r["accuracy"] for r in lines],
        "num_clients": [r["num_clients"] for r in lines[1:]],
        "staleness": sum(stale) / len(stale) if stale else None,
        "pipelined": any(r.get("pipelined") for r in lines[1:]),
        "status": summary.get("status"),
    }


def print_provenance(command: str, started: "dt.datetime", load_before: tuple[float, ...],
                     load_after: tuple[float, ...]) -> None:
    """The lines under a deployment benchmark's tables: command, date, versions, machine load."""
    import flwr
    import torch

    print(f"command: {command}")
    print(f"date: {started.isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, flwr {flwr.__version__}, python {platform.python_version()}, "
          f"{platform.platform()}")
    print(f"os.cpu_count() = {os.cpu_count()}, usable cores {len(os.sched_getaffinity(0))}, "
          f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after")


def require_positive(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit with argparse's usage error unless every named integer option is >= 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def write_json(path: str, command: str, started: "dt.datetime", args: argparse.Namespace,
               load_before: tuple[float, ...], load_after: tuple[float, ...], **numbers: Any) -> None:
    """A deployment benchmark's ``--json`` file: provenance, the arguments and its numbers."""
    Path(path).write_text(json.dumps({
        "command": command, "date": started.isoformat(timespec="seconds"), "args": vars(args),
        **numbers, "loadavg_before": load_before, "loadavg_after": load_after,
    }, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds of every run (default 8)")
    p.add_argument("--delay", type=int, default=2, help="DGA's delay D in rounds (default 2)")
    p.add_argument("--local-steps", type=int, default=5, help="local steps K per round (default 5)")
    p.add_argument("--profile", default="4g", help="link profile of every SuperNode's proxy (default 4g)")
    p.add_argument("--supernodes", type=int, default=4, help="SuperNodes (default 4)")
    p.add_argument("--with-d0", action="store_true", help="also run DGA with D=0 (synchronous, 0.1 s polling)")
    p.add_argument("--run-config", default=None, metavar='"k=v ..."',
                   help='further run-config overrides for every run, e.g. "model=mlp"')
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per flwr run (default 900)")
    p.add_argument("--workdir", default=None,
                   help="keep the deployment's FLWR_HOME, logs and results here (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    args = p.parse_args(argv)
    require_positive(p, args, "rounds", "local_steps", "supernodes")
    if args.delay < 0:
        p.error(f"--delay must be >= 0, got {args.delay}")
    try:
        get_profile(args.profile)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    user = parse_run_config(args.run_config)
    taken = [k for k in user if k in CONTROLLED]
    if taken:
        print(f"bench_dga_deploy: --run-config may not set {', '.join(taken)}: use the flags",
              file=sys.stderr)
        return 2

    runs = [("fedavg", {"strategy": "fedavg"}),
            (f"dga D={args.delay}", {"strategy": "dga", "dga-delay": args.delay})]
    if args.with_d0:
        runs.append(("dga D=0", {"strategy": "dga", "dga-delay": 0}))
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dga-deploy-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(args.workdir or tmp).resolve()
        results = workdir / "results"
        t0 = time.perf_counter()
        # Cold SuperNodes, as the figures in BENCHMARKS.md were measured.
        with LocalDeployment(ROOT, num_supernodes=args.supernodes, profile=args.profile,
                             workdir=workdir / "deployment", warm=False) as dep:
            print(f"[bench] deployment up in {time.perf_counter() - t0:.1f} s: SuperLink "
                  f"{dep.superlink_address}, {args.supernodes} SuperNodes behind {args.profile} proxies",
                  file=sys.stderr, flush=True)
            meter = CpuMeter(str(dep.home))
            for i, (label, over) in enumerate(runs):
                name = f"bench{i}"
                cfg = {**user, **over, "num-rounds": args.rounds, "local-steps": args.local_steps,
                       "results-dir": str(results), "run-name": name, "progress": "lines",
                       "save-model": False}
                print(f"[bench] {label}", file=sys.stderr, flush=True)
                cpu0, own0 = meter.snapshot(), time.process_time()
                run = dep.run(cfg, timeout_s=args.timeout, echo=sys.stderr)
                cpu = CpuMeter.delta(cpu0, meter.snapshot())
                cpu["proxies (this process)"] = time.process_time() - own0
                row: dict[str, Any] = {"ok": run.ok, "status": run.status, "run_wall_s": run.wall_s,
                                       "cpu_s": cpu, "flwr_ls": run.info}
                try:
                    row.update(read_run(results, name))
                except (OSError, ValueError, KeyError) as err:
                    row["error"] = f"{type(err).__name__}: {err}"
                if not run.ok:
                    print(f"[bench] {label} FAILED\n{run.describe()}", file=sys.stderr, flush=True)
                rows[label] = row
            meter.stop()
    load_after = os.getloadavg()

    base = rows["fedavg"]
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    prof = get_profile(args.profile)
    print()
    print(f"{args.supernodes} SuperNodes, each behind its own userspace proxy at `{args.profile}` "
          f"(RTT {prof.rtt_s * 1000:.0f} ms, up {prof.up.rate_bps / 1e6:.1f} Mbit/s, "
          f"down {prof.down.rate_bps / 1e6:.1f} Mbit/s), one local SuperLink; K={args.local_steps}")
    print()
    print("| run | rounds | total wall s | wall s/round, steady | wall s/round, mean | final acc "
          "| staleness | FedAvg/run, steady | FedAvg/run, mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        ok = r.get("ok") and "error" not in r
        rs = (base.get("steady_s") / r["steady_s"]) if ok and base.get("steady_s") and r.get("steady_s") else None
        rm = (base.get("mean_s") / r["mean_s"]) if ok and base.get("mean_s") and r.get("mean_s") else None
        note = "" if ok else f" (FAILED: status {r.get('status')} {r.get('error', '')})"
        print(f"| {label}{note} | {r.get('rounds', '–')} | {fmt(r.get('run_wall_s'), '.1f')} "
              f"| {fmt(r.get('steady_s'), '.2f')} | {fmt(r.get('mean_s'), '.2f')} "
              f"| {fmt(r.get('final_accuracy'), '.4f')} | {fmt(r.get('staleness'), '.2f')} "
              f"| {fmt(rs, '.2f')}{'×' if rs else ''} | {fmt(rm, '.2f')}{'×' if rm else ''} |")
    print()
    print("total wall s: `flwr run` from submission to exit (FAB build, ServerApp start-up, "
          "logs); wall s/round from metrics.jsonl's wall_s: steady = (wall at R - wall at 1)/(R - 1), "
          "mean = wall at R / R; staleness: mean rounds of a client's own updates in flight")
    print()
    kinds = list(next(iter(rows.values()))["cpu_s"])
    print("CPU seconds (user + system) of each kind of process during each run, sampled from /proc "
          "every 0.5 s (flwr-clientapp: one process per message):")
    print()
    print("| run | " + " | ".join(kinds) + " | total | total / wall |")
    print("|---|" + "---:|" * (len(kinds) + 2))
    for label, r in rows.items():
        total = sum(r["cpu_s"].values())
        print(f"| {label} | " + " | ".join(f"{r['cpu_s'][k]:.1f}" for k in kinds)
              + f" | {total:.1f} | {total / r['run_wall_s']:.2f} |")
    print()
    print_provenance(command, started, load_before, load_after)
    if args.json:
        write_json(args.json, command, started, args, load_before, load_after, runs=rows)
    return 0 if all(r.get("ok") and "error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
