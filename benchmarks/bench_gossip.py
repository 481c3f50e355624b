"""Gossip over topologies: D-PSGD on ring, torus, exponential and complete graphs, and
CHOCO-SGD with top-1% on the ring, against FedAvg, for a fixed budget of rounds.

Every run is the default task (digits, the small CNN, batch 32, lr 0.05, momentum 0.9,
Dirichlet 0.5 split) in the in-process Flower runtime with ``--clients`` nodes, ``--rounds``
rounds of ``--steps`` local steps, and the ``4g`` profile on the simulated clock. The
table gives, at the last round: the accuracy of the nodes' average model, the mean (and
min) accuracy of the individual nodes, the consensus distance (1/n) sum ||x_i - x̄||², the
total bytes the relay carried each way, the total a peer-to-peer exchange would send (each
message once per logical edge), and ``sim_s``.

The relay's downlink lags one round: it forwards round t's messages with round t+1's
train message, so the last round's messages are never forwarded (no round follows), while
the p2p figure counts every round's. Round 1's downlink is the initial model. FedAvg's
bytes are its broadcast and uploads.

Examples
--------
::

    python benchmarks/bench_gossip.py                     # 16 nodes, 20 rounds
    python benchmarks/bench_gossip.py --clients 8 --rounds 5 --steps 5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fededge.server.inprocess import run_inprocess  # noqa: E402

CONFIGS = {
    "fedavg": {"strategy": "fedavg"},
    "d-psgd ring": {"strategy": "gossip", "topology": "ring"},
    "d-psgd torus": {"strategy": "gossip", "topology": "torus"},
    "d-psgd exponential": {"strategy": "gossip", "topology": "exponential"},
    "d-psgd complete": {"strategy": "gossip", "topology": "complete"},
    "choco ring top-1%": {"strategy": "gossip", "topology": "ring", "gossip-algorithm": "choco",
                          "compressor": "topk", "topk-ratio": 0.01},
}


def _run(out: Path, name: str, over: dict, clients: int) -> dict:
    t0 = time.perf_counter()
    run_dir = run_inprocess({"progress": "off", "results-dir": str(out),
                             "run-name": name.replace(" ", "-").replace("%", "pc"),
                             "save-model": False, **over}, num_clients=clients)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    row = {
        "config": name,
        "gap": lines[0].get("spectral_gap"),
        "acc": last["accuracy"],
        "node_acc": last.get("node_accuracy_mean"),
        "node_min": last.get("node_accuracy_min"),
        "consensus": last.get("consensus_distance"),
        "up_mb": last["cum_bytes_up"] / 1e6,
        "down_mb": last["cum_bytes_down"] / 1e6,
        "p2p_mb": (sum(r.get("bytes_p2p", 0) for r in lines) / 1e6) if "bytes_p2p" in last else None,
        "eval_mb": sum(r.get("bytes_eval_up", 0) for r in lines) / 1e6,
        "sim_s": last["sim_s"],
        "wall_s": time.perf_counter() - t0,
    }
    print(f"  {name}: final {row['acc']:.4f}, {row['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
    return row


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--netem", default="4g")
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    args = ap.parse_args()
    base = {"num-rounds": args.rounds, "local-steps": args.steps, "netem": args.netem}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            rows.append(_run(Path(tmp), name, {**base, **over}, args.clients))
    print(f"\n{args.clients} nodes, {args.rounds} rounds x {args.steps} local steps, digits "
          f"Dirichlet 0.5, netem {args.netem}\n")
    print("| config | spectral gap | avg-model acc | mean node acc (min) | consensus dist | "
          "relay up MB | relay down MB | p2p MB | sim_s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {_fmt(r['gap'], '.4f')} | {r['acc']:.4f} | "
              f"{_fmt(r['node_acc'], '.4f')} ({_fmt(r['node_min'], '.4f')}) | {_fmt(r['consensus'], '.3g')} | "
              f"{r['up_mb']:.1f} | {r['down_mb']:.1f} | {_fmt(r['p2p_mb'], '.1f')} | {r['sim_s']:.1f} |")
    eval_mb = {r["config"]: r["eval_mb"] for r in rows if r["eval_mb"]}
    if eval_mb:
        print("\nCHOCO nodes also sent their models for server-side evaluation only (not in relay "
              "MB): " + ", ".join(f"{k}: {v:.1f} MB" for k, v in eval_mb.items()))


if __name__ == "__main__":
    main()
