"""fededge's own run: its run config turned into a measured :class:`~fededge.server.experiment.Experiment`.

:func:`run_experiment` is what fededge's ServerApp calls. It reads nothing the library
pieces read themselves: it parses nothing (``RunConfig`` is parsed once by the app), it
builds the data set, the evaluate function, the seeded initial model and the strategy
(:mod:`fededge.strategies.registry`), and hands them to
:class:`fededge.server.experiment.Experiment`, which meters, times and records the run for
fededge exactly as it would for any other Flower app.

Before round 1, in simulation, the server makes the clients' data split once itself
(:func:`check_data_split`): a split that cannot work stops the run with one
:class:`~fededge.config.ConfigError` instead of failing every client of every round.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.arrays import record_to_torch
from fededge.clients.device import resolve_device, set_cuda_determinism
from fededge.clients.train import evaluate
from fededge.compress.plan import UpdatePlan
from fededge.config import ConfigError, RunConfig, saved_run_config
from fededge.models.zoo import count_parameters
from fededge.server.grid import InProcessGrid
from fededge.server.experiment import (
    RESUME_MAY_CHANGE, Experiment, ExperimentResult, NotEnoughNodesError, RoundFailedError, seeded_sampling, wait_for_nodes,
)
from fededge.netem.runclock import ClockConfig
from fededge.server.results import ResultsConfig, new_run_id
from fededge.strategies.registry import build_strategy
from fededge.wrapping import innermost
from fededge.workload import check_partition, dataset_for, model_for

__all__ = [
    "ExperimentResult", "NotEnoughNodesError", "RoundFailedError", "check_data_split", "check_resumable", "run_experiment",
    "seeded_sampling", "simulated_data_splits", "train_config", "wait_for_nodes",
]

log = logging.getLogger("fededge")


def simulated_data_splits(grid: Grid, timeout_s: float) -> list[tuple[int, str | None]]:
    """The ``(num-partitions, data-dir)`` splits a simulation's clients will make; [] elsewhere.

    fededge's in-process grid holds every node's config. Flower's simulation hands the
    ServerApp no node configs, and its nodes register while the ServerApp starts, so
    counting them could come too early: one node is asked instead, with a ``query``
    message to fededge's ClientApp (:func:`fededge.clients.app.node_info`; not metered,
    it is no part of training). No answer, or a ClientApp without that handler, leaves
    the check to the clients. In a deployment each node has its own node config and
    may have its own data, so the server does not guess: a client that cannot make its
    split replies with a named configuration error, which stops the run
    (:func:`fededge.clients.mods.config_error_mod`).
    """
    inner = innermost(grid)
    if isinstance(inner, InProcessGrid):
        return inner.data_splits()
    if not fi.is_flower_simulation(inner):
        return []
    node = next(iter(inner.get_node_ids()), None)
    if node is None:
        return []
    msg = Message(RecordDict(), node, MessageType.QUERY, group_id="fededge-node-info")
    replies = list(inner.send_and_receive([msg], timeout=timeout_s))
    if not replies or replies[0].has_error() or keys.METRICS not in replies[0].content:
        log.debug("no node config from node %d (%s); the clients check their own split", node,
                  replies[0].error.reason if replies and replies[0].has_error() else "no usable reply")
        return []
    metrics = replies[0].content[keys.METRICS]
    if keys.REPLY_NUM_PARTITIONS not in metrics:
        return []
    return [(int(metrics[keys.REPLY_NUM_PARTITIONS]), None)]


def check_data_split(grid: Grid, cfg: RunConfig) -> float:
    """In simulation, make the clients' data split once on the server; return its seconds.

    Raises :class:`~fededge.config.ConfigError` (naming ``min-partition-size``, ``alpha``,
    the sample count and the number of clients) when the clients could not make it:
    exactly when, since it is the clients' own seeded partition
    (:func:`fededge.workload.check_partition`). Without this, every client of round 1
    would compute the same split only to fail, and the run would stop on a generic
    "no client update could be used".
    """
    t0 = time.perf_counter()
    for num_partitions, data_dir in simulated_data_splits(grid, cfg.round_timeout):
        check_partition(cfg, num_partitions, data_dir)
    return time.perf_counter() - t0


def train_config(cfg: RunConfig) -> ConfigRecord:
    """What the server sends with every train message (the strategy adds the round).

    With an lr schedule (``lr-schedule`` other than ``constant``, or ``lr-warmup-rounds``)
    it also carries the schedule and ``num-rounds``; each client computes its round's rate
    from them and ``server-round`` (:func:`fededge.clients.app.round_lr`). Without one the
    config is what it always was, byte for byte.
    """
    config = ConfigRecord({
        keys.LOCAL_STEPS: cfg.local_steps,
        keys.LOCAL_LR: cfg.local_lr,
        keys.MOMENTUM: cfg.momentum,
        keys.WEIGHT_DECAY: cfg.weight_decay,
        keys.BATCH_SIZE: cfg.batch_size,
    })
    if cfg.lr_schedule != "constant" or cfg.lr_warmup_rounds:
        config[keys.LR_SCHEDULE] = cfg.lr_schedule
        config[keys.LR_WARMUP_ROUNDS] = cfg.lr_warmup_rounds
        config[keys.NUM_ROUNDS] = cfg.num_rounds
    return config


def run_experiment(
    grid: Grid,
    cfg: RunConfig,
    *,
    run_id: str | None = None,
    runtime: str = "flower",
    strategy: Strategy | None = None,
) -> ExperimentResult:
    """Train for ``cfg.num_rounds`` rounds and write ``<results-dir>/<run-id>/``.

    fededge's app as the first user of the library: the run config, parsed once, becomes
    a test set and an evaluate function, a seeded initial model, a strategy
    (:func:`~fededge.strategies.registry.build_strategy`) and an
    :class:`~fededge.server.experiment.Experiment`, which runs it.

    Parameters
    ----------
    grid : Grid
        Flower's grid (simulation or deployment) or fededge's in-process grid.
    cfg : RunConfig
        The validated run config.
    run_id : str, optional
        Name of the run directory (default: timestamp and pid).
    runtime : str
        Recorded in config.json (``flower-simulation``, ``inprocess``, ...).
    strategy : Strategy, optional
        A strategy to use, as it is, instead of the one ``cfg.strategy`` names.

    Examples
    --------
    >>> res = run_experiment(grid, RunConfig.from_mapping(context.run_config))  # doctest: +SKIP
    """
    device = resolve_device(cfg.server_device)
    set_cuda_determinism(device, cfg.deterministic)
    ds = dataset_for(cfg)
    x_test, y_test = ds.x_test.to(device), ds.y_test.to(device)
    model = model_for(cfg, ds).to(device)
    initial = ArrayRecord(model.state_dict())
    strategy = strategy or build_strategy(cfg)

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(record_to_torch(arrays, copy=False))  # copies them
        loss, acc = evaluate(model, x_test, y_test)
        return MetricRecord({"accuracy": acc, "loss": loss})

    needed = cfg.clients_per_round if isinstance(cfg.clients_per_round, int) else 1
    plan = UpdatePlan.build(cfg.update_config(), model.state_dict())
    if plan.entries:  # printed once; the whole plan, tensor by tensor, is in config.json
        plan.log(log)
    experiment = Experiment(
        evaluate_fn=evaluate_fn, run_id=run_id or new_run_id(cfg.run_name), seed=cfg.seed,
        results=cfg.owned(ResultsConfig), clock=cfg.owned(ClockConfig),
        min_nodes=max(needed, cfg.min_available_nodes), config=cfg.to_mapping(),
        metadata={"device": str(device), "runtime": runtime, "model_parameters": count_parameters(model),
                  **({"inprocess_nodes": len(list(grid.get_node_ids())), "inprocess_workers": grid.workers,
                      "inprocess_client_device": grid.client_device, "inprocess_runtime": grid.runtime_note}
                     if isinstance(grid, InProcessGrid) else
                     # (Flower's simulation registers its nodes before the ServerApp starts:
                     # `fededge resume` restarts it with as many, the data split the same)
                     {"flower_nodes": len(list(grid.get_node_ids()))}),
                  "train_examples": len(ds.x_train), "test_examples": len(ds.x_test),
                  **({"update_plan": plan.as_json()} if plan.entries else {})},
        title=f"{cfg.strategy}, {cfg.model} on {cfg.dataset} ({cfg.partition}), device {device}"
              + (f"; in-process, {grid.runtime_note}" if isinstance(grid, InProcessGrid) else ""),
    )

    def before_start(g: Grid) -> None:
        log.debug("the clients' data split checked in %.3f s", check_data_split(g, cfg))

    resume_from = None
    if cfg.resume_from:
        resume_from = Path(cfg.resume_from)
        check_resumable(resume_from, cfg)
    return experiment.run(strategy, grid, initial_arrays=initial, num_rounds=cfg.num_rounds,
                          timeout=cfg.round_timeout, train_config=train_config(cfg), before_start=before_start,
                          resume_from=resume_from)


def check_resumable(run_dir: Path, cfg: RunConfig) -> None:
    """Raise :class:`~fededge.config.ConfigError` unless ``cfg`` may resume ``run_dir``:
    a run directory fededge wrote, whose run config equals ``cfg``'s but for the keys of
    :data:`~fededge.server.experiment.RESUME_MAY_CHANGE`; each other difference is named."""
    meta_path = run_dir / "config.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"resume-from={str(run_dir)!r}: {meta_path} cannot be read ({err}); give the "
                          "directory of a run fededge wrote") from err
    # A key the run's fededge did not have yet (lr-schedule, ...) had its default's effect,
    # or the effect EARLIER_EFFECT names (dgc-warmup-epochs: 0).
    saved, now = saved_run_config(meta.get("config", {})), cfg.to_mapping()
    differ = sorted(k for k in set(saved) | set(now)
                    if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k))
    if cfg.lr_schedule != "constant" and "num-rounds" in saved and saved["num-rounds"] != cfg.num_rounds:
        raise ConfigError(
            f"resume-from={str(run_dir)!r}: num-rounds={cfg.num_rounds} but the run had {saved['num-rounds']}, and "
            f"lr-schedule={cfg.lr_schedule!r} is laid over num-rounds, so the rounds left would follow another "
            f"curve than those done; resume with num-rounds={saved['num-rounds']}, or start a new run")
    if differ:
        shown = ", ".join(f"{k}={now.get(k)!r} (the run had {saved.get(k)!r})" for k in differ[:5])
        raise ConfigError(
            f"resume-from={str(run_dir)!r}: the run config differs from the run's in what a round computes: "
            f"{shown}{' ...' if len(differ) > 5 else ''}; resume with the run's own values (fededge resume reads "
            f"them from {meta_path}), or start a new run")
