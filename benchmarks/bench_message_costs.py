#!/usr/bin/env python
"""Where a message's seconds go in the in-process runtime, beside the clients' compute (issue 21).

Runs ``run_inprocess`` with every message in this process (``workers=1``: one thread,
nothing hidden in another process) and wraps the functions a message passes through
with a timer (``time.perf_counter`` around the call; no profiler, whose per-call cost
would inflate the small calls). Each row is the total time in one function divided by
the number of messages; rows nest (``local SGD`` is inside ``the ClientApp``), so the
table is read top-down: the ClientApp's own work against the compute it reports, then
the wire and the states around it, then the server's decoding.

The default configuration is the goal row of bench_scale.py (``10000:mlp:signsgd``,
20 local steps, states on disk, evaluation every 10 rounds) over ``--rounds`` rounds.

A second table (``--contract-only`` prints it alone) times, step by step, what any
ClientApp pays for the same message under Flower's Message API, whatever it does
inside: rebuild the train message from its serialised objects, read its arrays, build a
reply that carries a payload of the signSGD update's size and the train metrics,
serialise it, and rebuild it on the server. That is the part of a message's cost that
is Flower's, not fededge's: a lower bound for any in-process runtime that keeps
Flower's wire.

Example
-------
::

    python benchmarks/bench_message_costs.py --rounds 20
    python benchmarks/bench_message_costs.py --contract-only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import timed_calls  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--states", choices=["memory", "disk"], default="disk")
    ap.add_argument("--contract-only", action="store_true", help="only the table of Flower's own costs")
    ap.add_argument("--repeat", type=int, default=2000, help="messages timed for that table")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.contract_only:
        contract(args.repeat)
        return 0
    import fededge.clients.app as app
    import fededge.clients.mods as mods
    import fededge.compress.update as update
    import fededge.server.grid as grid
    import fededge.server.nodestates as nodestates
    import fededge.server.workers as workers
    import fededge.strategies.compressed as compressed
    from flwr.clientapp import ClientApp

    from fededge import _flwr_internals as fi
    from fededge.server.inprocess import run_inprocess

    rows = [  # (label, owner, attribute)
        ("a message, end to end (grid)", grid.InProcessGrid, "_execute"),
        ("  the ClientApp (mods and train)", ClientApp, "__call__"),
        ("    local SGD (compute-s)", app, "local_sgd"),
        ("    encoding the update (compute-s)", update.UpdateEncoder, "encode"),
        ("    train: received record -> tensors", app, "record_to_torch"),
        ("    train: loading the model", torch.nn.Module, "load_state_dict"),
        ("    train: its workload (data, model)", app, "client_workload"),
        ("    train: reply tensors -> record", app, "record_from_torch"),
        ("    CompressionMod: records -> tensors", mods, "record_to_torch"),
        ("    CompressionMod: state tensors -> record", mods, "record_from_torch"),
        ("    CompressionMod: bundling the payloads", mods, "bundle_record"),
        ("  rebuilding a message from its objects (x2)", workers, "received"),
        ("  serialising the reply", fi, "serialise"),
        ("  the node's state: to bytes", nodestates, "state_to_bytes"),
        ("  the node's state: from bytes", nodestates, "state_from_bytes"),
        ("  the node's state: stored", nodestates.DiskStates, "put_bytes"),
        ("  the node's state: fetched", nodestates.DiskStates, "take_bytes"),
        ("server: decoding the update", compressed, "decode_compressed"),
        ("server: pushing a round (per message)", grid.InProcessGrid, "push_messages"),
    ]

    with timed_calls({label: (owner, attr) for label, owner, attr in rows}) as times, \
            tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        run_inprocess({"dataset": "synthetic", "synthetic-samples": 500_000, "partition": "iid",
                       "local-steps": args.local_steps, "clients-per-round": args.per_round,
                       "num-rounds": args.rounds, "model": "mlp", "progress": "off", "results-dir": out,
                       "save-model": False, "checkpoint-every": 0, "min-partition-size": 1, "client-threads": 1,
                       "evaluate-every": 10, "client-states": args.states, "compressor": "signsgd",
                       "error-feedback": True}, num_clients=args.clients, workers=1)
        wall = time.perf_counter() - t0
    total = {label: sum(t) for label, t in times.items()}
    calls = {label: len(t) for label, t in times.items()}
    n = calls[rows[0][0]]
    print(f"{n} messages, {wall:.1f} s wall; ms per message (rows nest: read top-down)\n")
    print(f"| {'where':<46} | {'ms/message':>10} | {'calls':>6} |")
    print(f"|{'-' * 48}|{'-' * 11}:|{'-' * 7}:|")
    for label, _, _ in rows:
        print(f"| {label:<46} | {1e3 * total[label] / max(n, 1):>10.3f} | {calls[label]:>6} |")
    inside = total[rows[1][0]] - total[rows[2][0]] - total[rows[3][0]]
    around = total[rows[0][0]] - total[rows[1][0]]
    print(f"\nthe ClientApp beyond its compute: {1e3 * inside / n:.3f} ms/message; "
          f"the wire and the state around it: {1e3 * around / n:.3f} ms/message; "
          f"compute: {1e3 * (total[rows[2][0]] + total[rows[3][0]]) / n:.3f} ms/message\n")
    contract(args.repeat)
    return 0


def contract(repeat: int) -> None:
    """Print what Flower's Message API costs a message of the goal row's model, apart
    from anything fededge does, step by step: the lower bound of the wire rows above."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from fededge import _flwr_internals as fi
    from fededge.arrays import to_numpy
    from fededge.models.zoo import build_model
    from fededge.server.workers import received

    model = build_model("mlp", input_shape=(32,), num_classes=10, seed=0)  # synthetic: 32 features
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    weights = sum(a.size for a in arrays.values())
    payload = np.zeros((weights + 7) // 8 + 16 * len(arrays), dtype=np.uint8)  # a sign bit a weight, headers
    metrics = {"train-loss": 0.5, "num-examples": 50, "compute-s": 0.006, "local-steps-done": 20,
               "partition-id": 7, "num-partitions": 10_000}
    with fi.task_identity(run_id=1, node_id=1, task_id=1):
        instruction = Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                                          "config": ConfigRecord({"server-round": 3, "local-steps": 20,
                                                                  "local-lr": 0.05, "momentum": 0.9})}),
                              dst_node_id=5, message_type="train")
        fi.set_run_id(instruction, 1)
        root, objects = fi.serialise(instruction)
        msg = received(root, dict(objects), root)

        def reply() -> Message:
            return Message(RecordDict({"compressed": ArrayRecord({"bundle": Array(payload)}),
                                       "metrics": MetricRecord(metrics)}), reply_to=msg)

        built = reply()
        reply_root, reply_objects = fi.serialise(built)
        steps = [  # (label, the step, part of the wire)
            ("client: the train message rebuilt from its objects", lambda: received(root, dict(objects), root),
             True),
            ("client: its six arrays read (fededge.arrays.to_numpy)",
             lambda: {k: to_numpy(a) for k, a in msg.content["arrays"].items()}, False),
            ("client: the reply built (payload and metrics)", reply, False),
            ("client: the reply serialised", lambda: fi.serialise(built), True),
            ("server: the reply rebuilt from its objects",
             lambda: received(reply_root, dict(reply_objects), reply_root), True),
        ]
        print(f"Flower's Message API alone, the MLP ({weights:,} weights, a {payload.size:,}-byte reply "
              f"payload), ms per message, {repeat} messages:\n")
        print(f"| {'where':<58} | {'ms/message':>10} |")
        print(f"|{'-' * 60}|{'-' * 11}:|")
        total = wire = 0.0
        for label, step, on_the_wire in steps:
            for _ in range(min(repeat, 50)):  # warm
                step()
            t0 = time.perf_counter()
            for _ in range(repeat):
                step()
            ms = 1e3 * (time.perf_counter() - t0) / repeat
            total += ms
            wire += ms if on_the_wire else 0.0
            print(f"| {label:<58} | {ms:>10.3f} |")
        print(f"| {'all of it':<58} | {total:>10.3f} |")
        print(f"| {'the wire alone (rebuilt twice, serialised once)':<58} | {wire:>10.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
