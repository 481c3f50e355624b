"""What one edge client costs: peak memory and time per round of fededge's ClientApp on one
core, as a stand-in for a Raspberry Pi class device.

A child process pinned to one core (``taskset`` semantics through
``os.sched_setaffinity``) with one torch thread does what a ``flwr-clientapp`` process
does for a train message. It imports Flower, torch and fededge, builds its data partition
and model, and runs fededge's ClientApp on a real Flower ``Message`` (the global model
plus the train config), ``--rounds`` times. Only the gRPC transport is missing. The script
reports:

- peak RSS (``ru_maxrss``) after the imports, after the first message and at the end;
- the import time (paid once per message in a real deployment, where each message runs
  in a fresh process);
- the first message's time and the steady time per message (local steps plus
  (de)serialisation of the model).

Examples
--------
::

    python benchmarks/bench_edge_client.py                         # small CNN, K=20, 5 rounds
    python benchmarks/bench_edge_client.py --model mlp --local-steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
os.sched_setaffinity(0, {int(sys.argv[1])})
import torch
torch.set_num_threads(1)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from fededge import _flwr_internals as fi
from fededge.clients.app import app
from fededge.config import RunConfig
from fededge.workload import dataset_for, model_for
t_import = time.perf_counter() - t0
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
rss_import = rss_mb()
over = json.loads(sys.argv[2]); rounds = int(sys.argv[3])
cfg = RunConfig.from_mapping(over)
ds = dataset_for(cfg)
model = model_for(cfg, ds)
arrays = ArrayRecord(model.state_dict())
ctx = Context(run_id=1, node_id=2, node_config={"partition-id": 0, "num-partitions": int(sys.argv[4])},
              state=RecordDict(), run_config=cfg.to_mapping())
times = []
with fi.task_identity(run_id=1, node_id=1, task_id=1):
    for r in range(1, rounds + 1):
        msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({
            "server-round": r, "local-steps": cfg.local_steps, "local-lr": cfg.local_lr,
            "momentum": cfg.momentum, "batch-size": cfg.batch_size})}), 2, "train")
        fi.set_message_id(msg, f"m{r}")
        t = time.perf_counter()
        reply = app(msg, ctx)
        times.append(time.perf_counter() - t)
        assert not reply.has_error(), reply.error
        arrays = reply.content["arrays"]
        if r == 1:
            rss_first = rss_mb()
print(json.dumps({"import_s": t_import, "rss_import_mb": rss_import, "rss_first_mb": rss_first,
                  "rss_peak_mb": rss_mb(), "times": times,
                  "compute_s": [float(reply.content["metrics"]["compute-s"])],
                  "params": sum(v.numel() for v in model.state_dict().values())}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--partitions", type=int, default=10)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args(argv)
    over = {"model": args.model, "dataset": args.dataset, "local-steps": args.local_steps,
            "batch-size": args.batch_size, "device": "cpu", "client-threads": 1}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.core), json.dumps(over), str(args.rounds),
                          str(args.partitions)], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    res = json.loads(out.stdout.strip().splitlines()[-1])
    steady = res["times"][1:] or res["times"]
    print(f"\nfededge ClientApp on one core (core {args.core}, 1 torch thread): {args.model} on "
          f"{args.dataset} ({res['params']:,} parameters), K={args.local_steps}, batch {args.batch_size}, "
          f"partition 0 of {args.partitions}\n")
    print("| imports s | first message s | steady s / message | steps / s | RSS after imports MB "
          "| RSS after message 1 MB | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    per = sum(steady) / len(steady)
    print(f"| {res['import_s']:.2f} | {res['times'][0]:.3f} | {per:.3f} | {args.local_steps / per:.0f} "
          f"| {res['rss_import_mb']:.0f} | {res['rss_first_mb']:.0f} | {res['rss_peak_mb']:.0f} |")
    print(f"\ncommand: python benchmarks/bench_edge_client.py {' '.join(argv or sys.argv[1:])}".rstrip())
    print(f"python {platform.python_version()}, {platform.platform()}, load average before {load:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
