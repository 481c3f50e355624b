"""A node's warm worker: torch, the node's data and model built once, messages over a Unix socket.

Flower starts a fresh ``flwr-clientapp`` process for every message (by design since
1.21), which then pays the torch import, torch's first optimizer (it imports
``torch._dynamo``) and the node's data and model again: about 7 CPU s a message
(BENCHMARKS.md). The worker is one long-lived process per SuperNode that has paid them
once. fededge's shim ClientApp (:mod:`fededge.clients.shim`, no torch) hands it each
message and the node's context; the worker runs fededge's own ClientApp object
(``fededge.clients.app.app``) on them exactly as Flower calls it, ``app(message,
context)``, and sends back the reply's content and the updated ``context.state``.

- **Order.** One connection, one message, one at a time: the worker never runs two
  messages at once, as a SuperNode never does.
- **Isolation.** Nothing of a message survives in the worker but what fededge's app
  caches by its own keys: the data by the data key (:mod:`fededge.workload`), the model
  object by architecture (each message loads its weights), and one reply computed ahead
  (:mod:`fededge.clients.preview`), used only for the message (run id, node id, preview
  id) and incoming ``context.state`` (SHA-256) it was computed for. A node's training
  state travels in ``context.state`` with every message, as in the cold path, so runs
  and configs cannot leak into each other.
- **Computing ahead.** After a reply that left a preview in the node's state, the worker
  runs the app on it in a background thread. The next message, whatever it is, waits
  for that run to end first (one message at a time, as above), so a message that does
  not use it (an evaluate message, a resynchronising one) can wait up to one round's
  compute.
- **Permissions.** The socket's directory must be the worker's own with no access for
  group or others (0700; it refuses to start otherwise), the socket itself is 0600, and
  each connection's peer uid (``SO_PEERCRED``) must equal the worker's, else it is
  answered with a refusal and closed.

Run by ``fededge supernode`` (:mod:`fededge.clients.supernode`), which starts it
together with ``flower-supernode`` and stops both together; by hand:
``python -m fededge.clients.worker --socket DIR/worker.sock``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from fededge.clients.preview import discard_ahead, held_preview, speculate
from fededge.clients.workerwire import WireError, decode_records, encode_records, recv_frame, send_frame
from fededge.nodecache import ENV_CACHE_DIR, NODE_CONFIG_CACHE_DIR

__all__ = ["WorkerSecurityError", "check_private_dir", "peer_uid", "serve"]

_log = logging.getLogger("fededge.worker")
PROTOCOL = 1


class WorkerSecurityError(RuntimeError):
    """The socket's directory is not private to the worker's user."""


def check_private_dir(d: Path) -> None:
    """Create ``d`` (0700) or check that it is owned by this user with no group/other access."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise WorkerSecurityError(f"{d} is not a directory")
    if st.st_uid != os.getuid():
        raise WorkerSecurityError(f"{d} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise WorkerSecurityError(f"{d} has mode {oct(st.st_mode & 0o777)}: group or others may use it; "
                                  "make it 0700 (chmod 700) or choose another directory")


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _load_app() -> Callable[..., Any]:
    from fededge.clients.app import app

    try:  # torch's first optimizer imports torch._dynamo (~2 CPU s): pay it now, not in message 1
        import torch._dynamo  # noqa: F401
    except ImportError:  # pragma: no cover - torch builds without dynamo
        pass
    return app


def handle(header: dict[str, Any], blobs: list[bytes], app: Callable[..., Any],
           after: list[Callable[[], None]] | None = None) -> tuple[dict[str, Any], list[bytes]]:
    """Run one message through ``app`` as Flower would; the reply frame. When the node's
    state now holds a preview (:mod:`fededge.clients.preview`), ``after`` (if given) gets
    the background run that computes the next message ahead, to start once the reply has
    been sent."""
    from flwr.app import Context, Message

    from fededge._flwr_internals import set_message_id, task_identity

    m = header["message"]
    content = decode_records(header["content"], blobs)
    state = decode_records(header["state"], blobs)
    node_config = dict(header["node_config"])
    if NODE_CONFIG_CACHE_DIR in node_config:
        os.environ[ENV_CACHE_DIR] = str(node_config[NODE_CONFIG_CACHE_DIR])
    run_id, node_id = int(m["run_id"]), int(m["node_id"])
    with task_identity(run_id, node_id, 0):
        msg = Message(content, dst_node_id=node_id, message_type=str(m["type"]), group_id=str(m["group_id"]))
        set_message_id(msg, str(m["id"]))
        context = Context(run_id, node_id, node_config, state, dict(header["run_config"]))
        reply = app(msg, context)
    out: list[bytes] = []
    if after is not None and held_preview(context.state) is not None:
        after.append(lambda: speculate(app, run_id=run_id, node_id=node_id, node_config=node_config,
                                       run_config=dict(header["run_config"]), state=context.state))
    if reply.has_error():
        return {"ok": True, "error": {"code": int(reply.error.code), "reason": str(reply.error.reason)},
                "state": encode_records(context.state, out)}, out
    return {"ok": True, "content": encode_records(reply.content, out),
            "state": encode_records(context.state, out)}, out


def _remove_stale_socket(path: Path) -> None:
    """Unlink ``path``, a socket a worker that died left; refuse (WorkerSecurityError) a
    path that is not a socket or one a live worker answers on (two SuperNodes given one
    --worker-socket: the second took the path and both nodes' messages went to it)."""
    import stat

    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise WorkerSecurityError(f"{path} exists and is not a socket: give --worker-socket a path of its own")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:  # nobody listens: stale
        path.unlink()
        return
    finally:
        probe.close()
    raise WorkerSecurityError(f"another worker is listening on {path}: give each SuperNode its own --worker-socket")


def serve(socket_path: str | os.PathLike[str], *, app: Callable[..., Any] | None = None,
          ready: Callable[[], None] | None = None) -> None:
    """Listen on ``socket_path`` and run messages until SIGTERM/SIGINT.

    The socket is bound (and connections queue) before the app is imported, so a
    message that arrives while torch loads waits for it instead of running cold.
    """
    path = Path(socket_path)
    check_private_dir(path.parent)
    if path.exists() or path.is_symlink():
        _remove_stale_socket(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        srv.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    srv.listen(16)
    stopping = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    t0 = time.perf_counter()
    try:
        app = app or _load_app()
        _log.info("fededge worker %d ready on %s (%.1f s to load)", os.getpid(), path, time.perf_counter() - t0)
        if ready is not None:
            ready()
        ahead: list[threading.Thread] = []  # the next message, computed ahead (at most one)
        while True:
            conn, _ = srv.accept()
            with conn:
                try:
                    _serve_one(conn, app, ahead)
                except Exception:  # noqa: BLE001 - one connection's trouble (a malformed frame, a peer
                    # gone before its answer) is that connection's: the worker serves the next one
                    _log.warning("fededge worker: a request failed; serving on", exc_info=True)
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _run_ahead(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception:  # the real message will compute again, and report its own error
        _log.warning("fededge worker: computing the next message ahead failed; it will run when it comes",
                     exc_info=True)
        discard_ahead()


def _serve_one(conn: socket.socket, app: Callable[..., Any], ahead: list[threading.Thread] | None = None) -> None:
    uid = peer_uid(conn)
    if uid != os.getuid():
        _log.warning("fededge worker: refused a connection from uid %d", uid)
        try:
            send_frame(conn, {"ok": False, "refused": f"uid {uid} may not use this worker"}, [])
            # Closing with its request unread would reset the connection before the peer
            # reads why: drain (bounded) first. Nothing read is looked at.
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.5)
            for _ in range(64):
                if not conn.recv(65536):
                    break
        except OSError:
            pass
        return
    try:
        header, blobs = recv_frame(conn)
    except (WireError, OSError, ValueError) as err:
        _log.warning("fededge worker: bad request: %s", err)
        return
    if header.get("protocol") != PROTOCOL:
        send_frame(conn, {"ok": False, "exception": f"protocol {header.get('protocol')} != worker's {PROTOCOL}"},
                   [])
        return
    t0 = time.perf_counter()
    # One message at a time: a run computing this message ahead finishes first (its
    # result is then used if it was computed for this message and state, else dropped).
    while ahead:
        ahead.pop().join()
    after: list[Callable[[], None]] = []
    try:
        reply, out = handle(header, blobs, app, after)
    except Exception as ex:  # the app raised: the shim re-raises, so Flower reports it as usual
        reply, out = {"ok": False, "exception": f"{type(ex).__name__}: {ex}",
                      "traceback": traceback.format_exc()}, []
        after.clear()
    reply["worker_s"] = time.perf_counter() - t0
    try:
        send_frame(conn, reply, out)
    except OSError as err:  # the shim gave up (its timeout): nothing to do
        _log.warning("fededge worker: could not send a reply: %s", err)
        after.clear()
    if ahead is not None:
        for job in after:
            thread = threading.Thread(target=_run_ahead, args=(job,), name="fededge-ahead", daemon=True)
            thread.start()
            ahead.append(thread)


def _set_process_name(name: bytes) -> None:
    """The name ``ps`` and ``/proc/PID/stat`` show (not ``python``), so that meters and
    operators can tell the worker apart. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fededge.clients.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the Unix socket to listen on (its directory: 0700)")
    args = p.parse_args(argv)
    _set_process_name(b"fededge-worker")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        serve(args.socket)
    except WorkerSecurityError as err:
        print(f"fededge worker: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
