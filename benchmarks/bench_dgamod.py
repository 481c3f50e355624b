#!/usr/bin/env python
"""DGAMod's own cost per message, with its stored updates in flight kept as they are or
encoded again: milliseconds per message, side by side.

A DGA client's state is its model and its D updates still in flight (D + 1 models). Each
message DGAMod decodes that state, brings it up to the global model, and writes it back.
An update in flight never changes once recorded, so fededge keeps the ones the stored
state already holds as their stored ``Array`` objects and encodes only the model and the
round just trained (``fededge.clients.mods._unchanged_kept``); the other column encodes
every model again, as before. Each row runs ``3 D + 1`` rounds of one client through a
``ClientApp`` with ``DGAMod`` around a train function that adds 0.01 to every weight (so
the time is the mod's and Flower's message handling, not training), the global model
arriving every round from round D + 2 on, and averages the rounds after the first D + 1.
Best of ``--repeat``, the two ways interleaved. One torch thread.

Example
-------
::

    python benchmarks/bench_dgamod.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = (("cnn", (1, 8, 8)), ("cnn-bn", (3, 32, 32)))


def _per_message(model: str, shape: tuple[int, ...], delay: int, *, every_model: bool) -> float:
    from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    import fededge.clients.mods as mods
    from fededge import _flwr_internals as fi
    from fededge import keys
    from fededge.api import DGAMod
    from fededge.arrays import record_from_torch, record_to_torch
    from fededge.models import build_model

    original = mods._unchanged_kept
    if every_model:
        mods._unchanged_kept = lambda dga, kept, fresh: dga.state_dict()
    try:
        initial = record_from_torch(build_model(model, input_shape=shape, num_classes=10, seed=0).state_dict())

        def step(msg: Message, context: Context) -> Message:
            arrays = {k: v + 0.01 if v.is_floating_point() else v
                      for k, v in record_to_torch(msg.content[keys.ARRAYS]).items()}
            metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.COMPUTE_S: 0.0})
            return Message(RecordDict({keys.ARRAYS: record_from_torch(arrays), keys.METRICS: metrics}), reply_to=msg)

        app = ClientApp()
        app.train(mods=[DGAMod()])(step)
        context = Context(run_id=1, node_id=7, node_config={keys.PARTITION_ID: 0}, state=RecordDict(), run_config={})
        times = []
        for rnd in range(1, 3 * delay + 2):
            arrives = rnd == 1 or rnd - 1 - delay >= 1  # G(rnd - 1 - D) reaches the client
            conf = ConfigRecord({keys.SERVER_ROUND: rnd, keys.DGA_GLOBAL_ROUND: max(rnd - 1 - delay, 0),
                                 keys.DGA_CORRECTION: True})
            content = {keys.CONFIG: conf, **({keys.ARRAYS: initial} if arrives else {})}
            with fi.task_identity(run_id=1, node_id=1, task_id=rnd):
                msg = Message(RecordDict(content), 7, "train")
            fi.set_message_id(msg, f"m{rnd}")
            t0 = time.perf_counter()
            app(msg, context)
            times.append(time.perf_counter() - t0)
        later = times[delay + 1:]
        return sum(later) / len(later)
    finally:
        mods._unchanged_kept = original


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", type=int, nargs="+", default=[5, 20])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if any(d < 1 for d in args.delays) or args.repeat < 1:
        ap.error("--delays and --repeat must be >= 1")
    torch.set_num_threads(1)
    print("| model | D | every model encoded, ms/message | stored updates kept, ms/message | × |")
    print("|---|---:|---:|---:|---:|")
    for model, shape in MODELS:
        for d in args.delays:
            every, kept = [], []
            for _ in range(args.repeat):
                every.append(_per_message(model, shape, d, every_model=True))
                kept.append(_per_message(model, shape, d, every_model=False))
            print(f"| {model} | {d} | {min(every) * 1e3:.2f} | {min(kept) * 1e3:.2f} | {min(every) / min(kept):.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
