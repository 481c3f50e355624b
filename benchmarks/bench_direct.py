#!/usr/bin/env python
"""What a round costs besides training, with messages serialised or handed over directly
(issue 35, item 2): the in-process runtime's ``direct`` delivery against serialising
every message (``run_inprocess(direct=False)``, the path before it).

Each row is fededge's in-process run of one model with little local work (``--steps``
SGD steps of batch ``--batch``), so that what the runtime itself costs per message is a
visible part of a round: ``s/round`` is the median wall time of rounds 2..R-1 (round 1
warms up; the last round is evaluated), ``compute`` the clients' summed local-SGD
seconds in those rounds, ``rest`` the difference (messages, the server's average,
bookkeeping), ``bytes`` a round's uplink + downlink (which must be equal between the
modes). The modes alternate, ``--repeats`` times each, in one process; the best of each
is printed. Modes (``--modes``):

- ``serialised``: every message serialised and rebuilt (``direct=False``);
- ``direct``: messages handed over as copies, the models as host bytes;
- ``resident``: direct, and each reply's model a ``TensorArray`` that stays on its device,
  averaged there by the server (what a CUDA client gets by default). On the CPU
  (``--device cpu``) it is forced for CPU tensors (``replies_on_device(everywhere=True)``),
  which shows what the path's own bookkeeping costs; its gain is on a GPU, where the
  models no longer cross the bus.

    python benchmarks/bench_direct.py                      # resnet18, cnn-bn, mlp
    python benchmarks/bench_direct.py --models resnet18 --repeats 3 --modes direct,resident
    python benchmarks/bench_direct.py --models resnet18 --device cuda --modes direct,resident   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

WORKLOADS = {
    "resnet18": {"model": "resnet18", "dataset": "synthetic-images", "synthetic-samples": 1000},
    "cnn-bn": {"model": "cnn-bn", "dataset": "digits"},
    "mlp": {"model": "mlp", "dataset": "digits"},
}


def one(model: str, mode: str, args: argparse.Namespace) -> dict:
    from unittest import mock

    from fededge import arrays
    from fededge.server.inprocess import run_inprocess

    direct = mode != "serialised"
    if mode == "resident":
        keep = arrays.replies_on_device(everywhere=args.device == "cpu")
    elif mode == "direct":  # the models as host bytes, on a GPU too
        keep = mock.patch.object(arrays, "_resident_copies", lambda tensors, everywhere=False: {})
    else:
        keep = contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, keep:
        overrides = WORKLOADS[model] | {
            "num-rounds": args.rounds, "local-steps": args.steps, "batch-size": args.batch, "partition": "iid",
            "evaluate-every": args.rounds, "progress": "off", "results-dir": tmp, "save-model": False,
            "checkpoint-every": 0, "device": args.device, "server-device": args.device,
            "min-partition-size": 2}
        run_dir = run_inprocess(overrides, num_clients=args.clients, direct=direct)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = list(zip(lines[1:], lines[2:]))[:-1]  # rounds 2..R-1: after the warm-up, before the last evaluation
    wall = statistics.median(b["wall_s"] - a["wall_s"] for a, b in rounds)
    compute = statistics.median(sum(c["compute_s"] for c in b["clients"]) for _, b in rounds)
    return {"model": model, "mode": mode, "device": args.device, "round_s": wall, "compute_s": compute,
            "bytes": lines[-1]["bytes_up"] + lines[-1]["bytes_down"], "loss": lines[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,cnn-bn,mlp")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="serialised,direct", help="serialised, direct, resident (comma-separated)")
    p.add_argument("--device", default="cpu", help="the clients' and the server's device: cpu or cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    print(f"# {torch.get_num_threads()} torch threads, torch {torch.__version__}; {args.clients} clients, "
          f"{args.steps} local step(s) of batch {args.batch}, best of {args.repeats}", flush=True)
    print(f"{'model':>9} {'mode':>10} {'s/round':>8} {'compute':>8} {'rest':>7} {'bytes/round':>12} {'loss':>10}",
          flush=True)
    modes = args.modes.split(",")
    unknown = set(modes) - {"serialised", "direct", "resident"}
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}: the modes are serialised, direct and resident")
    results = []
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes:
                runs[mode].append(one(model, mode, args))
        best = {m: min(rs, key=lambda r: r["round_s"]) for m, rs in runs.items()}
        for m in modes:
            r = best[m]
            results.append(r)
            print(f"{model:>9} {m:>10} {r['round_s']:>8.3f} {r['compute_s']:>8.3f} "
                  f"{r['round_s'] - r['compute_s']:>7.3f} {r['bytes']:>12} {r['loss']:>10.6f}", flush=True)
        rest = {m: best[m]["round_s"] - best[m]["compute_s"] for m in modes}
        same = len({(best[m]["bytes"], best[m]["loss"]) for m in modes}) == 1
        ratios = ", ".join(f"{m} {rest[modes[0]] / max(rest[m], 1e-9):.2f}x" for m in modes[1:])
        print(f"{model:>9} the rest of a round against {modes[0]}: {ratios}; "
              f"bytes and loss {'the same' if same else 'DIFFER'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
