"""The simulated clock: how long messages and computation take on emulated links.

In simulation (Flower's Ray runtime or the in-process one) nothing really crosses a slow
link, so fededge computes when it would have. The model, per direction of a client's
link (:class:`~fededge.netem.profiles.Direction`):

``arrival = start + serialisation + stalls + delay + jitter``

- **start**: a link direction is a FIFO. A message cannot start before the previous
  one on the same direction has left (``start = max(send_at, busy_until)``).
- **serialisation**: ``8 * bytes / rate``. With loss ``p > 0`` and a round trip ``RTT``,
  the rate is capped by TCP's Mathis ceiling ``MSS/RTT * 1.22/sqrt(p)`` (Mathis et al.,
  1997; MSS = 1448 bytes). With a Mahimahi trace, the trace's delivery opportunities
  decide when the last byte leaves instead.
- **stalls**: TCP loses no bytes; a loss shows up as a wait. The number of loss events
  among the ``ceil(bytes / MSS)`` segments is drawn from a Poisson law with mean
  ``segments * p / loss_burst`` (a Gilbert–Elliott burst counts once), and each event
  stalls the transfer by about one RTT (fast retransmit). Tail-loss timeouts (RTO) are
  not modelled.
- **delay**: the one-way delay. **jitter**: a normal sample with standard deviation
  ``jitter``, clipped so that the total delay is never negative. Messages of one link
  direction arrive in the order they were sent (one TCP stream, as the proxy and the
  kernel deliver them): a message is never due before the one before it.

Randomness is per link direction, from ``SeedSequence([seed, client, direction])``,
so a run is deterministic for a seed whatever the order in which clients are handled.

Compute time is the client's measured compute divided by its speed factor (2.0: a device
twice as fast as the machine that measured it), plus the device's fixed cost per message,
``message_overhead_s`` (:class:`ClientLink`). On a real SuperNode each message pays
seconds that the ClientApp's own ``compute-s`` never sees: Flower starts a
``flwr-clientapp`` process for it, which imports Flower and torch and rebuilds the node's
data and model unless a warm worker holds them. ``benchmarks/bench_deploy_overhead.py``
measures it per device (its ``--clock`` table: wall seconds per message beyond the
measured compute, cold and warm) so that ``sim_s`` predicts the testbed's real seconds.
It is not scaled by the speed factor: it is the device's own measured figure.

Strategies describe what their protocol waits for with three primitives,
:meth:`SimClock.send_down`, :meth:`SimClock.compute` and :meth:`SimClock.send_up`, each
taking the time an event may start and returning when it ends. Synchronous FedAvg
(:func:`synchronous_round`) waits for every selected client's upload. A protocol that
overlaps communication with computation (delayed averaging, asynchronous aggregation)
chains the same calls with its own dependencies and gets exactly the overlap it allows.
The clock has no per-strategy special cases.

Pure: no Flower, no sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fededge.netem.profiles import Direction, LinkProfile
from fededge.netem.trace import PACKET_BYTES, DeliveryTrace

__all__ = [
    "clock_compute_s",
    "MSS_BYTES", "ClientLink", "LinkDirection", "SimClock", "ClientRound", "RoundTiming",
    "mathis_rate_bps", "synchronous_round", "transfer_duration", "PULL_RETRY_S", "pulled",
]

MSS_BYTES = 1448  # TCP payload per 1500-byte packet (20 IP + 32 TCP with timestamps)
_UP, _DOWN = 0, 1


def clock_compute_s(measured_s: float, steps: int, sim_step_s: float) -> float:
    """What a client's compute takes on the clock: ``steps * sim_step_s`` when the run sets
    ``sim-step-s`` (> 0), else the measured seconds."""
    return steps * sim_step_s if sim_step_s > 0 else measured_s


def mathis_rate_bps(rtt_s: float, loss: float) -> float:
    """TCP's loss-limited throughput, MSS/RTT * 1.22/sqrt(p), in bit/s (inf if no loss)."""
    if loss <= 0 or rtt_s <= 0:
        return math.inf
    return MSS_BYTES * 8 / rtt_s * 1.22 / math.sqrt(loss)


def transfer_duration(d: Direction, nbytes: int, *, rtt_s: float) -> float:
    """Expected time of one transfer on an idle, loss-free-draw link: the hand formula.

    ``delay + 8 * bytes / min(rate, Mathis)``, without jitter, stalls or traces. The
    4 MiB, 10 Mbit/s, 50 ms example: 0.05 + 4194304 * 8 / 1e7 = 3.4054 s.
    """
    rate = min(d.rate_bps if d.rate_bps is not None else math.inf, mathis_rate_bps(rtt_s, d.loss))
    serial = 0.0 if math.isinf(rate) else nbytes * 8 / rate
    return d.delay_s + serial


@dataclass
class LinkDirection:
    """One direction of one client's link, with its FIFO state and random stream."""

    direction: Direction
    rtt_s: float
    rng: np.random.Generator
    trace: DeliveryTrace | None = None
    busy_until: float = 0.0
    next_opportunity: int = 0  # traces: opportunities before this index are used
    bytes_sent: int = 0
    loss_events: int = 0
    last_arrival: float = 0.0  # a later message never arrives before an earlier one (one TCP stream)

    def send(self, nbytes: int, at: float) -> float:
        """Send ``nbytes`` no earlier than ``at``; return the arrival time."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        d = self.direction
        start = max(at, self.busy_until)
        if self.trace is not None and nbytes > 0:
            # Each opportunity carries one packet once: skip those earlier sends used.
            first = max(self.next_opportunity, self.trace.first_index_at_or_after(start))
            last = first + math.ceil(nbytes / PACKET_BYTES) - 1
            self.next_opportunity = last + 1
            left = max(start, self.trace.time_of(last))
            if d.loss > 0:  # TCP's loss ceiling holds on a trace too (as in the proxy)
                left = max(left, start + nbytes * 8 / mathis_rate_bps(self.rtt_s, d.loss))
        elif self.trace is not None:
            left = start
        else:
            rate = min(d.rate_bps if d.rate_bps is not None else math.inf, mathis_rate_bps(self.rtt_s, d.loss))
            left = start + (0.0 if math.isinf(rate) else nbytes * 8 / rate)
        if d.loss > 0 and nbytes > 0:
            segments = math.ceil(nbytes / MSS_BYTES)
            events = int(self.rng.poisson(segments * d.loss / d.loss_burst))
            self.loss_events += events
            left += events * self.rtt_s
        self.busy_until = left
        self.bytes_sent += nbytes
        jitter = float(self.rng.normal(0.0, d.jitter_s)) if d.jitter_s > 0 else 0.0
        # In order, as the proxy and the kernel deliver a connection's bytes: each
        # message's own jitter put a later one before an earlier one (a pipelined
        # protocol's model r+1 before model r).
        self.last_arrival = max(self.last_arrival, left + max(0.0, d.delay_s + jitter))
        return self.last_arrival


@dataclass(frozen=True)
class ClientLink:
    """A client's network and device: its link profile and compute-speed factor."""

    profile: LinkProfile | None  # None: an ideal network (transfers take no time)
    speed: float = 1.0
    message_overhead_s: float = 0.0  # the device's fixed seconds per message (process start, ...)
    # The device pulls its next message only once it has sent its reply (a Flower
    # SuperNode does): a message waits at the server until then (DGATimeline).
    pulls: bool = False

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"compute speed factor must be > 0, got {self.speed}")
        if not (math.isfinite(self.message_overhead_s) and self.message_overhead_s >= 0):
            raise ValueError(f"message overhead must be a finite number of seconds >= 0, got "
                             f"{self.message_overhead_s}; measure it with benchmarks/bench_deploy_overhead.py")


@dataclass(frozen=True)
class ClientRound:
    """What one client did in a synchronous round, as measured."""

    client: int  # partition id
    bytes_down: int
    compute_s: float  # measured on the client
    bytes_up: int


@dataclass(frozen=True)
class RoundTiming:
    start: float
    end: float
    downloaded: dict[int, float] = field(default_factory=dict)
    computed: dict[int, float] = field(default_factory=dict)
    uploaded: dict[int, float] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


#: Seconds a Flower SuperNode waits after a pull that found no message before it pulls
#: again (flwr 1.41, ``flwr.supernode.start_client_internal``: ``time.sleep(3)``).
PULL_RETRY_S = 3.0


def pulled(sent: float, asked: float, retry_s: float = PULL_RETRY_S) -> float:
    """When a node that pulls gets a message the server has ready at ``sent``: it asks at
    ``asked`` (its previous reply just went out) and, while it finds nothing, again every
    ``retry_s`` seconds."""
    if sent <= asked:
        return asked
    return asked + retry_s * math.ceil((sent - asked) / retry_s - 1e-12)


class SimClock:
    """Per-client links and devices on one simulated timeline.

    Parameters
    ----------
    clients : sequence of ClientLink
        Indexed by partition id.
    seed : int
        Seeds every link direction's random stream.
    """

    def __init__(self, clients: Sequence[ClientLink], *, seed: int = 0) -> None:
        self.clients = list(clients)
        self.now = 0.0
        self._dirs: dict[tuple[int, int], LinkDirection | None] = {}
        self.seed = seed
        self.replied: dict[int, float] = {}  # client -> arrival of its latest upload

    def _link(self, client: int, which: int) -> LinkDirection | None:
        key = (client, which)
        if key not in self._dirs:
            if not 0 <= client < len(self.clients):
                raise IndexError(f"client {client} has no link; the clock knows {len(self.clients)} clients")
            prof = self.clients[client].profile
            if prof is None:
                self._dirs[key] = None
            else:
                d = prof.up if which == _UP else prof.down
                trace = DeliveryTrace.from_file(d.trace) if d.trace is not None else None
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, client, which]))
                self._dirs[key] = LinkDirection(d, prof.rtt_s, rng, trace)
        return self._dirs[key]

    def send_down(self, client: int, nbytes: int, at: float) -> float:
        """Server -> client: when a message sent at ``at`` has fully arrived."""
        link = self._link(client, _DOWN)
        return at if link is None else link.send(nbytes, at)

    def send_up(self, client: int, nbytes: int, at: float) -> float:
        """Client -> server: when a message sent at ``at`` has fully arrived."""
        link = self._link(client, _UP)
        arrival = at if link is None else link.send(nbytes, at)
        self.replied[client] = arrival
        return arrival

    def receive(self, client: int, sent: float) -> float:
        """When ``client`` takes a message the server has ready at ``sent``: at once,
        unless the device pulls (``ClientLink.pulls``) and has replied before; then at its
        first ask from that reply on (:func:`pulled`)."""
        if not self.clients[client].pulls or client not in self.replied:
            return sent
        return pulled(sent, self.replied[client])

    def up_departed(self, client: int) -> float:
        """When the last byte of ``client``'s latest upload left it (0 on an ideal link).

        A protocol that lets a client compute while its reply is in flight waits for
        this, not for the arrival: the client's link must be free of its own upload.
        """
        link = self._link(client, _UP)
        return 0.0 if link is None else link.busy_until

    def compute(self, client: int, measured_s: float, at: float) -> float:
        """When computation measured at ``measured_s`` seconds, begun at ``at``, ends: the
        device's fixed ``message_overhead_s``, then the compute scaled by its speed."""
        if measured_s < 0:
            raise ValueError(f"measured compute must be >= 0, got {measured_s}")
        link = self.clients[client]
        return at + link.message_overhead_s + measured_s / link.speed

    def state_dict(self) -> dict:
        """What the clock has done so far (each used link direction's queue, trace
        position, counters and random stream), for a checkpoint; plain values only."""
        return {"now": self.now, "seed": self.seed, "num_clients": len(self.clients),
                "replied": {int(c): float(v) for c, v in self.replied.items()}, "links": [
            [client, which, None if d is None else {
                "busy_until": d.busy_until, "next_opportunity": d.next_opportunity, "bytes_sent": d.bytes_sent,
                "loss_events": d.loss_events, "last_arrival": d.last_arrival, "rng": d.rng.bit_generator.state}]
            for (client, which), d in sorted(self._dirs.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` on a clock built with the same links."""
        if state["seed"] != self.seed or state["num_clients"] != len(self.clients):
            raise ValueError(f"clock state of {state['num_clients']} clients (seed {state['seed']}) cannot be "
                             f"loaded into a clock of {len(self.clients)} clients (seed {self.seed})")
        self.now = float(state["now"])
        self.replied = {int(c): float(v) for c, v in state.get("replied", {}).items()}
        self._dirs = {}
        for client, which, saved in state["links"]:
            link = self._link(int(client), int(which))
            if (link is None) != (saved is None):
                raise ValueError(f"clock state: client {client}'s link is not the one the state was saved with")
            if link is not None:
                link.busy_until = float(saved["busy_until"])
                link.next_opportunity = int(saved["next_opportunity"])
                link.bytes_sent = int(saved["bytes_sent"])
                link.loss_events = int(saved["loss_events"])
                link.last_arrival = float(saved.get("last_arrival", 0.0))  # (a checkpoint from before it)
                link.rng.bit_generator.state = saved["rng"]

    def stats(self) -> dict[str, int]:
        dirs = [d for d in self._dirs.values() if d is not None]
        return {"loss_events": sum(d.loss_events for d in dirs)}


def synchronous_round(clock: SimClock, clients: Sequence[ClientRound], *, start: float | None = None) -> RoundTiming:
    """One synchronous round: broadcast, local computation, upload; wait for all.

    Each selected client receives the model (a device that pulls, at its first ask after
    the broadcast: :meth:`SimClock.receive`), computes, and uploads. The round ends when
    the last upload has arrived: aggregation is instantaneous, and the next round's
    broadcast is the next round's download. Advances ``clock.now`` to the end.
    """
    t0 = clock.now if start is None else start
    down, comp, up = {}, {}, {}
    for c in clients:
        down[c.client] = clock.send_down(c.client, c.bytes_down, clock.receive(c.client, t0))
        comp[c.client] = clock.compute(c.client, c.compute_s, down[c.client])
        up[c.client] = clock.send_up(c.client, c.bytes_up, comp[c.client])
    end = max(up.values(), default=t0)
    clock.now = end
    return RoundTiming(t0, end, down, comp, up)
