#!/usr/bin/env python
"""A cohort's uplinks encoded as one batch against client by client (issue 35, item 3).

For each model and codec, C clients' model deltas (random, the model's shapes) are
encoded for ``--rounds`` rounds, with error feedback carried from round to round:

- ``per client``: each client's ``UpdateEncoder.encode``, one after another (what every
  client does on the per-client path);
- ``batched``: ``fededge.compress.batch.encode_batch`` on all C at once (what a cohort's
  clients get, fededge/clients/cohort.py:encode_update).

Each round is timed both ways, alternately, on twin encoders; the table shows the best
round of each (the machine is shared) and checks the bytes are the same (PowerSGD's:
the same sizes, the decoded values to float32 rounding, since its batched matmuls round
differently). Codecs without a batched form (QSGD) are listed too: they fall back to
client by client inside the batch.

    python benchmarks/bench_encode_batch.py
    python benchmarks/bench_encode_batch.py --models mlp,resnet18 --clients 10 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from fededge.compress.batch import batchable, encode_batch
from fededge.compress.codec import decode_any
from fededge.compress.update import UpdateConfig, UpdateEncoder
from fededge.models.zoo import build_model

SHAPES = {"mlp": (32,), "cnn": (1, 28, 28), "cnn-bn": (1, 28, 28), "resnet18-w8": (3, 32, 32),
          "resnet18": (3, 32, 32)}
CODECS = {
    "signsgd+EF": UpdateConfig(compressor="signsgd", error_feedback=True),
    "signsgd": UpdateConfig(compressor="signsgd"),
    "top1%+EF": UpdateConfig(compressor="topk", topk_ratio=0.01, error_feedback=True),
    "psgd r2+EF": UpdateConfig(compressor="powersgd", powersgd_rank=2, error_feedback=True),
    "psgd r4+EF": UpdateConfig(compressor="powersgd", powersgd_rank=4, error_feedback=True),
    "qsgd 4bit": UpdateConfig(compressor="qsgd", qsgd_levels=7),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _row(model_name: str, codec: str, clients: int, rounds: int, device: str) -> dict:
    model = build_model(model_name, input_shape=SHAPES[model_name], num_classes=10, seed=0)
    shapes = {n: p.shape for n, p in model.state_dict().items() if p.is_floating_point()}
    cfg = CODECS[codec]
    alone = [UpdateEncoder(cfg, stream=c) for c in range(clients)]
    together = [UpdateEncoder(cfg, stream=c) for c in range(clients)]
    gen = torch.Generator().manual_seed(0)
    per_client, batched = [], []
    for rnd in range(rounds):
        deltas = [{n: (0.01 * torch.randn(s, generator=gen)).to(device) for n, s in shapes.items()}
                  for _ in range(clients)]
        _sync(device)
        t0 = time.perf_counter()
        expected = [e.encode(d, round=rnd) for e, d in zip(alone, deltas)]
        _sync(device)
        t1 = time.perf_counter()
        got = encode_batch(together, deltas, round=rnd)
        _sync(device)
        t2 = time.perf_counter()
        if cfg.compressor == "powersgd":  # batched matmuls: the same sizes, values to rounding
            if [{n: len(b) for n, b in g.items()} for g in got] != [{n: len(b) for n, b in e.items()}
                                                                   for e in expected]:
                raise SystemExit(f"{model_name} {codec}: the batch's payload sizes differ in round {rnd}")
            worst = max(float((decode_any(g[n]) - decode_any(e[n])).abs().max() / (decode_any(e[n]).abs().max()
                                                                                   + 1e-30))
                        for g, e in zip(got, expected) for n in e)
            if worst > 1e-3:
                raise SystemExit(f"{model_name} {codec}: a batch's tensor differs by {worst:.2g} relative")
        elif got != expected:
            raise SystemExit(f"{model_name} {codec}: the batch's bytes differ from the clients' own in round {rnd}")
        per_client.append(t1 - t0)
        batched.append(t2 - t1)
    a, b = min(per_client[1:] or per_client), min(batched[1:] or batched)
    return {"model": model_name, "codec": codec, "clients": clients, "batched form": batchable(together[0]),
            "per client ms": 1e3 * a, "batched ms": 1e3 * b, "speed-up": a / b,
            "bytes a client": sum(len(p) for p in expected[0].values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,cnn-bn,resnet18-w8")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"of {', '.join(CODECS)}")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the clients' default: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [_row(m, c, args.clients, args.rounds, args.device)
            for m in args.models.split(",") for c in args.codecs.split(",")]
    print(f"device {args.device}, {args.threads} torch thread(s), {args.clients} clients, best of {args.rounds - 1} "
          f"rounds after the first")
    print("| model | codec | batched form | per client, ms | batched, ms | speed-up | bytes a client |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['codec']} | {'yes' if r['batched form'] else 'no'} | {r['per client ms']:.1f} | "
              f"{r['batched ms']:.1f} | {r['speed-up']:.2f}x | {r['bytes a client']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
