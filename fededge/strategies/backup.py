"""Backup workers: synchronous rounds that aggregate the first ``m`` of ``m + e`` replies."""

from __future__ import annotations

import logging
import time
from typing import Any

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fededge._flwr_internals import wire_sizes
from fededge.algorithms.asyncfl import LoopConfig, first_arrivals
from fededge.strategies.arrivals import Puller, resolve_order
from fededge.strategies.asyncloop import AsyncLoop, AsyncRoundInfo, log
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

    label = "BackupWorkers"

    def __init__(self, *, backup: int | float = LoopConfig.backup, **loop: Any) -> None:
        super().__init__(**loop)
        self.loop_config = LoopConfig(order=self.order, backup=backup)
        self.backup = backup
        self._saving: dict[str, Any] | None = None  # the round being checkpointed
        self._order = "clock"

    def backups_for(self, sampled: int) -> int:
        """e for a round of ``sampled`` clients (at least one is always aggregated)."""
        return self.loop_config.backups_for(sampled)

    # -- the run (OwnLoop's start) ---------------------------------------------------
    def _prepare(self, grid: Grid, initial_arrays: ArrayRecord, resume: dict[str, Any] | None) -> None:
        self._order = resolve_order(self.order, grid)
        if self._order == "clock":
            rule, measured = self.timing.compute_rule(self.step_s)
            log.log(logging.WARNING if measured else logging.INFO,
                    "BackupWorkers: the first replies on the simulated clock; %s", rule)
        if resume is None:
            self._keys = set(initial_arrays.keys())
        self._at: tuple[ArrayRecord, float] = (initial_arrays, 0.0)  # the model and the simulated time

    def _restore(self, grid: Grid, state: dict[str, Any]) -> int:
        """Continue with the round after the checkpoint's (its own model, not initial_arrays)."""
        self.timing.resume_clock()
        arrays = arrays_from_state(state["arrays"])
        self._at = (arrays, float(state["now"]))
        self._keys = set(arrays.keys())
        if state["result_arrays"]:
            self._result.arrays = arrays
        return int(state["round"])

    def _rounds(self, grid: Grid, done: int, num_rounds: int, timeout: float) -> None:
        order = self._order
        arrays, now = self._at
        for rnd in range(done + 1, num_rounds + 1):
            msgs = list(self.configure_train(rnd, arrays, self._train_config, grid))
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
            # Ranked by arrival, ties by client (partition id): message ids are random per run,
            # and equal arrivals are the rule on an ideal link with sim-step-s.
            named = {self.timing.name(node_of[mid]): mid for mid in arrival}
            first = {named[c] for c in first_arrivals({c: arrival[mid] for c, mid in named.items()}, m_needed)} \
                if arrival else set()
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
            self._evaluate(rnd, arrays)
            # A reply not waited for (arrival order, on a SuperLink) is of this round and
            # is never used: nothing of a later round is out at a checkpoint.
            self._at = (arrays, now)
            self._round_done(rnd)
        if self._result.arrays is None:
            self._result.arrays = arrays

    def _checkpoint(self, t: int) -> None:
        self._saving = {"round": t, "arrays": self._at[0], "now": self._at[1]}
        try:
            super()._checkpoint(t)
        finally:
            self._saving = None

    def _extra_state(self) -> dict[str, Any]:
        """The run after a round, as plain values (:mod:`fededge.strategies.resume`): the
        round, its model, the simulated time, who is placed where, the tallies and
        reports not yet taken. Read by ``hook.save`` at a checkpoint."""
        if self._saving is None:
            raise RuntimeError("backup workers: state_dict() is read at a checkpoint (hook.save), "
                               "after a round")
        return {**super()._extra_state(), "arrays": arrays_to_state(self._saving["arrays"]),
                "now": self._saving["now"], "result_arrays": self._result.arrays is not None}

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
