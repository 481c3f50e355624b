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

**What travels** (the form the Flower strategy uses). Rather than the bare average
``Δ̄(s)``, the server sends the *global model* ``G(s) = x(1) + sum_{r <= s} Δ̄(r)``, the
same number of bytes, so a client never drifts from the server through rounding and a
client that missed a message is put right by the next one. Round t's message carries
``G(g)`` with ``g = last_arrived(config, t)``, the newest round whose average the rule has
delivered by the start of round t (``t - 1 - D`` after the warm-up); it carries no arrays
when ``g`` did not change. The client rebuilds its model (:meth:`DGAClient.sync`):

- with correction:    x(t, j) = G(g) + sum_{g < s < t} Δ(s, j)   (its own updates in flight)
- without correction: x(t, j) = G(g)

runs its K steps to ``x'``, and replies ``y(t, j) = x' - sum_{g < s < t} Δ(s, j)``, which is
``G(g) + Δ(t, j)`` (:meth:`DGAClient.train_round`). The server takes the weighted mean
``ȳ(t) = G(g) + Δ̄(t)`` (Flower's own FedAvg aggregation) and advances
``G(t) = G(t-1) + ȳ(t) - G(g)`` (:class:`DGAServer`). When ``g = t - 1`` (D = 0, or the
warm-up) the reply is ``x'`` itself and ``G(t) = ȳ(t)``: bit for bit FedAvg with K local
steps. Both forms give the same models (tests check them against each other).

This module is the arithmetic, pure torch (no Flower): the client's state, the server's
global-model history, and the timeline on the simulated clock (fededge.netem.clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Mapping, Sequence, TypeVar

import torch

from fededge.netem.clock import ClientRound, SimClock

__all__ = ["NORM_STATISTICS", "PIPELINE_MODES", "DGAConfig", "DGAClient", "DGAServer", "DGAStateError", "DGATimeline",
           "average", "inflight_prefix", "last_arrived", "norm_statistics", "round_delta", "stale_stability_limit"]

Weights = dict[str, torch.Tensor]
T = TypeVar("T")

#: How the server schedules DGA's rounds (:attr:`DGAConfig.pipeline`).
PIPELINE_MODES: tuple[str, ...] = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class DGAConfig:
    """DGA's knobs. Run-config keys in brackets; this class declares each knob once
    (its default, its check and its meaning) for the library and for fededge's app.

    Parameters
    ----------
    delay : int
        [dga-delay] D, in rounds (communication periods of K local steps): how many rounds
        late the average of a round arrives. 0 is synchronous local SGD (FedAvg with K
        local steps), bit for bit.
    correction : bool
        [dga-correction] Swap the client's own stale update for the average (DGA, Zhu et
        al., 2021) rather than applying the stale average alone (plain delayed averaging,
        for the ablation).
    warmup_rounds : int
        [dga-warmup-rounds] The first rounds run with D = 0 (synchronous), before the
        delay starts.
    pipeline : str
        [dga-pipeline] How the server schedules rounds: ``auto`` pushes rounds ahead (real
        overlap) where the grid runs each node's messages in order (a SuperLink
        deployment, the in-process runtime) and keeps one message per node in flight
        elsewhere (Ray simulation); ``on`` / ``off`` force it (``on`` on a grid that may
        run two messages of one node at once is refused). See docs/algorithms.md.
    compute_ahead : bool
        [dga-compute-ahead] Each round's message also carries the next round's content
        (its config and ``G(g)``; a *preview*), wherever that global model already exists
        (:meth:`previews`: this round's own delay is at least 1; not in the run's last
        round nor in a checkpoint round), and the next message then refers to it instead of
        repeating it. A node with a warm worker (``fededge supernode``) computes the next
        round in the background as soon as it has replied, so its compute overlaps its own
        upload, Flower's pull of the next message and that message's start-up: DGA's
        overlap on nodes that pull their messages one at a time. The models are those of
        the same run without it, bit for bit; only when things happen changes
        (:class:`fededge.clients.preview.PreviewMod` on the client, ``DGATimeline`` on the
        clock). Nodes without a warm worker compute in the foreground, as before.
    """

    delay: int = 0
    correction: bool = True
    warmup_rounds: int = 0
    pipeline: str = "auto"
    compute_ahead: bool = False

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0 rounds, got {self.delay}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINE_MODES)}, got {self.pipeline!r}")
        if not isinstance(self.compute_ahead, bool):
            raise ValueError(f"compute_ahead must be true or false, got {self.compute_ahead!r}")

    def delay_at(self, rnd: int) -> int:
        """The delay of round ``rnd`` (1-based): 0 during the warm-up."""
        return 0 if rnd <= self.warmup_rounds else self.delay

    def previews(self, rnd: int) -> bool:
        """Whether round ``rnd``'s message may carry round ``rnd + 1``'s content
        (:attr:`compute_ahead`): only where the next round's global model exists before
        round ``rnd`` is averaged (``last_arrived(rnd + 1) < rnd``: round ``rnd``'s own
        average is not due at its end, its delay is at least 1)."""
        return self.compute_ahead and last_arrived(self, rnd + 1) < rnd


class DGAStateError(ValueError):
    """A client's DGA state does not fit the message it got (for example a SuperNode that
    restarted and lost its ``context.state``). The server resends the global model."""


def last_arrived(config: DGAConfig, t: int) -> int:
    """``g``: the newest round whose average has arrived when round ``t`` starts.

    Averages arrive in round order (round ``s`` at the end of round ``s + D(s)``), so every
    round up to ``g`` has arrived and none after it. 0 means only the initial model.
    """
    if t < 1:
        raise ValueError(f"rounds start at 1, got {t}")
    for s in range(t - 1, 0, -1):  # arrival is monotone in s: the first hit is the newest
        if s + config.delay_at(s) <= t - 1:
            return s
    return 0


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

    Two equivalent drivers. The average form, per round: :meth:`finish_round` with the
    change of its K local steps, then :meth:`receive` for each average that has arrived.
    The global-model form (what the ClientApp runs): :meth:`sync` with the global model
    of round ``g`` when a message brings one, then :meth:`train_round` with the model
    after the K steps, which returns the reply. ``state_dict()`` is what goes in
    ``context.state``.
    """

    config: DGAConfig
    model: Weights
    in_flight: dict[int, Weights] = field(default_factory=dict)  # round -> own delta
    global_round: int = 0  # the newest round whose average ``model`` includes

    # -- the average form ------------------------------------------------------------
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
        self.global_round = max(self.global_round, rnd)

    # -- the global-model form -------------------------------------------------------
    def sync(self, g: int, global_model: Weights | None) -> None:
        """Round ``g``'s global model ``G(g)`` has arrived (``None``: nothing new; the
        message says the client already holds ``G(g)``).

        Own updates of rounds ``<= g`` are now inside ``G(g)`` and leave the in-flight
        list. With the correction the model is ``G(g)`` plus the rest in flight;
        without it, ``G(g)``.
        """
        if global_model is None:
            if g != self.global_round:
                raise DGAStateError(
                    f"the message says this client holds the global model of round {g}, but its "
                    f"state holds round {self.global_round} (a SuperNode restarted, or a message "
                    "failed); the server resends the global model on its next message")
            return
        if g < self.global_round:
            raise DGAStateError(f"global model of round {g} arrived after that of round {self.global_round}")
        self.in_flight = {s: d for s, d in self.in_flight.items() if s > g}
        model = {k: v.clone() for k, v in global_model.items()}
        if self.config.correction:
            for s in sorted(self.in_flight):
                model = {k: v + self.in_flight[s][k] for k, v in model.items()}
        self.model = model
        self.global_round = g

    def train_round(self, t: int, after: Weights) -> Weights:
        """Round ``t``'s K steps took ``model`` to ``after``: record the change, return
        the reply ``after - (own updates in flight)``, which is ``G(g) + Δ(t)``."""
        if t in self.in_flight or t <= self.global_round:
            raise DGAStateError(f"round {t} was already trained (global round {self.global_round}, "
                                f"in flight {sorted(self.in_flight)})")
        delta = {k: after[k] - v for k, v in self.model.items()}
        reply = {k: v.clone() for k, v in after.items()}
        if self.config.correction:
            for s in sorted(self.in_flight):
                reply = {k: v - self.in_flight[s][k] for k, v in reply.items()}
            self.model = {k: v.clone() for k, v in after.items()}
        self.in_flight[t] = delta
        return reply

    def staleness(self) -> int:
        """Rounds whose average this client is still waiting for."""
        return len(self.in_flight)

    def state_dict(self) -> Weights:
        out = {f"model/{k}": v for k, v in self.model.items()}
        for rnd, d in self.in_flight.items():
            out.update({f"{inflight_prefix(rnd)}{k}": v for k, v in d.items()})
        out["meta/global_round"] = torch.tensor(self.global_round, dtype=torch.int64)
        return out

    @classmethod
    def from_state_dict(cls, config: DGAConfig, state: Weights) -> "DGAClient":
        model: Weights = {}
        in_flight: dict[int, Weights] = {}
        global_round = 0
        for key, v in state.items():
            kind, _, rest = key.partition("/")
            if kind == "model":
                model[rest] = v
            elif kind == "inflight":
                rnd, _, name = rest.partition("/")
                in_flight.setdefault(int(rnd), {})[name] = v
            elif key == "meta/global_round":
                global_round = int(v)
            else:
                raise ValueError(f"unknown DGA state key {key!r}")
        return cls(config, model, in_flight, global_round)


def inflight_prefix(rnd: int) -> str:
    """The prefix of round ``rnd``'s update in flight in :meth:`DGAClient.state_dict`."""
    return f"inflight/{rnd}/"


def round_delta(state: Mapping[str, T], rnd: int) -> dict[str, T]:
    """Round ``rnd``'s own change Δ(rnd) from a :meth:`DGAClient.state_dict` (or any
    mapping with its keys, such as the ``ArrayRecord`` kept in ``context.state``), without
    reading the model and the other rounds. Empty if that round is not in flight.

    A compressor of DGA's replies encodes this: the reply is ``G(g) + Δ(rnd)``, and the
    server, which holds ``G(g)``, needs only ``Δ(rnd)``.
    """
    prefix = inflight_prefix(rnd)
    return {k[len(prefix):]: state[k] for k in state.keys() if k.startswith(prefix)}


#: Suffixes of the buffers torch's normalisation layers keep (BatchNorm, InstanceNorm with
#: ``track_running_stats``): running statistics, not trained by any gradient.
NORM_STATISTICS: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


def norm_statistics(names: Sequence[str]) -> frozenset[str]:
    """The names among ``names`` that are normalisation layers' running statistics."""
    return frozenset(n for n in names if n.rsplit(".", 1)[-1] in NORM_STATISTICS)


class DGAServer:
    """The server's side: the global models ``G(s)`` still needed, advanced each round.

    Parameters
    ----------
    config : DGAConfig
    initial : Weights
        ``G(0)``, the initial model.
    statistics : set of str, optional
        Entries that are running statistics (BatchNorm's), not weights. Without the
        correction, every client starts round t from ``G(g)``, so a running mean or
        variance it replies after its K steps is ``y = c G(g) + (1 - c) b``: an
        exponential average with decay ``c = (1 - momentum)^K`` started from the stale
        ``G(g)``, where ``b`` is the average of its K batch statistics. The server takes
        ``b̄`` out of ``ȳ`` and continues its own average without delay:
        ``G(t) = c G(t-1) + (1 - c) b̄ = c G(t-1) + ȳ - c G(g)``, what one worker's
        BatchNorm would hold. Advanced like a weight instead, ``G(t-1) + ȳ - G(g)``, a
        statistic follows ``x(t) = x(t-1) + (1 - c)(b - x(t-1-D))``: delayed feedback that
        oscillates with a growing amplitude for large D (running variances go negative).
        ``num_batches_tracked``, a counter, and every entry with the correction follow
        the weights' rule.
    statistics_decay : float, optional
        ``c`` above: ``(1 - m)^K`` for BatchNorm momentum ``m`` (torch's default 0.1) and K
        local steps. 0 makes ``G(t)`` the round's average ``ȳ`` itself.
    """

    def __init__(self, config: DGAConfig, initial: Weights, statistics: Container[str] = frozenset(),
                 statistics_decay: float = 0.0) -> None:
        if not 0.0 <= statistics_decay < 1.0:
            raise ValueError(f"statistics_decay must be in [0, 1), got {statistics_decay}")
        self.config = config
        self.round = 0
        self.globals: dict[int, Weights] = {0: initial}
        self.statistics = statistics
        self.statistics_decay = statistics_decay

    def last_arrived(self, t: int) -> int:
        return last_arrived(self.config, t)

    def global_model(self, s: int) -> Weights:
        if s not in self.globals:
            raise KeyError(f"the global model of round {s} is not kept (kept: {sorted(self.globals)})")
        return self.globals[s]

    def advance(self, t: int, ybar: Weights) -> Weights:
        """Round ``t``'s replies averaged to ``ȳ(t)``: return and keep ``G(t)``."""
        if t != self.round + 1:
            raise ValueError(f"rounds advance in order: expected {self.round + 1}, got {t}")
        g = self.last_arrived(t)
        if g == t - 1:  # everyone started from G(t-1): ȳ is the new model (FedAvg exactly)
            new = dict(ybar)
        else:
            prev, base = self.globals[t - 1], self.globals[g]
            c = self.statistics_decay
            stats = () if self.config.correction else self.statistics
            # A counter (num_batches_tracked, an integer) is no average: it keeps the rule.
            new = {k: ((c * v + (ybar[k].to(v.dtype) - c * base[k])).to(v.dtype)
                       if k in stats and v.is_floating_point()
                       else (v + (ybar[k].to(v.dtype) - base[k])).to(v.dtype))
                   for k, v in prev.items()}
        self._keep(t, new)
        return new

    def skip(self, t: int) -> Weights:
        """Round ``t`` had no usable reply: ``Δ̄(t) = 0``, so ``G(t) = G(t-1)``."""
        if t != self.round + 1:
            raise ValueError(f"rounds advance in order: expected {self.round + 1}, got {t}")
        self._keep(t, self.globals[t - 1])
        return self.globals[t]

    def _keep(self, t: int, new: Weights) -> None:
        self.globals[t] = new
        self.round = t
        # Later messages need G(last_arrived(t')) for t' > t, and advance needs G(t) and
        # G(last_arrived(t + 1)); last_arrived is monotone, so older ones can go.
        keep = self.last_arrived(t + 1)
        for s in [s for s in self.globals if s < keep]:
            del self.globals[s]


class DGATimeline:
    """When each DGA round happens on the simulated clock: the overlap the protocol allows.

    Round ``t``'s message to client ``j`` leaves the server as soon as the global model
    it carries, ``G(g)`` with ``g = last_arrived(t)``, is ready (that is when a pipelined
    server pushes it), and travels on the client's downlink behind the earlier ones.
    Client ``j`` starts round ``t`` when all of these hold:

    - its previous local steps are done;
    - its previous reply has left it (its uplink is free);
    - round ``t``'s message has arrived.

    A device that pulls its messages (``ClientLink.pulls``, run-config ``nodes-pull``: a
    Flower SuperNode asks for its next message only once it has sent its reply) gets
    round ``t``'s message no earlier than its previous reply's arrival at the server, so
    the download cannot overlap its compute and upload; and a node that found no message
    asks again 3 s later (:func:`fededge.netem.clock.pulled`), as Flower's do.

    With ``compute_ahead`` (:meth:`DGAConfig.previews`), round ``t``'s message leaves once
    round ``t + 1``'s global model is ready too, and a client that got round ``t``'s
    content with round ``t - 1``'s message computes round ``t`` as soon as it has handled
    that message (a warm worker's background run, with no per-message overhead), while
    its reply travels and round ``t``'s message comes; its reply leaves when both the
    compute and round ``t``'s message (plus the per-message overhead) are done.

    The average of round ``t`` is ready at the server when the last upload of round
    ``t`` has arrived. So a slow client delays the others only through the averages
    they wait for. With ``D = 0`` this is synchronous FedAvg: download, compute,
    upload, wait for everyone (:func:`fededge.netem.clock.synchronous_round` gives the
    same times).

    Built only from the clock's primitives (``send_down``, ``compute``, ``send_up``,
    ``up_departed``).
    """

    def __init__(self, clock: SimClock, config: DGAConfig, *, clients: Sequence[int]) -> None:
        self.clock = clock
        self.config = config
        self.clients = list(clients)
        self._free = {j: 0.0 for j in self.clients}  # end of the client's last compute
        self._replied = {j: 0.0 for j in self.clients}  # arrival of the client's last reply
        self._handled = {j: 0.0 for j in self.clients}  # departure of the client's last reply
        self.ready: dict[int, float] = {0: 0.0}  # round -> its average ready at the server
        self.started: dict[tuple[int, int], float] = {}
        self.arrived: dict[tuple[int, int], float] = {}  # (round, client) -> message arrival
        self.replied: dict[tuple[int, int], float] = {}  # (round, client) -> reply arrival
        self.blocked: dict[tuple[int, int], float] = {}  # time spent waiting for the message

    def run_round(self, t: int, work: Sequence[ClientRound], *, ahead: bool | None = None,
                  from_preview: Container[int] | None = None, wait_s: float | None = None) -> float:
        """Schedule round ``t`` (measured compute and bytes per client); return when its
        average is ready at the server (the round's end on the clock).

        ``ahead``: round t's messages carried round t+1's content (default: whenever
        :meth:`DGAConfig.previews` allows it); ``from_preview``: the clients whose round t
        content came with round t-1's message (default: all that ran round t-1, if round
        t-1's messages carried previews). The strategy passes what it really sent (it sends
        no preview past a checkpoint, and the full content to a node it resynchronises).
        ``wait_s``: a participant never answered, and the server waited that long (its
        round timeout) before averaging without it, counted as its loop counts it: from
        when round t-1 was done (or round t's messages left, if later)."""
        if ahead is None:
            ahead = self.config.previews(t)
        if from_preview is None:
            from_preview = {j for (s, j) in self.arrived if s == t - 1} if t > 1 and self.config.previews(t - 1) \
                else set()
        sent = self.ready[last_arrived(self.config, t + 1 if ahead else t)]
        arrivals = []
        for c in work:
            j = c.client
            link = self.clock.clients[j]
            self.arrived[(t, j)] = self.clock.send_down(j, c.bytes_down, self.clock.receive(j, sent))
            if j in from_preview:
                # Computed ahead: from the end of the node's handling of round t-1's message
                # (which brought round t's content), in its warm worker, while its reply
                # travels and round t's message comes; the reply leaves once both are done.
                start = self._handled[j]
                self.started[(t, j)] = start
                self._free[j] = start + c.compute_s / link.speed
                handled = self.arrived[(t, j)] + link.message_overhead_s
                self.blocked[(t, j)] = max(0.0, handled - self._free[j])  # the reply waits for the message
                leave = max(self._free[j], handled)
            else:
                could = max(self._free[j], self.clock.up_departed(j))
                start = max(could, self.arrived[(t, j)])
                self.started[(t, j)] = start
                self.blocked[(t, j)] = start - could
                self._free[j] = leave = self.clock.compute(j, c.compute_s, start)
            self._handled[j] = leave
            self._replied[j] = self.replied[(t, j)] = self.clock.send_up(j, c.bytes_up, leave)
            arrivals.append(self._replied[j])
        # G(t) is G(t-1) plus round t's average: never ready before G(t-1), even where
        # round t-1's slowest client had no work in round t (a dropout, an error reply)
        self.ready[t] = max([self.ready[t - 1], *arrivals, *(() if wait_s is None else (max(sent, self.ready[t - 1]) + wait_s,))])
        self.clock.now = max(self.clock.now, self.ready[t])
        return self.ready[t]


def stale_stability_limit(delay: int, momentum: float = 0.0, *, tol: float = 1e-12) -> float:
    """The largest ``lr * curvature`` at which DGA without the correction (at K = 1: heavy
    ball on the gradient of ``delay`` iterations ago) still converges on a quadratic.

    On ``f(w) = h/2 * w**2`` the stale-only rule with momentum ``m`` and step ``lr`` is the
    linear recursion ``w(i+1) = w(i) + m (w(i) - w(i-1)) - a w(i-D)`` with ``a = lr * h``.
    It converges iff every root of ``z**(D+1) - (1+m) z**D + m z**(D-1) + a`` (for D >= 1;
    ``z**2 - (1+m-a) z + m`` for D = 0) lies inside the unit circle. This returns the
    supremum of such ``a`` (bisection to ``tol``; tests/algorithms/test_dga.py runs the
    recursion itself at points below the limit, which converge, and just above it,
    which diverge).

    Closed forms it matches: ``2 (1 + m)`` at D = 0 (synchronous heavy ball, FedAvg at
    K = 1) and ``2 sin(pi / (2 (2D + 1)))`` without momentum. With the correction, clients
    with the same loss (the IID limit) get ``grad w(i,j) - grad w(i-D,j) + avg grad
    w(i-D) = grad w(i,j)``: the synchronous rule, whose limit does not depend on D. Only
    the clients' differences from the average are stale.

    Example: with momentum 0.9 the limit is 3.8 at D = 0, 0.0114 at D = 10 and 0.0061 at
    D = 20 (334 and 618 times smaller); without momentum 13 and 26 times smaller.
    """
    import numpy as np

    if delay < 0 or not 0 <= momentum < 1:
        raise ValueError(f"need delay >= 0 and 0 <= momentum < 1, got delay={delay}, momentum={momentum}")

    def stable(a: float) -> bool:
        c = np.zeros(2 + max(1, delay))  # c[i]: the coefficient of w(t+1-i)
        c[0], c[1], c[2] = 1.0, -(1.0 + momentum), momentum
        c[1 + delay] += a
        return bool(np.max(np.abs(np.roots(c))) < 1.0)

    lo, hi = 0.0, 2.0 * (1.0 + momentum) + 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return lo
