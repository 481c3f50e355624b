#!/usr/bin/env python
"""Many clients on one machine (issue 21): seconds per round, peak memory, the floor.

Each configuration runs ``fededge run``'s in-process runtime in a fresh process (so that
its peak RSS is its own), ``clients-per-round`` clients a round, on synthetic data split
IID. Columns:

- ``s/round``: wall seconds per round after round 1 (round 1 also starts the workers
  and builds the first clients' data).
- ``floor``: the clients' own compute (their local SGD steps, ``compute_s`` summed over
  the round's clients) divided by the cores used (``--workers``): what a round cannot
  beat. ``ratio`` = s/round / floor.
- ``clients``, ``eval``, ``server``: where a round's seconds go (in-process rows): the
  clients' phase (the round's messages run on every worker, with the wire and the
  states), the server's evaluation of the new model, and the server's other work
  (sampling, serialising and metering the messages, decoding and aggregating).
- ``RSS``: peak resident memory of the run's process, and ``RSS all`` that plus the
  largest worker's peak once per worker (an upper bound of the run's total: peaks need
  not coincide, and the node cache's mapped data set counts in every process that reads
  it). ``PSS all``: the peak of the summed proportional set size of the run's process and
  its workers, sampled every 0.5 s: shared pages (libraries, the mapped data set) counted
  once, so the memory the run uses together.
- When a row with several workers and the same configuration on one worker both run
  (the same ``states`` preferred, else any), a second table sets each against the
  one-worker row's compute (the strict floor: compute timed with nothing beside it,
  divided by the workers).
- ``held``: clients holding a state at the end (a stateful compressor's residual).

A row's ``workers`` may end in ``c`` (``1c``, ``2c``): the same run with ``cohort = true``,
each round's clients trained as one batched program (fededge/clients/cohort.py) in the
run's own process, with its torch threads (every core). Its ``floor`` is the per-client
floor over every core: a cohort client's ``compute_s`` is what one client of its group
took training on its own (fededge/clients/cohort.py), so their sum over the cores is what
the per-client path cannot beat with that many workers, and a ratio under 1 is a cohort
beating it. A third table sets each
cohort row against the per-client rows of the same configuration (speed-up = their
s/round over the cohort row's).

A row's ``workers`` and ``states`` may be ``auto``: what ``fededge run`` picks without
flags (``--workers auto``, ``client-states=auto``); its floor divides by the processes it
picked (config.json's ``inprocess_workers``; ``inprocess_runtime`` says why).

A row's ``workers`` may be ``ray``: the same configuration under Flower's simulation
(``flwr run`` on a private local SuperLink, ``fededge.deploy.launch.flwr_run_local``), one
CPU per virtual client, ``client-states`` passed on (``disk``: fededge's ClientApp keeps
idle nodes' states in files). Its ``RSS`` is the peak of the summed RSS of every Flower
and Ray process, sampled every 0.5 s; ``floor`` divides by the machine's cores.

A row may end in ``:dataset:samples[:local-steps]`` (default ``synthetic``, ``--samples``
and 20 local steps); the CNN needs images (``synthetic-images``). Each data set is built
into the node cache (a temporary one) before the rows run, so no row's memory includes
building it.

Example
-------
::

    python benchmarks/bench_scale.py                    # the table in BENCHMARKS.md
    python benchmarks/bench_scale.py --rows 10000:mlp:signsgd:60:1:memory,10000:mlp:signsgd:60:2:disk
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

#: clients:model:compressor:rounds:workers:states[:dataset:samples]
DEFAULT_ROWS = (
    "100:mlp:none:20:2:memory", "100:mlp:signsgd:20:2:memory",
    "1000:mlp:signsgd:30:2:disk", "1000:mlp:signsgd:10:ray:memory", "1000:mlp:signsgd:10:ray:disk",
    "10000:mlp:none:20:2:disk",
    "10000:mlp:signsgd:60:1:memory", "10000:mlp:signsgd:60:1:disk", "10000:mlp:signsgd:60:2:disk",
    "1000:cnn:signsgd:4:2:disk:synthetic-images:20000:5", "10000:cnn:signsgd:4:2:disk:synthetic-images:20000:5",
    "100000:mlp:signsgd:20:2:disk",
)


def _flower_rss_kb() -> int:
    """Summed RSS of every Flower and Ray process on the machine (kB)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            if not any(k in cmd for k in (b"flwr", b"flower", b"ray", b"raylet", b"gcs_server")):
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` (kB): its private pages plus its share of each
    page it shares (a library, the mapped data set), so that the PSS of several
    processes adds up to the memory they use together."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree_pss_kb() -> int:
    """Summed PSS of this process and its children (the in-process runtime's workers,
    found by their parent pid in /proc/*/stat as tests/server/test_scale.py finds them)."""
    me = os.getpid()
    total = _pss_kb(me)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == me:
            total += _pss_kb(int(proc.name))
    return total


@contextmanager
def _sampled(fn, every_s: float = 0.5) -> Iterator[list[int]]:  # noqa: ANN001
    """The peak of ``fn()`` sampled every ``every_s`` seconds while the block runs."""
    import threading

    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], fn())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        done.set()
        t.join()
        peak[0] = max(peak[0], fn())


def _ray_run(overrides: dict, clients: int, out: Path) -> tuple[Path, int]:
    from fededge.deploy.launch import flwr_run_local

    with _sampled(_flower_rss_kb) as peak:
        run = flwr_run_local(Path(__file__).resolve().parents[1], flwr_home=out / "flwr-home", num_supernodes=clients,
                             run_config=overrides, timeout_s=3000)
    if not run.ok:
        raise RuntimeError(f"the Flower run failed: {run.status}\n{run.output[-3000:]}")
    (run_dir,) = list(Path(overrides["results-dir"]).iterdir())
    return run_dir, peak[0]


@contextmanager
def timed_calls(targets: dict[str, tuple[object, str]], starts: dict[str, list[float]] | None = None
                ) -> Iterator[dict[str, list[float]]]:
    """Within the block, each ``targets`` entry ``name: (owner, attribute)`` is wrapped in
    a timer: the dict yielded collects the seconds of every call under ``name`` (and
    ``starts``, if given, the ``perf_counter`` at which each began). The originals are put
    back on the way out (bench_message_costs.py and bench_gpu.py use it too)."""
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}
    calls: dict[str, list[float]] = {name: [] for name in targets}
    if starts is not None:
        starts.update({name: [] for name in targets})

    def timed(name: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                calls[name].append(time.perf_counter() - t0)
                if starts is not None:
                    starts[name].append(t0)
        return call

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, timed(name))
    try:
        yield calls
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])


def _timed_phases() -> AbstractContextManager[dict[str, list[float]]]:
    """Seconds of each call to the grid's delivery of a round's messages (``clients``:
    the clients' phase, their messages on every worker, wire and states included) and to
    the server's evaluation (``evaluate``). The rest of a round is the server's own work
    (sampling, serialising, metering, aggregating)."""
    from fededge.server.grid import InProcessGrid
    from fededge.server.experiment import Experiment

    return timed_calls({"clients": (InProcessGrid, "_run_batch"), "evaluate": (Experiment, "evaluate")})


def one(clients: int, model: str, compressor: str, rounds: int, workers: str, states: str, per_round: int,
        dataset: str, samples: int, local_steps: int, out: Path, evaluate_every: int = 1) -> dict:
    from fededge.server.inprocess import run_inprocess

    overrides = {"dataset": dataset, "synthetic-samples": samples, "partition": "iid", "local-steps": local_steps,
                 "clients-per-round": per_round, "num-rounds": rounds, "model": model, "progress": "off",
                 "results-dir": str(out / "results"), "save-model": False, "checkpoint-every": 0,
                 "min-partition-size": 1, "client-threads": 1, "client-states": states,
                 "evaluate-every": evaluate_every}
    if compressor != "none":
        overrides |= {"compressor": compressor, "error-feedback": True}
    if workers == "ray":
        run_dir, rss_kb = _ray_run(overrides, clients, out)
        cores, self_kb, all_kb = os.cpu_count() or 1, rss_kb, rss_kb
        procs = cores
    else:
        w = workers.removesuffix("c")
        with _timed_phases() as phases, _sampled(_tree_pss_kb) as pss:
            run_dir = run_inprocess(overrides | {"cohort": workers.endswith("c")}, num_clients=clients,
                                    workers="auto" if w == "auto" else int(w))
        procs = int(json.loads((run_dir / "config.json").read_text())["inprocess_workers"])
        cores = (os.cpu_count() or 1) if workers.endswith("c") else procs
        self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        all_kb = self_kb + (cores - 1) * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = lines[2:]
    round_s = (lines[-1]["wall_s"] - lines[1]["wall_s"]) / len(later)
    compute = sum(c["compute_s"] for r in later for c in r["clients"]) / len(later)
    held = sorted({c["partition"] for r in lines[1:] for c in r["clients"]})
    spent = {}
    if workers != "ray":  # per round over rounds 2..R, as s/round
        calls = {"clients": len(later), "evaluate": sum(r["accuracy"] is not None for r in later)}  # evaluate-every
        spent = {name: sum(times[-calls[name]:]) / len(later) if calls[name] else 0.0
                 for name, times in phases.items()}
    return {"clients": clients, "model": model, "compressor": compressor, "rounds": rounds, "workers": workers,
            "procs": procs,
            "states": states, "dataset": dataset, "samples": samples, "round_s": round_s, "floor_s": compute / cores,
            "clients_s": spent.get("clients"), "evaluate_s": spent.get("evaluate"),
            "rss_gb": self_kb / 2**20, "rss_all_gb": all_kb / 2**20,
            "pss_all_gb": pss[0] / 2**20 if workers != "ray" else None,
            "held": len(held) if compressor != "none" else 0, "accuracy": lines[-1]["accuracy"]}


def _phase(r: dict, key: str) -> str:
    return "—" if r.get(key) is None else f"{r[key]:.3f}"


def _gb(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _server(r: dict) -> str:
    """The rest of a round: the server's own work besides evaluating."""
    if r.get("clients_s") is None:
        return "—"
    return f"{r['round_s'] - r['clients_s'] - r['evaluate_s']:.3f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="clients:model:compressor:rounds:workers:states,...")
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--samples", type=int, default=500_000, help="synthetic-samples")
    p.add_argument("--evaluate-every", type=int, default=1,
                   help="the server evaluates every N rounds (and after the last): how much of a round "
                        "is the evaluation of a large test set")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        if args.one.startswith("prebuild:"):
            from fededge.config import RunConfig
            from fededge.workload import dataset_for

            _, dataset, samples = args.one.split(":")
            dataset_for(RunConfig.from_mapping({"dataset": dataset, "synthetic-samples": int(samples)}))
            return 0
        c, m, comp, r, w, s, *data = args.one.split(":")
        dataset, samples = (data[0], int(data[1])) if data else ("synthetic", args.samples)
        steps = int(data[2]) if len(data) > 2 else 20
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(int(c), m, comp, int(r), w, s, args.per_round, dataset, samples, steps, Path(tmp),
                                 args.evaluate_every)))
        return 0
    rows = []
    print(f"{'clients':>8} {'model':>5} {'compressor':>10} {'rounds':>6} {'workers':>7} {'states':>6} "
          f"{'s/round':>8} {'floor':>7} {'ratio':>6} {'clients':>8} {'eval':>6} {'server':>7} {'RSS GB':>7} "
          f"{'RSS all':>8} {'PSS all':>8} {'held':>6} {'acc':>6}", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FEDEDGE_CACHE_DIR": cache}  # the data set, built once, mapped by every process
        datasets = {tuple(r.split(":")[6:8]) or ("synthetic", str(args.samples)) for r in args.rows.split(",")}
        for dataset, samples in sorted(datasets):
            subprocess.run([sys.executable, __file__, "--one", f"prebuild:{dataset}:{samples}"], env=env, check=True)
        for row in args.rows.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", row, "--per-round", str(args.per_round),
                                   "--samples", str(args.samples), "--evaluate-every", str(args.evaluate_every)],
                                  capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                print(f"{row}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["row"] = row
            rows.append(r)
            print(f"{r['clients']:>8} {r['model']:>5} {r['compressor']:>10} {r['rounds']:>6} {r['workers']:>7} "
                  f"{r['states']:>6} {r['round_s']:>8.3f} {r['floor_s']:>7.3f} {r['round_s'] / r['floor_s']:>6.2f} "
                  f"{_phase(r, 'clients_s'):>8} {_phase(r, 'evaluate_s'):>6} {_server(r):>7} "
                  f"{r['rss_gb']:>7.2f} {r['rss_all_gb']:>8.2f} {_gb(r.get('pss_all_gb')):>8} {r['held']:>6} "
                  f"{r['accuracy']:>6.3f}", flush=True)
    _strict(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _strict(rows: list[dict]) -> None:
    """Each multi-worker row against the compute of the same configuration run on one
    process (when both ran): a row's own floor takes its clients' compute as timed while
    the workers share the cores with this process, which a busier runtime slows (and so
    flatters); the one-process row times the same compute with nothing beside it."""
    def key(r: dict) -> tuple[str, ...]:
        f = r["row"].split(":")
        return (*f[:4], *f[6:])  # all but workers and states

    alone: dict[tuple[str, ...], float] = {}
    for r in rows:  # the one-worker row with the same states first, else any
        if r["workers"] == "1":
            alone.setdefault(key(r), r["floor_s"])
            alone[(*key(r), r["states"])] = r["floor_s"]

    def match(r: dict) -> float | None:
        return alone.get((*key(r), r["states"]), alone.get(key(r)))

    _cohorts(rows, key)
    pairs = [(r, c) for r in rows if r["workers"] not in ("1", "ray") and not r["workers"].endswith("c")
             and (c := match(r)) is not None]
    if not pairs:
        return
    print("\nagainst the one-process row's compute (strict floor = its compute / workers):")
    print(f"{'row':>40} {'s/round':>8} {'strict floor':>13} {'ratio':>6}")
    for r, compute in pairs:
        floor = compute / r["procs"]
        print(f"{r['row']:>40} {r['round_s']:>8.3f} {floor:>13.3f} {r['round_s'] / floor:>6.2f}")


def _cohorts(rows: list[dict], key) -> None:  # noqa: ANN001
    """Each cohort row against the per-client rows of the same configuration."""
    pairs = [(c, r) for c in rows if c["workers"].endswith("c")
             for r in rows if not r["workers"].endswith("c") and key(r) == key(c) and r["states"] == c["states"]]
    if not pairs:
        return
    print("\ncohort against per-client (speed-up = per-client s/round / cohort s/round):")
    print(f"{'row':>40} {'per-client workers':>18} {'per-client s/round':>18} {'cohort s/round':>14} {'speed-up':>8}")
    for c, r in pairs:
        print(f"{c['row']:>40} {r['workers']:>18} {r['round_s']:>18.3f} {c['round_s']:>14.3f} "
              f"{r['round_s'] / c['round_s']:>8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
