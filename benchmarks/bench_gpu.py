#!/usr/bin/env python
"""fededge on a GPU against its pure-torch floor and the CPU (issue 35): one script, one table.

Run it on a machine with a CUDA GPU (about 8 minutes on an H100 with 16 cores; 2026-11-27,
without the CPU ResNet rows, the first seven rows took 6 minutes); ``scripts/gpu_check.sh``
runs it with the CUDA tests;
``--quick`` runs tiny sizes on any machine (CPU only where no GPU), to check the script.

Rows, each in a fresh process (``fededge run``'s in-process runtime, as a new user runs it):

- **ResNet-18**, ``synthetic-images`` (CIFAR-shaped), 10 clients x 20 local steps, batch
  32, every client every round: fededge on ``cuda``, fededge on the CPU (all cores), and
  the **pure-torch floor**: the same 200 SGD steps (``fededge.clients.train.local_sgd``,
  each client from the round's global weights, its data already on the device) with
  nothing else, timed on the same GPU (its update on a GPU is torch.optim.SGD's default
  there, the multi-tensor form, since db23d65; before, one kernel per tensor operation). The floor uses the kernels fededge's clients use
  (run config ``deterministic``, true by default: cuDNN's deterministic algorithms, no
  autotuner); on CUDA both rows are also run with ``deterministic=false`` (``path`` marked
  ``*``), each compared with its own floor; and once with every message serialised
  (``/ser``: ``run_inprocess(direct=False)``, the path before direct delivery).
  A row with 4 worker processes on the GPU measures several clients in flight at once
  (issue 35, item 4), against the floor of one; the table's last lines say how many of
  them fitted in the GPU's free memory.
- **MLP, 1,000 clients, 100 a round, signSGD + error feedback**, ``synthetic`` data:
  per-client path with 1 and with 8 worker processes, and the cohort path
  (``cohort = true``: each round's clients as one batched program), on ``cuda`` and on
  the CPU.
- **defaults**, for each workload: ``device=auto`` and ``--workers auto``, what
  ``fededge run`` does without flags (issue 35, items 5 and 6: the device is timed on
  both where CUDA is); the table's last lines say what they chose (config.json's
  ``inprocess_runtime``).

Columns: ``s/round`` (wall seconds per round over rounds 2..R: round 1 also builds the
data and warms up), ``compute`` (the clients' summed ``compute_s`` per round: their
local SGD, or their shares of the cohort's), ``vs floor`` (s/round over the pure-torch
floor, ResNet rows) and ``vs best CPU`` (the best CPU row's s/round of the same workload
over this row's). Record the output in BENCHMARKS.md with the machine and the commit.

    python benchmarks/bench_gpu.py               # the table (GPU machine)
    python benchmarks/bench_gpu.py --quick       # tiny sizes, any machine
    python benchmarks/bench_gpu.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _workloads(quick: bool) -> dict[str, dict]:
    if quick:
        return {
            "resnet": {"model": "resnet18-w8", "dataset": "synthetic-images", "synthetic-samples": 1200,
                       "clients": 4, "local-steps": 3, "num-rounds": 3, "clients-per-round": 4},
            "mlp": {"model": "mlp", "dataset": "synthetic", "synthetic-samples": 20000, "clients": 100,
                    "local-steps": 5, "num-rounds": 3, "clients-per-round": 20, "compressor": "signsgd",
                    "error-feedback": True},
        }
    return {
        "resnet": {"model": "resnet18", "dataset": "synthetic-images", "synthetic-samples": 20000, "clients": 10,
                   "local-steps": 20, "num-rounds": 5, "clients-per-round": 10},
        "mlp": {"model": "mlp", "dataset": "synthetic", "synthetic-samples": 500000, "clients": 1000,
                "local-steps": 20, "num-rounds": 8, "clients-per-round": 100, "compressor": "signsgd",
                "error-feedback": True},
    }


def _rows(quick: bool, cuda: bool, cpu_resnet: bool = True) -> list[dict]:
    cpu_rounds = 2 if not quick else 3
    rows = []
    devices = (["cuda"] if cuda else []) + ["cpu"]
    for dev in devices if cpu_resnet or not cuda else ["cuda"]:
        rows.append({"workload": "resnet", "device": dev, "path": "floor",
                     **({"num-rounds": cpu_rounds} if dev == "cpu" else {})})
        rows.append({"workload": "resnet", "device": dev, "path": "per-client", "workers": 1,
                     **({"num-rounds": cpu_rounds} if dev == "cpu" else {})})
        if dev == "cuda":  # the same two without deterministic kernels (run config deterministic=false)
            rows.append({"workload": "resnet", "device": dev, "path": "floor", "deterministic": False})
            rows.append({"workload": "resnet", "device": dev, "path": "per-client", "workers": 1,
                         "deterministic": False})
            # every message serialised, as before direct delivery (issue 35, item 2)
            rows.append({"workload": "resnet", "device": dev, "path": "per-client", "workers": 1, "direct": False})
            # several clients in flight on the GPU, one per process (issue 35, item 4; each
            # process its own CUDA context, messages serialised between processes)
            rows.append({"workload": "resnet", "device": dev, "path": "per-client", "workers": 4})
    for dev in devices:
        for workers in (1, 8 if not quick else 2):
            rows.append({"workload": "mlp", "device": dev, "path": "per-client", "workers": workers})
        rows.append({"workload": "mlp", "device": dev, "path": "cohort", "workers": 1})
    # What a user gets without flags: device=auto (timed on both devices where CUDA is) and
    # --workers auto; the row says what they chose.
    for workload in ("resnet", "mlp"):
        rows.append({"workload": workload, "device": "auto", "path": "defaults", "workers": "auto",
                     **({"num-rounds": cpu_rounds} if workload == "resnet" and not cuda else {})})
    return rows


def label(row: dict) -> str:
    """A row's name for ``--rows``: workload:device:path[*][/ser][:workers], e.g.
    ``resnet:cuda:floor*``, ``resnet:cuda:per-client:1``, ``mlp:cpu:per-client:8``,
    ``mlp:auto:defaults:auto`` (``*``: deterministic=false; ``/ser``: every message serialised)."""
    name = f"{row['workload']}:{row['device']}:{row['path']}" + ("*" if row.get("deterministic", True) is False else "")
    name += "/ser" if row.get("direct") is False else ""
    return name + (f":{row['workers']}" if "workers" in row else "")


def pick(rows: list[dict], wanted: str | None) -> list[dict]:
    """The rows ``--rows`` names, in its order (all of them when it is not given); a name
    that matches no row is an error that lists the names there are."""
    if not wanted:
        return rows
    by = {label(r): r for r in rows}
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in names if w not in by]
    if unknown:
        raise SystemExit(f"bench_gpu: --rows names no row {', '.join(unknown)}; the rows here are: "
                         + ", ".join(by))
    return [by[w] for w in names]


def _row_config(row: dict) -> dict:
    """The run-config keys a row sets over its workload's."""
    return {k: row[k] for k in ("num-rounds", "deterministic") if k in row}


def _floor(work: dict, row: dict) -> dict:
    """The same SGD steps in plain torch: each client from the global weights, its data
    already on the device, nothing else (no messages, no aggregation)."""
    import torch

    from fededge.clients.train import BatchSampler, local_sgd
    from fededge.config import RunConfig
    from fededge.models.zoo import build_model
    from fededge.workload import client_data, dataset_for

    cfg = RunConfig.from_mapping({k: v for k, v in work.items() if k not in ("clients",)} | {"partition": "iid"}
                                 | _row_config(row))
    from fededge.clients.device import set_cuda_determinism

    dev = torch.device(row["device"])
    if dev.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    # The kernels fededge's clients use: deterministic ones unless the row says otherwise
    # (run config deterministic, true by default), so that "vs floor" compares like with like.
    set_cuda_determinism(dev, cfg.deterministic)
    ds = dataset_for(cfg)
    model = build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=0).to(dev)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    n = work["clients"]
    data = [client_data(cfg, i, n, dev, None) for i in range(n)]
    samplers = [BatchSampler(len(x), cfg.batch_size, seed=0, stream=i) for i, (x, _) in enumerate(data)]
    times = []
    for _ in range(cfg.num_rounds):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for (x, y), s in zip(data, samplers):
            model.load_state_dict(start)
            local_sgd(model, x, y, steps=cfg.local_steps, lr=cfg.local_lr, momentum=cfg.momentum, sampler=s)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    later = times[1:] or times
    return {"round_s": sum(later) / len(later), "compute_s": sum(later) / len(later), "accuracy": None}


def _phase_targets() -> dict[str, tuple[object, str]]:
    """Where a round's seconds go (``--phases``): the calls timed, by what they do. No
    call holds another, but for a batched encoding's client-by-client fallback, which
    :func:`_per_round` counts in the batch only."""
    from flwr.serverapp.strategy.fedavg import FedAvg

    from fededge import _flwr_internals as fi
    from fededge.clients import cohort, train
    from fededge.compress.update import UpdateEncoder
    from fededge.server.experiment import Experiment
    from fededge.strategies import compressed

    return {"local SGD, client by client": (train, "local_sgd"), "cohort SGD": (cohort, "cohort_sgd"),
            "encoding, client by client": (UpdateEncoder, "encode"), "encoding, batched": (cohort, "_encode_batches"),
            "message copies (direct)": (fi, "detached_copy"), "message sizes (direct)": (fi, "direct_wire_size"),
            "message sizes, a shared content": (fi, "direct_wire_split"),
            "message sizes, own objects": (fi, "message_own_bytes"),
            "server: decoding replies": (compressed, "decode_compressed"),
            "server: FedAvg's average": (FedAvg, "aggregate_train"), "server: evaluation": (Experiment, "evaluate")}


def _per_round(calls: dict[str, list[float]], starts: dict[str, list[float]], cut: float,
               rounds: int) -> dict[str, float]:
    """Seconds a round of each phase over the rounds ``round_s`` counts (2..R): the calls
    that began after ``cut``, when round 1 was closed (its line written). A client's own
    encoding made inside a batched encoding (a fallback) is counted in the batch only."""
    batches = list(zip(starts.get("encoding, batched", []), calls.get("encoding, batched", [])))

    def counted(name: str, t: float) -> bool:
        return t >= cut and not (name == "encoding, client by client"
                                 and any(b <= t <= b + d for b, d in batches))

    return {name: sum(d for t, d in zip(starts[name], ds) if counted(name, t)) / max(rounds, 1)
            for name, ds in calls.items() if any(counted(name, t) for t in starts[name])}


def _fededge(work: dict, row: dict, out: Path, phases: bool = False) -> dict:
    from fededge.server.inprocess import run_inprocess

    overrides = {k: v for k, v in work.items() if k != "clients"} | {
        "partition": "iid", "device": row["device"], "server-device": row["device"], "progress": "off",
        "results-dir": str(out), "save-model": False, "checkpoint-every": 0, "min-partition-size": 1,
        "cohort": row["path"] == "cohort",
        # the CPU rows use every core: per client in one process, or spread over the workers
        "client-threads": 0 if row["device"] == "cpu" and row.get("workers", 1) == 1 else 1}
    if row["path"] == "defaults":  # fededge run's own choices: client-threads as it comes
        overrides.pop("client-threads")
    overrides |= _row_config(row)
    calls: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    closes: dict[str, list[float]] = {}
    closed: dict[str, list[float]] = {"close": []}
    with contextlib.ExitStack() as stack:
        if phases:  # in this process only: a worker process's calls are not seen
            from bench_scale import timed_calls

            from fededge.server.experiment import _RoundCloser

            calls = stack.enter_context(timed_calls(_phase_targets(), starts))
            # every round is closed (its line written; evaluated when due), round 0 first
            closed = stack.enter_context(timed_calls({"close": (_RoundCloser, "close")}, closes))
        run_dir = run_inprocess(overrides, num_clients=work["clients"], workers=row.get("workers", 1),
                                direct=row.get("direct"))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = lines[2:]
    round_s = (lines[-1]["wall_s"] - lines[1]["wall_s"]) / len(later)
    compute = sum(c["compute_s"] for r in later for c in r["clients"]) / len(later)
    meta = json.loads((run_dir / "config.json").read_text())
    result = {"round_s": round_s, "compute_s": compute, "accuracy": lines[-1]["accuracy"],
              # what the defaults chose, and how many processes fit on the GPU (item 4)
              "chose": meta.get("inprocess_runtime") if row["path"] == "defaults" or (
                  row["device"] == "cuda" and row.get("workers", 1) != 1) else None}
    if phases:
        if len(closed["close"]) < 2:
            raise RuntimeError("--phases: round 1 was never closed (no round 1?)")
        result["phases"] = _per_round(calls, starts, closes["close"][1] + closed["close"][1], len(later))
    return result


def one(row: dict, quick: bool, profile: str | None = None, phases: bool = False) -> dict:
    work = _workloads(quick)[row["workload"]]
    with tempfile.TemporaryDirectory() as tmp:
        if row["path"] == "floor":
            return row | _floor(work, row)
        if not profile:
            return row | _fededge(work, row, Path(tmp), phases)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        res = prof.runcall(_fededge, work, row, Path(tmp))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
        stats.print_stats(90)
        stats.sort_stats("tottime").print_stats(45)
        Path(profile).write_text(text.getvalue())
        return row | res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script on any machine")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, choices=("resnet", "mlp"), help="one workload's rows")
    p.add_argument("--no-cpu-resnet", action="store_true",
                   help="leave out the ResNet rows on the CPU where CUDA is (minutes each, known from earlier runs)")
    p.add_argument("--rows", default=None, metavar="NAMES",
                   help="comma-separated row names to run, in that order (e.g. resnet:cuda:floor,"
                        "resnet:cuda:per-client:1,mlp:cuda:cohort:1); an unknown name lists the names")
    p.add_argument("--profile-rows", default=None, metavar="NAMES",
                   help="with --profile: the rows to profile (default: each workload's first per-client row)")
    p.add_argument("--row-timeout", type=float, default=240, help="seconds a row may take before it is given up")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="also run the first GPU (else CPU) per-client row of each workload under cProfile once, "
                        "and write the top functions to FILE.<workload>.txt (its timing is not in the table)")
    p.add_argument("--phases", action="store_true",
                   help="also time where each fededge row's rounds go (local SGD, encoding, message copies and "
                        "sizes, the server's decoding, average and evaluation: seconds a round, rounds 2..R, "
                        "in the run's own process) and print it after the table")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one), args.quick, args.profile, args.phases)))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    machine = (torch.cuda.get_device_name(0) if cuda else "no GPU") + f", {os.cpu_count()} CPU cores, torch {torch.__version__}"
    print(f"# {machine}{' (quick sizes)' if args.quick else ''}", flush=True)
    print(f"{'workload':>8} {'device':>6} {'path':>14} {'workers':>7} {'s/round':>8} {'compute':>8} "
          f"{'vs floor':>8} {'vs best CPU':>11} {'acc':>6}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FEDEDGE_CACHE_DIR": cache}
        every = _rows(args.quick, cuda, not args.no_cpu_resnet)
        rows = [r for r in pick(every, args.rows) if args.only in (None, r["workload"])]
        profiled = pick(every, args.profile_rows) if args.profile_rows else [
            r for r in (next((r for r in rows if r["workload"] == w and r["path"] == "per-client"), None)
                        for w in ("resnet", "mlp")) if r is not None]
        for row in rows:
            t0 = time.perf_counter()
            proc = _in_a_process(row, args, env)
            took = time.perf_counter() - t0
            if proc is None:
                continue
            if proc.returncode != 0:
                print(f"{row}: failed after {took:.0f} s\n{proc.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["row_wall_s"] = round(took, 1)  # the row's whole process: what --row-timeout must allow
            results.append(r)
            print(f"{_line(r, results)}   ({took:.0f} s)", flush=True)
            if args.json:  # after each row: a bench cut short by its timeout keeps the rows done
                Path(args.json).write_text(json.dumps(results, indent=1))
        print("\nthe same rows, with every ratio against the finished table:")
        for r in results:
            print(_line(r, results))
        for r in results:
            if r.get("chose"):
                print(f"{label(r)} chose: {r['chose']}")
        if any("phases" in r for r in results):
            print("\nwhere a round goes (seconds a round, rounds 2..R, the run's own process; worker processes' "
                  "calls are not seen, nor serialisation on /ser rows: that is in the rest):")
            for r in results:
                if "phases" in r:
                    parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]))
                    rest = r["round_s"] - sum(r["phases"].values())
                    print(f"{label(r)}: s/round {r['round_s']:.3f}: {parts}; the rest {rest:.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if args.profile:  # after the table: a profile cut short by a timeout loses no row
            for r in profiled:
                if r["path"] == "floor":
                    continue
                name = label(r).replace(":", "_").replace("*", "-nd").replace("/", "_")
                _in_a_process(r, args, env, ["--profile", f"{args.profile}.{name}.txt"])
    return 0


def _in_a_process(row: dict, args: argparse.Namespace, env: dict, extra: list[str] | None = None
                  ) -> subprocess.CompletedProcess | None:
    """``row`` run by this script in a fresh process, or None (said) past ``--row-timeout``."""
    cmd = ([sys.executable, __file__, "--one", json.dumps(row)] + (extra or []) + (["--quick"] if args.quick else [])
           + (["--phases"] if args.phases and not extra else []))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=args.row_timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"{row}: gave up after {args.row_timeout:.0f} s (--row-timeout); its last output:\n{tail[-1500:]}",
              flush=True)
        return None


def _line(r: dict, results: list[dict]) -> str:
    floor = next((x["round_s"] for x in results if x["workload"] == r["workload"] and x["path"] == "floor"
                  and x["device"] == r["device"] and x.get("deterministic", True) == r.get("deterministic", True)),
                 None)
    cpu = [x["round_s"] for x in results if x["workload"] == r["workload"] and x["device"] == "cpu"
           and x["path"] != "floor"]
    vs_floor = f"{r['round_s'] / floor:.2f}" if floor and r["path"] != "floor" else "—"
    vs_cpu = f"{min(cpu) / r['round_s']:.2f}" if cpu and r["path"] != "floor" else "—"
    acc = "—" if r.get("accuracy") is None else f"{r['accuracy']:.3f}"
    path = r["path"] + ("*" if r.get("deterministic", True) is False else "") + ("/ser" if r.get("direct") is False
                                                                                   else "")
    return (f"{r['workload']:>8} {r['device']:>6} {path:>14} {r.get('workers', '—')!s:>7} {r['round_s']:>8.3f} "
            f"{r['compute_s']:>8.3f} {vs_floor:>8} {vs_cpu:>11} {acc:>6}")


if __name__ == "__main__":
    raise SystemExit(main())
