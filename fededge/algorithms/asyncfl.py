"""Asynchronous and straggler-tolerant aggregation: the arithmetic and the scheduling, pure.

Four ways not to wait for the slowest client (docs/algorithms.md, "Asynchronous
aggregation"):

- **FedAsync** (Xie, Koyejo and Gupta, 2019, arXiv:1903.03934): the server mixes each
  update into the model as it arrives, ``x <- (1 - a) x + a x_i`` with
  ``a = alpha * s(tau)``, where ``tau`` is the number of server versions made since the
  client received its model and ``s`` a staleness function.
- **FedBuff** (Nguyen et al., AISTATS 2022, arXiv:2106.06639): the server buffers client
  deltas ``Δ_i = x_i - x(v_i)`` (from the version ``v_i`` the client trained on) and,
  once ``K`` are in, steps ``x <- x + eta * Σ n_i s(tau_i) Δ_i / Σ n_i``. With
  ``s = 1``, ``eta = 1`` and no staleness this is FedAvg's example-weighted mean.
- **Bounded staleness (SSP)** (Ho et al., NeurIPS 2013; the "bounded delay" consistency
  of the parameter server, Li et al., OSDI 2014): updates are applied as they arrive,
  ``x <- x + Δ_i / n`` (each of the n clients owns 1/n of a round, as in a parameter
  server), and a client may start its next round only while it is at most ``s`` rounds
  ahead of the slowest active client. ``s = 0`` is bulk-synchronous: a round of n
  updates, each from the same model, is FedAvg with equal weights.
- **Backup workers** (Chen et al., 2016, "Revisiting distributed synchronous SGD"):
  synchronous rounds that select ``m + e`` clients and aggregate the first ``m`` replies
  (:func:`first_arrivals`). ``e = 0`` is FedAvg.

Staleness functions (FedAsync's section 5.2), of ``tau >= 0``:

- ``constant``:   ``s(tau) = 1``
- ``polynomial``: ``s(tau) = (1 + tau) ** -a``
- ``hinge``:      ``s(tau) = 1`` if ``tau <= b`` else ``1 / (a * (tau - b) + 1)``

The event-driven part, :class:`AsyncScheduler`, decides who may start training when
(concurrency, the SSP bound, clients written off after a timeout) and
:class:`EventQueue` orders arrivals by simulated time. The Flower strategy
(:mod:`fededge.strategies.asyncfl`) moves messages; this module holds no Flower and no
network, so the rules are tested in milliseconds. :class:`AsyncServer`,
:class:`AsyncScheduler` and :class:`EventQueue` save and load their state
(``state_dict`` / ``load_state_dict``, plain values) so that a run can be checkpointed
between two events and continued exactly.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = [
    "ASYNC_MODES", "ASYNC_ORDERS", "STALENESS_FUNCTIONS", "AsyncConfig", "LoopConfig", "AsyncServer", "AsyncScheduler",
    "AsyncStateError", "Dispatch", "Event", "EventQueue", "StalenessFunction", "first_arrivals",
]

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")
ASYNC_MODES = ("fedasync", "fedbuff", "ssp")
#: In which order the asynchronous loop uses replies (:attr:`LoopConfig.order`).
ASYNC_ORDERS = ("auto", "clock", "arrival")


class AsyncStateError(RuntimeError):
    """The asynchronous server or scheduler was asked something its state cannot answer
    (an update from a version it no longer keeps, a client that is not running)."""


@dataclass(frozen=True)
class StalenessFunction:
    """``s(tau)``: how much an update ``tau`` versions stale counts (FedAsync, 2019).

    Parameters
    ----------
    kind : str
        [staleness] ``constant``, ``polynomial`` or ``hinge``.
    a : float
        [staleness-a] ``polynomial``: the exponent (FedAsync uses 0.5; FedBuff's ``1/sqrt(1 + tau)``
        is ``polynomial`` with ``a = 0.5``). ``hinge``: the slope after ``b`` (FedAsync
        uses 10).
    b : float
        [staleness-b] ``hinge``: staleness tolerated at full weight (FedAsync uses 4).

    Example
    -------
    >>> StalenessFunction("polynomial", a=0.5)(3)
    0.5
    """

    kind: str = "polynomial"
    a: float = 0.5
    b: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_FUNCTIONS:
            raise ValueError(f"staleness must be one of {', '.join(STALENESS_FUNCTIONS)}, got {self.kind!r}")
        if not (self.a >= 0 and math.isfinite(self.a)):
            raise ValueError(f"staleness-a must be a finite number >= 0, got {self.a}")
        if not (self.b >= 0 and math.isfinite(self.b)):
            raise ValueError(f"staleness-b must be a finite number >= 0, got {self.b}")

    def __call__(self, tau: float) -> float:
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau}")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + tau) ** -self.a)
        return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)


@dataclass(frozen=True)
class AsyncConfig:
    """What a user tunes for the asynchronous strategies. Run-config keys in brackets;
    this class declares each knob once (default, check, meaning).

    Parameters
    ----------
    mode : str
        ``fedasync``, ``fedbuff`` or ``ssp``.
    alpha : float
        [async-alpha] FedAsync's mixing weight in (0, 1] (the paper's experiments use 0.6; lower it when
        clients are many and updates noisy).
    buffer_size : int
        [buffer-size] FedBuff's K: updates per aggregation (the paper uses 10). K = the number of
        clients with no staleness is FedAvg.
    server_lr : float
        [server-lr, where 0 keeps this default] FedBuff's server step eta (1: the mean
        delta).
    staleness : StalenessFunction
        Weight of a stale update (FedAsync and FedBuff; SSP bounds staleness instead).
    ssp_bound : int
        [ssp-bound] SSP's s: a client may be at most s rounds ahead of the slowest active client.
    concurrency : int
        [async-concurrency] Clients training at once (0: every participant). FedBuff's paper samples a new
        client each time one finishes; with fewer than all, idle clients are drawn at
        random (seeded).
    """

    mode: str = "fedasync"
    alpha: float = 0.6
    buffer_size: int = 10
    server_lr: float = 1.0
    staleness: StalenessFunction = field(default_factory=StalenessFunction)
    ssp_bound: int = 2
    concurrency: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ASYNC_MODES:
            raise ValueError(f"mode must be one of {', '.join(ASYNC_MODES)}, got {self.mode!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"async-alpha must be in (0, 1], got {self.alpha}")
        if self.buffer_size < 1:
            raise ValueError(f"buffer-size must be >= 1, got {self.buffer_size}")
        if not self.server_lr > 0:
            raise ValueError(f"server-lr must be > 0 for fedbuff, got {self.server_lr}")
        if self.ssp_bound < 0:
            raise ValueError(f"ssp-bound must be >= 0, got {self.ssp_bound}")
        if self.concurrency < 0:
            raise ValueError(f"async-concurrency must be >= 0 (0: all clients), got {self.concurrency}")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """How fededge's asynchronous loop (FedAsync, FedBuff, SSP and backup workers) uses
    replies. Run-config keys in brackets; declared here once.

    Parameters
    ----------
    order : str
        [async-order] ``auto``, ``clock`` (use arrivals in simulated-time order:
        simulation) or ``arrival`` (in real arrival order: a SuperLink deployment).
        ``auto`` picks ``arrival`` on a SuperLink and ``clock`` elsewhere.
    step_s : float
        [async-step-s] Under ``clock`` order, the compute a reply stands for on the
        simulated clock when the run's clock would otherwise take the measured time
        (``sim-step-s`` 0 and no ``compute_s``): this many seconds per local step the
        reply reports (times its client's speed factor). It makes the order of arrivals,
        and so the run, the same for the same config and seed on any machine. 0 uses the
        measured compute time instead (the wall clock): the order then follows the
        machine's speed and load, and the log says so. The default, 0.01 s, is about a
        step of the default CNN on digits on one core of a 2-core server CPU.
    backup : int or float
        [backup-workers] Backup workers' ``e``: of the clients sampled each round, the
        replies not waited for (the first ``m = sampled - e`` are aggregated). A count
        (int >= 0) or a fraction of the sampled clients (a float in [0, 1), rounded). At
        least one reply is always aggregated. 0 is FedAvg.
    """

    order: str = "auto"
    step_s: float = 0.01
    backup: int | float = 0

    def __post_init__(self) -> None:
        if self.order not in ASYNC_ORDERS:
            raise ValueError(f"order must be one of {', '.join(ASYNC_ORDERS)}, got {self.order!r}")
        if isinstance(self.step_s, bool) or not isinstance(self.step_s, (int, float)) \
                or not (self.step_s >= 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step_s must be a number of seconds >= 0 (0: the measured compute time), "
                             f"got {self.step_s!r}")
        e = self.backup
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not e >= 0:
            raise ValueError(f"backup must be a count >= 0 or a fraction in [0, 1), got {e!r}")
        if isinstance(e, float) and e >= 1:
            raise ValueError(f"backup as a fraction must be < 1, got {e}; write an int for a count")

    def backups_for(self, sampled: int) -> int:
        """e for a round of ``sampled`` clients (at least one is always aggregated)."""
        e = round(self.backup * sampled) if isinstance(self.backup, float) else int(self.backup)
        return min(e, sampled - 1)


def _float_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in state.items()}


class AsyncServer:
    """The server's model under FedAsync, FedBuff or SSP, one arriving update at a time.

    Parameters
    ----------
    config : AsyncConfig
    initial : mapping of str to tensor
        Version 0 of the model.
    num_clients : int
        n, for SSP's ``Δ_i / n``.

    The server keeps every version some running client still trains on (the strategy
    calls :meth:`keep` with those), since FedBuff and SSP need ``x(v_i)`` to form the
    delta. Integer tensors (BatchNorm's counters) are taken from the newest update
    rather than mixed.
    """

    def __init__(self, config: AsyncConfig, initial: Mapping[str, Any], *, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.config = config
        self.num_clients = num_clients
        self.version = 0
        self.models: dict[int, dict[str, torch.Tensor]] = {0: _float_state(initial)}
        self._buffer: list[tuple[float, float, dict[str, torch.Tensor]]] = []  # (n_i, s(tau), Δ_i)
        self.staleness: list[int] = []  # tau of every update used, in arrival order

    @property
    def model(self) -> dict[str, torch.Tensor]:
        return self.models[self.version]

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def keep(self, versions: Iterable[int]) -> None:
        """Forget every version but the current one and ``versions``."""
        wanted = set(versions) | {self.version}
        self.models = {v: m for v, m in self.models.items() if v in wanted}

    def receive(self, update: Mapping[str, Any], *, base_version: int, num_examples: float = 1.0) -> bool:
        """Use one client's trained model ``update`` (trained from ``base_version``).

        Returns True when a new version was made (FedAsync and SSP: always; FedBuff:
        when the buffer filled).
        """
        if base_version not in self.models:
            raise AsyncStateError(
                f"update trained on version {base_version}, which the server no longer keeps "
                f"(it keeps {sorted(self.models)}); keep() must list running clients' versions")
        if not num_examples > 0:
            raise ValueError(f"num_examples must be > 0, got {num_examples}")
        tau = self.version - base_version
        self.staleness.append(tau)
        cur, base = self.model, self.models[base_version]
        new = {k: torch.as_tensor(v) for k, v in update.items()}
        if set(new) != set(cur):
            raise AsyncStateError(f"update has tensors {sorted(new)}, the model has {sorted(cur)}")
        mode = self.config.mode
        if mode == "fedbuff":
            delta = {k: new[k].to(cur[k].dtype) - base[k] if cur[k].is_floating_point() else new[k]
                     for k in cur}
            self._buffer.append((float(num_examples), self.config.staleness(tau), delta))
            if len(self._buffer) < self.config.buffer_size:
                return False
            total = sum(n for n, _, _ in self._buffer)
            eta = self.config.server_lr
            out = {}
            for k, v in cur.items():
                if not v.is_floating_point():
                    out[k] = self._buffer[-1][2][k].clone()
                    continue
                step = sum((n * s / total) * d[k] for n, s, d in self._buffer)
                out[k] = v + eta * step
            self._buffer = []
        elif mode == "fedasync":
            a = self.config.alpha * self.config.staleness(tau)
            out = {k: ((1 - a) * v + a * new[k].to(v.dtype)) if v.is_floating_point() else new[k].clone()
                   for k, v in cur.items()}
        else:  # ssp
            out = {k: (v + (new[k].to(v.dtype) - base[k]) / self.num_clients) if v.is_floating_point()
                   else new[k].clone() for k, v in cur.items()}
        self.version += 1
        self.models[self.version] = out
        return True

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`receive` continues from, as plain values (a checkpoint): the
        version, every model version kept, the FedBuff buffer and the staleness record.
        The tensors are the server's own (it never changes one in place)."""
        return {"version": self.version,
                "models": {v: dict(m) for v, m in self.models.items()},
                "buffer": [(n, s, dict(d)) for n, s, d in self._buffer],
                "staleness": list(self.staleness)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a server built with the same config and
        number of clients); raises ``ValueError`` for the state of another model."""
        version = int(state["version"])
        models = {int(v): {k: torch.as_tensor(t) for k, t in m.items()} for v, m in state["models"].items()}
        if version not in models:
            raise ValueError(f"server state at version {version} does not keep that version "
                             f"(it keeps {sorted(models)})")
        names = list(self.model)
        for v, m in models.items():
            if list(m) != names:
                raise ValueError(f"server state's version {v} has tensors {sorted(m)}, this server's model "
                                 f"has {sorted(names)}")
        self.version = version
        self.models = models
        self._buffer = [(float(n), float(s), {k: torch.as_tensor(t) for k, t in d.items()})
                        for n, s, d in state["buffer"]]
        self.staleness = [int(t) for t in state["staleness"]]


def first_arrivals(arrivals: Mapping[int, float], m: int) -> list[int]:
    """Backup workers: the ``m`` clients whose replies arrive first (ties by client id).

    ``arrivals`` maps a client to its reply's arrival time (``inf``: never).
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    ranked = sorted((t, c) for c, t in arrivals.items() if math.isfinite(t))
    return [c for _, c in ranked[:m]]


@dataclass(frozen=True)
class Dispatch:
    """A client's message in flight: the version it carries and when it left."""

    client: int
    version: int
    at: float
    seq: int  # dispatch order, unique


@dataclass(order=True, frozen=True)
class Event:
    """An arrival at the server (a reply, or the timeout of one that never came)."""

    time: float
    seq: int
    client: int = field(compare=False)
    dropped: bool = field(compare=False, default=False)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    """Arrivals ordered by simulated time, ties by dispatch order (deterministic)."""

    def __init__(self) -> None:
        self._heap: list[Event] = []

    def push(self, event: Event) -> None:
        heapq.heappush(self._heap, event)

    def peek(self) -> Event | None:
        return self._heap[0] if self._heap else None

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def state_dict(self, encode: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """The queued events as plain values; ``encode`` turns a payload into one (the
        strategy's: a reply Message into its serialised objects)."""
        enc = encode or (lambda p: p)
        return {"events": [(e.time, e.seq, e.client, e.dropped, None if e.payload is None else enc(e.payload))
                           for e in self._heap]}

    def load_state_dict(self, state: Mapping[str, Any], decode: Callable[[Any], Any] | None = None) -> None:
        """Continue from :meth:`state_dict`; ``decode`` undoes its ``encode``. Events pop
        in the same order ((time, seq) orders them totally)."""
        dec = decode or (lambda p: p)
        self._heap = [Event(float(t), int(seq), int(client), dropped=bool(dropped),
                            payload=None if payload is None else dec(payload))
                      for t, seq, client, dropped, payload in state["events"]]
        heapq.heapify(self._heap)


class AsyncScheduler:
    """Who may start training, and when: concurrency, the SSP bound, write-offs.

    A client is *idle*, *running* (a message in flight) or, after its message was
    written off (no reply within the timeout), *lagging*: it is asked again with the
    current model, but the SSP bound no longer waits for it until it completes an
    update; it then rejoins at the slowest active client's round (a returning node
    pulls the current model; making the others wait for it to replay its lost rounds
    would stall them).

    Parameters
    ----------
    clients : sequence of int
        The participants.
    concurrency : int
        At most this many running at once (0: all).
    ssp_bound : int or None
        SSP's s; None: no bound (FedAsync, FedBuff).
    seed : int
        Draws which idle clients start when fewer may start than are idle.
    """

    def __init__(self, clients: Sequence[int], *, concurrency: int = 0, ssp_bound: int | None = None,
                 seed: int = 0) -> None:
        if not clients:
            raise ValueError("the scheduler needs at least one client")
        if len(set(clients)) != len(clients):
            raise ValueError("clients must be distinct")
        self.clients = list(clients)
        self.concurrency = concurrency or len(self.clients)
        self.ssp_bound = ssp_bound
        self.rng = random.Random(seed)
        self.done = {c: 0 for c in self.clients}  # updates completed (SSP's clock)
        self.running: dict[int, Dispatch] = {}
        self.lagging: set[int] = set()
        self.dropped = {c: 0 for c in self.clients}  # messages written off, per client
        self.contributions = {c: 0 for c in self.clients}
        self._seq = 0

    def slowest(self) -> int:
        """The SSP clock of the slowest active client (lagging ones do not count)."""
        active = [self.done[c] for c in self.clients if c not in self.lagging]
        return min(active) if active else max(self.done.values())

    def may_start(self, client: int) -> bool:
        if client in self.running:
            return False
        if self.ssp_bound is None or client in self.lagging:
            return True
        return self.done[client] - self.slowest() <= self.ssp_bound

    def startable(self) -> list[int]:
        """The idle clients to start now, in a seeded order."""
        free = self.concurrency - len(self.running)
        if free <= 0:
            return []
        ok = [c for c in self.clients if self.may_start(c)]
        if len(ok) > free:
            ok = sorted(self.rng.sample(ok, free))
        return ok

    def start(self, client: int, *, version: int, at: float) -> Dispatch:
        if not self.may_start(client):
            raise AsyncStateError(f"client {client} may not start now (running, or over the SSP bound)")
        d = Dispatch(client, version, at, self._seq)
        self._seq += 1
        self.running[client] = d
        return d

    def finish(self, client: int) -> Dispatch:
        """The client's update arrived and was used."""
        d = self._take(client)
        self.done[client] += 1
        self.contributions[client] += 1
        if client in self.lagging:
            # the slowest of the others (this client, lagging, is not among them yet): with
            # itself among them it rejoined at its own old round, and held every other
            # client at the SSP bound until it had caught up alone
            others = [self.done[c] for c in self.clients if c not in self.lagging]
            self.lagging.discard(client)
            if others:
                self.done[client] = max(self.done[client], min(others))
        return d

    def write_off(self, client: int) -> Dispatch:
        """The client's message got no (usable) reply within the timeout."""
        d = self._take(client)
        self.dropped[client] += 1
        self.lagging.add(client)
        return d

    def _take(self, client: int) -> Dispatch:
        if client not in self.running:
            raise AsyncStateError(f"client {client} has no message in flight")
        return self.running.pop(client)

    def ahead(self) -> int:
        """How far the fastest active client's clock is ahead of the slowest's."""
        active = [self.done[c] for c in self.clients if c not in self.lagging]
        return max(active) - min(active) if active else 0

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the scheduler continues from, as plain values (a checkpoint): the
        messages running, the clients' SSP clocks, who lags, the counters, the dispatch
        sequence and the state of its own random generator."""
        return {"clients": list(self.clients), "concurrency": self.concurrency, "ssp_bound": self.ssp_bound,
                "rng": self.rng.getstate(), "done": dict(self.done),
                "running": [(d.client, d.version, d.at, d.seq) for d in self.running.values()],
                "lagging": sorted(self.lagging), "dropped": dict(self.dropped),
                "contributions": dict(self.contributions), "seq": self._seq}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a scheduler built with the same clients,
        concurrency and bound; ``ValueError`` otherwise)."""
        saved = (list(state["clients"]), int(state["concurrency"]), state["ssp_bound"])
        if saved != (self.clients, self.concurrency, self.ssp_bound):
            raise ValueError(f"scheduler state of clients {saved[0]}, concurrency {saved[1]}, SSP bound {saved[2]} "
                             f"cannot be loaded into a scheduler of clients {self.clients}, concurrency "
                             f"{self.concurrency}, SSP bound {self.ssp_bound}")
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self.done = {int(c): int(n) for c, n in state["done"].items()}
        self.running = {}
        for client, version, at, seq in state["running"]:
            self.running[int(client)] = Dispatch(int(client), int(version), float(at), int(seq))
        self.lagging = {int(c) for c in state["lagging"]}
        self.dropped = {int(c): int(n) for c, n in state["dropped"].items()}
        self.contributions = {int(c): int(n) for c, n in state["contributions"].items()}
        self._seq = int(state["seq"])
