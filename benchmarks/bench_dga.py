"""Delayed Gradient Averaging against FedAvg: time to accuracy under a network, the shape
of the paper's table (Zhu et al., NeurIPS 2021, Table 1 and the correction ablation).

Every run is the default task (digits, 10 clients, the small CNN, batch 32, lr 0.05,
momentum 0.9) in the in-process Flower runtime, with the same budget of local steps per
client (``--steps``), so K = 5 runs 4x as many rounds as K = 20. Training does not depend
on the emulated network, so each configuration is trained once, on an ideal network, and
its per-client record (measured compute, bytes each way) is replayed on the simulated
clock under each profile (fededge.analysis.replay; the same rules the run itself uses:
synchronous rounds for FedAvg, DGA's overlap for DGA).

Table 1: for each data split (IID, Dirichlet 0.3) and profile: FedAvg with K = 5, 10, 20
and DGA with K = 5 and D in ``--delays``; final accuracy, ``sim_s`` to ``--target``, the
speedup to target over FedAvg K = 5, and the speedup per local step (simulated time for
the same number of steps: the paper's "speedup" is of this kind). Table 2 (ablation): DGA K = 5 with and without the
correction for D in ``--ablation-delays`` on the IID split: final and best accuracy.

Examples
--------
::

    python benchmarks/bench_dga.py                      # both tables, ~15 min on 2 cores
    python benchmarks/bench_dga.py --steps 100 --delays 2 --ablation-delays 5 --quick
    python benchmarks/bench_dga.py --plot docs/figures/dga.png
    # DGA with compressed uplinks, against FedAvg K=5 with and without the same codec:
    python benchmarks/bench_dga.py --splits iid --profiles 4g --delays 2 5 --fedavg-k 5 --quick \
        --compress sign-ef --compress-fedavg --sim-step-s 0.0084

``--compress`` compresses the DGA runs' uplinks (and, with ``--compress-down``, casts the
model the server sends) (fededge's codecs; DGA compresses each
client's own K-step change, see docs/algorithms.md); ``--compress-fedavg`` adds FedAvg
rows with the same codec, so that the speedup due to DGA is shown apart from the one due
to compression. ``--sim-step-s`` charges a fixed time per local step on the clock instead
of the measured compute (deterministic, and independent of other work on the machine);
0.0084 s is fededge's ClientApp on one core of this machine (benchmarks/bench_edge_client.py).
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
from fededge.analysis.replay import replay_sim_s  # noqa: E402

SPLITS = {"iid": {"partition": "iid"}, "dir0.3": {"partition": "dirichlet", "alpha": 0.3}}

#: Uplink codecs for --compress (run-config keys).
COMPRESS = {
    "sign-ef": {"compressor": "signsgd", "error-feedback": True},
    "topk10-fp16-ef": {"compressor": "topk", "topk-ratio": 0.1, "topk-values": "fp16", "error-feedback": True},
    "powersgd2": {"compressor": "powersgd", "powersgd-rank": 2},
    "qsgd16": {"compressor": "qsgd", "qsgd-levels": 16},
}

# The paper's regime: bandwidth is cheap, latency is not. Light from Shanghai to Boston
# takes 162 ms one way (the seed notes' figure); 1 Gbit/s and no loss are assumptions.
LATENCY_PROFILE = """
[wan-324ms]
description = "long-haul path where latency, not bandwidth, dominates"
source = "delay: 162 ms one way, Shanghai-Boston at the speed of light (shared/seeds 004, DGA slides); 1 Gbit/s and no loss: assumption"
up = { rate-kbit = 1000000, delay-ms = 162 }
down = { rate-kbit = 1000000, delay-ms = 162 }
"""


def _run(out: Path, name: str, over: dict, clients: int) -> dict:
    t0 = time.perf_counter()
    run_dir = run_inprocess({"progress": "off", "results-dir": str(out), "run-name": name,
                             "save-model": False, **over}, num_clients=clients)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  {name}: {len(lines) - 1} rounds, final {lines[-1]['accuracy']:.4f}, "
          f"{time.perf_counter() - t0:.0f} s wall", file=sys.stderr, flush=True)
    return {"dir": run_dir, "acc": [r["accuracy"] for r in lines]}


def _to_target(acc: list[float], sim: list[float], target: float) -> float | None:
    return next((s for a, s in zip(acc, sim) if a is not None and a >= target), None)  # (None: not evaluated)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="local steps per client in every run")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--delays", type=int, nargs="+", default=[2, 5, 10, 20])
    ap.add_argument("--fedavg-k", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--ablation-delays", type=int, nargs="+", default=[5, 10, 15, 20])
    ap.add_argument("--profiles", nargs="+", default=["4g", "intercontinental", "wan-324ms"],
                    help="built-in profiles, or wan-324ms (defined here: 1 Gbit/s, 324 ms RTT)")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--local-lr", type=float, default=None, help="client lr (default: the run config's, 0.05)")
    ap.add_argument("--momentum", type=float, default=None, help="client momentum (default 0.9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, help="write accuracy against sim_s (PNG)")
    ap.add_argument("--quick", action="store_true", help="skip the ablation")
    ap.add_argument("--compress", choices=list(COMPRESS), help="compress the DGA runs' uplinks")
    ap.add_argument("--compress-down", choices=["fp16", "bf16"],
                    help="with --compress: also cast the model the server sends (downlink-compressor)")
    ap.add_argument("--compress-fedavg", action="store_true",
                    help="with --compress: add FedAvg rows with the same codec")
    ap.add_argument("--sim-step-s", type=float, default=0.0,
                    help="clock seconds per local step (0: the measured compute)")
    args = ap.parse_args(argv)

    base = {"seed": args.seed, "target-accuracy": args.target, "sim-step-s": args.sim_step_s}
    comp = dict(COMPRESS[args.compress]) if args.compress else {}
    if comp and args.compress_down:
        comp["downlink-compressor"] = args.compress_down
    tag = (f" + {args.compress}" + (f", {args.compress_down} down" if args.compress_down else "")
           if args.compress else "")
    if args.local_lr is not None:
        base["local-lr"] = args.local_lr
    if args.momentum is not None:
        base["momentum"] = args.momentum
    runs: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dga-") as tmp:
        out = Path(tmp)
        for split in args.splits:
            print(f"training on {split}", file=sys.stderr)
            for k in args.fedavg_k:
                runs[(split, f"FedAvg K={k}")] = _run(out, f"fedavg-k{k}-{split}", {
                    **base, **SPLITS[split], "local-steps": k, "num-rounds": args.steps // k}, args.clients)
                if comp and args.compress_fedavg:
                    runs[(split, f"FedAvg K={k}{tag}")] = _run(out, f"fedavg-k{k}-{split}-c", {
                        **base, **SPLITS[split], **comp, "local-steps": k, "num-rounds": args.steps // k},
                        args.clients)
            for d in args.delays:
                runs[(split, f"DGA K=5 D={d}{tag}")] = _run(out, f"dga-d{d}-{split}", {
                    **base, **SPLITS[split], **comp, "strategy": "dga", "dga-delay": d, "local-steps": 5,
                    "num-rounds": args.steps // 5}, args.clients)
        ablation: dict[tuple[int, bool], dict] = {}
        if not args.quick:
            print("ablation on iid", file=sys.stderr)
            for d in args.ablation_delays:
                for corr in (True, False):
                    known = runs.get(("iid", f"DGA K=5 D={d}{tag}"))
                    ablation[(d, corr)] = known if (corr and known) else _run(
                        out, f"dga-d{d}-{'c' if corr else 'nc'}", {
                            **base, **SPLITS["iid"], **comp, "strategy": "dga", "dga-delay": d,
                            "dga-correction": corr, "local-steps": 5, "num-rounds": args.steps // 5},
                        args.clients)
        extra = out / "profiles.toml"
        extra.write_text(LATENCY_PROFILE)
        for r in runs.values():
            r["sim"] = {p: replay_sim_s(r["dir"], netem=p, netem_file=str(extra)) for p in args.profiles}

    print(f"\n## DGA vs FedAvg: {args.clients} clients, digits CNN, {args.steps} local steps per "
          f"client, target {args.target:.0%}, local lr {base.get('local-lr', 0.05)}, momentum "
          f"{base.get('momentum', 0.9)}, compute on the clock: "
          f"{f'{args.sim_step_s} s per step' if args.sim_step_s else 'measured'}"
          f"{f', DGA uplinks {args.compress} {comp}' if comp else ''}\n")
    for split in args.splits:
        for prof in args.profiles:
            print(f"\n### {split}, `{prof}`\n")
            print("| run | rounds | final acc | sim s / round | sim s to target | speedup to target "
                  "| speedup per step |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            ref = runs[(split, f"FedAvg K={args.fedavg_k[0]}")]
            ref_t = _to_target(ref["acc"], ref["sim"][prof], args.target)
            ref_step = ref["sim"][prof][-1] / args.steps
            for (s, name), r in runs.items():
                if s != split:
                    continue
                sim = r["sim"][prof]
                t = _to_target(r["acc"], sim, args.target)
                speed = ref_t / t if (t and ref_t) else None
                per_step = ref_step / (sim[-1] / args.steps)
                print(f"| {name} | {len(sim) - 1} | {r['acc'][-1]:.4f} | {sim[-1] / (len(sim) - 1):.3f} "
                      f"| {_fmt(t)} | {_fmt(speed, '.2f')}{'x' if speed else ''} | {per_step:.2f}x |")
    if ablation:
        print("\n### Correction ablation (iid; DGA K=5)\n")
        print("| D | final acc, with correction | without | best acc, with | without |")
        print("|---:|---:|---:|---:|---:|")
        for d in args.ablation_delays:
            w, n = ([a for a in ablation[(d, c)]["acc"] if a is not None] for c in (True, False))
            print(f"| {d} | {w[-1]:.4f} | {n[-1]:.4f} | {max(w):.4f} | {max(n):.4f} |")

    if args.plot:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5 * len(args.profiles), 3.6 * len(args.splits)))
        axes = fig.subplots(len(args.splits), len(args.profiles), squeeze=False)
        for i, split in enumerate(args.splits):
            for j, prof in enumerate(args.profiles):
                ax = axes[i][j]
                for (s, name), r in runs.items():
                    if s == split:
                        ax.plot(r["sim"][prof], r["acc"], label=name, lw=1.3,
                                ls="-" if name.startswith("DGA") else "--")
                ax.set_title(f"{split}, {prof}")
                ax.set_xlabel("simulated seconds")
                ax.set_ylabel("test accuracy")
                ax.set_ylim(0.5, 1.0)
                ax.axhline(args.target, color="grey", lw=0.6)
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=80)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
