#!/usr/bin/env python
"""Flower's Array conversions against fededge.arrays: milliseconds per record, side by side.

A client converts its records on every message: the model it receives and replies
(``arrays``), and its state in ``context.state`` (DGA keeps its model and its D updates
in flight: D + 1 models; error feedback a residual; ``keep-momentum`` the buffers). Each
row converts one record of ``models`` copies of a model's state_dict, both ways, with
Flower's own calls (``ArrayRecord(torch_state_dict=...)``, ``.to_torch_state_dict()``) and
with fededge.arrays (``record_from_torch``, ``record_to_torch``), interleaved, median of
``--repeat``. One torch thread.

Example
-------
::

    python benchmarks/bench_arrays.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import torch
    from flwr.app import ArrayRecord

    from fededge import arrays
    from fededge.models.zoo import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = {"cnn (digits)": ((1, 8, 8), 10), "mlp (synthetic)": ((32,), 10), "resnet18 (CIFAR)": ((3, 32, 32), 10)}
    print(f"{'model':>18} {'copies':>6} {'arrays':>6} {'MB':>6} | {'encode flwr':>11} {'fededge':>8} {'x':>5} | "
          f"{'decode flwr':>11} {'fededge':>8} {'x':>5}")
    for name, (shape, classes) in shapes.items():
        sd = build_model(name.split()[0], input_shape=shape, num_classes=classes, seed=0).state_dict()
        for copies in (1, 6, 21):
            if name.startswith("resnet") and copies > 1:
                continue
            state = {f"{i}/{k}": v.clone() for i in range(copies) for k, v in sd.items()}
            rec = ArrayRecord(torch_state_dict=state)
            mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
            times: dict[str, list[float]] = {k: [] for k in ("ef", "eo", "df", "do")}
            calls = {"ef": lambda: ArrayRecord(torch_state_dict=state), "eo": lambda: arrays.record_from_torch(state),
                     "df": lambda: rec.to_torch_state_dict(), "do": lambda: arrays.record_to_torch(rec)}
            for f in calls.values():
                f()
            for _ in range(args.repeat):
                for k, f in calls.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{name:>18} {copies:>6} {len(state):>6} {mb:>6.1f} | {m['ef']:>9.2f}ms {m['eo']:>6.2f}ms "
                  f"{m['ef'] / m['eo']:>5.1f} | {m['df']:>9.2f}ms {m['do']:>6.2f}ms {m['df'] / m['do']:>5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
