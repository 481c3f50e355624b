#!/usr/bin/env python
"""DGA in the paper's regime (issue 20): the correction ablation with D counted in local
iterations, K = 1 and K > 1, several seeds, and DGA against FedAvg at equal local steps.

Zhu et al. (NeurIPS 2021; shared/seeds/004, "Deal with Staleness") average after every
local iteration and delay the average by D iterations, D = 5..20; their optimiser is
momentum SGD whose momentum runs across iterations. Here every run is the default task
(digits, 10 clients, the small CNN, batch 32, lr 0.05, momentum 0.9) split IID, in the
in-process Flower runtime (``run_inprocess``: fededge's ServerApp and ClientApp, the
wire included), with the same budget of local steps per client (``--steps``):

- ``K=1`` (in ``--k``): ``local-steps=1``, ``dga-delay=D`` rounds = D iterations; the
  paper's rule.
- ``K=k`` for each other ``--k``: ``local-steps=k``, ``dga-delay=D/k`` rounds (D iterations
  of staleness at least; a D that k does not divide is skipped).
- ``--momentum-state``: ``keep`` (the clients keep their momentum buffers across rounds,
  run-config ``keep-momentum``: the paper's optimiser; with K = 1 exactly its rule,
  tests/algorithms/test_dga.py) and/or ``restart`` (fededge's default: a fresh buffer
  each round, so at K = 1 momentum never acts).

D = 0 is FedAvg with that K (bit for bit; the same run serves both correction columns).
Each cell is the final test accuracy (the server's evaluation after the last round),
mean ± sample standard deviation over ``--seeds``; ``best`` is the mean over seeds of
each run's best round. For a model with BatchNorm (``--set model=cnn-bn``) two more
columns give the final model's accuracy with its running statistics recomputed on the
training set: the weights' own accuracy, apart from the statistics DGA averaged. Runs
go ``--jobs`` at a time, each in its own process with one torch thread, through
``fededge sweep``'s machinery (:mod:`fededge.sweep`, a list of cells times the seeds);
``--out DIR`` keeps them, and the same command again finishes a stopped batch.

Examples
--------
::

    python benchmarks/bench_dga_paper.py                                  # the tables in BENCHMARKS.md
    python benchmarks/bench_dga_paper.py --steps 60 --seeds 0 --delays 0 5 --k 1 5 --jobs 2   # a smoke run
    python benchmarks/bench_dga_paper.py --plot docs/figures/dga-paper.png --json /tmp/dga-paper.json
    python benchmarks/bench_dga_paper.py --k 1 --momentum-state keep --set model=cnn-bn --set lr-schedule=cosine
    python benchmarks/bench_dga_paper.py --k 1 5 --momentum-state keep --from-json k1.json k5.json --plot both.png
    python benchmarks/bench_dga_paper.py --k 1 --momentum-state keep --from-json k1.json --curves curves.png

``Δ`` columns: the mean over seeds of each run's final accuracy minus its own seed's
FedAvg run, ± the standard deviation of those differences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _with_statistics_recomputed(over: dict, state: dict) -> float | None:
    """The final model's test accuracy with its BatchNorm running statistics recomputed
    on the whole training set (None for a model without them). What the server evaluates
    uses the statistics DGA averaged, which the weights may have left behind; this tells
    the weights' own accuracy apart from that."""
    import torch

    from fededge.clients.train import evaluate
    from fededge.config import RunConfig
    from fededge.workload import dataset_for, model_for

    cfg = RunConfig.from_mapping(over)
    ds = dataset_for(cfg)
    model = model_for(cfg, ds)
    model.load_state_dict(state)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return None
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for i in range(0, len(ds.x_train), 256):
            model(ds.x_train[i:i + 256])
    return evaluate(model, ds.x_test, ds.y_test)[1]


def _specs(args: argparse.Namespace) -> list[dict]:
    specs = []
    for state in args.momentum_state:
        for k in args.k:
            for d in args.delays:
                if d % k:
                    continue
                for corr in ([True] if d == 0 else [c == "with" for c in args.correction]):
                    for seed in args.seeds:
                        over = {"strategy": "dga", "partition": "iid", "seed": seed, "local-steps": k,
                                "num-rounds": args.steps // k, "dga-delay": d // k, "dga-correction": corr,
                                "keep-momentum": state == "keep", "client-threads": 1,
                                # no checkpoints (--set checkpoint-every=N for them): at K = 1 the
                                # default wrote every clients' D + 1 models every 5 local steps,
                                # a fifth of a run's time
                                "checkpoint-every": 0}
                        if args.local_lr is not None:
                            over["local-lr"] = args.local_lr
                        if args.momentum is not None:
                            over["momentum"] = args.momentum
                        if args.evaluate_every_steps:
                            over["evaluate-every"] = max(args.evaluate_every_steps // k, 1)
                        if args.warmup_steps is not None:
                            over["lr-warmup-rounds"] = args.warmup_steps // k
                        over.update(args.set)
                        specs.append({"state": state, "k": k, "d": d, "correction": corr, "seed": seed,
                                      "clients": args.clients, "over": over})
    return specs


def _run_all(specs: list[dict], jobs: int, json_path: Path | None = None, out: Path | None = None) -> list[dict]:
    """Every run, ``jobs`` at a time, through ``fededge sweep``'s machinery (fededge.sweep):
    each spec's settings but the seed are a cell, run once per seed, each a ``fededge run``
    process. With ``out`` the sweep's runs stay there, and the same command again finishes
    a stopped batch (finished runs kept, interrupted ones resumed from their checkpoints);
    else they go in a temporary directory. ``json_path`` receives the runs at the end."""
    import torch

    from fededge.sweep import plan, run_sweep

    settings: list[dict] = []
    for spec in specs:
        over = {k: v for k, v in spec["over"].items() if k != "seed"}
        if over not in settings:
            settings.append(over)
    # What every run shares is the sweep's base; each cell holds only what varies.
    shared = {k: v for k, v in settings[0].items() if all(k in o and o[k] == v for o in settings)}
    cells = [{k: v for k, v in o.items() if k not in shared} for o in settings]
    seeds = sorted({spec["seed"] for spec in specs})
    clients = {spec["clients"] for spec in specs}
    os.environ["OMP_NUM_THREADS"] = "1"  # each run one thread, as before (the runs inherit it)
    tmp = None if out is not None else tempfile.TemporaryDirectory(prefix="bench-dga-paper-")
    try:
        root = Path(out) if out is not None else Path(tmp.name)
        sweep = plan(root, {}, seeds, base={"progress": "off", "save-model": True, **shared},
                     num_clients=clients.pop(), cells=cells)
        run_sweep(sweep, jobs=jobs, report=lambda line: print(line, file=sys.stderr, flush=True))
        runs = {(json.dumps(r.cell, sort_keys=True), r.seed): r for r in sweep.runs}
        results = []
        for spec in specs:
            cell = {k: v for k, v in spec["over"].items() if k != "seed" and k not in shared}
            run_dir = runs[(json.dumps(cell, sort_keys=True), spec["seed"])].run_dir()
            lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            evaluated = [r for r in lines if r["accuracy"] is not None]  # evaluate-every: the others are null
            state = torch.load(run_dir / "model.pt")
            results.append({**spec, "acc": [r["accuracy"] for r in evaluated],
                            "acc_round": [r["round"] for r in evaluated],
                            "acc_rs": _with_statistics_recomputed(spec["over"], state),
                            "wall_s": json.loads((run_dir / "summary.json").read_text())["wall_s"]})
    finally:
        if tmp is not None:
            tmp.cleanup()
    if json_path is not None:
        json_path.write_text(json.dumps(results))
    return results


def _cell(runs: list[dict]) -> str:
    if not runs:
        return "—"
    final = [r["acc"][-1] * 100 for r in runs]
    sd = statistics.stdev(final) if len(final) > 1 else 0.0
    return f"{statistics.mean(final):.1f} ± {sd:.1f}"


def _paired(runs: list[dict], fedavg: list[dict]) -> str:
    """Mean ± sd over seeds of each run's final accuracy minus its own seed's FedAvg run
    (same data split and initial model): most of the seeds' spread cancels."""
    base = {r["seed"]: r["acc"][-1] for r in fedavg}
    diffs = [(r["acc"][-1] - base[r["seed"]]) * 100 for r in runs if r["seed"] in base]
    if not diffs:
        return "—"
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return f"{statistics.mean(diffs):+.1f} ± {sd:.1f}"


def _best(runs: list[dict]) -> str:
    return "—" if not runs else f"{statistics.mean(max(r['acc']) * 100 for r in runs):.1f}"


def _recomputed(runs: list[dict]) -> str:
    vals = [r["acc_rs"] * 100 for r in runs if r.get("acc_rs") is not None]
    return "—" if not vals else f"{statistics.mean(vals):.1f}"


def _settings(args: argparse.Namespace) -> str:
    """The ``--set`` keys, for a table's heading or a plot's title."""
    return "".join(f", {k}={v}" for k, v in getattr(args, "set", {}).items())


def _tables(results: list[dict], args: argparse.Namespace) -> str:
    out = []
    for state in args.momentum_state:
        for k in args.k:
            rows = [r for r in results if r["state"] == state and r["k"] == k]
            if not rows:
                continue
            out.append(f"\n#### K = {k}, momentum {'kept across rounds' if state == 'keep' else 'restarted each round'}"
                       f" ({args.steps} local steps, seeds {' '.join(map(str, args.seeds))}{_settings(args)})\n")
            stats = any(r.get("acc_rs") is not None for r in rows)
            out.append("| D (iterations) | D (rounds) | with correction | without | Δ with | Δ without "
                       "| best, with | best, without |"
                       + (" with, BN statistics recomputed | without, recomputed |" if stats else ""))
            out.append("|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if stats else ""))
            fedavg = [r for r in rows if r["d"] == 0]
            for d in args.delays:
                if d % k:
                    continue
                w = [r for r in rows if r["d"] == d and r["correction"]]
                wo = [r for r in rows if r["d"] == d and (not r["correction"] or d == 0)]
                dw, dwo = ("—", "—") if d == 0 else (_paired(w, fedavg), _paired(wo, fedavg))
                out.append(f"| {d} | {d // k} | {_cell(w)} | {_cell(wo)} | {dw} | {dwo} | {_best(w)} | {_best(wo)} |"
                           + (f" {_recomputed(w)} | {_recomputed(wo)} |" if stats else ""))
    return "\n".join(out)


def _plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.momentum_state), figsize=(6 * len(args.momentum_state), 4), squeeze=False)
    for ax, state in zip(axes[0], args.momentum_state):
        for k in args.k:
            for corr, style in ((True, "-"), (False, "--")):
                pts = []
                for d in args.delays:
                    runs = _runs(results, state, k, d, corr)
                    if runs:
                        final = [r["acc"][-1] * 100 for r in runs]
                        pts.append((d, statistics.mean(final), statistics.stdev(final) if len(final) > 1 else 0))
                if pts:
                    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], ls=style,
                                marker="o", capsize=3, label=f"K={k}, {'with' if corr else 'without'} correction")
        title = f"momentum {'kept across rounds' if state == 'keep' else 'restarted each round'}{_settings(args)}"
        _label(ax, textwrap.fill(title, 80), "delay D (local iterations)", "final test accuracy (%)", legend_size=8)
    _save(fig, path)


def _runs(results: list[dict], state: str, k: int, d: int, corr: bool) -> list[dict]:
    """The runs of one cell: D = 0 (FedAvg) serves both correction columns."""
    return [r for r in results if r["state"] == state and r["k"] == k and r["d"] == d
            and (r["correction"] == corr or d == 0)]


def _label(ax, title: str, xlabel: str, ylabel: str, legend_size: int) -> None:  # noqa: ANN001
    ax.set_title(title, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(fig, path: Path) -> None:  # noqa: ANN001
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _plot_curves(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Test accuracy against local steps, mean over seeds, one line per (K, D, correction):
    where the runs part, not only where they end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for state in args.momentum_state:
        for k in args.k:
            for d in args.delays:
                for corr in ([True] if d == 0 else [True, False]):
                    runs = [r for r in _runs(results, state, k, d, corr) if "acc_round" in r]
                    if not runs:
                        continue
                    common = set.intersection(*(set(r["acc_round"]) for r in runs))
                    rounds = sorted(common)
                    mean = [statistics.mean(r["acc"][r["acc_round"].index(t)] * 100 for r in runs) for t in rounds]
                    label = f"K={k}, " + ("FedAvg (D=0)" if d == 0 else f"D={d} {'with' if corr else 'without'}")
                    ax.plot([t * k for t in rounds], mean, ls="-" if corr else "--", label=f"{label} ({len(runs)})")
    title = f"mean over seeds (runs in brackets){_settings(args)}"
    _label(ax, textwrap.fill(title, 90), "local steps", "test accuracy (%)", legend_size=7)
    _save(fig, path)


def _setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as TOML would (an int, float, bool or bare string)."""
    import tomllib

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="local steps per client in every run")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 5, 10, 15, 20], help="D in local iterations")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 5], help="local steps per round (D must divide by K)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--momentum-state", nargs="+", default=["keep", "restart"], choices=["keep", "restart"])
    ap.add_argument("--local-lr", type=float, default=None, help="client lr (default: the run config's, 0.05)")
    ap.add_argument("--momentum", type=float, default=None, help="client momentum (default 0.9)")
    ap.add_argument("--set", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                    help="another run-config key for every run, e.g. --set model=cnn-bn --set lr-schedule=cosine")
    ap.add_argument("--evaluate-every-steps", type=int, default=0, metavar="S",
                    help="the server evaluates every S local steps (evaluate-every = S / K rounds) and after "
                         "the last; 0 (default): after every round. A CNN on 32x32 images at K = 1 spends "
                         "most of its time evaluating otherwise")
    ap.add_argument("--warmup-steps", type=int, default=None, metavar="W",
                    help="the learning rate's linear warm-up in local steps (lr-warmup-rounds = W / K), so "
                         "one command runs every K with the same schedule")
    ap.add_argument("--correction", nargs="+", default=["with", "without"], choices=["with", "without"],
                    help="which columns to run for D > 0")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--plot", type=Path, help="final accuracy against D")
    ap.add_argument("--curves", type=Path, help="accuracy against local steps, mean over seeds, per D")
    ap.add_argument("--json", type=Path, help="write the runs here at the end (--out keeps them as they finish)")
    ap.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                    help="tabulate and plot the runs of earlier --json files (merged) instead of running; "
                         "--k, --delays and the other options say what to show")
    ap.add_argument("--out", type=Path, default=None,
                    help="keep the runs in this sweep directory (fededge sweep's layout); the same command "
                         "again finishes a stopped batch. Default: a temporary directory")
    args = ap.parse_args(argv)
    args.set = dict(args.set)
    if any(k < 1 for k in args.k) or args.steps < 1:
        ap.error("--k and --steps must be >= 1")
    if args.evaluate_every_steps < 0 or (args.warmup_steps is not None and args.warmup_steps < 0):
        ap.error("--evaluate-every-steps and --warmup-steps must be >= 0")
    t0 = time.perf_counter()
    if args.from_json:
        results = [r for f in args.from_json for r in json.loads(f.read_text())]
    else:
        results = _run_all(_specs(args), args.jobs, args.json, args.out)
    print(_tables(results, args))
    print(f"\n{len(results)} runs, " + (f"from {' '.join(map(str, args.from_json))}" if args.from_json
                                        else f"{time.perf_counter() - t0:.0f} s wall"))
    if args.plot:
        _plot(results, args, args.plot)
        print(f"plot: {args.plot}")
    if args.curves:
        _plot_curves(results, args, args.curves)
        print(f"curves: {args.curves}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
