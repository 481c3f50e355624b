"""Re-time a finished run under another network, without training again.

Training does not depend on the emulated network: the simulated clock only turns what
each client did (its measured compute, the bytes it received and sent, recorded per round
in ``metrics.jsonl`` under ``clients``) into time. :func:`replay_sim_s` runs that record
through a fresh clock for another ``netem`` / ``compute-speed`` setting, with the same
rules as the run itself: synchronous rounds, or DGA's overlap for a DGA run. Replaying
a run under its own setting reproduces its ``sim_s``.

What the run's clock was is read from the ``clock`` entry that
:class:`~fededge.server.experiment.Experiment` writes into ``config.json`` (so the run of a
user's own app, whose run config has none of fededge's keys, replays too), and the
strategy from its ``strategy_class`` entry (DGA's delay from its rounds' ``dga_delay``).
Run directories written before those entries existed are read by fededge's run-config
keys (``netem``, ``compute-speed``, ``strategy``, ``dga-delay``, ...), as before.

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
    if not (run_dir / "config.json").is_file():
        inside = sorted(p.name for p in run_dir.iterdir() if (p / "config.json").is_file()) if run_dir.is_dir() else []
        raise ValueError(f"{run_dir} is not a run directory (no config.json)"
                         + (f"; the runs in it: {', '.join(inside[:5])}" if inside else ""))
    config = json.loads((run_dir / "config.json").read_text())
    text = (run_dir / "metrics.jsonl").read_text()
    raw = [x for x in text.splitlines() if x.strip()]
    if raw and not text.endswith("\n"):
        try:
            json.loads(raw[-1])
        except json.JSONDecodeError:  # the last line cut short by a kill: as resume and plot, left out
            raw = raw[:-1]
    return config, [json.loads(x) for x in raw]


#: Strategies (by ``config.json``'s ``strategy_class``) whose rounds are not synchronous.
_KINDS = {
    "fededge.strategies.dga.DGA": "dga",
    "fededge.strategies.gossip.Gossip": "gossip",
    "fededge.strategies.fedasync.FedAsync": "fedasync",
    "fededge.strategies.fedbuff.FedBuff": "fedbuff",
    "fededge.strategies.ssp.SSP": "ssp",
    "fededge.strategies.asyncloop.AsyncFL": "async",
    "fededge.strategies.backup.BackupWorkers": "backup",
}


def _kind(config: dict, cfg: dict) -> str | None:
    """What times the run's rounds: ``dga``, ``gossip``, an asynchronous strategy's name, or
    None (synchronous rounds)."""
    if "strategy_class" in config:
        return _KINDS.get(config["strategy_class"])
    return cfg.get("strategy")  # a run dir from before the class was recorded: fededge's own key


def _clock(config: dict, cfg: dict) -> dict:
    """The run's clock settings, kebab-case: Experiment's ``clock`` entry, or the run-config
    keys of a run dir from before it was written."""
    clock = config.get("clock")
    if clock is None:
        clock = {k: cfg[k] for k in ("netem", "netem-file", "compute-speed", "seed", "sim-step-s", "message-overhead-s")
                 if k in cfg}
    return {"netem": "", "netem-file": "", "compute-speed": "1.0", "seed": 0, "sim-step-s": 0.0,
            "message-overhead-s": 0.0, "nodes-pull": False, "timeout": cfg.get("round-timeout", 3600.0),
            **{k: v for k, v in clock.items() if v is not None}}


def _dga_config(cfg: dict, lines: list[dict]) -> DGAConfig:
    """DGA's delay and warm-up as the rounds recorded them (``dga_delay``: 0 during the
    warm-up, D after it; the correction does not change the timing), else by fededge's
    run-config keys."""
    delays = [int(r["dga_delay"]) for r in sorted(lines, key=lambda r: r["round"])
              if r["round"] >= 1 and r.get("dga_delay") is not None]
    if not delays:
        return DGAConfig(delay=int(cfg.get("dga-delay", 0)), correction=bool(cfg.get("dga-correction", True)),
                         warmup_rounds=int(cfg.get("dga-warmup-rounds", 0)))
    delay = max(delays)
    warmup = next((i for i, d in enumerate(delays) if d == delay), 0) if delay > 0 else 0
    return DGAConfig(delay=delay, warmup_rounds=warmup)


def replay_sim_s(run_dir: str | Path, *, netem: str | None = None, compute_speed: str | None = None,
                 netem_file: str | None = None, seed: int | None = None) -> list[float]:
    """Cumulative ``sim_s`` after each recorded round (round 0 included) under the given
    network; arguments left as None keep the run's own."""
    config, lines = load_rounds(run_dir)
    cfg = config.get("config", config)
    kind = _kind(config, cfg)
    if kind is None and any(r.get("self_timed") for r in lines):
        # A strategy that times its own rounds (a DGA subclass, a user's own) re-timed as
        # synchronous rounds gave other numbers without a word.
        raise ValueError(f"{run_dir}: its strategy ({config.get('strategy_class', cfg.get('strategy'))}) times its "
                         "own rounds, which replay does not know how to do again (it knows synchronous rounds "
                         f"and DGA's); run it again with the other netem")
    if kind in ("fedasync", "fedbuff", "ssp", "async", "backup"):
        raise ValueError(f"{run_dir}: {kind} runs cannot be replayed under another network: "
                         "which update arrives first, and so what is aggregated, depends on the "
                         "network; run it again with the other netem")
    if kind == "gossip":
        raise ValueError(f"{run_dir}: gossip runs cannot be replayed yet (their clock is per edge, "
                         "fededge.algorithms.gossip.GossipTimeline, and their per-client upload "
                         "includes evaluation copies); re-run with the other netem setting")
    missing = [r["round"] for r in lines if r["round"] >= 1 and "clients" not in r]
    if missing:
        raise ValueError(f"{run_dir}: rounds {missing[:5]} have no per-client record ('clients'); "
                         "runs made before fededge recorded it cannot be replayed")
    clock_cfg = _clock(config, cfg)
    seed = int(clock_cfg["seed"]) if seed is None else seed
    n = 1 + max((c["partition"] for r in lines for c in r.get("clients", [])), default=0)
    netem_json = Path(run_dir) / "netem.json"
    if netem_json.exists():  # the run's clock knew every partition, not only those that replied
        n = max(n, len(json.loads(netem_json.read_text())["clients"]))
    links = assign_links(clock_cfg["netem"] if netem is None else netem, n,
                         seed=seed,
                         netem_file=clock_cfg["netem-file"] if netem_file is None else netem_file,
                         speed=clock_cfg["compute-speed"] if compute_speed is None else compute_speed,
                         message_overhead_s=float(clock_cfg["message-overhead-s"]),
                         pulls=bool(clock_cfg["nodes-pull"]))
    clock = SimClock(links, seed=seed)
    timeline = None
    if kind == "dga":
        timeline = DGATimeline(clock, _dga_config(cfg, lines), clients=range(n))
    # The run's clock charged sim-step-s per local step, when set, not the measured compute:
    # the steps each client reported (recorded), else, in older run dirs, local-steps.
    steps, step_s = int(cfg.get("local-steps", 1)), float(clock_cfg["sim-step-s"])
    timeout = float(clock_cfg["timeout"])
    out, total = [], 0.0
    for r in lines:
        if r["round"] >= 1:
            if timeline is not None:
                work = [ClientRound(c["partition"], c["bytes_down"], _compute_s(c, steps, step_s), c["bytes_up"])
                        for c in r.get("clients", [])]
                before = timeline.ready[r["round"] - 1]
                # As the run sent it (compute-ahead previews), where the line recorded it
                preview = r.get("dga_from_preview")
                total += timeline.run_round(r["round"], work, ahead=r.get("dga_ahead"),
                                            from_preview=None if preview is None else set(preview),
                                            wait_s=r.get("dga_waited_s")) - before
            else:
                # As the run's clock: the training, the second exchange (norm-stats=global's
                # queries), the clients' evaluation, one after the other; a node that never
                # answered held the round until the timeout.
                duration = 0.0
                for key in ("clients", "clients_followup", "clients_evaluate"):
                    work = [ClientRound(c["partition"], c["bytes_down"],  # (no local steps after the training)
                                        _compute_s(c if key == "clients" else {**c, "steps": 0}, steps, step_s),
                                        c["bytes_up"])
                            for c in r.get(key, [])]
                    if work:
                        duration += synchronous_round(clock, work).duration
                # (the timeout the round ran with: a resumed run may have changed it)
                total += max(duration, float(r.get("round_timeout", timeout))) if r.get("dropped") else duration
        out.append(total)
    return out


def _compute_s(client: dict, local_steps: int, step_s: float) -> float:
    """A client's recorded compute on the clock (:meth:`RunClock.compute_s
    <fededge.netem.runclock.RunClock.compute_s>`): per step when it reported its steps
    (``steps``: null when it reported none), else as measured."""
    if "steps" not in client:  # recorded before the steps were
        return clock_compute_s(client["compute_s"], local_steps, step_s)
    steps = client["steps"]
    return client["compute_s"] if steps is None else clock_compute_s(client["compute_s"], int(steps), step_s)
