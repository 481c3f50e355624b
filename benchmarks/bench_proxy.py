#!/usr/bin/env python
"""What the netem proxy costs, and how faithfully it shapes: two tables.

(a) Overhead. An unshaped, zero-delay profile: bulk throughput through the proxy vs
    direct loopback (one TCP connection, ``--bulk-mb`` MB), and the added p50/p99 latency
    of a 64-byte request/response. The issue's goals: at least 1 Gbit/s through the
    unshaped proxy and under 0.5 ms added p50.
(b) Fidelity. For built-in profiles (default ``4g``, ``wifi``, ``3g``): configured vs
    measured median RTT, and configured vs measured up and down throughput. Throughput
    is measured at the receiver, from the first received block to the last, over the
    bytes after the first block (loopback socket buffers absorb data at the sender). The
    "model" rate is what the proxy is meant to deliver: the profile's rate, capped by the
    Mathis ceiling and slowed by one RTT per expected loss event on lossy profiles (see
    :mod:`fededge.netem.proxy`); the error is measured against it.

The proxy runs as a separate process (``fededge netem proxy`` through
:func:`fededge.netem.proxy.register_cli`), as a user runs it, so that it does not share
this interpreter's GIL with the load generators. Everything stays on 127.0.0.1.

Examples
--------
::

    python benchmarks/bench_proxy.py
    python benchmarks/bench_proxy.py --bulk-mb 200 --profiles 4g 5g --seconds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from fededge.deploy.procs import stop_popen
from fededge.netem import loopback
from fededge.netem.profiles import LinkProfile, load_profiles
from fededge.netem.proxy import MSS_BYTES, mathis_ceiling_bps

HOST = loopback.HOST
#: The loopback server and client of the proxy's tests, with room for the slowest profiles.
tcp_server = partial(loopback.tcp_server, conn_timeout_s=60)
connect = partial(loopback.connect, timeout_s=60)

_PROXY_MAIN = (
    "import argparse, sys\n"
    "from fededge.netem.proxy import register_cli\n"
    "p = argparse.ArgumentParser(); register_cli(p.add_subparsers(dest='c'))\n"
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
)


@contextmanager
def proxy_process(profile: str, upstream_port: int, profiles_file: str | None = None) -> Iterator[tuple[str, int]]:
    cmd = [sys.executable, "-c", _PROXY_MAIN, "proxy", "--profile", profile,
           "--listen", f"{HOST}:0", "--upstream", f"{HOST}:{upstream_port}"]
    if profiles_file:
        cmd += ["--profiles-file", profiles_file]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        if not line.startswith("netem proxy "):
            raise RuntimeError(f"proxy did not start: {line}{proc.stderr.read() if proc.poll() is not None else ''}")
        host, _, port = line.split()[2].rpartition(":")
        yield host, int(port)
    finally:
        stop_popen(proc, grace_s=10)


def echo(conn: socket.socket) -> None:
    buf = bytearray(65536)
    for _ in range(10_000_000):
        n = conn.recv_into(buf)
        if not n:
            return
        conn.sendall(memoryview(buf)[:n])


class Sink:
    """Reads until EOF; keeps (time, bytes) of the first block and the time of the last."""

    def __init__(self) -> None:
        self.first_t = self.last_t = 0.0
        self.first_n = self.total = 0
        self.done = threading.Event()

    def __call__(self, conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        try:
            for _ in range(100_000_000):
                n = conn.recv_into(buf)
                now = time.perf_counter()
                if not n:
                    return
                if self.total == 0:
                    self.first_t, self.first_n = now, n
                self.last_t = now
                self.total += n
        finally:
            self.done.set()

    @property
    def bps(self) -> float:
        span = self.last_t - self.first_t
        return (self.total - self.first_n) * 8 / span if span > 0 else math.inf


def source(nbytes: int) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        block = b"\0" * (1 << 20)
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            conn.sendall(memoryview(block)[:n])
            left -= n
        conn.shutdown(socket.SHUT_WR)
    return send


def upload(addr: tuple[str, int], sink: Sink, nbytes: int, timeout_s: float) -> float:
    with connect(addr) as s:
        source(nbytes)(s)
        if not sink.done.wait(timeout_s):
            raise TimeoutError("upload did not finish")
    return sink.bps


def download(addr: tuple[str, int], timeout_s: float) -> float:
    sink = Sink()
    with connect(addr) as s:
        s.settimeout(timeout_s)
        sink(s)
    return sink.bps


def ping(addr: tuple[str, int], n: int, size: int = 64) -> list[float]:
    out = []
    msg = b"x" * size
    with connect(addr) as s:
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < size:
                chunk = s.recv(size - got)
                if not chunk:
                    raise ConnectionError("closed")
                got += len(chunk)
            out.append(time.perf_counter() - t)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead(bulk_mb: int, pings: int) -> None:
    nbytes = bulk_mb * 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        pfile = Path(tmp) / "profiles.toml"
        pfile.write_text('[unshaped]\nsource = "benchmark: no shaping"\nup = {}\ndown = {}\n')
        rows = []
        for label in ("direct", "proxy"):
            sink = Sink()
            with tcp_server(sink) as port:
                if label == "direct":
                    bps = upload((HOST, port), sink, nbytes, 120)
                else:
                    with proxy_process("unshaped", port, str(pfile)) as addr:
                        bps = upload(addr, sink, nbytes, 120)
            with tcp_server(echo) as port:
                if label == "direct":
                    lat = ping((HOST, port), pings)
                else:
                    with proxy_process("unshaped", port, str(pfile)) as addr:
                        ping(addr, 50)  # warm-up
                        lat = ping(addr, pings)
            rows.append((label, bps, pct(lat, 0.5), pct(lat, 0.99)))
    (_, d_bps, d50, d99), (_, p_bps, p50, p99) = rows
    print(f"(a) overhead: unshaped proxy vs direct loopback; {bulk_mb} MB bulk, {pings} x 64-byte request/response")
    print(f"{'path':<8} {'throughput':>14} {'RTT p50':>10} {'RTT p99':>10}")
    for label, bps, l50, l99 in rows:
        print(f"{label:<8} {bps / 1e9:>9.2f} Gbit/s {l50 * 1e3:>7.3f} ms {l99 * 1e3:>7.3f} ms")
    print(f"proxy/direct throughput: {p_bps / d_bps:.2f}x  (goal: >= 1 Gbit/s through the proxy: "
          f"{'met' if p_bps >= 1e9 else 'NOT met'})")
    print(f"added latency: p50 {(p50 - d50) * 1e3:.3f} ms, p99 {(p99 - d99) * 1e3:.3f} ms  "
          f"(goal: < 0.5 ms added p50: {'met' if p50 - d50 < 0.5e-3 else 'NOT met'})")


def model_bps(profile: LinkProfile, up: bool) -> tuple[float, float]:
    """(nominal rate, the rate the proxy's model should deliver) of one direction."""
    d = profile.up if up else profile.down
    nominal = d.rate_bps or math.inf
    rtt = profile.rtt_s
    eff = min(nominal, mathis_ceiling_bps(d.loss, rtt))
    # One RTT per loss event; events per byte = loss / burst / MSS.
    per_byte_s = 8 / eff + d.loss / d.loss_burst / MSS_BYTES * rtt
    return nominal, 1 / per_byte_s * 8


def fidelity(names: list[str], seconds: float, pings: int) -> None:
    profiles = load_profiles()
    print(f"\n(b) fidelity: built-in profiles through the proxy (~{seconds:g} s per transfer, "
          f"{pings} pings; throughput at the receiver)")
    print(f"{'profile':<8} {'RTT cfg':>8} {'RTT med':>8} {'err':>6} | {'dir':<4} {'rate cfg':>10} "
          f"{'model':>10} {'measured':>10} {'err':>6}")
    for name in names:
        prof = profiles[name]
        with tcp_server(echo) as port, proxy_process(name, port) as addr:
            med = statistics.median(ping(addr, pings))
        cfg_rtt = prof.rtt_s
        rtt_err = (med - cfg_rtt) / cfg_rtt * 100 if cfg_rtt else float("nan")
        first = True
        for up in (True, False):
            nominal, model = model_bps(prof, up)
            nbytes = int(model * seconds / 8)
            if up:
                sink = Sink()
                with tcp_server(sink) as port, proxy_process(name, port) as addr:
                    bps = upload(addr, sink, nbytes, seconds * 5 + 10)
            else:
                with tcp_server(source(nbytes)) as port, proxy_process(name, port) as addr:
                    bps = download(addr, seconds * 5 + 10)
            err = (bps - model) / model * 100
            head = (f"{name:<8} {cfg_rtt * 1e3:>5.1f} ms {med * 1e3:>5.1f} ms {rtt_err:>+5.1f}%" if first
                    else " " * 33)
            first = False
            print(f"{head} | {'up' if up else 'down':<4} {nominal / 1e6:>5.2f} Mb/s {model / 1e6:>5.2f} Mb/s "
                  f"{bps / 1e6:>5.2f} Mb/s {err:>+5.1f}%")
    print("rate cfg: the profile's rate; model: capped by the Mathis ceiling and one RTT per "
          "loss event (lossy profiles); err: measured vs model")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk-mb", type=int, default=500)
    ap.add_argument("--pings", type=int, default=2000, help="request/response pairs for (a)")
    ap.add_argument("--profiles", nargs="+", default=["4g", "wifi", "3g"])
    ap.add_argument("--seconds", type=float, default=3.0, help="target length of each transfer in (b)")
    ap.add_argument("--fidelity-pings", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"$ python {' '.join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])}")
    print(f"date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}; "
          f"{platform.python_implementation()} {platform.python_version()}; {os.cpu_count()} CPUs; "
          f"{platform.platform()}")
    t0 = time.perf_counter()
    overhead(args.bulk_mb, args.pings)
    fidelity(args.profiles, args.seconds, args.fidelity_pings)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
