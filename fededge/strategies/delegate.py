"""What a wrapper strategy passes to the strategy it wraps unchanged.

:class:`~fededge.strategies.compressed.Compressed` and
:class:`~fededge.strategies.normstats.NormCalibrated` change the training half of a
round; its evaluation half and the run's summary are the inner strategy's.
"""

from __future__ import annotations

from flwr.serverapp.strategy import Strategy

__all__ = ["DelegatesEvaluation"]


class DelegatesEvaluation(Strategy):
    """A wrapper (``self.inner``) whose evaluation and summary are its inner strategy's."""

    inner: Strategy

    def configure_evaluate(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):  # noqa: ANN001, ANN201
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.inner.summary()
