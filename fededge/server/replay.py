"""Re-time a finished run under another network, without training again.

Training does not depend on the emulated network: the simulated clock only turns what
each client did (its measured compute, the bytes it received and sent, recorded per round
in ``metrics.jsonl`` under ``clients``) into time. :func:`replay_sim_s` runs that record
through a fresh clock for another ``netem`` / ``compute-speed`` setting, with the same
rules as the run itself: synchronous rounds, or DGA's overlap for ``strategy="dga"``. Replaying
a run under its own setting reproduces its ``sim_s``.

Pure: no Flower.
"""

from __future__ import annotations

import json
from pathlib import Path

from fededge.algorithms.dga import DGAConfig, DGATimeline
from fededge.netem.assign import assign_links
from fededge.netem.clock import ClientRound, SimClock, clock_compute_s, synchronous_round

__all__ = ["load_rounds", "replay_sim_s"]


def load_rounds(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """The run's ``config.json`` and its ``metrics.jsonl`` lines."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return config, lines


def replay_sim_s(run_dir: str | Path, *, netem: str | None = None, compute_speed: str | None = None,
                 netem_file: str | None = None, seed: int | None = None) -> list[float]:
    """Cumulative ``sim_s`` after each recorded round (round 0 included) under the given
    network; arguments left as None keep the run's own."""
    config, lines = load_rounds(run_dir)
    cfg = config.get("config", config)
    if cfg.get("strategy") in ("fedasync", "fedbuff", "ssp", "backup"):
        raise ValueError(f"{run_dir}: {cfg['strategy']} runs cannot be replayed under another network: "
                         "which update arrives first, and so what is aggregated, depends on the "
                         "network; run it again with the other netem")
    if cfg.get("strategy") == "gossip":
        raise ValueError(f"{run_dir}: gossip runs cannot be replayed yet (their clock is per edge, "
                         "fededge.algorithms.gossip.GossipTimeline, and their per-client upload "
                         "includes evaluation copies); re-run with the other netem setting")
    missing = [r["round"] for r in lines if r["round"] >= 1 and "clients" not in r]
    if missing:
        raise ValueError(f"{run_dir}: rounds {missing[:5]} have no per-client record ('clients'); "
                         "runs made before fededge recorded it cannot be replayed")
    seed = int(cfg.get("seed", 0)) if seed is None else seed
    n = 1 + max((c["partition"] for r in lines for c in r.get("clients", [])), default=0)
    netem_json = Path(run_dir) / "netem.json"
    if netem_json.exists():  # the run's clock knew every partition, not only those that replied
        n = max(n, len(json.loads(netem_json.read_text())["clients"]))
    links = assign_links(cfg.get("netem", "") if netem is None else netem, n,
                         seed=seed,
                         netem_file=cfg.get("netem-file", "") if netem_file is None else netem_file,
                         speed=cfg.get("compute-speed", "1.0") if compute_speed is None else compute_speed)
    clock = SimClock(links, seed=seed)
    timeline = None
    if cfg.get("strategy") == "dga":
        dga = DGAConfig(delay=int(cfg.get("dga-delay", 0)), correction=bool(cfg.get("dga-correction", True)),
                        warmup_rounds=int(cfg.get("dga-warmup-rounds", 0)))
        timeline = DGATimeline(clock, dga, clients=range(n))
    # The run's clock charged sim-step-s per local step, when set, not the measured compute.
    steps, step_s = int(cfg.get("local-steps", 1)), float(cfg.get("sim-step-s", 0.0))
    out, total = [], 0.0
    for r in lines:
        work = [ClientRound(c["partition"], c["bytes_down"], clock_compute_s(c["compute_s"], steps, step_s),
                            c["bytes_up"])
                for c in r.get("clients", [])]
        if r["round"] >= 1:
            if timeline is not None:
                before = timeline.ready[r["round"] - 1]
                total += timeline.run_round(r["round"], work) - before
            elif work:
                total += synchronous_round(clock, work).duration
        out.append(total)
    return out
