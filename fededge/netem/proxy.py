"""A userspace TCP proxy that shapes real traffic with a :class:`LinkProfile`.

``fededge netem proxy --profile 4g --listen 127.0.0.1:9093 --upstream 127.0.0.1:9092``
accepts TCP connections on ``--listen`` and opens one connection to ``--upstream`` for
each. Bytes from the accepting side (the client) toward the upstream (the server) follow
``profile.up``; the reverse direction follows ``profile.down``. No root, any kernel, any
TCP protocol (Flower's HTTP Fleet API, with or without TLS, passes through unchanged:
the proxy never looks inside the bytes).

How each direction of a connection is shaped
--------------------------------------------
A *reader* task reads the source in chunks and stamps each chunk, when it is read, with
a delivery time; a *writer* task delivers chunks in order when they are due (it sleeps
until the head of the queue is due: there is never a sleep per chunk in the reader, so
data stays pipelined and a 100 ms delay does not cap throughput).

- **Rate** by a "link free at" virtual clock, the equivalent of a token bucket whose
  depth is one read quantum: ``departure = max(now, link_free) + len * 8 / rate`` and
  ``link_free = departure``. When a direction is rate-shaped the reader reads at most
  ``_QUANTUM_S`` (2 ms) worth of rate per chunk (at least one MSS, at most
  ``chunk_bytes``), so bytes leave in bursts of at most ~2 ms of link time.
- **Delay**: ``due = departure + delay_s + jitter sample``.
- **Jitter without reordering**: the jitter sample is normal with standard deviation
  ``jitter_s``, truncated at +-4 standard deviations (so a bound can be stated and
  tested) and so that the total delay is >= 0; then ``due = max(previous due, due)``.
  Chunks therefore never overtake each other; for back-to-back chunks the ``max`` pulls
  the effective delay toward the upper part of the distribution, as Linux netem's does
  when it must keep order.
- **Loss as stalls**: TCP through a proxy that terminates it cannot lose bytes; a lost
  packet shows up as a head-of-line stall while it is retransmitted. For every MSS-sized
  segment (1448 bytes) of a chunk the proxy draws the direction's Gilbert–Elliott chain
  (``Direction.gilbert_elliott``: P(good -> bad) = p, P(bad -> good) = r, every packet
  in bad lost; a seeded numpy ``Generator`` per direction and connection). Each *loss
  event* (entering the bad state; a burst counts once) delays that chunk and everything
  after it by one base RTT (``up.delay_s + down.delay_s``, the time for fast retransmit
  to repair it); a tail loss's longer RTO is not modelled. With ``tcp_loss_ceiling``
  (default on) the direction's throughput is also capped at the Mathis et al. (1997)
  ceiling ``MSS * 8 / RTT * 1.22 / sqrt(loss)``, because the real TCP connections on
  both sides of the proxy see no loss and would not slow down by themselves. The two
  add up: a bulk transfer of ``n`` bytes takes ``n * 8 / min(rate, ceiling)`` plus one
  RTT per loss event. This is the TCP loss model the issue prescribes for the simulated
  clock (:mod:`fededge.netem.clock`): a stall of about one RTT per loss event, and the
  Mathis ceiling on throughput.
- **Trace replay**: when ``direction.trace`` is set, bytes leave only at the trace's
  delivery opportunities (1500 bytes each; :class:`~fededge.netem.trace.DeliveryTrace`),
  counted from when the proxy started (``NetemProxy.start``). An opportunity is used
  once: a cursor over the opportunities carries the unused bytes of a partly filled one
  to the next chunk, so a continuous transfer of ``n`` bytes starting at ``t`` leaves at
  ``DeliveryTrace.departure_s(t, n)``; opportunities that pass while the direction is
  idle are lost, as on a real link.
- **Backpressure**: the reader stops reading the source while the bytes queued in that
  direction (read, not yet handed to the destination socket) are at or above
  ``max_buffer_bytes``, and resumes when the writer drains them; the writer waits for
  the destination socket to drain. A fast sender therefore fills its own socket
  buffers, not the proxy's memory: queued bytes never exceed ``max_buffer_bytes`` plus
  one chunk (``ProxyStats.peak_queued_up/down`` record the peak).
- **EOF and errors**: a half-close (EOF from one side) is passed on after the data
  queued before it (``write_eof``); the other direction keeps flowing. A connection
  error on either side closes both sides of that connection.

Links are per connection: every accepted connection gets its own up and down link
(rate, loss chain, trace cursor); concurrent connections do not share a bottleneck.
Timing uses the event loop's monotonic clock; asyncio's timers overshoot by up to ~1 ms,
which is not cumulative (due times are absolute).

Example
-------
>>> from fededge.netem.profiles import get_profile
>>> cfg = ProxyConfig(listen_host="127.0.0.1", listen_port=0, upstream_host="127.0.0.1",
...                   upstream_port=9092, profile=get_profile("4g"))
>>> with run_in_thread(cfg) as handle:           # doctest: +SKIP
...     host, port = handle.address              # dial this instead of 9092
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any, Deque

import numpy as np

from fededge.netem.profiles import Direction, LinkProfile, ProfileError
from fededge.netem.trace import PACKET_BYTES, DeliveryTrace, first_slot_at_or_after

__all__ = [
    "MSS_BYTES", "NetemProxy", "ProxyConfig", "ProxyHandle", "ProxyStats", "mathis_ceiling_bps",
    "parse_hostport", "register_cli", "run_in_thread",
]

MSS_BYTES = 1448  # TCP payload of a 1500-byte packet with timestamps (20 IP + 32 TCP)
_QUANTUM_S = 0.002  # read quantum of a rate-shaped direction: ~2 ms of link time
_JITTER_TRUNC = 4.0  # jitter samples are truncated at +-4 standard deviations
_CONNECT_TIMEOUT_S = 10.0


def mathis_ceiling_bps(loss: float, rtt_s: float, mss: int = MSS_BYTES) -> float:
    """TCP's throughput ceiling under random loss: ``MSS * 8 / RTT * 1.22 / sqrt(p)``.

    Mathis, Semke, Mahdavi, Ott, "The macroscopic behavior of the TCP congestion
    avoidance algorithm", CCR 1997. ``inf`` without loss or without delay.
    """
    if loss <= 0 or rtt_s <= 0:
        return math.inf
    return mss * 8 / rtt_s * 1.22 / math.sqrt(loss)


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """What the proxy listens on, where it forwards to, and how it shapes.

    Parameters
    ----------
    listen_host, listen_port : str, int
        Where clients connect; port 0 picks a free port (``NetemProxy.start`` returns it).
    upstream_host, upstream_port : str, int
        The server each accepted connection is forwarded to.
    profile : LinkProfile
        ``up`` shapes client -> upstream, ``down`` upstream -> client.
    seed : int
        Seeds jitter and loss; connection ``i`` (in accept order), direction ``d`` uses
        ``numpy.random.default_rng([seed, i, d])``.
    max_buffer_bytes : int
        Bytes a direction may hold before it stops reading its source (backpressure).
        Larger values let more data be in flight on long, fast links
        (bandwidth-delay product); 4 MiB covers 100 Mbit/s at 300 ms.
    chunk_bytes : int
        Largest read. Unshaped directions read this much at a time; larger is cheaper
        per byte, smaller gives finer timing.
    tcp_loss_ceiling : bool
        Cap each lossy direction at the Mathis ceiling (see the module docstring).
    """

    listen_host: str
    listen_port: int
    upstream_host: str
    upstream_port: int
    profile: LinkProfile
    seed: int = 0
    max_buffer_bytes: int = 4 * 1024 * 1024
    chunk_bytes: int = 64 * 1024
    tcp_loss_ceiling: bool = True

    def __post_init__(self) -> None:
        for name in ("listen_port", "upstream_port"):
            port = getattr(self, name)
            if not (isinstance(port, int) and 0 <= port <= 65535):
                raise ValueError(f"{name} must be an integer in 0..65535, got {port!r}")
        if self.upstream_port == 0:
            raise ValueError("upstream_port must be the server's port, not 0")
        if self.chunk_bytes < MSS_BYTES:
            raise ValueError(f"chunk_bytes must be >= {MSS_BYTES} (one MSS), got {self.chunk_bytes}")
        if self.max_buffer_bytes < self.chunk_bytes:
            raise ValueError(f"max_buffer_bytes must be >= chunk_bytes ({self.chunk_bytes}), "
                             f"got {self.max_buffer_bytes}")
        if not isinstance(self.profile, LinkProfile):
            raise ValueError(f"profile must be a LinkProfile, got {type(self.profile).__name__}")


@dataclass
class ProxyStats:
    """Counters over all connections of a proxy (read them from any thread).

    ``bytes_up``/``bytes_down`` count bytes handed to the destination socket;
    ``peak_queued_*`` is the largest number of bytes one direction of one connection
    held at once; ``loss_events_*`` counts Gilbert–Elliott loss events (stalls).
    """

    connections_accepted: int = 0
    connections_open: int = 0
    connections_failed: int = 0  # upstream could not be reached
    bytes_up: int = 0
    bytes_down: int = 0
    peak_queued_up: int = 0
    peak_queued_down: int = 0
    loss_events_up: int = 0
    loss_events_down: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _GilbertElliott:
    """Loss events of a Gilbert–Elliott chain over a stream of packets.

    Run lengths are geometric (good runs with mean 1/p, bad runs with mean 1/r), so a
    chunk of n packets costs a few draws, not n.
    """

    def __init__(self, direction: Direction, rng: np.random.Generator) -> None:
        self.p, self.r = direction.gilbert_elliott
        self.rng = rng
        self.bad = False
        self.left = self._run(False)  # packets left in the current run

    def _run(self, bad: bool) -> float:
        prob = self.r if bad else self.p
        return math.inf if prob <= 0 else float(self.rng.geometric(prob))

    def events(self, packets: int) -> int:
        """Advance by ``packets`` and return how many bursts started among them."""
        events = 0
        while packets > 0:
            if self.left <= 0:
                self.bad = not self.bad
                self.left = self._run(self.bad)
                events += self.bad
            take = min(packets, self.left)
            packets -= int(take)
            self.left -= take
        return events


class _TraceCursor:
    """Hands out a trace's delivery opportunities in order, each once."""

    def __init__(self, trace: DeliveryTrace, t0: float) -> None:
        self.ops = trace.opportunities_ms
        self.period = trace.period_ms
        self.t0 = t0
        self.next_index = 0  # first unused opportunity (global index over repeated periods)
        self.spare = 0  # unused bytes of opportunity next_index - 1

    def _time(self, index: int) -> float:
        cycle, i = divmod(index, len(self.ops))
        return self.t0 + (cycle * self.period + self.ops[i]) / 1000.0

    def _first_at_or_after(self, t: float) -> int:
        return first_slot_at_or_after(self.ops, self.period, (t - self.t0) * 1000.0)

    def departure(self, now: float, nbytes: int) -> float:
        """When the last of ``nbytes`` arriving at ``now`` leaves the link."""
        if self.spare and self.next_index > 0 and self._time(self.next_index - 1) >= now:
            used = min(self.spare, nbytes)
            self.spare -= used
            nbytes -= used
            if nbytes == 0:
                return self._time(self.next_index - 1)
        first = max(self.next_index, self._first_at_or_after(now))
        need = -(-nbytes // PACKET_BYTES)
        self.next_index = first + need
        self.spare = need * PACKET_BYTES - nbytes
        return self._time(self.next_index - 1)


class _Link:
    """The shaping state of one direction of one connection: when each chunk is due."""

    def __init__(self, direction: Direction, *, rtt_s: float, rng: np.random.Generator,
                 t0: float, chunk_bytes: int, tcp_loss_ceiling: bool) -> None:
        self.d = direction
        self.rng = rng
        self.rtt_s = rtt_s
        trace = None if direction.trace is None else DeliveryTrace.from_file(direction.trace)
        self.trace = None if trace is None else _TraceCursor(trace, t0)
        self.rate = None if self.trace is not None else direction.rate_bps
        ceiling = mathis_ceiling_bps(direction.loss, rtt_s) if tcp_loss_ceiling else math.inf
        self.ceiling = None if math.isinf(ceiling) else ceiling
        self.loss = _GilbertElliott(direction, rng) if direction.loss > 0 else None
        self.link_free = -math.inf
        self.last_due = -math.inf
        trace_bps = None if trace is None else trace.mean_rate_bps
        slowest = min(r for r in (self.rate, self.ceiling, trace_bps, math.inf) if r is not None)
        if math.isinf(slowest):
            self.read_bytes = chunk_bytes
        else:
            self.read_bytes = int(min(chunk_bytes, max(MSS_BYTES, slowest * _QUANTUM_S / 8)))
        # Without a trace, rate and loss ceiling combine into one rate.
        eff = min(self.rate or math.inf, self.ceiling or math.inf)
        self.eff_rate = None if math.isinf(eff) else eff

    def due(self, now: float, nbytes: int) -> tuple[float, int]:
        """(delivery time, loss events) of ``nbytes`` read at ``now``."""
        start = max(now, self.link_free)
        if self.trace is not None:
            departure = self.trace.departure(start, nbytes)
            if self.ceiling is not None:
                departure = max(departure, start + nbytes * 8 / self.ceiling)
        elif self.eff_rate is not None:
            departure = start + nbytes * 8 / self.eff_rate
        else:
            departure = start
        events = 0
        if self.loss is not None:
            events = self.loss.events(-(-nbytes // MSS_BYTES))
            departure += events * self.rtt_s
        self.link_free = departure
        extra = 0.0
        if self.d.jitter_s > 0:
            z = float(np.clip(self.rng.standard_normal(), -_JITTER_TRUNC, _JITTER_TRUNC))
            extra = z * self.d.jitter_s
        due = departure + max(0.0, self.d.delay_s + extra)
        due = max(due, self.last_due)
        self.last_due = due
        return due, events


_EOF = b""  # queued after the last chunk when the source half-closes


class _Pipe:
    """One direction of one connection: a reader task, a queue of stamped chunks, a writer."""

    def __init__(self, proxy: "NetemProxy", link: _Link, src: asyncio.StreamReader,
                 dst: asyncio.StreamWriter, up: bool) -> None:
        self.proxy = proxy
        self.link = link
        self.src = src
        self.dst = dst
        self.up = up
        self.queue: Deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.limit = proxy.config.max_buffer_bytes
        self.has_data = asyncio.Event()
        self.has_room = asyncio.Event()
        self.has_room.set()

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        stats = self.proxy.stats
        while True:
            if self.queued >= self.limit:
                self.has_room.clear()
                await self.has_room.wait()
                continue
            data = await self.src.read(self.link.read_bytes)
            now = loop.time()
            if not data:  # the FIN travels like data: after the queued bytes, one delay later
                due = max(now + self.link.d.delay_s, self.link.last_due)
                self.queue.append((due, _EOF))
                self.has_data.set()
                return
            due, events = self.link.due(now, len(data))
            self.queue.append((due, data))
            self.queued += len(data)
            if self.up:
                stats.peak_queued_up = max(stats.peak_queued_up, self.queued)
                stats.loss_events_up += events
            else:
                stats.peak_queued_down = max(stats.peak_queued_down, self.queued)
                stats.loss_events_down += events
            self.has_data.set()

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        stats = self.proxy.stats
        while True:
            if not self.queue:
                self.has_data.clear()
                await self.has_data.wait()
                continue
            wait = self.queue[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            # Everything already due goes out in one write and one drain.
            now = loop.time()
            batch: list[bytes] = []
            eof = False
            while self.queue and self.queue[0][0] <= now:
                _, data = self.queue.popleft()
                if not data:  # _EOF
                    eof = True
                    break
                batch.append(data)
            if batch:
                n = sum(len(b) for b in batch)
                self.dst.writelines(batch) if len(batch) > 1 else self.dst.write(batch[0])
                if self.up:
                    stats.bytes_up += n
                else:
                    stats.bytes_down += n
                await self.dst.drain()
                self.queued -= n
                if self.queued < self.limit:
                    self.has_room.set()
            if eof:
                if self.dst.can_write_eof() and not self.dst.is_closing():
                    self.dst.write_eof()
                return


class NetemProxy:
    """The proxy: ``await start()``, then ``await stop()`` (or ``serve_forever()``)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.stats = ProxyStats()
        self._server: asyncio.base_events.Server | None = None
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._t0 = 0.0
        self._next_conn = 0
        self.address: tuple[str, int] | None = None

    async def start(self) -> tuple[str, int]:
        """Bind and listen; return the bound (host, port). Traces count from now."""
        if self._server is not None:
            raise RuntimeError("proxy already started")
        for d in (self.config.profile.up, self.config.profile.down):
            if d.trace is not None:
                DeliveryTrace.from_file(d.trace)  # fail now, not on the first connection
        self._t0 = asyncio.get_running_loop().time()
        self._server = await asyncio.start_server(
            self._handle, self.config.listen_host, self.config.listen_port,
            limit=self.config.chunk_bytes)
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        return self.address

    async def serve_forever(self) -> None:
        """Serve until cancelled (starting first if needed); stop on the way out."""
        if self._server is None:
            await self.start()
        assert self._server is not None
        try:
            await self._server.serve_forever()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Close the listener, cancel every connection, close every socket."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conn_tasks):
            task.cancel()
        if self._conn_tasks:
            await asyncio.wait(list(self._conn_tasks), timeout=5)
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError):  # pragma: no cover
                pass
            self._server = None

    def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        # A plain callback that starts our own task: asyncio (3.11) calls .exception() on
        # a client_connected_cb task, which raises if stop() cancelled it.
        task = asyncio.get_running_loop().create_task(self._serve(c_reader, c_writer))
        self._conn_tasks.add(task)
        task.add_done_callback(self._conn_tasks.discard)

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self._writers.add(c_writer)
        conn_id = self._next_conn
        self._next_conn += 1
        self.stats.connections_accepted += 1
        self.stats.connections_open += 1
        u_writer: asyncio.StreamWriter | None = None
        try:
            try:
                u_reader, u_writer = await asyncio.wait_for(asyncio.open_connection(
                    self.config.upstream_host, self.config.upstream_port,
                    limit=self.config.chunk_bytes), _CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                self.stats.connections_failed += 1
                return
            self._writers.add(u_writer)
            for w in (c_writer, u_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop = asyncio.get_running_loop()
            prof, cfg = self.config.profile, self.config
            links = [
                _Link(d, rtt_s=prof.rtt_s, rng=np.random.default_rng([cfg.seed, conn_id, i]),
                      t0=self._t0, chunk_bytes=cfg.chunk_bytes, tcp_loss_ceiling=cfg.tcp_loss_ceiling)
                for i, d in enumerate((prof.up, prof.down))
            ]
            pipes = [_Pipe(self, links[0], c_reader, u_writer, up=True),
                     _Pipe(self, links[1], u_reader, c_writer, up=False)]
            tasks = [loop.create_task(coro) for p in pipes for coro in (p.read_loop(), p.write_loop())]
            try:
                pending = set(tasks)
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    # A task that raised (reset, broken pipe) ends the whole connection.
                    errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
                    for err in errors:
                        if not isinstance(err, (OSError, asyncio.IncompleteReadError)):
                            loop.call_exception_handler({  # a bug, not a network error
                                "message": "netem proxy connection failed", "exception": err})
                    if errors:
                        break
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
            self.stats.connections_open -= 1


class ProxyHandle:
    """A proxy running on its own event loop in a background thread (for tests)."""

    def __init__(self, config: ProxyConfig, *, timeout_s: float = 10.0) -> None:
        self.config = config
        self.proxy = NetemProxy(config)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._main: asyncio.Task[Any] | None = None
        self._thread = threading.Thread(target=self._run, name="netem-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise TimeoutError(f"netem proxy did not start within {timeout_s} s")
        if self._error is not None:
            self.stop()
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            try:
                await self.proxy.start()
            except BaseException as err:  # reported to the starting thread
                self._error = err
                self._ready.set()
                return
            self._ready.set()
            try:
                await asyncio.Event().wait()  # until cancelled by stop()
            finally:
                await self.proxy.stop()

        try:
            self._main = self._loop.create_task(main())
            self._loop.run_until_complete(asyncio.gather(self._main, return_exceptions=True))
        finally:
            self._loop.close()
            self._stopped.set()

    @property
    def address(self) -> tuple[str, int]:
        assert self.proxy.address is not None
        return self.proxy.address

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the proxy and its thread (idempotent)."""
        if not self._stopped.is_set() and self._main is not None:
            try:
                self._loop.call_soon_threadsafe(self._main.cancel)
            except RuntimeError:  # loop already closed
                pass
        self._thread.join(timeout_s)

    def __enter__(self) -> "ProxyHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_in_thread(config: ProxyConfig, *, timeout_s: float = 10.0) -> ProxyHandle:
    """Start a proxy in a background thread; use as a context manager or call ``.stop()``."""
    return ProxyHandle(config, timeout_s=timeout_s)


# ----------------------------------------------------------------------------- CLI


def parse_hostport(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9092"`` / ``"[::1]:9092"`` -> (host, port); argparse error otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 0-65535), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from fededge.netem.profiles import get_profile, load_profiles

    try:
        profile = get_profile(args.profile, load_profiles(args.profiles_file))
    except ProfileError as err:
        print(f"fededge netem proxy: {err}", file=sys.stderr)
        return 2
    (lhost, lport), (uhost, uport) = args.listen, args.upstream
    try:
        config = ProxyConfig(listen_host=lhost, listen_port=lport, upstream_host=uhost,
                             upstream_port=uport, profile=profile, seed=args.seed)
    except ValueError as err:
        print(f"fededge netem proxy: {err}", file=sys.stderr)
        return 2

    async def main() -> int:
        proxy = NetemProxy(config)
        try:
            host, port = await proxy.start()
        except OSError as err:
            print(f"fededge netem proxy: cannot listen on {lhost}:{lport}: {err}", file=sys.stderr)
            return 1
        row = profile.to_row()
        print(f"netem proxy {host}:{port} -> {uhost}:{uport} profile {profile.name} "
              f"(down {row['down']}, up {row['up']}, rtt {row['rtt_ms']} ms, "
              f"jitter {row['jitter_ms']} ms, loss {row['loss']})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await proxy.stop()
        print(f"netem proxy stopped: {proxy.stats.as_dict()}", flush=True)
        return 0

    return asyncio.run(main())


def register_cli(netem_subparsers: Any) -> None:
    """Add ``proxy`` to the ``fededge netem`` subcommands (``func`` returns an exit code)."""
    p = netem_subparsers.add_parser(
        "proxy", help="shape real TCP traffic with a link profile (userspace, no root)",
        description="A TCP proxy: connections to --listen are forwarded to --upstream; "
                    "client->upstream bytes follow the profile's up direction, the reverse "
                    "its down direction. Runs until SIGINT/SIGTERM.")
    p.add_argument("--profile", required=True, metavar="NAME", help="link profile name")
    p.add_argument("--profiles-file", default=None, metavar="F",
                   help="TOML file with more profiles (see fededge netem profiles)")
    p.add_argument("--listen", required=True, type=parse_hostport, metavar="HOST:PORT",
                   help="address to accept clients on (port 0: any free port)")
    p.add_argument("--upstream", required=True, type=parse_hostport, metavar="HOST:PORT",
                   help="server to forward to")
    p.add_argument("--seed", type=int, default=0, help="seed of jitter and loss draws")
    p.set_defaults(func=_cmd_proxy)
