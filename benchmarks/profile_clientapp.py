#!/usr/bin/env python
"""Where one message's ``flwr-clientapp`` process spends its seconds, end to end.

Runs an app on a :class:`fededge.deploy.local.LocalDeployment` whose SuperNodes start,
for every message, not Flower's ``flwr-clientapp`` but a wrapper of the same name first
on ``PATH`` that runs Flower's entry point under :mod:`cProfile` (the whole process:
imports, pulling the message, the FAB, loading the app, the ClientApp's call, pushing the
reply, the exit handlers). Each process writes its profile, its CPU seconds
(``getrusage``) and its wall seconds from the kernel's start time of the process (so the
interpreter's own start is counted) to ``--workdir/profiles``.

The report attributes each process's CPU time to phases by the cumulative time of the
functions that bound them, averaged over the profiled messages (round 1 left out unless
``--keep-first``: it also pays the node's first FAB install).

Example
-------
::

    python benchmarks/profile_clientapp.py --rounds 4               # fededge, cold
    python benchmarks/profile_clientapp.py --rounds 4 --env FEDEDGE_WORKER_SOCKET=
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from fededge.deploy.local import LocalDeployment

ROOT = Path(__file__).resolve().parents[1]

WRAPPER = '''#!{python}
import cProfile, json, os, resource, sys, time
out = os.environ["FEDEDGE_PROFILE_DIR"]
ticks = os.sysconf("SC_CLK_TCK")
with open("/proc/self/stat") as f:
    start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as f:
    up0 = float(f.read().split()[0])
t_enter = time.perf_counter()
born_s = up0 - start_ticks / ticks  # seconds since the kernel started this process
prof = cProfile.Profile()
done = []

def dump():
    if done:
        return
    done.append(1)
    prof.disable()
    pid = os.getpid()
    prof.dump_stats(f"{{out}}/{{pid}}.prof")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(f"{{out}}/{{pid}}.json", "w") as f:
        json.dump({{"cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": born_s + time.perf_counter() - t_enter,
                   "before_main_s": born_s}}, f)

_exit = os._exit
def _profiled_exit(code):
    dump()
    _exit(code)
os._exit = _profiled_exit
sys.argv[0] = "flwr-clientapp"
prof.enable()
try:
    from flwr.supernode.cli import flwr_clientapp
    flwr_clientapp()
finally:
    dump()
'''

# Phase -> functions (file suffix, name) whose cumulative time is the phase's. The
# first match per phase counts; phases are disjoint by construction of Flower's
# run_clientapp (imports happen before it; the call of the ClientApp is inside it).
PHASES: list[tuple[str, list[tuple[str, str]]]] = [
    ("imports before run_clientapp (flwr entry point)", [("flwr_clientapp.py", "<module>")]),
    ("pull message, context, FAB", [("run_clientapp.py", "pull_task_input")]),
    ("install FAB (unzip into FLWR_HOME)", [("install.py", "install_from_fab")]),
    ("load the ClientApp (imports of the app: torch, fededge, ...)", [("load.py", "_load_app")]),
    ("ClientApp call (data, model, training, reply records)", [("client_app.py", "__call__")]),
    ("push reply message", [("run_clientapp.py", "push_message")]),
    ("exit handlers (push status and context, heartbeat stop)", [("exit_handlers.py", "trigger_exit_handlers")]),
]


def write_wrapper(bindir: Path) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    w = bindir / "flwr-clientapp"
    w.write_text(WRAPPER.format(python=sys.executable))
    w.chmod(0o755)


def _cum(stats: pstats.Stats, suffix: str, name: str) -> float | None:
    best = None
    for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and file.endswith(suffix):
            best = ct if best is None else max(best, ct)
    return best


def _cum_all(stats: pstats.Stats, name_prefix: str) -> float:
    """Cumulative time of top-level imports of a package, as the import machinery sees them."""
    total = 0.0
    for (file, _line, func), (_cc, _nc, _tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func == "<module>" and f"/{name_prefix}/__init__.py" in file:
            total = max(total, ct)
    return total


def analyse(prof_dir: Path, skip_first: bool) -> dict[str, Any]:
    runs = sorted(prof_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if skip_first and len(runs) > 1:
        runs = runs[1:]
    rows: list[dict[str, float]] = []
    for meta_path in runs:
        meta = json.loads(meta_path.read_text())
        stats = pstats.Stats(str(meta_path.with_suffix(".prof")))
        total_prof = stats.total_tt  # type: ignore[attr-defined]
        row = {"cpu_s": meta["cpu_s"], "wall_s": meta["wall_s"], "before_main_s": meta["before_main_s"],
               "profiled_s": total_prof}
        for phase, funcs in PHASES:
            for suffix, name in funcs:
                v = _cum(stats, suffix, name)
                if v is not None:
                    row[phase] = v
                    break
            else:
                row[phase] = 0.0
        for pkg in ("torch", "fededge", "sklearn", "scipy", "flwr", "numpy", "grpc", "google"):
            row[f"import {pkg}"] = _cum_all(stats, pkg)
        rows.append(row)
    keys = list(rows[0]) if rows else []
    return {"messages": len(rows), "median": {k: statistics.median(r[k] for r in rows) for k in keys},
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--supernodes", type=int, default=1)
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--keep-first", action="store_true", help="keep round 1's message in the medians")
    p.add_argument("--warm", action="store_true", help="LocalDeployment(warm=True)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment")
    p.add_argument("--top", type=int, default=25, help="functions by cumulative time to print (one message)")
    p.add_argument("--app", default=str(ROOT), help="the app directory flwr run bundles (default: this repository)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-clientapp-", ignore_cleanup_errors=True) as tmp:
        work = Path(args.workdir or tmp).resolve()
        bindir, prof_dir = work / "bin", work / "profiles"
        write_wrapper(bindir)
        prof_dir.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.pathsep.join([str(bindir), str(Path(sys.executable).parent), os.environ["PATH"]]),
               "FEDEDGE_PROFILE_DIR": str(prof_dir)}
        env.update(dict(kv.split("=", 1) for kv in args.env))
        cfg = {"strategy": "fedavg", "num-rounds": args.rounds, "local-steps": args.local_steps,
               "fraction-evaluate": 0.0, "results-dir": str(work / "results"), "progress": "off",
               "save-model": False}
        with LocalDeployment(args.app, num_supernodes=args.supernodes, workdir=work / "dep", env=env,
                             warm=bool(args.warm)) as dep:
            run = dep.run(cfg, timeout_s=900)
        if not run.ok:
            print(run.describe(), file=sys.stderr)
            return 1
        res = analyse(prof_dir, skip_first=not args.keep_first)
        print(f"{res['messages']} flwr-clientapp processes profiled (medians, seconds):\n")
        print("| what | s |")
        print("|---|---:|")
        for k, v in res["median"].items():
            print(f"| {k} | {v:.2f} |")
        last = sorted(prof_dir.glob("*.prof"), key=lambda p: p.stat().st_mtime)[-1]
        print(f"\nTop functions by cumulative time, one message ({last.name}):\n")
        pstats.Stats(str(last)).sort_stats("cumulative").print_stats(args.top)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
