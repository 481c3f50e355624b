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

Example
-------
::

    python benchmarks/bench_message_costs.py --rounds 20
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
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
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
          f"compute: {1e3 * (total[rows[2][0]] + total[rows[3][0]]) / n:.3f} ms/message")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
