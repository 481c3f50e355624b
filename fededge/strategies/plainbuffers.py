"""``PlainBuffers(strategy)``: a server optimiser's step on parameters only.

Flower's server-optimiser strategies (FedAvgM, FedAdam, FedAdagrad, FedYogi) step every
array of the model, its normalisation statistics and counters too. Those are buffers, not
parameters (``torch.optim`` steps ``model.parameters()`` only): BatchNorm's running variance
under FedAvgM's server momentum 0.9 went negative and the model evaluated to NaN from
round 2, and its ``num_batches_tracked`` ran ahead of the steps taken. This wrapper gives
the statistics and the integer counters the clients' weighted average (FedAvg's), as
:class:`~fededge.algorithms.outer.OuterSGD` does for DiLoCo, and returns every array in
the dtype it was sent in: Flower's average is float64 (a counter came back 8.75, which
the clients' ``load_state_dict`` truncated), and FedAdam's step by a float64 scalar made
a float32 model float64, which doubled every downlink from round 2.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fededge import _flwr_internals as fi
from fededge.algorithms.normstats import statistic_names
from fededge.arrays import from_numpy, to_numpy
from fededge.strategies.compressed import integer_dtypes
from fededge.strategies.delegate import DelegatesEvaluation
from fededge.strategies.report import RoundReport, report_of

__all__ = ["PlainBuffers"]

class PlainBuffers(DelegatesEvaluation):
    """Wrap a strategy whose aggregate steps every array so that the model's
    normalisation statistics (``running_mean``/``running_var``) and integer buffers
    (``num_batches_tracked``) are the clients' weighted average instead.

    The record of the round's model is changed in place, so a strategy that keeps it as
    its current model (FedAvgM) continues from the averaged buffers.
    """

    #: a checkpoint of a run of the inner strategy alone (before this wrapper) resumes here
    resumes_inner_checkpoints = True

    def __init__(self, inner: Strategy) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"PlainBuffers wraps a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        self.inner = inner
        # the model's buffers, found in the first arrays sent (public: a checkpoint keeps them,
        # as a resumed run's arrays come averaged, its integers as floats)
        self.buffer_names: list[str] | None = None
        self._sent_dtypes: dict[str, str] = {}  # name -> dtype of the round's model, as sent

    def __getattr__(self, name: str):  # noqa: ANN204 - the inner strategy's settings (server_momentum, eta, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def round_report(self, server_round: int) -> RoundReport:
        return report_of(self.inner, server_round)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.buffer_names is None:
            # The model's buffers: its statistics and counters by name (a resumed run's
            # counters come averaged, as floats), and its integer and bool arrays.
            integers = integer_dtypes(arrays)
            self.buffer_names = [*statistic_names(dict(arrays.items())),
                                 *(k for k in arrays.keys() if k.rsplit(".", 1)[-1] == "num_batches_tracked"
                                   or k in integers)]
        self._sent_dtypes = {k: str(a.dtype) for k, a in arrays.items()}
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # noqa: ANN201
        replies = list(replies)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        self._average_buffers(arrays, replies)
        for k in arrays.keys():  # in place, as the buffers (FedAvgM keeps this record)
            sent = self._sent_dtypes.get(k)
            if sent is not None and str(arrays[k].dtype) != sent:
                nd, want = to_numpy(arrays[k]), np.dtype(sent)
                if want.kind == "b":
                    nd = nd != 0
                elif want.kind in "iu":
                    nd = np.rint(nd)
                arrays[k] = from_numpy(np.asarray(nd.astype(want)))  # (np.rint of a 0-d array is a scalar)
        return arrays, metrics

    def _average_buffers(self, arrays: ArrayRecord, replies: list[Message]) -> None:
        """The buffers of ``arrays``, in place: the clients' weighted average."""
        if not self.buffer_names:
            return
        key = getattr(self.inner, "arrayrecord_key", "arrays")
        weight = getattr(self.inner, "weighted_by_key", "num-examples")
        parts = []
        for r in replies:
            if r.has_error() or key not in r.content:
                continue
            rec = r.content[key]
            names = [k for k in self.buffer_names if k in rec and k in arrays]
            parts.append(RecordDict({"arrays": ArrayRecord({k: rec[k] for k in names}),
                                     **{n: r.content[n] for n in r.content.metric_records.keys()}}))
        if not parts or not len(parts[0]["arrays"]):
            return
        averaged = fi.aggregate_arrayrecords(parts, weight)  # FedAvg's own average
        for k in averaged.keys():
            arrays[k] = averaged[k]
