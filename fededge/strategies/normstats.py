"""``NormCalibrated(strategy)``: the server's model with normalisation statistics of its own.

Every round, after the inner strategy has aggregated its clients' updates, the wrapper
sends the aggregated model to that round's clients in a ``query.norm_stats`` message;
each answers with the BatchNorm statistics of exactly that model on a few batches of its
own data (:func:`fededge.protocol.norm_stats_content`), and the wrapper pools them into
the statistics of the clients' union (:func:`fededge.algorithms.normstats.pool_statistics`)
and puts them into the model it returns. The server then evaluates, and sends next
round, weights with statistics that belong to them, whatever the uplink did to the
weights: averaged statistics describe a model the server never holds, and under a lossy
uplink (PowerSGD rank 2 on a BatchNorm CNN) that, not the weights, made the accuracy
swing between rounds (BENCHMARKS.md, issue 36).

The price is one more exchange per round: the model down to each client again, forward
passes on ``batches`` mini-batches, and the statistics up (a few kB). The metering counts
its bytes, and the simulated clock charges it as a second synchronous exchange after the
round's training.

An answer that does not fit the model (names, shapes, NaN, a negative variance) or an
error is left out and reported; a round in which no client answered keeps the inner
strategy's statistics, with one warning. A round 1 in which every client answered with
an error stops the run: the clients do not answer the query (fededge's ClientApp does;
a ClientApp of one's own registers ``@app.query("norm_stats")``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fededge import keys
from fededge.algorithms.normstats import NormStatsError, check_statistics, pool_statistics, statistic_names
from fededge.arrays import record_to_torch
from fededge.compress import MalformedPayloadError
from fededge.errors import ConfigError
from fededge.protocol import read_norm_stats
from fededge.strategies.compressed import Compressed
from fededge.strategies.delegate import DelegatesEvaluation
from fededge.strategies.report import RoundReport, report_of
from fededge.wrapping import chain

__all__ = ["NormCalibrated", "NormStatsQueryError"]

log = logging.getLogger(__name__)


class NormStatsQueryError(ConfigError):
    """No client answers the ``query.norm_stats`` message: a configuration that cannot work."""


class NormCalibrated(DelegatesEvaluation):
    """Wrap a strategy on Flower's round loop so that its model's normalisation statistics
    are those of its own aggregated weights, pooled from the round's clients.

    Parameters
    ----------
    inner : Strategy
        Any strategy on Flower's round loop (``Compressed(...)`` included).
    batches : int
        Mini-batches each client runs forward for the statistics (its batch size is its
        own). 8 by default, as ``norm-stats-batches``.
    timeout : float, optional
        Seconds to wait for the answers (None: Flower's default).

    Examples
    --------
    >>> from flwr.serverapp.strategy import FedAvg
    >>> strategy = NormCalibrated(FedAvg(), batches=8)
    """

    def __init__(self, inner: Strategy, *, batches: int = 8, timeout: float | None = None) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"NormCalibrated wraps a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        if getattr(inner, "compressed_form", None) is not None:
            raise ValueError(f"NormCalibrated wraps strategies on Flower's round loop; {type(inner).__name__} "
                             "runs its own (and keeps its own rule for the statistics)")
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            raise ValueError(f"batches must be an integer >= 1, got {batches!r}")
        self.inner = inner
        decoder = next((s for s in chain(inner) if isinstance(s, Compressed)), None)
        if decoder is not None:  # (directly inside, or under another wrapper: PlainBuffers)
            # Its clients may leave the statistics out (norm-stats=global): the server's
            # own, recalibrated here, stand in for them also where no UpdateConfig says so.
            decoder.server_sets_statistics = True
        self.batches = batches
        self.timeout = timeout
        self._grid: Grid | None = None
        self._reasons: list[str] = []
        self._calibrated: dict[int, int] = {}  # round -> clients whose statistics were pooled
        self._reported = False  # someone takes the round reports (and reports the reasons)

    def round_report(self, server_round: int) -> RoundReport:
        self._reported = True
        reasons, self._reasons = self._reasons, []
        pooled = self._calibrated.pop(server_round, None)
        return report_of(self.inner, server_round).merge(RoundReport(
            reasons=reasons, metrics={} if pooled is None else {"norm_stats_clients": pooled}))

    # -- Strategy ------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._grid = grid
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # noqa: ANN201
        replies = list(replies)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        if arrays is None or self._grid is None:
            return arrays, metrics
        model = record_to_torch(arrays)
        names = statistic_names(model)
        if not names:
            return arrays, metrics
        largest = max(v.numel() for k, v in model.items() if k in names)
        # The round's clients that trained (aggregated arrays mean at least one did).
        config = ConfigRecord({keys.SERVER_ROUND: server_round, keys.NORM_STATS_BATCHES: self.batches})
        queries = [Message(content=RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}),
                           message_type=keys.NORM_STATS_QUERY, dst_node_id=r.metadata.src_node_id)
                   for r in replies if not r.has_error()]
        answers = list(self._grid.send_and_receive(queries, timeout=self.timeout))
        parts, errors = [], []
        for a in answers:
            node = a.metadata.src_node_id
            try:
                if a.has_error():
                    raise ValueError(a.error.reason)
                n, stats = read_norm_stats(a.content, max_elements=largest)
                check_statistics(stats, model)
                if n < 1:
                    raise NormStatsError(f"num-examples {n}")
                parts.append((n, {k: stats[k] for k in names}))
            except (ValueError, NormStatsError, MalformedPayloadError) as err:
                errors.append(f"node {node}: {err}")
        for e in errors:
            self._reasons.append(f"a norm-stats answer was left out: {e}")
            log.log(logging.DEBUG if self._reported else logging.WARNING, "round %d: a norm-stats answer was "
                    "left out: %s", server_round, e)
        if not parts:
            if server_round == 1 and errors and len(errors) == len(answers):
                raise NormStatsQueryError(
                    f"norm-stats=global: no client answered the '{keys.NORM_STATS_QUERY}' message in round 1 "
                    f"({errors[0]}); the ClientApp must answer it (fededge's does; one of your own: "
                    f"@app.query('{keys.NORM_STATS_ACTION}') returning fededge.protocol.norm_stats_content), "
                    "or set norm-stats to 'decoded'")
            log.warning("round %d: no client's normalisation statistics arrived (%d asked); the model keeps "
                        "the aggregated ones", server_round, len(queries))
            return arrays, metrics
        pooled = pool_statistics(parts)
        out = ArrayRecord()
        for name in arrays.keys():
            out[name] = Array(pooled[name].numpy()) if name in pooled else arrays[name]
        self._calibrated[server_round] = len(parts)
        return out, metrics
