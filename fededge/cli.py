"""The ``fededge`` command.

- ``fededge run [--num-clients N] [--run-config "k=v k2=v2"]``: the default Flower app in
  the in-process runtime (no SuperLink, no Ray): for quick experiments and sweeps.
  ``flwr run .`` runs the same ServerApp and ClientApp in Flower's simulation.
- ``fededge plot RUN_DIR [RUN_DIR ...] [-o out.png]``: compare runs (accuracy against
  round, simulated time and cumulative uplink bytes).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "parse_run_config"]

_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_run_config(text: str | None) -> dict[str, Any]:
    """Parse ``"k=v k2=v2"`` as ``flwr run --run-config`` does, or a ``.toml`` file.

    Values are TOML (``3``, ``0.1``, ``true``, ``"text"``); a bare word that is not
    valid TOML (``dataset=digits``) is taken as a string, a convenience Flower lacks.
    """
    if not text:
        return {}
    if text.endswith(".toml"):
        with open(text, "rb") as f:
            return tomllib.load(f)
    out: dict[str, Any] = {}
    consumed = _PAIR.sub("", text).strip()
    if consumed:
        raise ValueError(f"could not parse {consumed!r} in --run-config; write key=value pairs")
    for key, raw in _PAIR.findall(text):
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw.strip("'\"")
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    from fededge.config import ConfigError
    from fededge.server.inprocess import run_inprocess

    try:
        overrides = parse_run_config(args.run_config)
        run_dir = run_inprocess(overrides, num_clients=args.num_clients)
    except (ConfigError, ValueError) as err:
        print(f"fededge run: {err}", file=sys.stderr)
        return 2
    print(f"results: {run_dir}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from fededge.server.plot import plot_runs

    out = Path(args.output) if args.output else Path(args.run_dirs[0]) / "comparison.png"
    try:
        path = plot_runs(args.run_dirs, out, labels=args.labels, title=args.title)
    except (FileNotFoundError, ValueError) as err:
        print(f"fededge plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
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
    run.set_defaults(func=_cmd_run)

    plot = sub.add_parser("plot", help="compare runs in one PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("-o", "--output", help="PNG to write (default: RUN_DIR/comparison.png)")
    plot.add_argument("--labels", nargs="+", help="one legend label per run")
    plot.add_argument("--title")
    plot.set_defaults(func=_cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
