"""Straggler-tolerant aggregation under heterogeneous clients: time to target accuracy.

Every run is the default task (digits, the small CNN, batch 32, lr 0.05, momentum 0.9,
Dirichlet split) with ``--clients`` clients whose devices are slow and different:
compute-speed factors drawn lognormally (``--sigma``), links mixing wifi, 4g and 3g
(``--netem``), ``sim-step-s`` seconds per local step on a speed-1 device (a Raspberry
Pi class CPU; it also makes every run deterministic for its seed). The runs go through
fededge's in-process Flower runtime; the asynchronous ones use each reply at its
simulated arrival time.

Table 1: synchronous FedAvg, backup workers with e = 10% and 20% of the sampled clients,
FedBuff, FedAsync, bounded staleness (SSP) and DGA, each given the same number of client
updates (``--rounds`` x clients): simulated time to ``--target``, the speedup over
FedAvg, the accuracy at the moment FedAvg first reaches the target, the final accuracy
(mean of the last three evaluations), the mean and largest staleness of the updates
used, and how unevenly the clients contributed (max / min updates per client).

Table 2 (the staleness sweep): FedAsync on identical clients and an ideal network with
``c`` clients training at once, so every update is about ``c - 1`` versions stale; the
same number of updates each, with the staleness weight off (constant) and on
(polynomial, a = 0.5): where staleness starts to hurt.

Examples
--------
::

    python benchmarks/bench_async.py                       # both tables, ~12 min on 2 cores
    python benchmarks/bench_async.py --rounds 10 --sweep 1 8 --quick
    python benchmarks/bench_async.py --plot docs/figures/async.png
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


def _run(out: Path, name: str, over: dict, clients: int, reuse: Path | None = None) -> dict:
    t0 = time.perf_counter()
    done = sorted(reuse.glob(f"{name}-*")) if reuse else []
    if done:  # a finished run of the same name: read it instead of training again
        run_dir = done[-1]
    else:
        run_dir = run_inprocess({"progress": "off", "results-dir": str(out), "run-name": name,
                                 "save-model": False, **over}, num_clients=clients)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"  {name}: {len(lines) - 1} versions, final {lines[-1]['accuracy']:.4f}, sim "
          f"{lines[-1]['sim_s']:.0f} s, {time.perf_counter() - t0:.0f} s wall", file=sys.stderr, flush=True)
    stale = [int(k) for k, v in summary.get("staleness_hist", {}).items() for _ in range(v)]
    if not stale:  # DGA and FedAvg record their own fields
        stale = [int(r["staleness"] or 0) for r in lines[1:] if r.get("staleness") is not None]
    contrib = summary.get("contributions")
    return {
        "name": name, "acc": [r["accuracy"] for r in lines], "sim": [r["sim_s"] for r in lines],
        "staleness": stale, "contrib": contrib, "summary": summary, "clients": clients,
    }


def _to_target(run: dict, target: float) -> float | None:
    return next((s for a, s in zip(run["acc"], run["sim"]) if a >= target), None)


def _acc_at(run: dict, t: float | None) -> float | None:
    if t is None:
        return None
    seen = [a for a, s in zip(run["acc"], run["sim"]) if s <= t]
    return seen[-1] if seen else None


def _final(run: dict) -> float:
    tail = run["acc"][-3:]
    return sum(tail) / len(tail)


def _pct(xs: list[int], q: float) -> int:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=25, help="FedAvg rounds; every run gets rounds x clients updates")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--netem", default="wifi:0.4,4g:0.4,3g:0.2")
    ap.add_argument("--sigma", type=float, default=0.7, help="lognormal sigma of the compute-speed factors")
    ap.add_argument("--sim-step-s", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the split")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--buffer", type=int, default=0, help="FedBuff K (0: half the clients)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 8, 16, 32],
                    help="clients training at once in the staleness sweep (its clients: the largest)")
    ap.add_argument("--sweep-updates", type=int, default=240)
    ap.add_argument("--quick", action="store_true", help="only FedAvg, backup 10%%, FedBuff, FedAsync")
    ap.add_argument("--plot", help="write a figure (accuracy against simulated time; the sweep)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", type=Path, help="read runs already in this results directory (by run name) "
                    "instead of training them again: to re-plot or re-tabulate")
    args = ap.parse_args(argv)

    n, r = args.clients, args.rounds
    updates = n * r
    base = {"netem": args.netem, "compute-speed": f"lognormal:{args.sigma}", "sim-step-s": args.sim_step_s,
            "local-steps": args.local_steps, "partition": "dirichlet", "alpha": args.alpha,
            "target-accuracy": args.target, "seed": args.seed}
    k = args.buffer or max(1, n // 2)
    e10, e20 = max(1, round(0.1 * n)), max(1, round(0.2 * n))
    runs_spec = [
        ("fedavg", {"num-rounds": r}),
        (f"backup e={e10} (10%)", {"strategy": "backup", "backup-workers": e10,
                                   "num-rounds": -(-updates // (n - e10))}),
        (f"backup e={e20} (20%)", {"strategy": "backup", "backup-workers": e20,
                                   "num-rounds": -(-updates // (n - e20))}),
        (f"fedbuff K={k}", {"strategy": "fedbuff", "buffer-size": k, "num-rounds": updates // k}),
        ("fedasync", {"strategy": "fedasync", "num-rounds": updates}),
        ("ssp s=2", {"strategy": "ssp", "ssp-bound": 2, "num-rounds": updates}),
        ("dga D=2", {"strategy": "dga", "dga-delay": 2, "num-rounds": r}),
    ]
    if args.quick:
        runs_spec = [x for x in runs_spec if x[0].split()[0] in ("fedavg", "fedbuff", "fedasync")
                     or x[0].startswith(f"backup e={e10} ")]
    print(f"# {n} clients, {args.netem}, compute-speed lognormal:{args.sigma}, sim-step-s "
          f"{args.sim_step_s}, K = {args.local_steps}, Dirichlet {args.alpha}, {updates} client updates "
          f"per run, target {args.target}", flush=True)
    out = Path(tempfile.mkdtemp(prefix="bench-async-"))
    runs = [_run(out, name.split(" (")[0].replace(" ", "").replace("=", ""), {**base, **over}, n, args.reuse)
            | {"label": name} for name, over in runs_spec]
    ref = runs[0]
    t_ref = _to_target(ref, args.target)
    print()
    print(f"| strategy | sim s to {args.target} | speedup | acc when FedAvg hits target | final acc "
          f"| final − FedAvg (pts) | staleness mean / p50 / p90 / max | updates per client max / min |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        t = _to_target(run, args.target)
        speed = (t_ref / t) if (t and t_ref) else None
        st = run["staleness"]
        c = run["contrib"]
        cvals = [c.get(str(p), 0) for p in range(n)] if c else None
        spread = f"{max(cvals)} / {min(cvals)}" if cvals else "all equal"
        print(f"| {run['label']} | {_fmt(t)} | {_fmt(speed, '.2f')}× | {_fmt(_acc_at(run, t_ref), '.3f')} | "
              f"{_final(run):.3f} | {100 * (_final(run) - _final(ref)):+.1f} | "
              f"{_fmt(sum(st) / len(st) if st else 0.0, '.2f')} / {_pct(st, 0.5)} / {_pct(st, 0.9)} / "
              f"{max(st, default=0)} | {spread} |", flush=True)

    sweep = []
    if args.sweep:
        m = max(args.sweep)
        print()
        print(f"Staleness sweep: FedAsync (alpha 0.6), {m} identical clients, ideal network, "
              f"{args.sweep_updates} updates each; c clients train at once")
        print()
        print("| c | staleness mean / max | final acc, constant weight | final acc, polynomial (a = 0.5) |")
        print("|---:|---:|---:|---:|")
        for c in args.sweep:
            row = {}
            for kind in ("constant", "polynomial"):
                over = {"strategy": "fedasync", "async-concurrency": c, "staleness": kind,
                        "num-rounds": args.sweep_updates, "sim-step-s": args.sim_step_s,
                        "local-steps": args.local_steps, "partition": "dirichlet", "alpha": args.alpha,
                        "seed": args.seed}
                row[kind] = _run(out, f"sweep-c{c}-{kind}", over, m, args.reuse)
            st = row["constant"]["staleness"]
            print(f"| {c} | {sum(st) / len(st):.1f} / {max(st)} | {_final(row['constant']):.3f} | "
                  f"{_final(row['polynomial']):.3f} |", flush=True)
            sweep.append((c, sum(st) / len(st), _final(row["constant"]), _final(row["polynomial"])))

    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 11, 4.2))
        for i, run in enumerate(runs):
            run["color"] = f"C{i}"
            axes[0].plot(run["sim"], run["acc"], label=run["label"], lw=1.2, color=run["color"])
        axes[0].axhline(args.target, color="grey", ls=":", lw=0.8)
        axes[0].set_xscale("symlog", linthresh=10)
        axes[0].set_xlim(left=0)
        axes[0].set_xlabel("simulated time (s)")
        axes[0].set_ylabel("test accuracy")
        axes[0].set_title(f"{n} heterogeneous clients ({args.netem})")
        axes[0].legend(fontsize=7)
        for run in runs:
            if run["contrib"]:
                counts = sorted((run["contrib"].get(str(p), 0) for p in range(n)), reverse=True)
                axes[1].plot(range(n), counts, marker=".", label=run["label"], color=run["color"])
        axes[1].set_xlabel("client (sorted by contributions)")
        axes[1].set_ylabel("updates used")
        axes[1].set_title("who contributed")
        axes[1].legend(fontsize=7)
        if sweep:
            cs = [s[1] for s in sweep]
            axes[2].plot(cs, [s[2] for s in sweep], marker="o", label="constant weight")
            axes[2].plot(cs, [s[3] for s in sweep], marker="s", label="polynomial a=0.5")
            axes[2].set_xlabel("mean staleness (versions)")
            axes[2].set_ylabel("final accuracy")
            axes[2].set_title("FedAsync: where staleness hurts")
            axes[2].legend(fontsize=7)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
