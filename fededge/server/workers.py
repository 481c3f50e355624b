"""Worker processes for the in-process runtime: the clients' work on every core.

One message to one node is one job: the message as Flower's serialised objects, the
node's config and its ``context.state`` as bytes
(:func:`~fededge.server.nodestates.state_to_bytes`). :func:`run_message` runs
a job, in this process or in a worker, and gives back the reply (again as the bytes that
cross the wire) and the node's new state. The grid (:mod:`fededge.server.grid`) keeps
every node's state and its messages' order; a worker holds nothing between jobs but the
ClientApp and the caches the ClientApp keeps itself (data, model), so any worker can run
any node's message and the results do not depend on which one did, nor on how many
there are.

A worker is a fresh interpreter (this module run as ``__main__``, never a ``fork``:
the parent holds torch's thread pools and Flower's state), talking over a socket pair
with :mod:`multiprocessing.connection`'s framing. It imports the ClientApp by reference
(``"module:attribute"``, as Flower's ``clientapp`` setting names it) with the parent's
``sys.path``, and nothing of the parent's ``__main__``: a script without an
``if __name__ == "__main__":`` guard, ``python -`` or a notebook all work. Each worker
runs its clients with ``threads`` torch threads (1 by default: the workers, not torch,
use the cores). A worker says it is ready once it has imported the ClientApp; one that
cannot start stops the run with the worker's own error, before any message.

A worker that dies mid-message (killed, out of memory) gives that message an error
reply, and a fresh worker takes its place; the run goes on, as when a real node fails.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from fededge import _flwr_internals as fi
from fededge.server.nodestates import state_from_bytes, state_to_bytes

__all__ = ["ENV_WORKER", "Job", "JobResult", "SUPERLINK_NODE_ID", "WorkerPool", "WorkerStartError", "error_reply",
           "load_client_app", "over_the_wire", "received", "run_message", "run_message_direct",
           "run_message_objects"]

SUPERLINK_NODE_ID = 1  # flwr.common.constant.SUPERLINK_NODE_ID
#: Set to "1" in a worker process's environment.
ENV_WORKER = "FEDEDGE_INPROCESS_WORKER"

log = logging.getLogger("fededge.server.inprocess")

# (message id, node id, root object id, message objects, node config, state bytes or None)
Job = tuple[str, int, str, dict[str, bytes], dict[str, Any], "bytes | None"]
# (message id, reply root id, reply objects, new state bytes or None, (reason, traceback) or None)
JobResult = tuple[str, str, dict[str, bytes], "bytes | None", "tuple[str, str] | None"]


def load_client_app(ref: str) -> Any:
    """The ClientApp ``"module:attribute"`` names."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"a ClientApp reference is 'module:attribute' (e.g. 'fededge.clients.app:app'), "
                         f"got {ref!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def received(root: str, objects: dict[str, bytes], mid: str) -> Any:
    """The Message that ``objects`` (its serialised objects, consumed) stand for, with
    the id the SuperLink gives it and its size on the wire noted
    (:func:`fededge._flwr_internals.note_wire_size`: the meter need not serialise it
    again)."""
    size = sum(map(len, objects.values()))
    msg = fi.message_from_objects(root, objects)
    fi.set_message_id(msg, mid)
    fi.note_wire_size(msg, size)
    return msg


def over_the_wire(reply: Any) -> Any:
    """``reply`` as it arrives on the other side: serialised and rebuilt."""
    root, objects = fi.serialise(reply)
    return received(root, objects, root)


def error_reply(msg: Any, reason: str) -> Any:
    """The error reply a Flower runtime gives when the ClientApp failed on ``msg``."""
    from flwr.app import Error, Message

    from fededge.protocol import CLIENT_APP_RAISED_EXCEPTION

    return Message(Error(CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)


def run_message(client_app: Any, run_id: int, run_config: Mapping[str, Any], node_id: int, mid: str, root: str,
                objects: dict[str, bytes], node_config: Mapping[str, Any], state: Any) -> tuple[Any, Any, Any]:
    """Run one message on ``client_app`` with a fresh Context holding ``state`` (a
    RecordDict). Returns ``(reply message as it arrives over the wire, the Context's
    state afterwards, (reason, traceback) if the ClientApp raised, else None)``. An
    exception becomes an error reply, as in Flower's runtimes."""
    reply_root, reply_objects, new_state, failure = run_message_objects(
        client_app, run_id, run_config, node_id, mid, root, objects, node_config, state)
    return received(reply_root, reply_objects, reply_root), new_state, failure  # the reply crosses the wire too


def run_message_direct(client_app: Any, run_id: int, run_config: Mapping[str, Any], node_id: int, mid: str, msg: Any,
                       node_config: Mapping[str, Any], state: Any) -> tuple[Any, Any, Any]:
    """:func:`run_message` for direct delivery: ``msg`` is the node's own copy of the
    message (:func:`fededge._flwr_internals.detached_copy`), and the reply comes back as
    a copy too, its size on the wire noted (:func:`~fededge._flwr_internals.direct_wire_size`)
    and its id derived from ``mid``. Nothing is serialised."""
    from fededge.arrays import replies_on_device

    fi.set_message_id(msg, mid)
    with replies_on_device():  # fededge's ClientApp keeps a GPU reply's model on the GPU: nothing needs its bytes
        reply, new_state, failure = _call_app(client_app, run_id, run_config, node_id, msg, node_config, state)
    try:
        back = fi.detached_copy(reply)
        size = fi.direct_wire_size(back)
    except Exception as err:  # noqa: BLE001 - a reply Flower cannot send: an error reply, as in Flower
        failure = (f"{type(err).__name__}: the ClientApp's reply cannot be sent: {err}", traceback.format_exc())
        back = fi.detached_copy(error_reply(msg, failure[0]))
        size = fi.direct_wire_size(back)
    fi.set_message_id(back, hashlib.sha256(f"reply:{mid}".encode()).hexdigest())
    fi.note_wire_size(back, size)
    return back, new_state, failure


def run_message_objects(client_app: Any, run_id: int, run_config: Mapping[str, Any], node_id: int, mid: str,
                        root: str, objects: dict[str, bytes], node_config: Mapping[str, Any],
                        state: Any) -> tuple[str, dict[str, bytes], Any, Any]:
    """:func:`run_message` with the reply as it travels: ``(its root object id, its
    serialised objects, state, failure)`` (a worker sends those; nothing rebuilds it
    on this side)."""
    msg = received(root, objects, mid)
    reply, new_state, failure = _call_app(client_app, run_id, run_config, node_id, msg, node_config, state)
    try:
        return (*fi.serialise(reply), new_state, failure)
    except Exception as err:  # noqa: BLE001 - a reply Flower cannot send: an error reply, as in Flower
        failure = (f"{type(err).__name__}: the ClientApp's reply cannot be sent: {err}", traceback.format_exc())
        return (*fi.serialise(error_reply(msg, failure[0])), new_state, failure)


def _call_app(client_app: Any, run_id: int, run_config: Mapping[str, Any], node_id: int, msg: Any,
              node_config: Mapping[str, Any], state: Any) -> tuple[Any, Any, Any]:
    """``client_app`` on ``msg`` with a fresh Context holding ``state``: ``(reply, the
    Context's state afterwards, (reason, traceback) or None)``; an exception becomes an
    error reply, as in Flower's runtimes."""
    from flwr.app import Context

    ctx = Context(run_id=run_id, node_id=node_id, node_config=dict(node_config), state=state,
                  run_config=dict(run_config))
    from flwr.app import Message

    failure = None
    try:
        reply = client_app(msg, ctx)
        if not isinstance(reply, Message):
            raise TypeError(f"the ClientApp returned {type(reply).__name__}, not a flwr.app.Message")
    except Exception as err:  # noqa: BLE001 - becomes an error reply, as in Flower
        failure = (f"{type(err).__name__}: {err}", traceback.format_exc())
        reply = error_reply(msg, failure[0])
    return reply, ctx.state, failure


def _worker_main(conn: Connection) -> None:
    """A worker's life: its setup, then jobs in and results out until ``None`` or EOF."""
    try:
        app_ref, run_id, run_config, threads = conn.recv()
        import torch

        torch.set_num_threads(threads)
        app = load_client_app(app_ref)
    except BaseException:  # noqa: BLE001 - told to the parent, which stops the run
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        mid, node_id, root, objects, node_config, state_bytes = job
        state = state_from_bytes(state_bytes) if state_bytes is not None else _empty()
        with fi.task_identity(run_id=run_id, node_id=SUPERLINK_NODE_ID, task_id=run_id):
            reply_root, reply_objects, new_state, failure = run_message_objects(
                app, run_id, run_config, node_id, mid, root, objects, node_config, state)
        conn.send((mid, reply_root, reply_objects, state_to_bytes(new_state) if len(new_state) else None, failure))


def _empty() -> Any:
    from flwr.app import RecordDict

    return RecordDict()


#: A job's result where its worker died before beginning it (:meth:`WorkerPool.collect`).
UNSTARTED = object()

#: What the sending thread sends a worker to stop it (None, pickled: the worker's loop ends on it).
_STOP = ForkingPickler.dumps(None)


class WorkerStartError(RuntimeError):
    """A worker process could not start (its ClientApp did not import, ...)."""


# ``python -m`` would put the working directory first on the worker's path, where a
# directory named like a package (a checkout of fededge, the user's own app) would
# shadow what this process imported: the worker's path is this process's, and only it
# (its working directory where this process has one on its path: a notebook, ``python -``).
_START = ("import sys, runpy\n"
          "if sys.path[:1] == ['']:\n"
          "    del sys.path[0]\n"
          "runpy.run_module('fededge.server.workers', run_name='__main__', alter_sys=True)\n")


class _Worker:
    """One worker process and the two threads that feed it: one sends jobs, one reads
    results, while this process's main thread goes on (runs a job itself, aggregates).

    Up to :attr:`depth` jobs are in flight: while more messages wait than there are
    processes to run them, the next job is already in the pipe when the worker finishes
    one, so it does not wait for this process's main thread (busy with a job of its own)
    to hand it more; near a batch's end it holds one. Sending and reading on separate
    threads means neither side blocks on a full pipe while the other writes to it."""

    #: Jobs a worker holds at once: the one it runs and the next.
    depth = 2

    def __init__(self, setup: tuple[Any, ...], results: queue.SimpleQueue, start_timeout: float) -> None:
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(os.getcwd() if p == "" else p for p in sys.path)  # "": this process's cwd
        env = {**os.environ, "PYTHONPATH": path, ENV_WORKER: "1"}
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, this module
                [sys.executable, "-c", _START, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send(setup)
            if not self.conn.poll(start_timeout):
                raise WorkerStartError(f"an in-process worker did not start within {start_timeout:.0f} s")
            status, detail = self.conn.recv()
        except (EOFError, OSError) as err:
            self._kill()
            raise WorkerStartError(f"an in-process worker exited while starting (exit code {self.proc.poll()})"
                                   ) from err
        except BaseException:
            self._kill()
            raise
        if status != "ready":
            self._kill()
            raise WorkerStartError(f"an in-process worker could not start the ClientApp {setup[0]!r}:\n{detail}")
        self._results = results
        self._lock = threading.Lock()
        self._inflight: deque[Job] = deque()  # sent or being sent, in order; results come back in it
        self._dead = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._send_loop, daemon=True, name=f"fededge-worker-send-{self.proc.pid}"),
            threading.Thread(target=self._receive_loop, daemon=True, name=f"fededge-worker-recv-{self.proc.pid}"),
        ]
        for t in self._threads:
            t.start()

    # The two threads only move bytes (the socket calls release the GIL): pickling the
    # jobs and unpickling the results is the main thread's, so the threads never hold
    # the GIL for long while the main thread works (a thread waiting for it waits up to
    # Python's switch interval, 5 ms).
    def _send_loop(self) -> None:
        while True:
            job = self._outbox.get()
            try:
                self.conn.send_bytes(job)  # _STOP: the worker's signal to stop
            except (OSError, ValueError):
                return  # the worker died: the receiving thread reports its jobs
            if job is _STOP:
                return
            job = None  # not kept while waiting for the next (a model and a state)

    def _receive_loop(self) -> None:
        while True:
            try:
                result = self.conn.recv_bytes()
            except (EOFError, OSError, ValueError):
                with self._lock:  # the worker died (or was stopped)
                    self._dead = True
                    lost = list(self._inflight)
                    self._inflight.clear()
                # The first job it held is lost (it was running it, or about to); the others
                # never began (a worker reads its next job only once it has answered the
                # last): they go back to run elsewhere, not as errors of nodes that never ran.
                for k, job in enumerate(lost):
                    self._results.put((self, job, None if k == 0 else UNSTARTED))
                return
            with self._lock:
                job = self._inflight.popleft()
            self._results.put((self, job, result))

    def load(self) -> int | None:
        """Jobs this worker holds now (None: it died and takes none)."""
        with self._lock:
            return None if self._dead else len(self._inflight)

    def submit(self, job: Job) -> None:
        data = ForkingPickler.dumps(job)
        with self._lock:
            if not self._dead:
                self._inflight.append(job)
                self._outbox.put(data)
                return
        self._results.put((self, job, UNSTARTED))  # died meanwhile: the job never began

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def stop(self, timeout: float = 5.0) -> None:
        self._outbox.put(_STOP)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for t in self._threads:  # the worker's exit ends both (EOF, a broken pipe)
            t.join(timeout)
        self.conn.close()


class WorkerPool:
    """``size`` worker processes running jobs of one run's ClientApp.

    Parameters
    ----------
    app_ref : str
        The ClientApp as ``"module:attribute"``.
    run_id, run_config
        What every node's Context carries.
    size : int
        Number of worker processes.
    threads : int
        torch threads in each worker.
    start_timeout : float
        Seconds a worker may take to start (import torch, Flower and the ClientApp).

    Raises
    ------
    WorkerStartError
        A worker could not start; the message names why (the worker's traceback).
    """

    def __init__(self, app_ref: str, *, run_id: int, run_config: Mapping[str, Any], size: int,
                 threads: int = 1, start_timeout: float = 120.0) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self._setup = (app_ref, run_id, dict(run_config), threads)
        self._start_timeout = start_timeout
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._outstanding = 0
        self.restarts = 0
        try:
            for _ in range(size):
                self._workers.append(self._new())
        except BaseException:
            self.close()
            raise

    def _new(self) -> _Worker:
        return _Worker(self._setup, self._results, self._start_timeout)

    @property
    def size(self) -> int:
        return len(self._workers)

    def free(self, depth: int = _Worker.depth) -> list[_Worker]:
        """Workers that take another job now, one entry per job, each holding at most
        ``depth`` (1 to :attr:`_Worker.depth`): first one job for every idle worker, then
        a second for each that has one."""
        depth = max(1, min(depth, _Worker.depth))
        for w in list(self._workers):
            if w.load() is None:  # died, idle too: a fresh one in its place (the pool kept shrinking, unsaid)
                self._replace(w)
        loads = [(w, w.load()) for w in self._workers]
        return [w for level in range(depth) for w, n in loads if n is not None and n <= level]

    def busy(self) -> int:
        """Jobs submitted and not yet collected."""
        return self._outstanding

    def submit(self, worker: _Worker, job: Job) -> None:
        worker.submit(job)  # pickles it: what cannot be pickled raises here, nothing counted
        self._outstanding += 1

    def collect(self, timeout: float | None = None) -> list[tuple[Job, JobResult | None]]:
        """Wait for at least one submitted job to finish (``timeout=0``: do not wait);
        return ``(job, result)`` pairs, ``result`` None where the worker died running
        it, :data:`UNSTARTED` where it died before beginning it (the worker is replaced,
        once, whatever the number of jobs it held)."""
        if not self._outstanding:
            return []
        done = []
        try:
            item = self._results.get(block=timeout != 0, timeout=timeout or None)
            while True:
                worker, job, result = item
                if result is not None and result is not UNSTARTED:
                    result = ForkingPickler.loads(result)
                self._outstanding -= 1
                done.append((job, result))
                if (result is None or result is UNSTARTED) and worker in self._workers:
                    self._replace(worker)
                item = self._results.get_nowait()
        except queue.Empty:
            pass
        return done

    def _replace(self, worker: _Worker) -> None:
        worker.stop(timeout=1.0)
        log.error("an in-process worker (pid %s) died with exit code %s; a new one takes its place",
                  worker.proc.pid, worker.proc.returncode)
        self.restarts += 1
        self._workers[self._workers.index(worker)] = self._new()

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
