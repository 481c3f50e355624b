"""OwnLoop: the template of fededge's strategies that run their own round loop.

Flower's :class:`~flwr.serverapp.strategy.Strategy` writes ``start`` once and lets a
strategy override ``configure_*`` / ``aggregate_*``. DGA (rounds in flight), Gossip (no
global average), the asynchronous family (versions, not rounds) and BackupWorkers (the
first ``m`` of ``m + e``) cannot be written as those hooks, so each runs its own loop.
What is the same in all of them lives here, once:

- :meth:`start`: the train and evaluate configs, the :class:`Result`, the resume
  branch, the evaluation of round 0 (a fresh run only), then the strategy's rounds;
- evaluation of a round's model with the run's ``evaluate_fn`` (:meth:`_evaluate`);
- the clock (:meth:`attach_clock`) and the checkpoint hook (:meth:`attach_checkpoint`,
  :meth:`_round_done`: the rounds done, and a checkpoint when one is due);
- ``state_dict`` / ``load_state_dict`` (the protocol of :mod:`fededge.strategies.resume`)
  from declared state, as torch's ``Optimizer`` writes them once: the settings a
  checkpoint must have been made with (:attr:`resume_settings`, compared by name on
  load), the attributes saved as plain values (:attr:`state_attrs`), and the strategy's
  own extra state where plain values do not express it (:meth:`_extra_state`).

A strategy on this base writes only its rounds' logic:

``_prepare(grid, initial_arrays, resume)``
    before anything is evaluated or sent: checks, the participants' graph, the server's
    state; ``resume`` is the loaded checkpoint (None for a fresh run).
``_fresh(grid, initial_arrays)``
    a fresh run, after round 0 was evaluated: pick the participants.
``_restore(grid, state) -> int``
    a resumed run (its :attr:`state_attrs` are already back): put back the rest, check
    the grid's nodes, return the rounds done.
``_rounds(grid, done, num_rounds, timeout)``
    rounds ``done + 1 .. num_rounds``; after each, :meth:`_evaluate` and
    :meth:`_round_done`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fededge.netem.runclock import RunClock
from fededge.strategies.resume import CheckpointHook, ResumeError, from_plain, to_plain

__all__ = ["OwnLoop"]

log = logging.getLogger("fededge")


class OwnLoop(FedAvg):
    """The base of fededge's strategies with their own round loop (see the module docstring).

    Parameters
    ----------
    **fedavg
        Flower's FedAvg arguments: the participants' sampling (``fraction_train``,
        ``min_train_nodes``, ``min_available_nodes``), the record keys and the weight.
    """

    #: The strategy's name in its errors and logs.
    label: ClassVar[str] = "strategy"
    #: Attributes (dotted paths) whose values a checkpoint must have been made with: a
    #: checkpoint made with others is refused by name on load.
    resume_settings: ClassVar[tuple[str, ...]] = ()
    #: Attributes saved as plain values (:func:`~fededge.strategies.resume.to_plain`)
    #: and put back, as they were, before :meth:`_restore`.
    state_attrs: ClassVar[tuple[str, ...]] = ()
    #: How a compressed uplink goes with this strategy (``Compressed`` refuses to wrap it).
    compressed_form: ClassVar[str] = ("decode compressed replies inside the strategy's own loop, as DGA and "
                                      "Gossip do: Compressed decodes in configure_train/aggregate_train, "
                                      "which an own loop does not call")

    def __init__(self, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self._clock: RunClock | None = None  # attach_clock
        self._hook: CheckpointHook | None = None  # attach_checkpoint
        self._resume: dict[str, Any] | None = None  # a loaded state, for the next start()
        self._done = 0  # rounds done (by start)
        self._result = Result()
        self._evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
        self._train_config = ConfigRecord()
        self._evaluate_config = ConfigRecord()

    # ----------------------------------------------------------------- attached by the run
    def attach_clock(self, clock: RunClock) -> None:
        """Time the rounds on ``clock`` (the experiment's simulated clock)."""
        self._clock = clock

    def attach_checkpoint(self, hook: CheckpointHook) -> None:
        """Ask ``hook`` after every round whether to checkpoint
        (:mod:`fededge.strategies.resume`); when it is due, nothing of a later round is
        out when ``hook.save`` reads :meth:`state_dict`."""
        self._hook = hook

    def _due(self, t: int) -> bool:
        return self._hook is not None and self._hook.due(t)

    def _round_done(self, t: int) -> None:
        """Round ``t`` is done (and evaluated): count it, and checkpoint when due."""
        self._done = t
        if self._due(t):
            self._checkpoint(t)

    def _checkpoint(self, t: int) -> None:
        """Save round ``t``: a loop with messages still out first takes them in."""
        assert self._hook is not None
        self._hook.save(t)

    def _evaluate(self, t: int, arrays: ArrayRecord | None = None) -> None:
        """Evaluate round ``t``'s model (``arrays``, default the result's) with the run's
        ``evaluate_fn``, and keep its metrics in the result."""
        if self._evaluate_fn:
            res = self._evaluate_fn(t, self._result.arrays if arrays is None else arrays)
            if res is not None:
                self._result.evaluate_metrics_serverapp[t] = res

    # ----------------------------------------------------------------- the run
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run rounds 1 .. ``num_rounds`` (after a loaded checkpoint's, when one was
        loaded; its ``initial_arrays`` are then unused and round 0 is not evaluated again)."""
        self._train_config = ConfigRecord() if train_config is None else train_config
        self._evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._result = Result()
        self._evaluate_fn = evaluate_fn
        resume, self._resume = self._resume, None
        self._prepare(grid, initial_arrays, resume)
        if resume is None:
            self._evaluate(0, initial_arrays)
            self._fresh(grid, initial_arrays)
            done = 0
        else:
            for name, value in resume.get("attrs", {}).items():
                setattr(self, name, from_plain(value))
            done = self._restore(grid, resume)
        self._done = done
        self._rounds(grid, done, num_rounds, timeout)
        return self._result

    def _prepare(self, grid: Grid, initial_arrays: ArrayRecord, resume: dict[str, Any] | None) -> None:
        """Before round 0: checks and the state every run starts with."""

    def _fresh(self, grid: Grid, initial_arrays: ArrayRecord) -> None:
        """A fresh run, after round 0's evaluation: the participants."""

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        """A resumed run: put back what :attr:`state_attrs` does not hold; the rounds done."""
        return int(state["round"])

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _rounds (its round loop)")

    # ----------------------------------------------------------------- checkpoints
    def settings(self) -> dict[str, Any]:
        """The :attr:`resume_settings` by name, as plain values."""
        out = {}
        for path in self.resume_settings:
            value: Any = self
            for part in path.split("."):
                value = getattr(value, part)
            out[path.rsplit(".", 1)[-1]] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """The run after its last round (read by ``hook.save`` between two rounds), as
        plain values: the settings it ran with, the rounds done, the declared attributes
        and the strategy's extra state."""
        extra = self._extra_state()
        return {"settings": self.settings(), "round": self._done,
                "attrs": {name: to_plain(getattr(self, name)) for name in self.state_attrs}, **extra}

    def _extra_state(self) -> dict[str, Any]:
        """State that plain attributes do not express (a timeline, a loop in progress);
        raises where the run does not stand between two rounds."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next :meth:`start` goes on after its
        round. A checkpoint made with other :attr:`resume_settings` is refused
        (:class:`~fededge.strategies.resume.ResumeError`, naming both)."""
        if "settings" not in state:  # a checkpoint of fededge before OwnLoop
            state = self._upgrade(state)
        # (a setting added to resume_settings since the checkpoint was made is not in it:
        # compared where the checkpoint has it)
        saved = dict(state["settings"])
        mine = {k: v for k, v in self.settings().items() if k in saved}
        if saved != mine:
            raise ResumeError(f"{self.label}: the checkpoint ran with {saved}, this strategy with {mine}; "
                              "resume it with the run config it was made with")
        self._loaded(state)
        self._resume = state

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before this base existed, in today's form (``settings``,
        ``attrs``): each strategy maps its own former keys."""
        return {**state, "settings": {}, "attrs": {}}

    def _loaded(self, state: dict[str, Any]) -> None:
        """What a strategy takes from a loaded state at once, before :meth:`start`."""
