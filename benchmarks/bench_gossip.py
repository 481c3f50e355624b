"""Gossip over topologies: D-PSGD on ring, torus, exponential and complete graphs, and
CHOCO-SGD on the ring (QSGD with 2 levels unscaled at gamma 0.05 and scaled by
1/(1 + omega) at 0.05-0.8, top-1% at gamma 0.05 and 0.1, top-5% at 0.2-0.8, top-10% with
float32 or fp16 values at 0.4 and 0.6, scaled sign at 0.2-0.8), against FedAvg, for a fixed
budget of rounds (``--only`` picks configs).

Every run is the default task (digits, the small CNN, batch 32, lr 0.05, momentum 0.9,
Dirichlet 0.5 split) in the in-process Flower runtime with ``--clients`` nodes, ``--rounds``
rounds of ``--steps`` local steps, and the ``--netem`` profile (default ``wifi``) on the
simulated clock. The table gives, at the last round: the accuracy of the nodes' average
model, the mean (and min) accuracy of the individual nodes, the consensus distance
(1/n) sum ||x_i - x̄||², the total bytes the relay carried each way, the total a
peer-to-peer exchange would send (each message once per logical edge), and ``sim_s``; and
the first round (and its ``sim_s``) at which the average model, and the mean node, reach
``--target`` accuracy ("–": never within the budget).

CHOCO's gamma: Koloskova et al. (2019) need gamma to shrink with the compressor's quality
delta (Q is a delta-contraction: E||Q(x) - x||² <= (1 - delta)||x||²). Top-1% has
delta = 0.01, so it gets small gammas (0.05, 0.1); QSGD with s = 2 levels per 512-element
bucket is unbiased with variance factor omega = min(b/s², sqrt(b)/s) ~ 11, i.e. delta ~
1/(1 + omega) ~ 0.08 only once rescaled by 1/(1 + omega), which ``choco-scale``'s
automatic value now does (the "scaled" rows). Unscaled (``choco-scale=1``, the first
QSGD row), CHOCO's estimate update x̂ += Q(x - x̂) does not involve gamma: with
omega > 1 its error grows, whatever gamma. At gamma 0.05 it went to NaN in round 16 of 20
(16 nodes, wifi), so no larger gamma is run; the benchmark keeps the rounds before a
failure and says so. s = 2 costs
ceil(log2 3) + 1 = 3 bits per element (plus one float32 per bucket), about 10.4x fewer
bytes than float32; s = 4 would cost 4 bits (8x), short of the issue's 10x.

The relay's downlink lags one round: it forwards round t's messages with round t+1's
train message, so the last round's messages are never forwarded (no round follows), while
the p2p figure counts every round's. Round 1's downlink is the initial model. FedAvg's
bytes are its broadcast and uploads.

Examples
--------
::

    python benchmarks/bench_gossip.py                     # 16 nodes, 20 rounds, wifi
    python benchmarks/bench_gossip.py --target 0.9 --plot docs/figures/gossip.png
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
}
_CHOCO = {"strategy": "gossip", "topology": "ring", "gossip-algorithm": "choco"}
for _g in (0.05,):
    CONFIGS[f"choco ring qsgd-2 g{_g}"] = {**_CHOCO, "compressor": "qsgd", "qsgd-levels": 2,
                                           "gossip-gamma": _g, "choco-scale": 1.0}
for _g in (0.05, 0.1):
    CONFIGS[f"choco ring top-1% g{_g}"] = {**_CHOCO, "compressor": "topk", "topk-ratio": 0.01,
                                           "gossip-gamma": _g}
# QSGD scaled by 1 / (1 + omega) (choco-scale's automatic value): a contraction.
for _g in (0.05, 0.2, 0.5, 0.8):
    CONFIGS[f"choco ring qsgd-2 scaled g{_g}"] = {**_CHOCO, "compressor": "qsgd", "qsgd-levels": 2,
                                                  "gossip-gamma": _g}
for _g in (0.2, 0.4, 0.6, 0.8):
    CONFIGS[f"choco ring top-5% g{_g}"] = {**_CHOCO, "compressor": "topk", "topk-ratio": 0.05,
                                           "gossip-gamma": _g}
for _g in (0.4, 0.6):
    CONFIGS[f"choco ring top-10% g{_g}"] = {**_CHOCO, "compressor": "topk", "topk-ratio": 0.10,
                                            "gossip-gamma": _g}
    CONFIGS[f"choco ring top-10% fp16 g{_g}"] = {**_CHOCO, "compressor": "topk", "topk-ratio": 0.10,
                                                 "topk-values": "fp16", "gossip-gamma": _g}
# Scaled sign, ||x||_1 / d * sign(x) per tensor: the "Sign" compressor of Koloskova, Lin,
# Stich and Jaggi (ICLR 2020), 1 bit per element (~32x); biased, so CHOCO sends it unscaled.
for _g in (0.2, 0.4, 0.6, 0.8):
    CONFIGS[f"choco ring sign g{_g}"] = {**_CHOCO, "compressor": "signsgd", "gossip-gamma": _g}


def _first(lines: list[dict], key: str, target: float) -> tuple[int | None, float | None]:
    for r in lines:
        if r.get("round", 0) >= 1 and r.get(key) is not None and r[key] >= target:
            return r["round"], r["sim_s"]
    return None, None


def _run(out: Path, name: str, over: dict, clients: int, target: float) -> dict:
    t0, failed = time.perf_counter(), None
    sub = out / name.replace(" ", "-").replace("%", "pc")
    try:
        run_dir = run_inprocess({"progress": "off", "results-dir": str(sub), "run-name": sub.name,
                                 "save-model": False, **over}, num_clients=clients)
        metrics = run_dir / "metrics.jsonl"
    except Exception as e:  # e.g. CHOCO diverging to NaN: keep the rounds that finished
        failed = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"  {name}: FAILED {failed}", file=sys.stderr, flush=True)
        found = sorted(sub.rglob("metrics.jsonl"))
        if not found:
            raise
        metrics = found[-1]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    last = lines[-1]
    lines = [r for r in lines if r.get("round", 0) >= 1]
    t_round, t_sim = _first(lines, "accuracy", target)
    n_round, n_sim = _first(lines, "node_accuracy_mean", target)
    cum, curve_mb = 0, []
    for r in lines:  # bytes sent so far: p2p for gossip, broadcast + uploads for FedAvg
        cum = cum + r["bytes_p2p"] if "bytes_p2p" in r else r["cum_bytes_up"] + r["cum_bytes_down"]
        curve_mb.append(cum / 1e6)
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
        "t_round": t_round, "t_sim": t_sim, "n_round": n_round, "n_sim": n_sim,
        "rounds": [r["round"] for r in lines], "accs": [r["accuracy"] for r in lines],
        "curve_mb": curve_mb, "failed": failed,
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
    ap.add_argument("--netem", default="wifi")
    ap.add_argument("--seed", type=int, default=0,
                    help="run-config seed: model init, the Dirichlet split, batches (default 0)")
    ap.add_argument("--target", type=float, default=0.90,
                    help="accuracy for the rounds-to-target columns")
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    ap.add_argument("--plot", type=Path,
                    help="write average-model accuracy against rounds and cumulative bytes (PNG)")
    args = ap.parse_args()
    base = {"num-rounds": args.rounds, "local-steps": args.steps, "netem": args.netem, "seed": args.seed}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            rows.append(_run(Path(tmp), name, {**base, **over}, args.clients, args.target))
    print(f"\n{args.clients} nodes, {args.rounds} rounds x {args.steps} local steps, digits "
          f"Dirichlet 0.5, netem {args.netem}, seed {args.seed}\n")
    print("| config | spectral gap | avg-model acc | mean node acc (min) | consensus dist | "
          "relay up MB | relay down MB | p2p MB | sim_s | "
          f"avg ≥ {args.target:g}: round (sim_s) | mean node ≥ {args.target:g}: round (sim_s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {_fmt(r['gap'], '.4f')} | {r['acc']:.4f} | "
              f"{_fmt(r['node_acc'], '.4f')} ({_fmt(r['node_min'], '.4f')}) | {_fmt(r['consensus'], '.3g')} | "
              f"{r['up_mb']:.1f} | {r['down_mb']:.1f} | {_fmt(r['p2p_mb'], '.1f')} | {r['sim_s']:.1f} | "
              f"{_fmt(r['t_round'], 'd')} ({_fmt(r['t_sim'], '.1f')}) | "
              f"{_fmt(r['n_round'], 'd')} ({_fmt(r['n_sim'], '.1f')}) |")
    for r in rows:
        if r["failed"]:
            print(f"\n{r['config']} FAILED after round {r['rounds'][-1] if r['rounds'] else 0} "
                  f"(its row is that round's): {r['failed']}")
    eval_mb = {r["config"]: r["eval_mb"] for r in rows if r["eval_mb"]}
    if eval_mb:
        print("\nCHOCO nodes also sent their models for server-side evaluation only (not in relay "
              "MB): " + ", ".join(f"{k}: {v:.1f} MB" for k, v in eval_mb.items()))
    ref = next((r for r in rows if r["config"] == "d-psgd ring"), None)
    if ref and ref["p2p_mb"]:
        print("\nCHOCO bytes against D-PSGD ring (p2p, relay down): " + ", ".join(
            f"{r['config']}: {ref['p2p_mb'] / r['p2p_mb']:.1f}x, {ref['down_mb'] / r['down_mb']:.1f}x"
            for r in rows if r["config"].startswith("choco") and r["p2p_mb"]))
    print(f"\ntotal wall {sum(r['wall_s'] for r in rows):.0f} s")
    if args.plot:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullFormatter

        fig = Figure(figsize=(11, 4.2))
        ax_r, ax_b = fig.subplots(1, 2)
        for r in rows:
            ls = "--" if r["config"].startswith("choco") else ":" if r["config"] == "fedavg" else "-"
            ax_r.plot(r["rounds"], r["accs"], ls, label=r["config"], lw=1.3)
            ax_b.plot(r["curve_mb"], r["accs"], ls, label=r["config"], lw=1.3)
        for ax in (ax_r, ax_b):
            ax.axhline(args.target, color="grey", lw=0.6)
            ax.set_ylabel("average-model accuracy")
            ax.set_ylim(max(0.0, min(min(r["accs"]) for r in rows) - 0.02), 1.0)
            ax.grid(alpha=0.3)
        ax_r.set_xlabel("round")
        ax_b.set_xlabel("cumulative MB sent (gossip: p2p; FedAvg: up + down), log")
        ax_b.set_xscale("log")
        ax_b.xaxis.set_minor_formatter(NullFormatter())
        ax_b.legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{args.clients} nodes, digits Dirichlet 0.5, {args.steps} local steps/round, "
                     f"netem {args.netem}", fontsize=10)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=80)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
