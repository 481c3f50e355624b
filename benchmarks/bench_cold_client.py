#!/usr/bin/env python
"""What a cold ``flwr-clientapp`` process pays for fededge's part of one message.

A SuperNode without a warm worker runs every message in a fresh process. This measures,
in fresh interpreters, fededge's share of that: importing the client path, building the
model (with its warm-up forward and backward pass) and ``--steps`` local SGD steps, with
fededge's own SGD step (:func:`fededge.clients.train.sgd_step`, today's path) against the
same run that also builds a ``torch.optim.SGD`` as fededge did before (whose constructor
imports ``torch._dynamo``). The two variants are interleaved, ``--pairs`` times, so that a
noisy machine loads both alike; the table gives the medians and the minimums.

Example
-------
::

    python benchmarks/bench_cold_client.py --pairs 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = """
import os, sys, time
t0 = time.perf_counter()
import torch
from fededge.clients.app import _model
from fededge.clients.train import BatchSampler, local_sgd
m = _model("cnn", (1, 8, 8), 10, "cpu")
if os.environ["BENCH_VARIANT"] == "torch.optim":
    torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # what the client built before
x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))
local_sgd(m, x, y, steps={steps}, lr=0.05, momentum=0.9, sampler=BatchSampler(256, 32, seed=0))
print(time.perf_counter() - t0, "torch._dynamo" in sys.modules)
"""

VARIANTS = ("fededge sgd_step", "torch.optim")


def run_once(variant: str, steps: int) -> tuple[float, bool]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(steps=steps)], capture_output=True, text=True,
                         check=True, env={**_env(), "BENCH_VARIANT": variant})
    seconds, dynamo = out.stdout.split()
    return float(seconds), dynamo == "True"


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=7, help="interleaved pairs of fresh processes (default 7)")
    p.add_argument("--steps", type=int, default=5, help="local SGD steps per process (default 5)")
    args = p.parse_args()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    dynamo: dict[str, set[bool]] = {v: set() for v in VARIANTS}
    for _ in range(args.pairs):
        for v in VARIANTS:
            s, d = run_once(v, args.steps)
            times[v].append(s)
            dynamo[v].add(d)
    print(f"cold client process: import + model + {args.steps} SGD steps, {args.pairs} interleaved pairs")
    print(f"{'variant':<18} {'median s':>9} {'min s':>7}  imports torch._dynamo")
    for v in VARIANTS:
        print(f"{v:<18} {statistics.median(times[v]):>9.3f} {min(times[v]):>7.3f}  {sorted(dynamo[v])}")
    a, b = (statistics.median(times[v]) for v in VARIANTS)
    print(f"saved per message: {b - a:.3f} s (median), {100 * (b - a) / b:.0f}% of fededge's cold part")


if __name__ == "__main__":
    main()
