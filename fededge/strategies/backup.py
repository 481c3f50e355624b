"""Backup workers: synchronous rounds that aggregate the first ``m`` of ``m + e`` replies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fededge._flwr_internals import wire_sizes
from fededge.algorithms.asyncfl import LoopConfig, first_arrivals
from fededge.strategies.asyncloop import AsyncLoop, AsyncRoundInfo, Puller, log, resolve_order
from fededge.strategies.resume import arrays_from_state, arrays_to_state

__all__ = ["BackupWorkers"]


class BackupWorkers(AsyncLoop):
    """Synchronous rounds that aggregate the first ``m`` of ``m + e`` replies (Chen et
    al., 2016, "Revisiting distributed synchronous SGD").

    Each round samples clients exactly as FedAvg does (``fraction_train`` /
    ``min_train_nodes``: the ``m + e``) and aggregates, with FedAvg's own aggregation,
    the ``m`` replies that arrive first: first on the simulated clock in simulation,
    first in real time on a SuperLink (where the round then stops waiting). The replies
    not waited for are recorded as ``late`` in metrics.jsonl, so that the bias toward
    fast clients shows in the per-client contribution counts. ``backup = 0`` is FedAvg,
    bit for bit. Works with any ClientApp that answers FedAvg's train messages.

    Parameters
    ----------
    backup : int or float
        ``e``: :attr:`fededge.algorithms.asyncfl.LoopConfig.backup` (a count, or a
        fraction of the sampled clients). Raise it with the share of stragglers you are
        willing to leave out each round.
    **loop
        :class:`~fededge.strategies.asyncloop.AsyncLoop`'s arguments (``order``,
        ``poll_s``) and Flower's FedAvg arguments.

    Examples
    --------
    >>> strategy = BackupWorkers(backup=2, fraction_train=1.0)
    >>> strategy.backups_for(10)
    2
    """

    def __init__(self, *, backup: int | float = LoopConfig.backup, **loop: Any) -> None:
        super().__init__(**loop)
        self.loop_config = LoopConfig(order=self.order, backup=backup)
        self.backup = backup
        self._saving: dict[str, Any] | None = None  # the round being checkpointed

    def backups_for(self, sampled: int) -> int:
        """e for a round of ``sampled`` clients (at least one is always aggregated)."""
        return self.loop_config.backups_for(sampled)

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
        order = resolve_order(self.order, grid)
        if order == "clock":
            rule, measured = self.timing.compute_rule(self.step_s)
            log.log(logging.WARNING if measured else logging.INFO,
                    "BackupWorkers: the first replies on the simulated clock; %s", rule)
        train_config = ConfigRecord() if train_config is None else train_config
        self._result = Result()
        resume, self._resume = self._resume, None
        if resume is None:
            self._keys = set(initial_arrays.keys())
            self._evaluate(0, initial_arrays, evaluate_fn)
            arrays, now, first_round = initial_arrays, 0.0, 1
        else:  # continue with the round after the checkpoint's (its own model, not initial_arrays)
            self.timing.resume_clock()
            arrays = arrays_from_state(resume["arrays"])
            now, first_round = float(resume["now"]), int(resume["round"]) + 1
            self._keys = set(arrays.keys())
            if resume["result_arrays"]:
                self._result.arrays = arrays
        for rnd in range(first_round, num_rounds + 1):
            msgs = list(self.configure_train(rnd, arrays, train_config, grid))
            for m in msgs:
                m.metadata.group_id = str(rnd)
            sizes = wire_sizes(msgs)
            m_needed = len(msgs) - self.backups_for(len(msgs))
            ids = list(grid.push_messages(msgs))
            node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs)}
            size_of = dict(zip(ids, sizes))
            replies, took = self._collect(grid, ids, m_needed, timeout, order)
            info = AsyncRoundInfo(version=rnd, sim_s=now, order=order, groups=[str(rnd)])
            arrival: dict[str, float] = {}
            for mid, r in replies.items():
                self.timing.learn(r)
                why = self._why_unusable(r)
                if why is None:
                    arrival[mid] = self.timing.arrival(node_of[mid], now, size_of[mid], r, took[mid])
                    continue
                info.dropped.append(self.timing.name(node_of[mid]))
                if not r.has_error():
                    info.rejected += 1
                    info.reasons.append(f"node {node_of[mid]}: {why}")
            first = set(first_arrivals(arrival, m_needed)) if arrival else set()
            # Keep FedAvg's reply order (the order of the sampled messages): bit for bit.
            chosen = [replies[mid] for mid in ids if mid in first]
            # No reply: a dropout, unless the round had its m and stopped waiting for it.
            stopped_early = order == "arrival" and len(first) >= m_needed
            missing = [self.timing.name(node_of[mid]) for mid in ids if mid not in replies]
            info.late = [self.timing.name(node_of[mid]) for mid in ids if mid in arrival and mid not in first]
            if stopped_early:
                info.late += missing
            else:
                info.dropped += missing
            info.contributors = [self.timing.name(node_of[mid]) for mid in ids if mid in first]
            if len(first) >= m_needed:
                end = max(arrival[mid] for mid in first)
            else:  # fewer than m answered: the round waited for its timeout
                end = max([now + timeout] + [arrival[mid] for mid in first])
            now = info.sim_s = end
            info.staleness = [0] * len(chosen)
            new_arrays, metrics = self.aggregate_train(rnd, chosen) if chosen else (None, None)
            if new_arrays is not None:
                arrays = new_arrays
                self._result.arrays = arrays
                if metrics is not None:
                    self._result.train_metrics_clientapp[rnd] = metrics
            self._made(info)
            self._evaluate(rnd, arrays, evaluate_fn)
            if self._due(rnd):
                # A reply not waited for (arrival order, on a SuperLink) is of this round
                # and is never used: nothing of a later round is out.
                self._saving = {"round": rnd, "arrays": arrays, "now": now}
                try:
                    self._hook.save(rnd)
                finally:
                    self._saving = None
        if self._result.arrays is None:
            self._result.arrays = arrays
        return self._result

    def state_dict(self) -> dict[str, Any]:
        """The run after a round, as plain values (:mod:`fededge.strategies.resume`): the
        round, its model, the simulated time, who is placed where, the tallies and
        reports not yet taken. Read by ``hook.save`` at a checkpoint."""
        if self._saving is None:
            raise RuntimeError("backup workers: state_dict() is read at a checkpoint (hook.save), "
                               "after a round")
        return {**self._loop_state(), "round": self._saving["round"],
                "arrays": arrays_to_state(self._saving["arrays"]), "now": self._saving["now"],
                "result_arrays": self._result.arrays is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next :meth:`start` runs the rounds after
        the checkpoint's, from its model (``initial_arrays`` unused)."""
        self._load_loop_state(state)
        self._resume = state

    def _collect(self, grid: Grid, ids: list[str], m_needed: int, timeout: float,
                 order: str) -> tuple[dict[str, Message], dict[str, float]]:
        """The round's replies, and the real seconds each took from push to pull: all of
        them (clock order; the first m are picked on the clock), or the first ``m``
        usable ones in real time (arrival order)."""
        got: dict[str, Message] = {}
        took: dict[str, float] = {}
        t0 = time.monotonic()
        puller = Puller(grid)
        while True:
            left = [mid for mid in ids if mid not in got]
            if left:
                for r in puller.poll(left):
                    got[r.metadata.reply_to_message_id] = r
                    took[r.metadata.reply_to_message_id] = time.monotonic() - t0
            usable = sum(1 for r in got.values() if not r.has_error())
            if len(got) == len(ids) or (order == "arrival" and usable >= m_needed):
                return got, took
            if time.monotonic() - t0 >= timeout:
                return got, took
            time.sleep(self.poll_s)
