"""How a strategy tells the measurement layer what its round did: one small interface.

:class:`fededge.server.experiment.Experiment` meters the bytes of every message, times each
round on the simulated clock and writes ``metrics.jsonl``. For Flower's own strategies
it needs nothing from them: a round is a synchronous round of the messages metered
since the previous one. A strategy that knows more (rejected updates, staleness, its
own overlap of rounds, a decentralised model per node) implements:

``round_report(server_round) -> RoundReport``
    called once per round (version), right after the strategy's ``evaluate_fn`` call
    for that round; every field has a default meaning "the experiment's own figure".

``attach_clock(clock: RunClock) -> None`` (optional)
    called before ``start`` by a strategy that times its own rounds (DGA's overlap,
    gossip's edges, asynchronous arrivals); it then reports ``sim_s``.

A wrapper (``Compressed(FedAdam(...))``) merges its own report with its inner
strategy's (:meth:`RoundReport.merge`, :func:`report_of`) and passes the clock on
(:func:`attach_clock`). No class list lives in the experiment: a new strategy is one
file that implements these two methods.

Pure: no Flower.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from fededge.netem.runclock import RunClock
from fededge.wrapping import first_with

__all__ = ["MeasuredStrategy", "RoundReport", "attach_clock", "report_of"]


@dataclass
class RoundReport:
    """What one round (or server version) did, beyond what the metering sees.

    Parameters
    ----------
    groups : tuple of str, optional
        The message ``group_id`` values whose metered traffic belongs to this round (a
        strategy that keeps several rounds in flight); None: every message metered since
        the previous round; ``()``: none.
    sim_s : float, optional
        The round's duration on the simulated clock, when the strategy timed it itself
        (after :meth:`MeasuredStrategy.attach_clock`); None: the experiment times the
        round's metered traffic as a synchronous round.
    num_clients : int, optional
        Client updates the round used; None: the train replies that were neither errors
        nor ``rejected``.
    rejected : int
        Replies that arrived but could not be used (did not decode, wrong shape).
    mismatched : int
        Of the ``rejected``: updates refused because they came in another codec than the
        server was told the clients use (a
        :class:`~fededge.strategies.compressed.CodecMismatchError`).
    reasons : list of str
        One line per rejection, reported once each ("a compressed update was rejected
        and left out: node 7: ...").
    payload_bytes, dense_bytes : int
        Compressed updates: their payloads' bytes, and what the same tensors weigh as
        float32. ``compression_ratio`` is ``dense_bytes / payload_bytes``.
    bytes_up_excluded : int
        Uplink bytes that are not training traffic (gossip's evaluation copies), left
        out of ``bytes_up``.
    dropped : list of int, optional
        Clients (partition ids) that never answered; None: those the metering saw.
    metrics : dict
        Extra figures for this round's line of ``metrics.jsonl``, written flat.
    node_models : dict, optional
        Decentralised training: each node's model (a torch state dict), evaluated by the
        experiment with its evaluate function into ``node_accuracy_mean/min/max`` and
        ``node_loss_mean``; the same object for several nodes is evaluated once.
    notes : list of str
        Lines for the progress display (a topology's description).
    summary : dict
        Run-level figures for ``summary.json`` (cumulative: the latest report's win).

    Examples
    --------
    >>> RoundReport(rejected=1, reasons=["a client update was rejected and left out: node 3: NaN"],
    ...             metrics={"staleness": 0.5}).merge(RoundReport(payload_bytes=10, dense_bytes=40)).ratio
    4.0
    """

    groups: tuple[str, ...] | None = None
    sim_s: float | None = None
    num_clients: int | None = None
    rejected: int = 0
    mismatched: int = 0
    reasons: list[str] = field(default_factory=list)
    payload_bytes: int = 0
    dense_bytes: int = 0
    bytes_up_excluded: int = 0
    dropped: list[int] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    node_models: dict[int, Any] | None = None
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """The round's compression ratio, or None when nothing came compressed."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else None

    def merge(self, other: RoundReport) -> RoundReport:
        """This report with a wrapper's ``other`` added: counts summed, lists joined,
        figures united (``other``'s win); the fields ``other`` leaves at their default
        keep this one's."""
        def either(mine: Any, theirs: Any) -> Any:
            return mine if theirs is None else theirs

        return replace(
            self,
            groups=either(self.groups, other.groups),
            sim_s=either(self.sim_s, other.sim_s),
            num_clients=either(self.num_clients, other.num_clients),
            rejected=self.rejected + other.rejected,
            mismatched=self.mismatched + other.mismatched,
            reasons=[*self.reasons, *other.reasons],
            payload_bytes=self.payload_bytes + other.payload_bytes,
            dense_bytes=self.dense_bytes + other.dense_bytes,
            bytes_up_excluded=self.bytes_up_excluded + other.bytes_up_excluded,
            dropped=None if self.dropped is None and other.dropped is None
            else [*(self.dropped or []), *(other.dropped or [])],
            metrics={**self.metrics, **other.metrics},
            node_models=either(self.node_models, other.node_models),
            notes=[*self.notes, *other.notes],
            summary={**self.summary, **other.summary},
        )


@runtime_checkable
class MeasuredStrategy(Protocol):
    """A strategy that reports its rounds (the module docstring). ``attach_clock`` is
    optional and not part of the runtime check."""

    def round_report(self, server_round: int) -> RoundReport:
        """What round (version) ``server_round`` did; called once, after its evaluation."""
        ...


def report_of(strategy: object, server_round: int) -> RoundReport:
    """``strategy.round_report(server_round)``, or an empty report for a strategy without
    one (Flower's own: the metering's figures stand).

    Examples
    --------
    >>> from flwr.serverapp.strategy import FedAvg
    >>> report_of(FedAvg(), 1) == RoundReport()
    True
    """
    if isinstance(strategy, MeasuredStrategy):
        return strategy.round_report(server_round)
    return RoundReport()


def attach_clock(strategy: object, clock: RunClock) -> None:
    """Hand ``clock`` to a strategy that times its own rounds, or to the strategy a wrapper
    without ``attach_clock`` of its own wraps (its ``inner``); others need none."""
    target = first_with(strategy, "attach_clock")
    if target is not None:
        target.attach_clock(clock)
