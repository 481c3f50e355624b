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

``--states-peak CLIENTS:MB`` instead measures what a checkpoint adds to the process's
peak memory (``ru_maxrss``) when the in-process grid holds ``CLIENTS`` states of ``MB``
each in memory (``client-states=auto`` keeps a round's states there: ten ResNet-18
clients' PowerSGD states are about 45 MB each): the grid's ``state_dict`` and
:func:`~fededge.server.checkpoint.write_checkpoint`, as a run's checkpoint makes them,
each way in a fresh process: the states in the checkpoint's body (fededge before
2026-11-28, forced here by raising ``INLINE_STATES_MAX``) and today's side file, one state
at a time, past :data:`~fededge.server.nodestates.INLINE_STATES_MAX`.

Example
-------
::

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --rounds 5 --configs mlp:10,cnn:10,cnn:100
    python benchmarks/bench_checkpoint.py --states-peak 10:45
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


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def states_peak(clients: int, mb: float, inline: bool, out: Path) -> dict:
    """In this (fresh) process: ``clients`` states of ``mb`` each in the grid's memory,
    then one checkpoint as a run writes it; the peak RSS before and after."""
    import torch
    from flwr.app import ArrayRecord, RecordDict

    from fededge.server import grid as grid_module
    from fededge.server.checkpoint import states_file_for, write_checkpoint
    from fededge.server.grid import InProcessGrid

    if inline:
        grid_module.INLINE_STATES_MAX = 1 << 62
    grid = InProcessGrid("fededge.clients.app:app", num_nodes=clients, run_config={}, client_states="auto",
                         states_budget_mb=1 << 20)
    try:
        for i, nid in enumerate(grid.get_node_ids()):
            g = torch.Generator().manual_seed(i)
            grid.states.put(nid, RecordDict({"ef": ArrayRecord({"w": torch.randn(int(mb * 2**20) // 4, generator=g)})}))
        held, before = grid.states.held_bytes(), _max_rss()
        t0 = time.perf_counter()
        payload = {"round": 1, "grid": grid.state_dict(states_file=states_file_for(out, 1))}
        path, size, _ = write_checkpoint(out, 1, payload)
        seconds = time.perf_counter() - t0
        side = sum(p.stat().st_size for p in path.parent.glob("*.states"))
        return {"held": held, "before": before, "after": _max_rss(), "seconds": seconds, "ckpt": size, "side": side}
    finally:
        grid.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default="mlp:10,cnn:10,cnn:100",
                    help="model:clients pairs (digits data, top-k with error feedback, every client every round)")
    ap.add_argument("--states-peak", metavar="CLIENTS:MB", help="a checkpoint's peak memory instead (see above)")
    ap.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)  # CLIENTS MB inline|side: one fresh process
    args = ap.parse_args()
    if args._one:
        clients, mb, how = args._one
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(states_peak(int(clients), float(mb), how == "inline", Path(tmp))))
        return
    if args.states_peak:
        clients, mb = args.states_peak.split(":")
        print("| checkpoint | states in memory MB | peak RSS before MB | peak RSS after MB | added MB "
              "| checkpoint file MB | side file MB | seconds |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for how in ("inline", "side", "inline", "side"):
            got = json.loads(subprocess.run([sys.executable, __file__, "--_one", clients, mb, how], check=True,
                                            capture_output=True, text=True).stdout.strip().splitlines()[-1])
            name = "states in its body (before)" if how == "inline" else "side file, one state at a time"
            print(f"| {name} | {got['held'] / 1e6:.0f} | {got['before'] / 1e6:.0f} | {got['after'] / 1e6:.0f} | "
                  f"{(got['after'] - got['before']) / 1e6:.0f} | {got['ckpt'] / 1e6:.1f} | {got['side'] / 1e6:.1f} | "
                  f"{got['seconds']:.2f} |", flush=True)
        return
    print("| model | clients | checkpoint MB | write s (mean) | round s, no ckpt | round s, ckpt every round "
          "| write / round | server-only ckpt MB | node state MB | round s, nodes keep state | nodes / round |")
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
