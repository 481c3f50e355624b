"""Loopback TCP endpoints for measuring a shaped link: a threaded server and a client socket.

What the proxy's tests and ``benchmarks/bench_proxy.py`` measure a link with, and what a
user can check their own shaping with: put :func:`tcp_server` behind the proxy (or a
kernel-shaped interface), :func:`connect` to the proxy, and time what crosses.

Examples
--------
>>> from fededge.netem.loopback import connect, tcp_server
>>> def echo(conn):
...     conn.sendall(conn.recv(64))
>>> with tcp_server(echo) as port, connect(("127.0.0.1", port)) as s:
...     s.sendall(b"ping")
...     s.recv(64)
b'ping'

Pure standard library: no Flower.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["HOST", "connect", "tcp_server"]

HOST = "127.0.0.1"


@contextmanager
def tcp_server(handler: Callable[[socket.socket], None], *, host: str = HOST,
               conn_timeout_s: float = 30.0) -> Iterator[int]:
    """A threaded TCP server on ``host``, any free port, that yields the port.

    Each accepted connection (TCP_NODELAY, ``conn_timeout_s`` on its operations) runs
    ``handler(conn)`` in a thread of its own and is closed after it; an ``OSError`` in the
    handler (the peer went away) ends that connection only. Leaving the ``with`` block
    stops accepting and closes the listening socket.
    """
    lsock = socket.socket()
    lsock.bind((host, 0))
    lsock.listen(32)
    lsock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except (socket.timeout, OSError):
                continue
            conn.settimeout(conn_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def run(c: socket.socket = conn) -> None:
                with c:
                    try:
                        handler(c)
                    except OSError:
                        pass

            threading.Thread(target=run, daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        lsock.close()


def connect(addr: tuple[str, int], *, timeout_s: float = 30.0) -> socket.socket:
    """A TCP connection to ``addr`` with TCP_NODELAY (small requests go out at once)."""
    s = socket.create_connection(addr, timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
