"""What the server's evaluation holds in memory: ``evaluate()`` under ``no_grad`` against
the loop as it was before (issue 35), which summed each batch's loss into a tensor that
required gradients and so kept every batch's autograd graph, the activations of the
whole test set, until the end.

Each case runs in a fresh process (peak RSS is per process), on random CIFAR-shaped
inputs; both must print the same loss and accuracy.

Examples
--------
::

    python benchmarks/bench_eval_memory.py --model resnet18 --images 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _case(mode: str, model_name: str, images: int, batch: int) -> dict:
    import torch
    import torch.nn.functional as F

    from fededge.clients.train import evaluate
    from fededge.models.zoo import build_model

    torch.manual_seed(0)
    model = build_model(model_name, input_shape=(3, 32, 32), num_classes=10, seed=0)
    x, y = torch.randn(images, 3, 32, 32), torch.randint(0, 10, (images,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "before":  # the loop before the fix, verbatim but for the function around it
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros((), dtype=torch.int64)
        for s in range(0, len(x), batch):
            logits = model(x[s:s + batch])
            loss_sum += F.cross_entropy(logits, y[s:s + batch], reduction="sum").double()
            correct += (logits.argmax(dim=1) == y[s:s + batch]).sum()
        loss, acc = float(loss_sum) / len(x), float(correct) / len(x)
    else:
        loss, acc = evaluate(model, x, y, batch_size=batch)
    return {"mode": mode, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
            "seconds": time.perf_counter() - t0, "loss": loss, "accuracy": acc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--case", choices=["before", "now"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.model, args.images, args.batch)))
        return 0
    rows = []
    for mode in ("before", "now"):
        out = subprocess.run([sys.executable, __file__, "--case", mode, "--model", args.model, "--images",
                              str(args.images), "--batch", str(args.batch)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"evaluate() of {args.model} on {args.images} images of 3x32x32, batches of {args.batch}")
    print(f"{'evaluation':<28}{'peak RSS added':>16}{'seconds':>10}{'loss':>10}{'accuracy':>10}")
    names = {"before": "before (graph kept)", "now": "now (no_grad)"}
    for r in rows:
        print(f"{names[r['mode']]:<28}{r['peak_mb']:>13.0f} MB{r['seconds']:>10.1f}{r['loss']:>10.4f}{r['accuracy']:>10.4f}")
    same = rows[0]["loss"] == rows[1]["loss"] and rows[0]["accuracy"] == rows[1]["accuracy"]
    print(f"same loss and accuracy: {same}; memory ratio {rows[0]['peak_mb'] / max(rows[1]['peak_mb'], 1):.1f}x")
    print(f"command: {' '.join(sys.argv)}\ndate: {datetime.now(timezone.utc).isoformat(timespec='seconds')}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
