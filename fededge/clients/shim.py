"""fededge's ClientApp for SuperNodes: a thin shim that imports no torch.

Flower runs each message in a fresh ``flwr-clientapp`` process. This ClientApp passes
the message's content and the node's context (run config, node config,
``context.state``) to the node's warm worker (:mod:`fededge.clients.worker`) over a local
Unix socket, and returns the worker's reply and updated state. The worker runs
fededge's own ClientApp (``fededge.clients.app.app``), so the replies are those of the
cold path, bit for bit (``tests/deploy/test_local.py``).

Where the worker is: the environment variable :data:`ENV_SOCKET` (``fededge supernode``
sets it for the SuperNode it starts, which passes it on to its ClientApp processes), or
the node-config key :data:`NODE_CONFIG_SOCKET`.

- **Fallback.** No worker configured, or none listening (not started, died between
  messages, or a socket this user may not use): the shim runs fededge's ClientApp in
  this process, as a cold ``flwr-clientapp`` always did, and logs why once per process.
- **A worker that dies mid-message** closes its end of the socket: the shim raises
  :class:`WorkerError`, which Flower turns into an error reply (the strategy drops it,
  as any failed reply). A worker that hangs is given :data:`ENV_TIMEOUT` seconds
  (default 3600), then the same. Never a hang, never a second run of the message.

Serialisation uses Flower's public record types only (:mod:`fededge.clients.workerwire`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from fededge.clients.workerwire import WireError, decode_records, encode_records, recv_frame, send_frame
from fededge import keys
from fededge.nodecache import ENV_CACHE_DIR, NODE_CONFIG_CACHE_DIR

__all__ = ["ENV_SOCKET", "ENV_TIMEOUT", "NODE_CONFIG_SOCKET", "WorkerError", "WorkerShim", "app"]

ENV_SOCKET = "FEDEDGE_WORKER_SOCKET"
ENV_TIMEOUT = "FEDEDGE_WORKER_TIMEOUT_S"
NODE_CONFIG_SOCKET = keys.WORKER_SOCKET
PROTOCOL = 1
CONNECT_TIMEOUT_S = 5.0
_log = logging.getLogger("fededge.shim")


class WorkerError(RuntimeError):
    """The warm worker took the message and then died, hung past the timeout, or failed."""


class WorkerShim(ClientApp):
    """A ClientApp that forwards every message to the node's warm worker, or runs
    ``fededge.clients.app.app`` in-process when there is none.

    Parameters
    ----------
    socket_path : str or None
        The worker's socket; None: from :data:`ENV_SOCKET` or the node config.
    timeout_s : float or None
        Seconds to wait for a reply; None: :data:`ENV_TIMEOUT`, default 3600.
    """

    def __init__(self, *, socket_path: str | None = None, timeout_s: float | None = None) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.last_mode: str | None = None  # "warm" or "cold": how the last message ran
        self._told = False

    def __call__(self, message: Message, context: Context) -> Message:
        path = self.socket_path or os.environ.get(ENV_SOCKET) or str(context.node_config.get(NODE_CONFIG_SOCKET, ""))
        sock = self._connect(path) if path else None
        if sock is None:
            if not path:
                self._tell("no warm worker configured (FEDEDGE_WORKER_SOCKET): running cold in this process")
            self.last_mode = "cold"
            return _cold(message, context)
        self.last_mode = "warm"
        with sock:
            return self._forward(sock, message, context)

    def _tell(self, why: str) -> None:
        if not self._told:
            self._told = True
            _log.warning("fededge shim: %s", why)

    def _connect(self, path: str) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect(path)
        except OSError as err:
            s.close()
            self._tell(f"no warm worker at {path} ({type(err).__name__}: {err}): running cold in this process")
            return None
        return s

    def _forward(self, sock: socket.socket, message: Message, context: Context) -> Message:
        timeout = self.timeout_s if self.timeout_s is not None else float(os.environ.get(ENV_TIMEOUT, 3600))
        md = message.metadata
        blobs: list[bytes] = []
        header = {
            "protocol": PROTOCOL,
            "message": {"type": md.message_type, "id": md.message_id, "group_id": md.group_id,
                        "run_id": int(md.run_id), "node_id": int(context.node_id)},
            "content": encode_records(message.content, blobs),
            "state": encode_records(context.state, blobs),
            "run_config": dict(context.run_config),
            "node_config": dict(context.node_config),
        }
        t0 = time.monotonic()
        try:
            sock.settimeout(timeout)
            send_frame(sock, header, blobs)
            reply, out = recv_frame(sock)
        except (WireError, OSError) as err:
            raise WorkerError(f"the warm worker did not answer after {time.monotonic() - t0:.1f} s "
                              f"({type(err).__name__}: {err}); the message was not retried") from None
        if not reply.get("ok"):
            if "refused" in reply:
                raise WorkerError(f"the warm worker refused this process: {reply['refused']}")
            raise WorkerError(f"the ClientApp raised in the warm worker: {reply.get('exception')}\n"
                              f"{reply.get('traceback', '')}")
        state = decode_records(reply["state"], out)
        context.state.clear()
        for name, rec in state.items():
            context.state[name] = rec
        if "error" in reply:
            return Message(error=Error(code=int(reply["error"]["code"]), reason=str(reply["error"]["reason"])),
                           reply_to=message)
        return Message(content=decode_records(reply["content"], out), reply_to=message)


def _cold(message: Message, context: Context) -> Message:
    """fededge's ClientApp in this process (imports torch): today's cold path."""
    if NODE_CONFIG_CACHE_DIR in context.node_config:
        os.environ[ENV_CACHE_DIR] = str(context.node_config[NODE_CONFIG_CACHE_DIR])
    from fededge.clients.app import app as fededge_app

    return fededge_app(message, context)


app: Any = WorkerShim()
