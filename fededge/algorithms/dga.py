"""Delayed Gradient Averaging (Zhu et al., NeurIPS 2021), in the local-SGD round form.

The paper's per-iteration rule, for worker ``j`` at iteration ``i`` with delay ``D``::

    w(i,j) <- w(i,j) - eta * ( grad w(i,j) - grad w(i-D,j) + avg grad w(i-D) )

Worker j applies its own fresh gradient at once. When the average of iteration ``i-D``
arrives, D iterations late, the worker swaps its own stale contribution for it. Without the
correction, only the stale average is applied (``w <- w - eta * avg grad w(i-D)``:
plain delayed SGD), and accuracy falls as D grows.

**Round form** (what fededge runs). A client communicates every ``K`` local SGD steps. Let
``Δ(t,j)`` be the change of client j's model over its K steps of round t (``x_after -
x_before``, so ``-eta * sum of its gradients`` for plain SGD), and ``Δ̄(t)`` the average
of round t over the clients, weighted by their example counts. The average of round t is
sent at the end of round t and arrives D rounds later, at the end of round ``t + D``:

- with correction:    x(t+1, j) = x(t, j) + Δ(t, j) - Δ(t-D, j) + Δ̄(t-D)
- without correction: x(t+1, j) = x(t, j) + Δ̄(t-D)

with ``Δ(s, j) = Δ̄(s) = 0`` for ``s < 1`` (nothing arrives in the first D rounds).
Unrolled, the corrected client model is the global model made of every average that has
arrived, plus the client's own last D updates (those still in flight)::

    x(t+1, j) = x(1) + sum_{s <= t-D} Δ̄(s) + sum_{t-D < s <= t} Δ(s, j)

``D = 0`` is synchronous local SGD (FedAvg with K local steps) whichever the correction,
since the round's own average arrives at its end. ``warmup_rounds`` runs the first rounds
with ``D = 0``, as the paper's warm-up does. A round-t client computes its K steps from
``x(t, j)``, so the gradient staleness it experiences is between ``K*D`` and ``K*(D+1)-1``
local steps. With K = 1 this is the paper's per-iteration rule exactly.

This module is the client-side state and arithmetic, pure torch (no Flower). The server
only averages; the clock decides when averages arrive (fededge.netem.clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from fededge.netem.clock import ClientRound, SimClock

__all__ = ["DGAConfig", "DGAClient", "DGATimeline", "average"]

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DGAConfig:
    """DGA's knobs.

    Parameters
    ----------
    delay : int
        D, in rounds (communication periods of K local steps): how many rounds late the
        average of a round arrives. 0 is synchronous local SGD.
    correction : bool
        Swap the client's own stale update for the average (DGA) rather than applying
        the stale average alone (plain delayed averaging).
    warmup_rounds : int
        The first rounds run with D = 0 (synchronous), before the delay starts.
    """

    delay: int = 0
    correction: bool = True
    warmup_rounds: int = 0

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0 rounds, got {self.delay}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")

    def delay_at(self, rnd: int) -> int:
        """The delay of round ``rnd`` (1-based): 0 during the warm-up."""
        return 0 if rnd <= self.warmup_rounds else self.delay


def average(deltas: list[Weights], weights: list[float]) -> Weights:
    """Δ̄: the weighted mean of the clients' round deltas (FedAvg's weighting)."""
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"need one weight per delta, got {len(deltas)} deltas and {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    return {k: sum(d[k] * (w / total) for d, w in zip(deltas, weights)) for k in deltas[0]}


@dataclass
class DGAClient:
    """One client's DGA state: its local model and its own updates still in flight.

    Per round: :meth:`finish_round` with the change of its K local steps, then
    :meth:`receive` for each average that has arrived. Both keep ``model`` exactly as
    the round-form rule above says. ``state_dict()`` is what goes in ``context.state``.
    """

    config: DGAConfig
    model: Weights
    in_flight: dict[int, Weights] = field(default_factory=dict)  # round -> own delta

    def finish_round(self, rnd: int, delta: Weights) -> None:
        """Record round ``rnd``'s own change; with the correction it is applied at once."""
        if rnd in self.in_flight:
            raise ValueError(f"round {rnd} was already finished")
        if self.config.correction:
            self.model = {k: v + delta[k] for k, v in self.model.items()}
        self.in_flight[rnd] = {k: v.clone() for k, v in delta.items()}

    def receive(self, rnd: int, avg: Weights) -> None:
        """The average of round ``rnd`` has arrived: apply it (corrected or not)."""
        own = self.in_flight.pop(rnd, None)
        if own is None:
            raise ValueError(f"the average of round {rnd} arrived, but this client has no update "
                             f"of that round in flight (in flight: {sorted(self.in_flight)})")
        if self.config.correction:
            self.model = {k: v - own[k] + avg[k] for k, v in self.model.items()}
        else:
            self.model = {k: v + avg[k] for k, v in self.model.items()}

    def staleness(self) -> int:
        """Rounds whose average this client is still waiting for."""
        return len(self.in_flight)

    def state_dict(self) -> Weights:
        out = {f"model/{k}": v for k, v in self.model.items()}
        for rnd, d in self.in_flight.items():
            out.update({f"inflight/{rnd}/{k}": v for k, v in d.items()})
        return out

    @classmethod
    def from_state_dict(cls, config: DGAConfig, state: Weights) -> "DGAClient":
        model: Weights = {}
        in_flight: dict[int, Weights] = {}
        for key, v in state.items():
            kind, _, rest = key.partition("/")
            if kind == "model":
                model[rest] = v
            elif kind == "inflight":
                rnd, _, name = rest.partition("/")
                in_flight.setdefault(int(rnd), {})[name] = v
            else:
                raise ValueError(f"unknown DGA state key {key!r}")
        return cls(config, model, in_flight)


class DGATimeline:
    """When each DGA round happens on the simulated clock: the overlap the protocol allows.

    Client ``j`` starts round ``t`` when all of these hold:
    - its previous local steps are done;
    - its previous reply has left it (its uplink is free);
    - the averages the rule applies by then have arrived. Those are every round ``s``
      with ``s + D(s) <= t - 1``, and, for round 1, the initial model.

    The average of round ``t`` is ready at the server when the last upload of round
    ``t`` has arrived. It is then sent down to every client. So a slow client delays
    the others only through the averages they wait for. With ``D = 0`` this is
    synchronous FedAvg: download, compute, upload, wait for everyone
    (:func:`fededge.netem.clock.synchronous_round` gives the same times).

    Built only from the clock's primitives (``send_down``, ``compute``, ``send_up``,
    ``up_departed``).
    """

    def __init__(self, clock: SimClock, config: DGAConfig, *, model_bytes: int,
                 clients: Sequence[int]) -> None:
        self.clock = clock
        self.config = config
        self.clients = list(clients)
        self._free = {j: 0.0 for j in self.clients}  # end of the client's last compute
        # down[j][s]: when the average of round s reached client j (s = 0: the initial model)
        self.down: dict[int, dict[int, float]] = {
            j: {0: clock.send_down(j, model_bytes, 0.0)} for j in self.clients}
        self.ready: dict[int, float] = {0: 0.0}  # round -> its average ready at the server
        self.started: dict[tuple[int, int], float] = {}

    def _needed(self, t: int) -> int:
        """The last round whose average client models include when round t starts."""
        done = [s for s in range(1, t) if s + self.config.delay_at(s) <= t - 1]
        return max(done, default=0)

    def run_round(self, t: int, work: Sequence[ClientRound]) -> float:
        """Schedule round ``t`` (measured compute and bytes per client); return when its
        average is ready at the server (the round's end on the clock)."""
        need = self._needed(t)
        arrivals = []
        for c in work:
            j = c.client
            start = max(self._free[j], self.clock.up_departed(j), self.down[j][need])
            self.started[(t, j)] = start
            self._free[j] = self.clock.compute(j, c.compute_s, start)
            arrivals.append(self.clock.send_up(j, c.bytes_up, self._free[j]))
        self.ready[t] = max(arrivals, default=self.ready[t - 1])
        down_bytes = {c.client: c.bytes_down for c in work}
        for j in self.clients:
            self.down[j][t] = self.clock.send_down(j, down_bytes.get(j, 0), self.ready[t])
        self.clock.now = max(self.clock.now, self.ready[t])
        return self.ready[t]
