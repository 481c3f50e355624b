"""The ``fededge`` command.

- ``fededge run [--num-clients N] [--workers W] [--run-config "k=v k2=v2"]``: the default Flower app in
  the in-process runtime (no SuperLink, no Ray): for quick experiments and sweeps.
  ``flwr run .`` runs the same ServerApp and ClientApp in Flower's simulation.
- ``fededge simulate [--num-supernodes N] [--run-config ...]``: ``flwr run .`` in Flower's
  simulation runtime on a private local SuperLink, which it stops afterwards; exits
  non-zero when the run failed (``flwr run`` itself exits 0 either way).
- ``fededge resume RUN_DIR [--num-rounds N]``: continue a run (written with
  ``checkpoint-every``) from its newest intact checkpoint, in the runtime it ran in; its
  files go on as if it had never stopped.
- ``fededge netem profiles | show NAME | proxy ... | apply ... | clear ...``: link
  profiles and the network-emulation backends.
- ``fededge plot RUN_DIR [RUN_DIR ...] [-o out.png]``: compare runs (accuracy against
  round, simulated time and cumulative uplink bytes); ``fededge plot --sweep DIR``: a
  sweep's cells, mean ± sd over seeds.
- ``fededge replay RUN_DIR [--netem SPEC] [--netem-file F] [--compute-speed S] [--seed N]
  [--target ACC]``: a finished run re-timed under another network, without training again
  (:func:`fededge.analysis.replay.replay_sim_s`): each round's accuracy with its ``sim_s``
  as run and as replayed, and the time to ``--target``.
- ``fededge sweep --grid "strategy=fedavg,dga dga-delay=1,2" (or --cell "k=v ..." --cell ...) --seeds 0 1 2 [--run-config ...]
  [--out DIR] [--jobs N] [--baseline CELL]``: every combination times every seed, N runs
  at a time, and a table of mean ± sd and paired differences (``fededge.sweep``); the
  same command again finishes a killed sweep.
- ``fededge testbed up --clients N --profiles wifi:0.5,4g:0.5 [--shaping proxy|kernel|none]``,
  ``fededge testbed run --run-config ...``, ``fededge testbed status``, ``fededge testbed
  down``: a SuperLink and N SuperNodes, each in its own network namespace, on this
  machine (root; docs/deployment.md).
- ``fededge certs --out DIR --hosts superlink,127.0.0.1 [--supernodes N] [--days D]
  [--force]``: a CA, the SuperLink's TLS certificate and SuperNode authentication keys
  (docs/deployment.md).

A run that cannot work as configured (an unknown key, a data split the clients cannot
make) ends with one line, ``fededge: configuration error: ...``: with exit status 2 and
nothing started when ``fededge run`` or ``fededge simulate`` can tell up front, with 1
when the error comes from inside Flower's runtime (as from any failed run, whose line
is otherwise ``fededge: run failed: ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path
from typing import Any, Iterator, Sequence

from fededge.runconfig_text import format_run_config, parse_run_config

__all__ = ["main"]


def _workers(text: str) -> int | str:
    """``--workers``: ``auto`` or a count >= 1."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of processes >= 1, got {text!r}")
    return n


@contextlib.contextmanager
def _info_lines() -> Iterator[None]:
    """fededge's own INFO lines (the update plan, the runtime's choices, DGA's and
    gossip's settings, a move of the client states to disk) on stderr for one command,
    as ``[fededge] ...``: Python's default shows only warnings. Flower's lines are its own."""
    logger = logging.getLogger("fededge")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[fededge] %(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _cmd_run(args: argparse.Namespace) -> int:
    from fededge.config import ConfigError
    from fededge.server.experiment import NotEnoughNodesError, RoundFailedError
    from fededge.server.inprocess import run_inprocess

    try:
        overrides = parse_run_config(args.run_config)
        with _info_lines():
            run_dir = run_inprocess(overrides, num_clients=args.num_clients, workers=args.workers)
    except ConfigError as err:
        print(f"fededge: configuration error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"fededge run: {err}", file=sys.stderr)
        return 2
    except (RoundFailedError, NotEnoughNodesError) as err:
        print(f"fededge: run failed: {err}", file=sys.stderr)
        return 1
    print(f"results: {run_dir}")
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    import json

    from fededge.config import EARLIER_EFFECT, ConfigError
    from fededge.server.checkpoint import CheckpointError, checkpoint_files
    from fededge.server.experiment import NotEnoughNodesError, RoundFailedError
    from fededge.server.inprocess import run_inprocess
    from fededge.strategies.resume import ResumeError

    run_dir = Path(args.run_dir)
    try:
        meta = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"fededge resume: {run_dir} is not a fededge run directory ({err})", file=sys.stderr)
        return 2
    if not checkpoint_files(run_dir):
        print(f"fededge resume: {run_dir} has no checkpoint (checkpoints/round-*.ckpt): it wrote none before it "
              "stopped (checkpoint-every=0, or it stopped before its first checkpoint round); start it again",
              file=sys.stderr)
        return 2
    try:
        # a key the run's fededge did not have yet at the value that had its effect then
        lacked = {k: v for k, v in EARLIER_EFFECT.items() if k not in meta["config"]}
        overrides = {**lacked, **meta["config"], **parse_run_config(args.run_config)}
    except ValueError as err:
        print(f"fededge resume: {err}", file=sys.stderr)
        return 2
    if args.num_rounds is not None:
        overrides["num-rounds"] = args.num_rounds
    overrides["resume-from"] = str(run_dir.resolve())
    runtime = meta.get("runtime")
    if runtime == "inprocess":
        try:
            with _info_lines():
                # By default as many processes as the run had: with MKL's default mode a
                # matmul's last bits may depend on the process (PowerSGD's), so the same
                # count keeps the resumed run equal to the uninterrupted one.
                workers = args.workers if args.workers is not None else meta.get("inprocess_workers", 1)
                # and on the device device=auto chose for it (timing again could choose another)
                out = run_inprocess(overrides, num_clients=int(meta["inprocess_nodes"]), workers=workers,
                                    client_device=meta.get("inprocess_client_device"))
        except ConfigError as err:
            print(f"fededge: configuration error: {err}", file=sys.stderr)
            return 2
        except (CheckpointError, ResumeError) as err:
            print(f"fededge resume: {err}", file=sys.stderr)
            return 2
        except (RoundFailedError, NotEnoughNodesError) as err:
            print(f"fededge: run failed: {err}", file=sys.stderr)
            return 1
        print(f"results: {out}")
        return 0
    # Flower's simulation (fededge simulate, flwr run): the same app, resumed by its ServerApp,
    # on as many SuperNodes as the run had (another count splits the data otherwise).
    had = meta.get("flower_nodes")
    if args.num_supernodes is None:
        args.num_supernodes = int(had) if had else 10
    elif had and int(had) != args.num_supernodes:
        print(f"fededge resume: the run had {had} SuperNodes, not {args.num_supernodes}: its clients' data split "
              f"and the checkpoint's per-client state are for {had}; leave --num-supernodes out", file=sys.stderr)
        return 2
    # (TOML as the run config reads it: json.dumps wrote inf as Infinity, read back as a string)
    args.run_config = format_run_config(overrides)
    return _cmd_simulate(args)


def _fededge_app_config(app: str, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """The run config ``flwr run APP`` will hand fededge's ServerApp (the app's
    ``[tool.flwr.app.config]`` with ``overrides`` on top), or None when APP is not an app
    whose ServerApp is fededge's."""
    try:
        with open(Path(app) / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    flwr_app = project.get("tool", {}).get("flwr", {}).get("app", {})
    if flwr_app.get("components", {}).get("serverapp") != "fededge.server.app:app":
        return None
    return {**flwr_app.get("config", {}), **overrides}


def _simulation_preflight(app: str, overrides: dict[str, Any], num_supernodes: int) -> None:
    """Raise ConfigError, before anything starts, if fededge's app cannot run this config.

    The ServerApp runs the same checks inside the simulation (so that ``flwr run`` gets
    them too), but by then the SuperLink and Ray have started (tens of seconds) and
    Flower logs the error with a traceback. Here it costs the run config's parse and the
    clients' data split, once (exact: :func:`fededge.workload.check_partition`).
    """
    config = _fededge_app_config(app, overrides)
    if config is None:
        return
    from fededge.config import ConfigError, RunConfig, check_clients_available
    from fededge.workload import check_partition

    cfg = RunConfig.from_mapping(config)
    # (inside the simulation the ServerApp would wait round-timeout for the clients missing)
    check_clients_available(cfg, num_supernodes, where="the simulation", flag="--num-supernodes")
    try:
        check_partition(cfg, num_supernodes)
    except ConfigError:
        raise
    except (OSError, ValueError):
        # The data cannot be read from here (say, a data-dir relative to where the
        # simulation runs): the ServerApp checks the split inside the simulation.
        return


def _cmd_simulate(args: argparse.Namespace) -> int:
    import tempfile

    from fededge.config import ConfigError
    from fededge.deploy.launch import flwr_run_local

    try:
        overrides = parse_run_config(args.run_config)
    except ValueError as err:
        print(f"fededge simulate: {err}", file=sys.stderr)
        return 2
    try:
        _simulation_preflight(args.app, overrides, args.num_supernodes)
    except ConfigError as err:
        print(f"fededge: configuration error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fededge-flwr-home-") as home:
        run = flwr_run_local(
            args.app, flwr_home=home, run_config=overrides, num_supernodes=args.num_supernodes,
            cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
            timeout_s=args.timeout, echo=sys.stdout,
        )
    print(f"[fededge] flwr run: exit {run.returncode}, run status {run.status}, "
          f"{run.wall_s:.1f} s; local SuperLink stopped")
    if run.leftover_pids:
        print(f"[fededge] warning: processes still alive: {run.leftover_pids}", file=sys.stderr)
    failure = run.failure()
    if failure:
        print(f"fededge: {failure}", file=sys.stderr)
    return 0 if run.ok else 1


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fededge.sweep import SweepRunsFailed, format_table, parse_grid, plan, run_sweep

    out = Path(args.out) if args.out else Path("results") / time.strftime("sweep-%Y%m%d-%H%M%S")
    try:
        cells = [parse_run_config(c) for c in args.cell] if args.cell else None
        sweep = plan(out, parse_grid(args.grid or ""), args.seeds, base=parse_run_config(args.run_config),
                     num_clients=args.num_clients, cells=cells)
        result = run_sweep(sweep, jobs=args.jobs, baseline=args.baseline)
    except KeyboardInterrupt:
        print(f"fededge sweep: interrupted; the same command again finishes it (--out {out})", file=sys.stderr)
        return 130
    except SweepRunsFailed as err:
        print(f"fededge sweep: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # SweepError, ConfigError: nothing was run
        print(f"fededge sweep: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"table: {out / 'sweep.json'}, {out / 'sweep.csv'}; plot it with: fededge plot --sweep {out}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from fededge.analysis.replay import load_rounds, replay_sim_s

    try:
        again = replay_sim_s(args.run_dir, netem=args.netem, netem_file=args.netem_file,
                             compute_speed=args.compute_speed, seed=args.seed)
        _, lines = load_rounds(args.run_dir)
    except (OSError, ValueError) as err:  # (ProfileError is a ValueError)
        print(f"fededge replay: {err}", file=sys.stderr)
        return 2
    under = " ".join(f"{k}={v}" for k, v in (("netem", args.netem), ("netem-file", args.netem_file),
                                                ("compute-speed", args.compute_speed), ("seed", args.seed))
                     if v is not None) or "the run's own network"
    print(f"{args.run_dir}: re-timed under {under}")
    print(f"{'round':>5} {'accuracy':>8} {'sim_s as run':>12} {'replayed':>10}")
    for r, s in zip(lines, again):
        acc = "—" if r.get("accuracy") is None else f"{r['accuracy']:.4f}"
        print(f"{r['round']:>5} {acc:>8} {r['sim_s']:>12.2f} {s:>10.2f}")
    if args.target is not None:
        def reached(times: list[float]) -> str:
            hit = next((t for r, t in zip(lines, times) if r.get("accuracy") is not None
                        and r["accuracy"] >= args.target), None)
            return "not reached" if hit is None else f"{hit:.2f} s"
        print(f"time to accuracy {args.target:g}: {reached([r['sim_s'] for r in lines])} as run, "
              f"{reached(again)} replayed")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from fededge.analysis.plot import plot_runs, plot_sweep

    if args.sweep:
        if args.run_dirs:
            print("fededge plot: give run directories or --sweep DIR, not both", file=sys.stderr)
            return 2
        try:
            path = plot_sweep(args.sweep, args.output, title=args.title)
        except (FileNotFoundError, ValueError) as err:
            print(f"fededge plot: {err}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    if not args.run_dirs:
        hint = (" (--labels took every word after it: put the run directories before --labels)"
                if args.labels else "")
        print(f"fededge plot: give one or more run directories (or --sweep DIR){hint}", file=sys.stderr)
        return 2

    out = Path(args.output) if args.output else Path(args.run_dirs[0]) / "comparison.png"
    try:
        path = plot_runs(args.run_dirs, out, labels=args.labels, title=args.title)
    except (FileNotFoundError, ValueError) as err:
        print(f"fededge plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from fededge.deploy.certs import CertError, generate_certs

    try:
        bundle = generate_certs(args.out, hosts=args.hosts, supernodes=args.supernodes,
                                days=args.days, force=args.force)
    except CertError as err:
        print(f"fededge certs: {err}", file=sys.stderr)
        return 2
    for path in bundle.files:
        print(f"{path.stat().st_mode & 0o777:04o}  {path}")
    print(f"server certificate SANs: {', '.join(bundle.hosts)}")
    print(f"SuperLink: --ssl-ca-certfile {bundle.ca_cert} --ssl-certfile {bundle.server_cert} "
          f"--ssl-keyfile {bundle.server_key}")
    if bundle.supernode_keys:
        priv, pub = bundle.supernode_keys[0]
        print(f"SuperNode 0: flwr supernode register {pub} CONNECTION; flower-supernode "
              f"--root-certificates {bundle.ca_cert} --auth-supernode-private-key {priv} ...")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fededge", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the Flower app in-process (no SuperLink, no Ray)")
    run.add_argument("--num-clients", type=int, default=10, help="number of simulated nodes")
    run.add_argument(
        "--run-config", default=None,
        help='overrides, as for flwr run: "num-rounds=5 alpha=0.1" or a .toml file',
    )
    run.add_argument("--workers", type=_workers, default="auto",
                     help="processes running the clients (this one included; results do not depend on it, but for "
                          "the last bits of PowerSGD's matmuls under MKL's default mode: README); auto (the "
                          "default): every usable core, up to the clients of a round, and one process for CUDA "
                          "clients or cohort=true (the run's first line says which)")
    run.set_defaults(func=_cmd_run)

    sim = sub.add_parser("simulate", help="flwr run the app in Flower's simulation, then clean up")
    sim.add_argument("app", nargs="?", default=".", help="Flower app directory (default: .)")
    sim.add_argument("--num-supernodes", type=int, default=10)
    sim.add_argument("--cpus-per-client", type=float, default=1.0,
                     help="Ray CPUs per client (Flower's default 2 runs one client at a time on 2 cores)")
    sim.add_argument("--gpus-per-client", type=float, default=0.0,
                     help="fraction of a GPU per client, e.g. 0.25 for four clients per GPU")
    sim.add_argument("--run-config", default=None, help='overrides: "num-rounds=5 alpha=0.1"')
    sim.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is killed")
    sim.set_defaults(func=_cmd_simulate)

    resume = sub.add_parser("resume", help="continue a run from its newest intact checkpoint")
    resume.add_argument("run_dir", metavar="RUN_DIR")
    resume.add_argument("--num-rounds", type=int, default=None, help="run to this many rounds in all "
                        "(default: the run's own num-rounds)")
    resume.add_argument("--run-config", default=None, help="overrides of the keys a resumed run may change "
                        '(num-rounds, progress, checkpoint-every, ...): "progress=\'off\'"')
    resume.add_argument("--workers", type=_workers, default=None,
                        help="for an in-process run: processes running the clients (default: as many as the run "
                             "had; auto or a count, as for fededge run)")
    resume.add_argument("app", nargs="?", default=".", help="Flower app directory, for a run in Flower's simulation")
    resume.add_argument("--num-supernodes", type=int, default=None,
                        help="for a run in Flower's simulation (default: as many as it had)")
    resume.add_argument("--cpus-per-client", type=float, default=1.0, help=argparse.SUPPRESS)
    resume.add_argument("--gpus-per-client", type=float, default=0.0, help=argparse.SUPPRESS)
    resume.add_argument("--timeout", type=float, default=3600.0, help="seconds before a simulation is killed")
    resume.set_defaults(func=_cmd_resume)

    from fededge.netem.cli import register as register_netem

    register_netem(sub)

    from fededge.deploy.testbed import register_cli as register_testbed

    register_testbed(sub)

    sweep = sub.add_parser("sweep", help="a grid of run-config values x seeds, N runs at a time, one table")
    cells = sweep.add_mutually_exclusive_group(required=True)
    cells.add_argument("--grid", help='"key=v1,v2 key2=a,b": every combination is a cell (quote a value with a comma)')
    cells.add_argument("--cell", action="append", metavar='"k=v k2=v2"',
                       help="one cell, as --run-config writes it; repeat for each (in place of --grid)")
    sweep.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of every cell (default: 0)")
    sweep.add_argument("--run-config", default=None, help='the other keys of every run: "num-rounds=30"')
    sweep.add_argument("--out", default=None, help="sweep directory (default: results/sweep-<date>-<time>); "
                       "the same --out again finishes a killed sweep")
    sweep.add_argument("--jobs", type=int, default=0, help="runs at a time (default: one per core)")
    sweep.add_argument("--num-clients", type=int, default=10, help="simulated nodes of each run")
    sweep.add_argument("--baseline", default=None,
                       help='the cell the paired differences are taken from, as the table names it '
                            '("strategy=fedavg"; default: the first)')
    sweep.set_defaults(func=_cmd_sweep)

    rp = sub.add_parser("replay", help="re-time a finished run under another network, without training again")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--netem", help="link profile or mix (default: the run's own)")
    rp.add_argument("--netem-file", help="TOML file of profiles (with --netem file: its [assign] table)")
    rp.add_argument("--compute-speed", help="devices' compute speed (default: the run's own)")
    rp.add_argument("--seed", type=int, help="the clock's seed (default: the run's own)")
    rp.add_argument("--target", type=float, help="also print the time to this accuracy, as run and replayed")
    rp.set_defaults(func=_cmd_replay)

    plot = sub.add_parser("plot", help="compare runs in one PNG")
    plot.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    plot.add_argument("--sweep", metavar="DIR", help="draw a fededge sweep's cells (its --out directory)")
    plot.add_argument("-o", "--output", help="PNG to write (default: RUN_DIR/comparison.png)")
    plot.add_argument("--labels", nargs="+", help="one legend label per run")
    plot.add_argument("--title")
    plot.set_defaults(func=_cmd_plot)

    certs = sub.add_parser("certs", help="a CA, the SuperLink's TLS certificate and SuperNode keys")
    certs.add_argument("--out", required=True, help="directory to write into (made when missing)")
    certs.add_argument("--hosts", required=True,
                       help="comma-separated names and IPs the SuperLink is dialled by, e.g. superlink,127.0.0.1")
    certs.add_argument("--supernodes", type=int, default=0,
                       help="number of SuperNode authentication key pairs (EC P-256, OpenSSH format)")
    certs.add_argument("--days", type=int, default=365, help="validity of the CA and server certificate")
    certs.add_argument("--force", action="store_true", help="replace existing files (all of them)")
    certs.set_defaults(func=_cmd_certs)

    # Listed for --help; main() hands its arguments to fededge.clients.supernode untouched,
    # since all but a few are flower-supernode's.
    sub.add_parser("supernode", add_help=False,
                   help="a warm fededge worker and flower-supernode ARGS, started and stopped together")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["supernode"]:
        from fededge.clients.supernode import main as supernode_main

        return supernode_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
