#!/usr/bin/env python
"""Cohort training's arithmetic alone (issue 35): C clients' local SGD per client against
one batched program (fededge/clients/cohort.py:cohort_sgd), side by side in one process.

For each model, C clients with their own data (random, ``--examples`` each) and samplers
train ``--steps`` SGD steps (batch 32, momentum 0.9) from the same weights:

- ``per client``: ``fededge.clients.train.local_sgd`` one client after another, with 1
  torch thread (fededge's default ``client-threads``) and with every core;
- ``cohort``: ``cohort_sgd`` on all C at once, with 1 thread and with every core.

Each is timed ``--repeats`` times (the best is shown: the machine is shared), after one
untimed warm-up. ``speed-up`` is the best per-client time (either thread count) over the
cohort's with every core. The largest weight difference from the per-client path is
printed too (float32 rounding: tests/clients/test_cohort.py).

For a model made of ``Linear`` layers (the MLP), ``bmm floor`` is what the cohort cannot
beat on this machine with every core: the batched matmuls its steps must do (each
layer's forward, its weight gradient, and its input gradient but the first layer's),
timed alone with ``torch.bmm`` on the same shapes, best of ``--repeats``; ``best
possible`` is the per-client time over that floor, the most a cohort could gain here.

    python benchmarks/bench_cohort.py
    python benchmarks/bench_cohort.py --models mlp --clients 100 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from fededge.clients.cohort import CohortJob, _warm_up, cohort_sgd
from fededge.clients.train import BatchSampler, local_sgd
from fededge.models.zoo import build_model

SHAPES = {"mlp": (32,), "cnn": (1, 28, 28), "cnn-bn": (1, 28, 28), "resnet18-w8": (3, 32, 32)}


def _per_client(model, start, data, steps: int, threads: int) -> tuple[float, list[dict]]:  # noqa: ANN001
    torch.set_num_threads(threads)
    out = []
    t0 = time.perf_counter()
    for c, (x, y) in enumerate(data):
        model.load_state_dict(start)
        local_sgd(model, x, y, steps=steps, lr=0.05, momentum=0.9, sampler=BatchSampler(len(x), 32, seed=0, stream=c))
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return time.perf_counter() - t0, out


def _cohort(model, start, data, steps: int, threads: int) -> tuple[float, list[dict]]:  # noqa: ANN001
    torch.set_num_threads(threads)
    model.load_state_dict(start)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    jobs = [CohortJob(model=model, weights=weights, buffers=buffers, x=x, y=y, steps=steps, lr=0.05, momentum=0.9,
                      weight_decay=0.0, sampler=BatchSampler(len(x), 32, seed=0, stream=c), proximal_mu=0.0,
                      momentum_buffers=None) for c, (x, y) in enumerate(data)]
    seconds = cohort_sgd(jobs)
    return seconds, [j.trained for j in jobs]


def _bmm_floor(model, clients: int, steps: int, batch: int, repeats: int) -> float | None:  # noqa: ANN001
    """Seconds of the batched matmuls ``steps`` cohort steps of a Linear-only ``model``
    need (None for any other model): forward ``[C,B,in] x [C,in,out]``, weight gradient
    ``[C,out,B] x [C,B,in]``, input gradient ``[C,B,out] x [C,out,in]`` (not the first
    layer's)."""
    leaves = [m for m in model.modules() if not list(m.children())]
    if not all(isinstance(m, (torch.nn.Linear, torch.nn.ReLU, torch.nn.Flatten)) for m in leaves):
        return None
    layers = [m for m in leaves if isinstance(m, torch.nn.Linear)]
    shapes = []
    for i, m in enumerate(layers):
        fi, fo = m.in_features, m.out_features
        shapes += [((clients, batch, fi), (clients, fi, fo)), ((clients, fo, batch), (clients, batch, fi))]
        if i:
            shapes.append(((clients, batch, fo), (clients, fo, fi)))
    pairs = [(torch.randn(a), torch.randn(b)) for a, b in shapes]
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            for a, b in pairs:
                torch.bmm(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,cnn-bn,resnet18-w8")
    p.add_argument("--clients", type=int, default=0, help="clients (default: 100 for mlp, 20 for the CNNs)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    _warm_up()
    print(f"# {cores} cores, torch {torch.__version__}, {args.steps} steps of batch 32 per client")
    print(f"{'model':>12} {'clients':>7} {'per client 1t':>13} {f'per client {cores}t':>13} {'cohort 1t':>10} "
          f"{f'cohort {cores}t':>10} {'speed-up':>8} {'max |dw|':>9} {'bmm floor':>9} {'best possible':>13}",
          flush=True)
    for name in args.models.split(","):
        shape = SHAPES[name]
        clients = args.clients or (100 if name == "mlp" else 20)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(args.examples, *shape, generator=g), torch.randint(0, 10, (args.examples,), generator=g))
                for _ in range(clients)]
        model = build_model(name, input_shape=shape, num_classes=10, seed=0)
        start = copy.deepcopy(model.state_dict())
        best: dict[str, float] = {}
        results = {}
        for label, fn, threads in (("pc1", _per_client, 1), ("pcN", _per_client, cores), ("co1", _cohort, 1),
                                   ("coN", _cohort, cores)):
            fn(model, start, data[:2], 2, threads)  # warm-up
            times = []
            for _ in range(args.repeats):
                t, results[label] = fn(model, start, data, args.steps, threads)
                times.append(t)
            best[label] = min(times)
        diff = max((a[n] - b[n]).abs().max().item() for a, b in zip(results["pc1"], results["coN"]) for n in a)
        torch.set_num_threads(cores)
        floor = _bmm_floor(model, clients, args.steps, 32, args.repeats)
        per_client = min(best["pc1"], best["pcN"])
        tail = "        —             —" if floor is None else f"{floor:>10.3f} {per_client / floor:>12.2f}x"
        print(f"{name:>12} {clients:>7} {best['pc1']:>13.3f} {best['pcN']:>13.3f} {best['co1']:>10.3f} "
              f"{best['coN']:>10.3f} {per_client / best['coN']:>8.2f} {diff:>9.1e} {tail}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
