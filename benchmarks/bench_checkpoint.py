#!/usr/bin/env python
"""What ``checkpoint-every`` costs: checkpoint size and seconds against a round's seconds.

Each configuration runs twice in this process, in-process runtime, side by side: without
checkpoints (``checkpoint-every=0``) and with one after every round
(``checkpoint-every=1``). A checkpoint holds the global model, the strategy's state, the
random generators, the clock and, in the in-process runtime, every client's
``context.state`` (here an error-feedback residual the size of the model, per client):
the worst case, since under Flower's simulation or a deployment the clients' states are
not in it. The table gives its size, the seconds to write it (serialise, hash, write,
fsync, rename) and those seconds as a share of a round without checkpoints.

A third run stands for Flower's simulation or a deployment: the checkpoint holds the
server's side only and every node writes its own ``context.state`` after each round it
trains (:mod:`fededge.clients.statestore`, ``keep_client_states=False``). Its columns give
one node's state file and the round against the round without checkpoints (here all
nodes write from one process, one after another; on real devices they write in parallel,
each its own).

Example
-------
::

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --rounds 5 --configs mlp:10,cnn:10,cnn:100
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from fededge.server.inprocess import run_inprocess


def run(model: str, clients: int, rounds: int, every: int, out: Path, keep: bool = True) -> dict:
    run_dir = run_inprocess({
        "model": model, "num-rounds": rounds, "local-steps": 5, "compressor": "topk", "error-feedback": True,
        "clients-per-round": 1.0, "progress": "off", "checkpoint-every": every, "save-model": False,
        "results-dir": str(out), "min-partition-size": 5,
    }, num_clients=clients, keep_client_states=keep)
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    round_s = (lines[-1]["wall_s"] - lines[0]["wall_s"]) / rounds
    return {"summary": summary, "round_s": round_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default="mlp:10,cnn:10,cnn:100",
                    help="model:clients pairs (digits data, top-k with error feedback, every client every round)")
    args = ap.parse_args()
    print(f"| model | clients | checkpoint MB | write s (mean) | round s, no ckpt | round s, ckpt every round "
          f"| write / round | server-only ckpt MB | node state MB | round s, nodes keep state | nodes / round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FEDEDGE_STATE_DIR"] = str(Path(tmp) / "state")
        for spec in args.configs.split(","):
            model, clients = spec.split(":")
            base = run(model, int(clients), args.rounds, 0, Path(tmp) / "off")
            ck = run(model, int(clients), args.rounds, 1, Path(tmp) / "on")
            nodes = run(model, int(clients), args.rounds, 1, Path(tmp) / "nodes", keep=False)
            s, sn = ck["summary"], nodes["summary"]
            write_s = s["checkpoint_s_total"] / s["checkpoints"]
            states = sorted((Path(tmp) / "state").glob("*/partition-0/*.state"))
            node_mb = states[-1].stat().st_size / 1e6 if states else float("nan")
            extra = nodes["round_s"] / base["round_s"] - 1
            print(f"| {model} | {clients} | {s['checkpoint_bytes_last'] / 1e6:.2f} | {write_s:.4f} | "
                  f"{base['round_s']:.3f} | {ck['round_s']:.3f} | {write_s / base['round_s']:.1%} | "
                  f"{sn['checkpoint_bytes_last'] / 1e6:.2f} | {node_mb:.3f} | {nodes['round_s']:.3f} | "
                  f"{extra:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
