"""Measure any Flower strategy's run, inside any ServerApp: :class:`Experiment`.

Around Flower's own ``Strategy.start`` (fededge writes no second round loop) an
:class:`Experiment` adds

- a :class:`~fededge.server.metering.MeteredGrid`: the serialised bytes of every message,
  per round (``bytes_up``, ``bytes_down``);
- the simulated clock (:class:`~fededge.netem.runclock.RunClock`): each round's duration
  under a network profile and device speeds (``sim_s``);
- its ``evaluate_fn`` after every round, and one line of ``metrics.jsonl`` with the
  round's figures, then ``summary.json`` (rounds, time and bytes to a target accuracy),
  ``config.json``, ``netem.json`` and optionally ``model.pt``: a run directory that
  ``fededge plot`` reads;
- the progress display (a live bar on a terminal, one line per round elsewhere) and one
  line per client problem: "a client failed" (its ClientApp raised; an error reply) or
  "... was rejected" (its reply arrived but could not be used).

It works with any strategy: Flower's (FedAvg, FedAdam, ...), fededge's, or a user's. A
strategy that knows more about its rounds says so through
:mod:`fededge.strategies.report` (one small interface, no class list here). It reads no
run config: everything is a constructor argument, and fededge's own app
(:func:`fededge.server.runner.run_experiment`) is just its first user.

Any ClientApp works. The simulated clock places and times a reply by what it reports:
fededge's ClientApp sends ``compute-s``, ``local-steps-done`` and ``partition-id``. For a
reply without them the rules are :class:`~fededge.netem.runclock.RunClock`'s: a node is
placed by the index of its node id among the run's node ids, and its compute time is
``compute_s`` if given here, else the real time from the push of its message to the pull
of its reply, as the server measured it. That measured time includes the wait for other
clients on a runtime that runs them one after another (fededge's in-process grid,
Flower's simulation with fewer actors than clients): pass ``compute_s`` for a ``sim_s``
that is reproducible and that does not depend on the machine.
"""

from __future__ import annotations


import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.protocol import checkpoint_due
from fededge.netem.clock import ClientRound, synchronous_round
from fededge.netem.runclock import ClockConfig, RunClock
from fededge.server.metering import MeteredGrid, RoundTraffic
from fededge.server.checkpoint import CHECKPOINT_DIR, CheckpointError, latest_checkpoint, states_file_for, write_checkpoint
from fededge.server.results import PROGRESS_MODES, Progress, ResultsConfig, RoundRecord, RunRecorder, new_run_id
from fededge.strategies.report import RoundReport, attach_clock, report_of
from fededge.settings import whole_or_keywords
from fededge.tracking import MetricSink, Sinks, check_installed, make_sinks, parse_log_to
from fededge.tracking.base import check_sinks
from fededge.wrapping import innermost
from fededge.strategies.resume import (
    FromRound, ResumeError, arrays_from_state, arrays_to_state, attach_checkpoint, load_strategy_state,
    strategy_state,
)

#: Run-config keys a resumed run may give other values than the run it resumes: they
#: change what is recorded or how long it goes on, not what a round computes.
RESUME_MAY_CHANGE = frozenset({
    "num-rounds", "progress", "checkpoint-every", "save-model", "target-accuracy", "results-dir",
    "run-name", "round-timeout", "resume-from", "evaluate-every", "log-to", "mlflow-uri",
    # where idle clients' states live (the same results either way; a run from before
    # client-states=auto recorded "memory")
    "client-states", "client-states-memory-mb",
})

__all__ = [
    "CheckpointError", "EvaluateFn", "Experiment", "RESUME_MAY_CHANGE", "ResumeError", "ExperimentResult", "NotEnoughNodesError", "PROGRESS_MODES", "RoundFailedError",
    "seeded_sampling", "wait_for_nodes",
]

log = logging.getLogger("fededge")

#: ``evaluate_fn(server_round, arrays) -> MetricRecord`` with ``accuracy`` and ``loss``
#: (Flower's own ``evaluate_fn`` signature).
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord]


#: The exchanges of a synchronous round on the clock, in order (RoundTraffic's per-node
#: fields), and the keys of metrics.jsonl that record each one's clients (for replay).
EXCHANGES = ("nodes", "followup", "evaluation")
EXCHANGE_RECORDS = ("clients", "clients_followup", "clients_evaluate")


class RoundFailedError(RuntimeError):
    """No client update of a round could be used: every reply was an error (or none came).

    A run that carried on would report a model nobody trained; it stops instead, with
    the first client error in the message.
    """


class NotEnoughNodesError(RuntimeError):
    """Fewer nodes connected than the run needs, within the round timeout."""


def wait_for_nodes(grid: Grid, needed: int, timeout_s: float, *, poll_s: float = 1.0) -> int:
    """Wait until ``needed`` nodes are connected; raise :class:`NotEnoughNodesError`.

    Flower's own sampling waits for nodes forever; a count of ``clients-per-round`` above
    the number of nodes that will ever connect would hang the run with no message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        n = len(list(grid.get_node_ids()))
        if n >= needed:
            return n
        if time.monotonic() >= deadline:
            raise NotEnoughNodesError(
                f"the run needs {needed} connected nodes (clients-per-round / "
                f"min-available-nodes) but only {n} connected within round-timeout="
                f"{timeout_s:g} s; lower clients-per-round, use a fraction such as 1.0, "
                "or start more SuperNodes (num-supernodes in simulation)"
            )
        time.sleep(poll_s)


@contextmanager
def seeded_sampling(seed: int) -> Iterator[None]:
    """Seed the module-level ``random`` for the run, then restore it.

    Flower's strategies sample nodes with ``random.sample`` (``strategy_utils.
    sample_nodes``), the global RNG. Seeding it makes client selection reproducible;
    restoring it keeps the in-process runtime from changing its caller's RNG.
    """
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


@dataclass
class ExperimentResult:
    """A finished run: its directory, the figures of its summary.json, Flower's Result."""

    run_dir: Path
    summary: dict[str, Any]
    flower_result: Result


class Experiment:
    """Bytes, simulated time and results for any strategy's run, in any ServerApp.

    See the module docstring for what it measures and writes.

    Parameters
    ----------
    evaluate_fn : callable
        ``evaluate_fn(server_round, arrays) -> MetricRecord`` with ``accuracy`` and
        ``loss`` (Flower's ``evaluate_fn``): called on the global model after every round,
        and on each node's model for decentralised strategies. Other metrics it returns
        are written to ``metrics.jsonl`` too, under their own names.
    results_dir, run_name, target_accuracy, progress, save_model, checkpoint_every, evaluate_every, log_to, mlflow_uri
        :class:`fededge.server.results.ResultsConfig`'s knobs (defaults, checks and
        meaning declared there, once). With ``evaluate_every = k > 1``, ``evaluate_fn``
        runs before round 1, after every k-th round and after the last one only. With
        ``checkpoint_every = k > 0`` a checkpoint of the whole run (model, strategy, random
        generators, clock, recorder and, on fededge's in-process runtime, every client's
        ``context.state``) is written after every k-th round; :meth:`run` with
        ``resume_from`` continues from it. ``log_to = "tensorboard,mlflow"`` sends every
        round to those tools too (:mod:`fededge.tracking`); a tool that is not installed
        is refused here, naming its extra.
    sinks : sequence of MetricSink, optional
        Sinks of your own, or fededge's configured beyond ``log_to``
        (``sinks=[MLflowSink(tracking_uri="http://mlflow:5000", experiment="fl")]``),
        each given every round as :class:`fededge.tracking.MetricSink` says.
    results : ResultsConfig, optional
        The results knobs above as one object (``results=ResultsConfig(results_dir="out",
        checkpoint_every=1)``), in place of those keywords (giving both is refused).
    clock : ClockConfig, optional
        The clock knobs below as one object (``clock=ClockConfig(netem="4g")``), in place
        of those keywords (giving both is refused).
    run_id : str, optional
        The run directory's name (default: ``[run_name-]<date>-<time>-<pid>``); an
        existing one is never overwritten (``-2``, ``-3``, ... are appended).
    netem, netem_file, compute_speed, sim_step_s, compute_s, message_overhead_s, nodes_pull
        The simulated clock: :class:`fededge.netem.runclock.ClockConfig`'s knobs
        (``netem="4g"`` or ``"wifi:0.5,4g:0.5"``; ``compute_speed="lognormal:0.5"``;
        ``""``: an ideal network, so ``sim_s`` is compute only).
    seed : int
        Seeds the links' assignment and Flower's client sampling (the global ``random``,
        restored after the run).
    min_nodes : int
        Wait (up to the run's ``timeout``) for this many connected nodes before round 1;
        fail with :class:`NotEnoughNodesError` otherwise.
    config : mapping, optional
        Recorded in ``config.json`` under ``config`` (your app's own run config); read
        by ``fededge plot`` to label runs.
    metadata : mapping, optional
        Merged into ``config.json`` (device, data set sizes, runtime...).
    title : str, optional
        How the first progress line names the run (default: the strategy's class).

    Examples
    --------
    In a ServerApp's main, with Flower's own strategy and any ClientApp:

    >>> exp = Experiment(evaluate_fn=my_evaluate, results_dir="results", netem="4g",
    ...                  target_accuracy=0.9, compute_s=1.0)            # doctest: +SKIP
    >>> res = exp.run(FedAdam(), grid, initial_arrays=ArrayRecord(model.state_dict()),
    ...               num_rounds=5, train_config=ConfigRecord({"lr": 0.1}))  # doctest: +SKIP
    >>> res.summary["sim_s"], res.run_dir / "metrics.jsonl"            # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        evaluate_fn: EvaluateFn,
        results_dir: str | Path = ResultsConfig.results_dir,
        run_id: str | None = None,
        run_name: str = ResultsConfig.run_name,
        netem: str = ClockConfig.netem,
        netem_file: str = ClockConfig.netem_file,
        compute_speed: str = ClockConfig.compute_speed,
        sim_step_s: float = ClockConfig.sim_step_s,
        compute_s: float | None = ClockConfig.compute_s,
        message_overhead_s: float = ClockConfig.message_overhead_s,
        nodes_pull: bool = ClockConfig.nodes_pull,
        seed: int = 0,
        target_accuracy: float = ResultsConfig.target_accuracy,
        progress: str = ResultsConfig.progress,
        save_model: bool = ResultsConfig.save_model,
        checkpoint_every: int = ResultsConfig.checkpoint_every,
        evaluate_every: int = ResultsConfig.evaluate_every,
        log_to: str = ResultsConfig.log_to,
        mlflow_uri: str = ResultsConfig.mlflow_uri,
        sinks: Sequence[MetricSink] = (),
        min_nodes: int = 1,
        config: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        title: str | None = None,
        results: ResultsConfig | None = None,
        clock: ClockConfig | None = None,
    ) -> None:
        if not callable(evaluate_fn):
            raise ValueError(f"evaluate_fn must be a callable (server_round, arrays) -> MetricRecord, "
                             f"got {evaluate_fn!r}")
        # The settings objects, built once (their checks run now, not after the run
        # started) and kept: given whole, or from the keywords.
        self.results = whole_or_keywords(
            ResultsConfig, results, owner="Experiment", name="results", results_dir=str(results_dir),
            run_name=run_name, target_accuracy=target_accuracy, progress=progress, save_model=save_model,
            checkpoint_every=checkpoint_every, evaluate_every=evaluate_every, log_to=log_to, mlflow_uri=mlflow_uri)
        self.clock_config = whole_or_keywords(
            ClockConfig, clock, owner="Experiment", name="clock", netem=netem, netem_file=netem_file,
            compute_speed=compute_speed, sim_step_s=sim_step_s, compute_s=compute_s,
            message_overhead_s=message_overhead_s, nodes_pull=nodes_pull)
        if min_nodes < 0:
            raise ValueError(f"min_nodes must be >= 0, got {min_nodes}")
        self.evaluate_fn = evaluate_fn
        r = self.results
        self.results_dir = Path(r.results_dir)
        self.run_id = run_id
        self.run_name = r.run_name
        self.seed = seed
        self.target_accuracy = r.target_accuracy
        self.progress = r.progress
        self.save_model = r.save_model
        self.checkpoint_every = r.checkpoint_every
        self.evaluate_every = r.evaluate_every
        self.log_to = parse_log_to(r.log_to)
        check_installed(self.log_to)  # a missing tool stops here, before round 1, naming its extra
        self.sinks = check_sinks(sinks)
        self.min_nodes = min_nodes
        self.config = dict(config or {})
        self.metadata = dict(metadata or {})
        self.title = title

    def _sinks(self) -> Sinks:
        """This run's sinks: fresh ones for ``log_to``, then the caller's own."""
        return Sinks([*make_sinks(self.log_to, mlflow_uri=self.results.mlflow_uri), *self.sinks])

    def _clock_json(self, timeout: float) -> dict[str, Any]:
        """The clock's settings for config.json (read back by ``fededge.analysis.replay``),
        and the round timeout a dropout costs there."""
        c = self.clock_config
        # (netem-file absolute: replay reads it from wherever it runs)
        netem_file = str(Path(c.netem_file).resolve()) if c.netem_file else c.netem_file
        return {"netem": c.netem, "netem-file": netem_file, "compute-speed": c.compute_speed, "seed": self.seed,
                "sim-step-s": c.sim_step_s, "compute-s": c.compute_s, "message-overhead-s": c.message_overhead_s,
                "nodes-pull": c.nodes_pull, "timeout": timeout}

    def run(
        self,
        strategy: Strategy,
        grid: Grid,
        *,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float = 3600.0,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        before_start: Callable[[Grid], None] | None = None,
        resume_from: str | Path | None = None,
    ) -> ExperimentResult:
        """Run ``strategy.start`` on a metered ``grid`` and record every round.

        Parameters
        ----------
        strategy : Strategy
            Any Flower strategy (see the module docstring).
        grid : Grid
            The ServerApp's grid (simulation, deployment or fededge's in-process grid).
        initial_arrays, num_rounds, timeout, train_config, evaluate_config
            Passed to ``strategy.start`` (``timeout``: seconds to wait for a round's
            replies; a round with a node that never answered lasts at least that long on
            the clock).
        before_start : callable, optional
            Called with the grid once the nodes are connected, before round 1 (fededge's
            app checks the clients' data split there).
        resume_from : path, optional
            A run directory with checkpoints: continue that run from its newest intact
            checkpoint (``initial_arrays`` is then not used), appending to its files.
            ``strategy`` must be built as the run's was (the caller's job: fededge's app
            compares the run config, :data:`RESUME_MAY_CHANGE`).

        Raises
        ------
        RoundFailedError
            A round had no usable update and not because its clients dropped out.
        NotEnoughNodesError
            Fewer than ``min_nodes`` nodes connected within ``timeout``.
        CheckpointError, ResumeError
            ``resume_from`` has no usable checkpoint, or it cannot be resumed here.
        """
        strategy_class = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
        checkpoint = None
        if resume_from is not None:
            path, checkpoint = latest_checkpoint(resume_from)
            also = ({f"{type(strategy.inner).__module__}.{type(strategy.inner).__qualname__}"}
                    if getattr(type(strategy), "resumes_inner_checkpoints", False) else set())
            if checkpoint.get("strategy_class") not in {strategy_class, *also}:
                raise ResumeError(f"{path} was written by a run of {checkpoint.get('strategy_class')}, "
                                  f"not {strategy_class}: resume it with the strategy it was run with")
            recorder = RunRecorder.reopen(resume_from, checkpoint["recorder"], target_accuracy=self.target_accuracy,
                                          sinks=self._sinks())
        else:
            recorder = RunRecorder(
                self.results_dir, self.run_id or new_run_id(self.run_name), self.config,
                target_accuracy=self.target_accuracy,
                extra={**self.metadata, "strategy_class": strategy_class,
                       "clock": self._clock_json(timeout)}, sinks=self._sinks())
        progress = Progress(self.progress, num_rounds)
        try:  # from here on a failure leaves summary.json "failed", not "running"
            done = 0 if checkpoint is None else int(checkpoint["round"])
            progress.note(f"run {recorder.run_id}: {self.title or type(strategy).__name__}; "
                          + (f"resumed after round {done} from {path.name}; " if checkpoint is not None else "")
                          + f"results in {recorder.run_dir.resolve()}")
            clock = RunClock(config=self.clock_config, seed=self.seed,
                             run_dir=None if checkpoint is not None else recorder.run_dir)
            rounds = _RoundCloser(self, strategy, MeteredGrid(grid), clock, recorder, progress, timeout, num_rounds)
            rounds.final = initial_arrays
            attach_clock(strategy, clock)
            own_loop = attach_checkpoint(strategy, rounds)
            if not own_loop and type(strategy).start is Strategy.start:
                # Flower's round loop aggregates whatever comes: a NaN or misshapen update
                # went into the model, a reply with other metric names stopped the run.
                # Those replies are rejected and left out instead (MeteredGrid.screen).
                rounds.metered.screen_for(strategy)
            if not own_loop and type(strategy).start is not Strategy.start:
                # Its own round loop, and no way to stop it at a round boundary: a checkpoint
                # written from outside would not hold its state. Say so, write none.
                rounds.uncheckpointable = (f"{type(strategy).__name__} runs its own round loop and does not "
                                           "implement attach_checkpoint (fededge.strategies.resume)")
                if checkpoint is not None:
                    raise ResumeError(f"{rounds.uncheckpointable}: it cannot be resumed")
                if self.checkpoint_every > 0:
                    log.warning("%s: no checkpoints are written (checkpoint-every=%d)", rounds.uncheckpointable,
                                self.checkpoint_every)
            connected = wait_for_nodes(grid, self.min_nodes, timeout)
            clock.know_nodes(grid.get_node_ids())
            clock.check(connected)  # an unknown profile stops the run before any training
            if before_start is not None:
                before_start(grid)
            with seeded_sampling(self.seed), fi.fast_average():  # Flower's average, bit for bit, faster
                runner: Strategy = strategy
                if checkpoint is not None:
                    initial_arrays = rounds.restore(checkpoint)
                    if not own_loop:
                        runner = FromRound(strategy, done)
                train_config = rounds.client_state_config(train_config)
                result = runner.start(
                    grid=rounds.metered, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                    train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=rounds.close)
        except BaseException as err:
            progress.close()
            recorder.close(status="failed", error=f"{type(err).__name__}: {err}")
            raise
        progress.close()
        if self.save_model:
            torch.save(rounds.final.to_torch_state_dict(), recorder.run_dir / "model.pt")
        summary = recorder.close(extra=rounds.summary, artifacts=_plot(recorder))
        progress.note(
            f"final accuracy {summary['final_accuracy']:.4f}; target {self.target_accuracy} "
            f"reached at round {summary['rounds_to_target']} (sim {summary['sim_s_to_target']} s); "
            f"results in {recorder.run_dir.resolve()}"
        )
        return ExperimentResult(recorder.run_dir, summary, result)

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float, dict[str, Any]]:
        """``(accuracy, loss, other metrics)`` of ``arrays`` by ``evaluate_fn``."""
        metrics = self.evaluate_fn(server_round, arrays)
        if metrics is None or "accuracy" not in metrics or "loss" not in metrics:
            raise ValueError("evaluate_fn must return a MetricRecord with 'accuracy' and 'loss', got "
                             f"{None if metrics is None else sorted(metrics.keys())}")
        others = {k: v for k, v in metrics.items() if k not in ("accuracy", "loss")}
        return float(metrics["accuracy"]), float(metrics["loss"]), others


def _plot(recorder: RunRecorder) -> tuple[Path, ...]:
    """The run's plot (``plot.png``: accuracy against rounds, simulated time and uplink
    bytes), for the sinks that keep files; none without sinks, or if it cannot be drawn."""
    if not recorder.sinks:
        return ()
    try:
        from fededge.analysis.plot import plot_runs

        return (plot_runs([recorder.run_dir], recorder.run_dir / "plot.png"),)
    except Exception as err:  # noqa: BLE001 - a plot never fails the run it shows
        log.warning("the run's plot for the metric sinks could not be drawn: %s: %s", type(err).__name__, err)
        return ()


def _tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples where a checkpoint may give lists back."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class _RoundCloser:
    """Closes each round of one run, and keeps the run's state between rounds.

    The strategy's loop calls :meth:`close` after every round (as its ``evaluate_fn``):
    it evaluates the model when due, times the round on the clock and records its line
    of metrics.jsonl. As the strategy's checkpoint hook (:meth:`due`, :meth:`save`,
    :class:`fededge.strategies.resume.CheckpointHook`) it writes the checkpoints, and
    :meth:`restore` reads one back."""

    def __init__(self, exp: Experiment, strategy: Strategy, metered: MeteredGrid, clock: RunClock,
                 recorder: RunRecorder, progress: Progress, timeout: float, num_rounds: int) -> None:
        self.exp = exp
        self.strategy = strategy
        self.metered = metered
        self.clock = clock
        self.recorder = recorder
        self.progress = progress
        self.timeout = timeout
        self.final: ArrayRecord | None = None
        self.num_rounds = num_rounds  # the run's last round: always evaluated
        self.summary: dict[str, Any] = {}
        self.resumed = 0  # the checkpoint's round: rounds up to it are recorded already
        self.uncheckpointable: str | None = None  # why no checkpoint can be written, if so
        self.checkpoints: list[dict[str, float]] = []  # each written: round, bytes, seconds
        # The nodes' state stores (fededge.clients.statestore): this server's attempt, and
        # the attempt that wrote the checkpoint it continues from with the round that one
        # continued after (its own and 0 for a fresh run): a node drops what another attempt
        # wrote after that round. A checkpoint keeps its writer's.
        self.attempt = uuid.uuid4().hex[:12]
        self.base: tuple[str, int] | None = (self.attempt, 0)

    # -- checkpoints (fededge.strategies.resume.CheckpointHook) ----------------------
    def due(self, server_round: int) -> bool:
        return self.uncheckpointable is None and checkpoint_due(server_round, every=self.exp.checkpoint_every,
                                                                resumed=self.resumed)

    def _inner_grid(self) -> Any:
        return innermost(self.metered.inner)

    def save(self, server_round: int) -> None:
        """Write the checkpoint of ``server_round`` (recorded already, nothing of a later
        round outstanding): model, strategy, generators, clock, recorder, and the
        in-process runtime's client states."""
        last = self.recorder.records[-1].round if self.recorder.records else None
        if last != server_round:
            raise RuntimeError(f"checkpoint of round {server_round} asked for, but the last recorded round is {last}")
        grid = self._inner_grid()
        np_state = np.random.get_state(legacy=False)
        payload = {
            "format": 1, "round": server_round, "run_id": self.recorder.run_id,
            "strategy_class": f"{type(self.strategy).__module__}.{type(self.strategy).__qualname__}",
            "config": self.exp.config,
            "arrays": arrays_to_state(self.final),
            "strategy": strategy_state(self.strategy),
            "random": random.getstate(),
            "torch_rng": torch.get_rng_state(),
            # the CUDA generators too, where this process has used CUDA (a user's evaluate_fn
            # or model drawing on the GPU: dropout); never initialising CUDA for it
            "cuda_rng": (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_available() and torch.cuda.is_initialized() else None),
            "numpy_rng": {"bit_generator": np_state["bit_generator"], "pos": int(np_state["state"]["pos"]),
                          "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                          "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
            "clock": self.clock.state_dict(),
            "recorder": self.recorder.state_dict(),
            "summary": self.summary,
            "partition_of": dict(self.metered.partition_of),
            "traffic": self.metered.state_dict(),
            "checkpoints": list(self.checkpoints),
            "state_attempt": [self.attempt, self.resumed],
            # Disk states, and states in memory past INLINE_STATES_MAX, go to a side file of
            # the checkpoint, not into its body.
            "grid": grid.state_dict(states_file=states_file_for(self.recorder.run_dir, server_round))
            if getattr(grid, "keeps_client_states", False) else None,
        }
        path, size, seconds = write_checkpoint(self.recorder.run_dir, server_round, payload)
        self.checkpoints.append({"round": server_round, "bytes": size, "seconds": round(seconds, 6)})
        self.summary["checkpoints"] = len(self.checkpoints)  # over the whole run, resumed or not
        self.summary["checkpoint_bytes_last"] = size
        self.summary["checkpoint_s_total"] = round(sum(c["seconds"] for c in self.checkpoints), 6)
        log.debug("checkpoint of round %d: %s, %d bytes in %.3f s", server_round, path, size, seconds)

    def client_state_config(self, train_config: ConfigRecord | None) -> ConfigRecord | None:
        """``train_config``, and where this runtime does not keep the clients' states (Ray
        simulation, a SuperLink) while checkpoints are written, what the nodes' state
        stores need (:mod:`fededge.clients.statestore`): the run, the round resumed
        from, this attempt and the checkpoint period."""
        if self.exp.checkpoint_every <= 0 or self.uncheckpointable is not None \
                or getattr(self._inner_grid(), "keeps_client_states", False):
            return train_config
        # (the same bytes in a resumed run as in the uninterrupted one: ids of one length)
        base = {} if self.base is None else {keys.STATE_BASE_ATTEMPT: self.base[0], keys.STATE_BASE_FROM: self.base[1]}
        return ConfigRecord({**(train_config or {}), keys.STATE_KEY: self.recorder.run_id,
                             keys.STATE_RESUMED_FROM: self.resumed, keys.STATE_ATTEMPT: self.attempt,
                             keys.STATE_EVERY: self.exp.checkpoint_every, **base})

    def restore(self, checkpoint: dict[str, Any]) -> ArrayRecord:
        """Put back what :meth:`save` wrote (inside the run's seeded sampling); return
        the checkpoint's global model."""
        self.resumed = int(checkpoint["round"])
        saved = checkpoint.get("state_attempt")  # (absent from a fededge before it: the nodes' rule before)
        self.base = None if saved is None else (str(saved[0]), int(saved[1]))
        # The clock first: a strategy rebuilds its timeline on it while it loads.
        self.clock.load_state_dict(checkpoint["clock"])
        # Nodes that report no partition id are placed by their index among this grid's
        # node ids (a resumed run on Flower's simulation or a SuperLink gets new ones).
        self.clock.know_nodes(self.metered.get_node_ids())
        load_strategy_state(self.strategy, checkpoint["strategy"])
        grid = self._inner_grid()
        if checkpoint["grid"] is not None:
            if not hasattr(grid, "load_state_dict"):
                raise ResumeError("the checkpoint holds the in-process runtime's client states, but this grid "
                                  f"({type(grid).__name__}) is not fededge's in-process grid")
            grid.load_state_dict(checkpoint["grid"], states_dir=self.recorder.run_dir / CHECKPOINT_DIR)
        random.setstate(_tuples(checkpoint["random"]))
        torch.set_rng_state(checkpoint["torch_rng"])
        cuda_rng = checkpoint.get("cuda_rng")  # (absent from older checkpoints)
        if cuda_rng is not None and torch.cuda.is_available() and len(cuda_rng) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_rng)
        npr = checkpoint["numpy_rng"]
        np.random.set_state((npr["bit_generator"], npr["key"].numpy().astype(np.uint32), npr["pos"],
                             npr["has_gauss"], npr["gauss"]))
        self.summary = dict(checkpoint["summary"])
        # The checkpoints written before this one, and this one (its writing time was not
        # known when it was written: not counted in checkpoint_s_total).
        self.checkpoints = [*checkpoint["checkpoints"], {"round": self.resumed, "bytes": None, "seconds": 0.0}]
        self.metered.partition_of.update({int(k): int(v) for k, v in checkpoint["partition_of"].items()})
        self.metered.load_state_dict(checkpoint.get("traffic", {}))
        self.final = arrays_from_state(checkpoint["arrays"])
        return self.final

    def report(self, text: str) -> None:
        """One line per client problem: on the progress stream, or logged when it is off."""
        if self.progress.mode == "off":
            log.warning(text)
        else:
            self.progress.note(text)

    def evaluates(self, rnd: int) -> bool:
        """Whether round ``rnd``'s model is evaluated: before round 1, after every
        ``evaluate_every``-th round, and after the last."""
        return rnd <= 0 or rnd % self.exp.evaluate_every == 0 or rnd >= self.num_rounds

    def close(self, rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Evaluate round ``rnd``'s model (when due), take its traffic and report, write
        its line; write a checkpoint when one is due and the strategy runs on Flower's
        loop. None (Flower records nothing) for a round not evaluated."""
        if 0 < self.resumed and rnd <= self.resumed:  # a resumed run's round recorded already (Flower's loop re-evaluates it)
            rec = next(r for r in self.recorder.records if r.round == rnd)
            return None if rec.accuracy is None else MetricRecord({"accuracy": rec.accuracy, "loss": rec.loss})
        metrics = self._close(rnd, arrays)
        if self.due(rnd) and getattr(self.strategy, "attach_checkpoint", None) is None:
            self.save(rnd)  # Flower's loop: nothing is in flight between rounds
        return metrics

    def _close(self, rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        report = report_of(self.strategy, rnd)
        traffic = self.traffic(report)
        for err in traffic.errors:  # error replies: the ClientApp raised (dropouts are not errors)
            self.report(f"round {rnd}: a client failed: {err}")
        for reason in [*traffic.reasons, *report.reasons]:
            self.report(f"round {rnd}: {reason}")
        if traffic.rejected:  # replies the metering screened out (Flower's round loop)
            report = replace(report, rejected=report.rejected + traffic.rejected,
                             reasons=[*traffic.reasons, *report.reasons])
        for note in report.notes:
            self.progress.note(note)
        num_clients = report.num_clients if report.num_clients is not None else traffic.train_replies - report.rejected
        # Every reply failed (errors, rejected updates; dropouts are not errors): the round
        # is recorded, then the run stops, naming the clients' own error. Nothing looks at
        # this round's model (evaluate_fn included): a strategy may hand over none.
        # (replies rejected, as errors, are failures too: a dropout beside them hid that)
        failed = rnd >= 1 and num_clients == 0 and not ((traffic.dropped or report.dropped) and not traffic.errors
                                                         and not report.rejected)
        if not failed:
            self.final = arrays
        evaluated = self.evaluates(rnd) and not failed
        acc, loss, others = self.exp.evaluate(rnd, arrays) if evaluated else (None, None, {})
        extra = {k: v for k, v in others.items() if k not in RoundRecord.__dataclass_fields__}
        extra |= report.metrics
        if report.node_models is not None and evaluated:
            extra |= self.node_metrics(rnd, report.node_models)
        dropped = report.dropped if report.dropped is not None else [
            self.metered.partition_of.get(n, n) for n in traffic.dropped]
        if dropped and "dropped" not in extra:
            extra["dropped"] = sorted(set(dropped))  # (a node dropped from training and evaluation: once)
        if dropped and report.sim_s is None:  # what the round waited (a resumed run may change it)
            extra["round_timeout"] = self.timeout
        if report.sim_s is not None:  # the strategy timed the round itself (replay must know how)
            extra["self_timed"] = True
        # What each client did, so that the run can be re-timed under another network
        # (fededge.analysis.replay) without training again.
        for exchange, key in zip(EXCHANGES, EXCHANGE_RECORDS):
            placed = sorted(self.placed(traffic, exchange=exchange), key=lambda x: x[0])
            if placed or exchange == "nodes":
                extra[key] = [
                    {"partition": pid,
                     "compute_s": round(self.clock.measured_s(n.compute_s if n.reported_compute else None, n.wall_s), 9),
                     "bytes_down": n.bytes_down, "bytes_up": n.bytes_up, "steps": n.steps}
                    for pid, n in placed]
        rec = self.recorder.record_round(
            rnd, accuracy=acc, loss=loss,
            bytes_up=traffic.bytes_up - report.bytes_up_excluded, bytes_down=traffic.bytes_down,
            # The round on the simulated clock: the strategy's own timing, or download,
            # compute (scaled by the client's speed) and upload on each client's link.
            round_sim_s=report.sim_s if report.sim_s is not None else self.synchronous_sim_s(traffic),
            num_clients=num_clients,
            failures=traffic.failures, rejected=report.rejected, mismatched=report.mismatched,
            compression_ratio=report.ratio, extra=extra)
        self.summary |= report.summary
        self.progress.update(rec)
        if failed:
            first = (traffic.errors or report.reasons or ["no reply arrived within round-timeout"])[0]
            raise RoundFailedError(
                f"round {rnd}: no client update could be used ({traffic.failures} of "
                f"{traffic.replies} replies failed, {report.rejected} rejected); first error: {first}"
            )
        if rnd >= 1 and rec.num_clients == 0:
            # Dropouts (no answer) are not errors: the model stays as it was and the run goes on.
            self.progress.note(f"round {rnd}: no update: every selected client dropped out; the model is unchanged")
        return MetricRecord({"accuracy": acc, "loss": loss, **others}) if evaluated else None

    def traffic(self, report: RoundReport) -> RoundTraffic:
        """The round's metered messages: all since the last round, or the report's groups."""
        if report.groups is None:
            return self.metered.take()
        traffic = RoundTraffic()
        for group in report.groups:
            traffic.merge(self.metered.take(group))
        return traffic

    def placed(self, traffic: RoundTraffic, *, exchange: str = "nodes") -> list[tuple[int, Any]]:
        """``(client index on the clock, node traffic)`` of every node that replied: to the
        round's training (``nodes``), its second exchange (``followup``: norm-stats
        queries) or the clients' evaluation (``evaluation``)."""
        out = []
        for nid, n in getattr(traffic, exchange).items():
            # (a reply that names no partition: the one this node's training replies named)
            reported = n.partition_id if n.partition_id is not None else self.metered.partition_of.get(nid)
            pid = self.clock.place(nid, reported) if n.replied else None
            if pid is not None:
                out.append((pid, n))
        return out

    def synchronous_sim_s(self, traffic: RoundTraffic) -> float:
        """The round as a synchronous one: the slowest client's download, compute and
        upload; at least ``timeout`` when a node never answered."""
        placed = self.placed(traffic)
        if self.clock.clock is None and placed:
            reported = max((n.num_partitions for _, n in placed if n.num_partitions is not None), default=None)
            self.clock.build(max(self.clock.num_clients(reported), 1 + max(pid for pid, _ in placed)))
        if self.clock.clock is None:  # (no client placed yet: every one dropped out, say)
            return self.timeout if traffic.dropped else 0.0
        # The training, then (norm-stats queries) a second exchange that starts when it ends,
        # then the clients' evaluation (Flower's loop sends it after the training).
        duration = 0.0
        for k, exchange in enumerate((placed, *(self.placed(traffic, exchange=e) for e in EXCHANGES[1:]))):
            # The exchanges after the training take no local steps: with sim-step-s their
            # compute is 0 on the clock (as measured it would make sim_s a run's own real time)
            work = [ClientRound(pid, n.bytes_down,
                                self.clock.compute_s(n.compute_s if n.reported_compute else None,
                                                     n.steps if k == 0 else 0, n.wall_s),
                                n.bytes_up)
                    for pid, n in exchange]
            if work:
                duration += synchronous_round(self.clock.clock, work).duration
        # A node that never answered held the round until the server's timeout.
        return max(duration, self.timeout) if traffic.dropped else duration

    def node_metrics(self, rnd: int, models: Mapping[int, Any]) -> dict[str, Any]:
        """Every node's model on the evaluation: mean, min and max accuracy, mean loss."""
        seen: dict[int, tuple[float, float]] = {}  # id of a model object -> (accuracy, loss)
        accs, losses = [], []
        for i in sorted(models):
            m = models[i]
            if id(m) not in seen:
                acc, loss, _ = self.exp.evaluate(rnd, ArrayRecord(m))
                seen[id(m)] = (acc, loss)
            accs.append(seen[id(m)][0])
            losses.append(seen[id(m)][1])
        return {
            "node_accuracy_mean": sum(accs) / len(accs) if accs else None,
            "node_accuracy_min": min(accs, default=None),
            "node_accuracy_max": max(accs, default=None),
            "node_loss_mean": sum(losses) / len(losses) if losses else None,
        }
