#!/usr/bin/env python
"""What a node pays per message to keep its state on disk (issue 21): StateSpillMod.

Under Flower's Ray simulation and on a SuperNode, ``client-states="disk"`` puts
:class:`fededge.clients.statestore.StateSpillMod` around the ClientApp: on every message
it loads the node's ``context.state`` from its file, runs the message, and writes the
state back. This times that, alone: the train function only puts back a state the size
of an error-feedback residual of ``--model`` (one float32 array per parameter, random)
and a batch sampler's position, as fededge's CompressionMod and train leave them.

``--nodes`` nodes take turns (one message each, round robin), so every message reads a
file written one turn before (from the page cache, as on a node with free memory).
Columns: the state's size in memory (its arrays' bytes), the file's size, and the
median and minimum milliseconds per message over ``--repeat`` passes of every node,
load and write included. The spill directory is a fresh temporary one on ``--dir``'s
file system (default: the system's temporary directory).

Example
-------
::

    python benchmarks/bench_spill.py
    python benchmarks/bench_spill.py --models mlp cnn resnet18 --nodes 20 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"mlp": ((32,), 10), "cnn": ((1, 28, 28), 10), "cnn-bn": ((3, 32, 32), 10), "resnet18": ((3, 32, 32), 10)}


def run(model: str, nodes: int, repeat: int, directory: str | None) -> dict:
    import torch
    from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

    from fededge import keys
    from fededge._flwr_internals import task_identity
    from fededge.arrays import record_from_torch
    from fededge.clients.statestore import StateSpillMod
    from fededge.models.zoo import build_model

    shape, classes = SHAPES[model]
    params = build_model(model, input_shape=shape, num_classes=classes, seed=0).state_dict()
    g = torch.Generator().manual_seed(0)
    residual = {f"ef/{k}": torch.randn(v.shape, generator=g) for k, v in params.items() if v.is_floating_point()}
    state_bytes = sum(4 * t.numel() for t in residual.values())

    def train(msg: Message, ctx: Context) -> Message:
        ctx.state[keys.STATE_COMPRESS] = record_from_torch(residual)
        ctx.state[keys.STATE_SAMPLER] = ConfigRecord({"epoch": 3, "cursor": 17})
        return Message(RecordDict({keys.METRICS: MetricRecord({"n": 1})}), reply_to=msg)

    per_message = []
    with tempfile.TemporaryDirectory(dir=directory) as root, task_identity(run_id=1, node_id=1, task_id=1):
        mod = StateSpillMod(root)
        contexts = [Context(run_id=1, node_id=n + 1, node_config={}, state=RecordDict(), run_config={})
                    for n in range(nodes)]
        for p in range(repeat + 1):  # pass 0: every node's first message (no file yet), untimed
            t0 = time.perf_counter()
            for ctx in contexts:
                msg = Message(RecordDict({keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: p + 1})}),
                              dst_node_id=ctx.node_id, message_type="train")
                mod(msg, ctx, train)
            if p:
                per_message.append((time.perf_counter() - t0) / nodes)
        file_bytes = next(Path(root).rglob("*.state")).stat().st_size
    return {"model": model, "state_mb": state_bytes / 1e6, "file_mb": file_bytes / 1e6,
            "median_ms": 1e3 * statistics.median(per_message), "min_ms": 1e3 * min(per_message)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "resnet18"], choices=sorted(SHAPES))
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5, help="timed passes over every node")
    ap.add_argument("--dir", default=None, help="file system for the spill directory (default: the temp dir)")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.repeat < 1:
        ap.error("--nodes and --repeat must be >= 1")
    import torch

    torch.set_num_threads(1)
    print(f"{'model':<10} {'state MB':>9} {'file MB':>8} {'ms/message':>11} {'min':>7}")
    for m in args.models:
        r = run(m, args.nodes, args.repeat, args.dir)
        print(f"{r['model']:<10} {r['state_mb']:>9.2f} {r['file_mb']:>8.2f} {r['median_ms']:>11.2f} {r['min_ms']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
