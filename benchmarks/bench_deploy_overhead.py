#!/usr/bin/env python
"""What fededge costs per message on a real deployment, over plain Flower apps.

Rows (``--rows``), each on its own :class:`fededge.deploy.local.LocalDeployment` with the
same shape (a SuperLink and ``--supernodes`` SuperNodes on 127.0.0.1, no proxy), the same
number of rounds and the same model size on the wire, one after the other:

``flower``
    A minimal Flower app the script writes to a temporary directory (its own
    ``pyproject.toml``): a ServerApp running Flower's own ``FedAvg`` (``fraction_train=1``,
    no federated evaluation) from seeded random float32 arrays of the shapes of fededge's
    model, and a ClientApp whose ``train`` returns the arrays it received, unchanged,
    with ``num-examples``. No torch anywhere. Its ``evaluate_fn`` only writes a
    timestamp per round, which gives the round times.
``flower-torch``
    The same app, but its ClientApp trains: it makes torch parameters of the received
    arrays, takes one SGD step (momentum 0.9) on a quadratic loss and returns them. What
    any torch user of Flower pays per message today (torch's import and its first
    optimizer), the fair anchor.
``fededge-cold``
    fededge's own app (this repository) with ``strategy=fedavg``, ``local-steps`` (default
    1), no federated evaluation, the node cache off (``FEDEDGE_CACHE_DIR=off``): every
    message's process imports torch and fededge and rebuilds the node's data and model.
``fededge-cache``
    The same with the node cache on (:mod:`fededge.nodecache`): the first message of a
    node writes its data set and partition, later ones map them.
``fededge-warm``
    fededge's shim ClientApp (``fededge.clients.shim:app``, no torch) on ``fededge
    supernode`` nodes (``LocalDeployment(warm=True)``): each message goes to the node's
    warm worker. The worker's CPU is its own column.

Per row: the steady-state wall seconds per round, ``(wall at R - wall at 1) / (R - 1)``
(round 1 carries the ServerApp's start-up and the SuperNodes' first 3-second poll), the
same per message (a round's wall / its ``N`` train messages: the SuperNodes run
concurrently on the machine's cores, so this is an amortised figure, not one message's
latency), and the CPU seconds per message of each kind of process, sampled from
``/proc`` (``flwr-clientapp``: one fresh process per message): over the whole run, and
steady (rounds 2..R only, from the moment round 1 is recorded: no warm worker's or
ServerApp's start-up in it, which a device pays once, not per message).

For the simulated clock (fededge rows): ``message-overhead-s``, the steady wall seconds
per round minus the clock's own seconds per round (``round_sim_s``: the measured
compute on an ideal network). With ``--supernodes 1`` that is the per-message overhead
of the device the benchmark runs on, the figure :class:`fededge.netem.clock.ClientLink`
takes (``message_overhead_s``). ``--cpus 0`` pins the benchmark and every process it
starts to CPU 0 (``sched_setaffinity``, as ``taskset -c 0``): a one-core stand-in for a
Raspberry Pi.

Then the cost of a ``flwr-clientapp`` process's start alone: the wall and CPU seconds of
``python -c "import ..."`` for the modules such a process imports (median of
``--import-repeats``), so that a reader can split the per-message CPU into interpreter,
Flower, torch and fededge.

Examples
--------
::

    python benchmarks/bench_deploy_overhead.py                       # 4 SuperNodes, 8 rounds, all rows
    python benchmarks/bench_deploy_overhead.py --supernodes 1 --rows fededge-cold,fededge-warm --cpus 0
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dga_deploy import CpuMeter, fmt, print_provenance, require_positive, steady_per_round, write_json

from fededge.deploy.local import LocalDeployment, write_app_variant

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("flower", "flower-torch", "fededge-cold", "fededge-cache", "fededge-warm")
PLAIN_PACKAGE = "plainflwrapp"

# The minimal Flower app. {shapes} is filled in by write_plain_app.
PYPROJECT = """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{package}"
version = "1.0.0"
description = "A minimal Flower app: FedAvg over a ClientApp that echoes the arrays"
dependencies = ["flwr>=1.41", "numpy"]

[tool.setuptools.packages.find]
include = ["{package}*"]

[tool.flwr.app]
publisher = "fededge-bench"

[tool.flwr.app.components]
serverapp = "{package}.server:app"
clientapp = "{package}.client:app"

[tool.flwr.app.config]
num-rounds = 3
min-available-nodes = 1
times-file = ""
"""

SERVER = '''\
"""Flower's FedAvg, no evaluation; evaluate_fn only records when each round ended."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

SHAPES = {shapes!r}

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    t0 = time.perf_counter()
    cfg = context.run_config
    nodes = int(cfg["min-available-nodes"])
    rng = np.random.default_rng(0)
    arrays = ArrayRecord([rng.standard_normal(s).astype(np.float32) for s in SHAPES])
    times = []

    def evaluate_fn(server_round, _arrays):
        times.append({{"round": server_round, "wall_s": time.perf_counter() - t0}})
        with open(str(cfg["times-file"]), "w") as f:
            json.dump(times, f)
        return None

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes,
                      min_evaluate_nodes=0, min_available_nodes=nodes)
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(cfg["num-rounds"]),
                   evaluate_fn=evaluate_fn)
'''

CLIENT_TORCH = '''\
"""Trains: torch parameters of the received arrays, one SGD step on a quadratic loss."""

from collections import OrderedDict

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    params = OrderedDict((k, torch.nn.Parameter(torch.from_numpy(a.numpy().copy()))) for k, a in arrays.items())
    opt = torch.optim.SGD(params.values(), lr=0.01, momentum=0.9)
    loss = sum((p * p).sum() for p in params.values())
    loss.backward()
    opt.step()
    out = ArrayRecord(OrderedDict((k, p.detach()) for k, p in params.items()))
    return Message(content=RecordDict({{"arrays": out, "metrics": MetricRecord({{"num-examples": 1}})}}),
                   reply_to=msg)
'''

CLIENT = '''\
"""Returns the received arrays unchanged, with num-examples."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return Message(content=RecordDict({{"arrays": msg.content["arrays"],
                                        "metrics": MetricRecord({{"num-examples": 1}})}}), reply_to=msg)
'''


def model_shapes(run_config: dict[str, Any]) -> tuple[list[list[int]], int]:
    """Shapes of fededge's initial model for ``run_config``, and its bytes as float32."""
    from fededge.config import RunConfig
    from fededge.workload import dataset_for, model_for

    cfg = RunConfig.from_mapping(run_config)
    model = model_for(cfg, dataset_for(cfg))
    shapes = [list(t.shape) for t in model.state_dict().values()]
    return shapes, sum(4 * t.numel() for t in model.state_dict().values())


def write_plain_app(app_dir: Path, shapes: list[list[int]], *, torch_client: bool = False) -> Path:
    pkg = app_dir / PLAIN_PACKAGE
    pkg.mkdir(parents=True)
    pyproject = PYPROJECT.format(package=PLAIN_PACKAGE)
    if torch_client:
        pyproject = pyproject.replace(f"{PLAIN_PACKAGE}.client:app", f"{PLAIN_PACKAGE}.client_torch:app")
    (app_dir / "pyproject.toml").write_text(pyproject)
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(SERVER.format(shapes=shapes))
    (pkg / "client.py").write_text(CLIENT.format())
    (pkg / "client_torch.py").write_text(CLIENT_TORCH.format())
    return app_dir


def import_cost(statement: str, repeats: int) -> dict[str, float]:
    """Median wall and CPU seconds of ``python -c STATEMENT`` in a fresh interpreter."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], check=True, stdin=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


IMPORTS = [
    ("python -c pass", "pass"),
    ("import flwr-clientapp's entry point (flwr, numpy, grpc, ...)", "import flwr.supernode.cli"),
    ("import torch", "import torch"),
    ("import torch + its first optimizer (imports torch._dynamo)",
     "import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)"),
    ("import scikit-learn's digits loader (what building digits imports)", "import sklearn.datasets"),
    ("import fededge's ClientApp (flwr + torch + fededge)", "import flwr.supernode.cli, fededge.clients.app"),
    ("the same + build one node's data (partition 0 of N) and model",
     ("import flwr.supernode.cli, fededge.clients.app, torch\n"
      "from fededge.config import RunConfig\n"
      "from fededge.workload import client_data, dataset_for, model_for\n"
      "cfg = RunConfig.from_mapping({})\n"
      "client_data(cfg, 0, {n}, torch.device('cpu'))\n"
      "model_for(cfg, dataset_for(cfg))")),
]


def run_app(label: str, app_dir: Path, cfg: dict[str, Any], *, supernodes: int, workdir: Path,
            timeout_s: float, times_of: Any, env: dict[str, str] | None = None, warm: bool = False,
            sims_of: Any = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    with LocalDeployment(app_dir, num_supernodes=supernodes, workdir=workdir, env=env, warm=warm) as dep:
        print(f"[bench] {label}: deployment up in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        meter = CpuMeter(str(dep.home))
        cpu0 = meter.snapshot()
        # The CPU when round 1 is recorded: rounds 2..R are the steady state (no process
        # or worker start-up, no first poll in them).
        after1: dict[str, Any] = {}
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.1):
                try:
                    if len(times_of()) >= 2:
                        after1["cpu"] = meter.snapshot()
                        return
                except (OSError, ValueError, KeyError):
                    pass
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        run = dep.run(cfg, timeout_s=timeout_s, echo=sys.stderr)
        done.set()
        watcher.join(5)
        end = meter.snapshot()
        cpu = CpuMeter.delta(cpu0, end)
        steady_cpu = CpuMeter.delta(after1["cpu"], end) if "cpu" in after1 else None
        meter.stop()
    row: dict[str, Any] = {"ok": run.ok, "status": run.status, "run_wall_s": run.wall_s, "cpu_s": cpu,
                           "steady_cpu_s": steady_cpu}
    if not run.ok:
        print(f"[bench] {label} FAILED\n{run.describe()}", file=sys.stderr, flush=True)
    try:
        walls = times_of()
        row.update(rounds=len(walls) - 1, walls=walls, steady_s=steady_per_round(walls))
        if sims_of is not None:
            sims = sims_of()
            row.update(sims=sims, steady_sim_s=steady_per_round(sims))
    except (OSError, ValueError, KeyError) as err:
        row["error"] = f"{type(err).__name__}: {err}"
    return row


def fededge_walls(results: Path, key: str = "wall_s") -> list[float]:
    (metrics,) = list(results.glob("*/metrics.jsonl"))
    lines = sorted((json.loads(x) for x in metrics.read_text().splitlines() if x.strip()), key=lambda r: r["round"])
    return [float(r[key]) for r in lines]


def plain_walls(times_file: Path) -> list[float]:
    return [float(r["wall_s"]) for r in sorted(json.loads(times_file.read_text()), key=lambda r: r["round"])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--supernodes", type=int, default=4, help="SuperNodes (default 4)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of both runs (default 8)")
    p.add_argument("--local-steps", type=int, default=1, help="fededge's local steps K (default 1)")
    p.add_argument("--import-repeats", type=int, default=3,
                   help="repeats of each import measurement (default 3; 0 skips them)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per flwr run (default 900)")
    p.add_argument("--workdir", default=None, help="keep logs, apps and results here (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows to run, in order (default: all: {','.join(ROWS)})")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="pin this script and everything it starts to these CPUs (e.g. 0: a one-core "
                        "stand-in for a Raspberry Pi, as taskset -c 0)")
    p.add_argument("--app", default=str(ROOT), help="fededge's app directory (default: this repository)")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    args.rows = rows
    require_positive(p, args, "supernodes", "rounds", "local_steps")
    if args.rounds < 2:
        p.error("--rounds must be >= 2: the steady state leaves round 1 out")
    if args.import_repeats < 0:
        p.error(f"--import-repeats must be >= 0, got {args.import_repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpus is not None:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # inherited by every child

    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    n = args.supernodes
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-deploy-overhead-", ignore_cleanup_errors=True) as tmp:
        work = Path(args.workdir or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)

        def fed_cfg(label: str) -> dict[str, Any]:
            return {"strategy": "fedavg", "num-rounds": args.rounds, "local-steps": args.local_steps,
                    "fraction-evaluate": 0.0, "results-dir": str(work / f"results-{label}"), "run-name": "overhead",
                    "progress": "off", "save-model": False}

        shapes, model_bytes = model_shapes(fed_cfg("x"))
        for label in args.rows:
            if label.startswith("flower"):
                times_file = work / f"{label}-times.json"
                app = write_plain_app(work / f"{label}-app", shapes, torch_client=label == "flower-torch")
                rows[label] = run_app(
                    label, app, {"num-rounds": args.rounds, "times-file": str(times_file)}, supernodes=n,
                    workdir=work / f"dep-{label}", timeout_s=args.timeout,
                    times_of=lambda f=times_file: plain_walls(f))
                continue
            warm = label == "fededge-warm"
            app = write_app_variant(args.app, work / "shim-app") if warm else Path(args.app)
            cache = "off" if label == "fededge-cold" else str(work / f"cache-{label}")
            res = work / f"results-{label}"
            rows[label] = run_app(
                label, app, fed_cfg(label), supernodes=n, workdir=work / f"dep-{label}", timeout_s=args.timeout,
                env={"FEDEDGE_CACHE_DIR": cache}, warm=warm, times_of=lambda r=res: fededge_walls(r),
                sims_of=lambda r=res: fededge_walls(r, "sim_s"))
    imports = {label: import_cost(stmt.replace("{n}", str(n)), args.import_repeats) for label, stmt in IMPORTS} \
        if args.import_repeats else {}
    load_after = os.getloadavg()

    kinds = ("clientapp", "worker", "serverapp", "superlink", "supernode", "superexec")
    for r in rows.values():
        r["messages"] = n * r.get("rounds", args.rounds)
        r["per_msg_s"] = r["steady_s"] / n if r.get("steady_s") is not None else None
        r["cpu_per_msg"] = {k: r["cpu_s"].get(k, 0.0) / r["messages"] for k in kinds}
        r["cpu_per_msg"]["other"] = r["cpu_s"].get("other", 0.0) / r["messages"]
        r["cpu_per_msg"]["all"] = sum(r["cpu_s"].values()) / r["messages"]
        steady_msgs = n * (r.get("rounds", args.rounds) - 1)
        r["steady_cpu_per_msg"] = (sum(r["steady_cpu_s"].values()) / steady_msgs
                                   if r.get("steady_cpu_s") is not None and steady_msgs > 0 else None)
        if r.get("steady_sim_s") is not None and r.get("steady_s") is not None:
            r["message_overhead_s"] = r["steady_s"] - r["steady_sim_s"]
    ok = all(r.get("ok") and "error" not in r for r in rows.values())

    command = " ".join(shlex.quote(x) for x in [Path(sys.executable).name, *sys.argv])
    pinned = f", pinned to CPU(s) {args.cpus}" if args.cpus is not None else ""
    print()
    print(f"{n} SuperNodes on one LocalDeployment per row (127.0.0.1, no proxy), {args.rounds} rounds, "
          f"FedAvg with every node every round, no federated evaluation; model {len(shapes)} arrays, "
          f"{model_bytes / 1e3:.1f} kB float32 each way per message; fededge K={args.local_steps}{pinned}")
    print()
    cols = ["clientapp", "worker", "serverapp", "superlink", "supernode", "superexec", "other"]
    print("| row | total wall s | wall s/round, steady | wall s/message, steady | "
          + " | ".join(f"{c} CPU s/msg" if c == "clientapp" else c for c in cols)
          + " | all CPU s/msg | all CPU s/msg, steady |")
    print("|---|---:|---:|---:|" + "---:|" * (len(cols) + 2))
    for label, r in rows.items():
        note = "" if r.get("ok") and "error" not in r else f" (FAILED: {r.get('status')} {r.get('error', '')})"
        c = r["cpu_per_msg"]
        print(f"| {label}{note} | {fmt(r.get('run_wall_s'), '.1f')} | {fmt(r.get('steady_s'), '.2f')} "
              f"| {fmt(r.get('per_msg_s'), '.2f')} | " + " | ".join(f"{c[k]:.2f}" for k in cols)
              + f" | {c['all']:.2f} | {fmt(r.get('steady_cpu_per_msg'), '.2f')} |")
    if ok:
        print()
        print("Ratios of CPU s per message (all processes) and of steady wall s per round:")
        print()
        print("| row | CPU / flower | CPU / flower-torch | steady CPU / flower | steady CPU / flower-torch "
              "| wall / flower | wall / flower-torch |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, r in rows.items():
            cells = []
            for kind in ("cpu", "steady", "wall"):
                for base in ("flower", "flower-torch"):
                    b = rows.get(base)
                    if b is None:
                        cells.append("–")
                        continue
                    num, den = {"cpu": (r["cpu_per_msg"]["all"], b["cpu_per_msg"]["all"]),
                                "steady": (r["steady_cpu_per_msg"], b["steady_cpu_per_msg"]),
                                "wall": (r["steady_s"], b["steady_s"])}[kind]
                    if num is None or den is None:
                        cells.append("–")
                        continue
                    cells.append(f"{num / den:.2f}×" if den else "–")
            print(f"| {label} | " + " | ".join(cells) + " |")
    over = {k: r for k, r in rows.items() if "message_overhead_s" in r}
    if over:
        print()
        print("For the simulated clock: message-overhead-s = steady wall s/round − the clock's s/round "
              "(round_sim_s: measured compute, ideal network)" + (" (one SuperNode: the device's own "
                                                                 "figure)" if n == 1 else
                                                                 f" ({n} SuperNodes sharing the cores)"))
        print()
        print("| row | wall s/round | sim s/round | message-overhead-s |")
        print("|---|---:|---:|---:|")
        for label, r in over.items():
            print(f"| {label} | {r['steady_s']:.2f} | {r['steady_sim_s']:.3f} | {r['message_overhead_s']:.2f} |")
    print()
    print("wall s/round, steady: (wall at R - wall at 1)/(R - 1), from metrics.jsonl (fededge) or the "
          "plain app's evaluate_fn timestamps; wall s/message: that / N messages per round. CPU s/msg: "
          "CPU seconds (user + system) of each kind of process over the whole run (start-up included) "
          "/ (N x R) messages, sampled from /proc every 0.5 s; steady: the same over rounds 2..R only "
          "(from when round 1 is recorded; no process or worker start-up); worker: fededge's warm workers; other: "
          "the `fededge supernode` launchers.")
    if imports:
        print()
        print(f"A flwr-clientapp process's start, alone: `python -c \"import ...\"` in a fresh interpreter, "
              f"median of {args.import_repeats}:")
        print()
        print("| what | wall s | CPU s |")
        print("|---|---:|---:|")
        for label, m in imports.items():
            print(f"| {label} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} |")
    print()
    print_provenance(command, started, load_before, load_after)
    if args.json:
        write_json(args.json, command, started, args, load_before, load_after, model_shapes=shapes,
                   model_bytes=model_bytes, runs=rows, imports=imports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
