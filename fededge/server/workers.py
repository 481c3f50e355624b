"""Worker processes for the in-process runtime: the clients' work on every core.

One message to one node is one job: the message as Flower's serialised objects, the
node's config and its ``context.state`` as serialised objects. :func:`run_message` runs
a job, in this process or in a worker, and gives back the reply (again as the bytes that
cross the wire) and the node's new state. The grid (:mod:`fededge.server.grid`) keeps
every node's state and its messages' order; a worker holds nothing between jobs but the
ClientApp and the caches the ClientApp keeps itself (data, model), so any worker can run
any node's message and the results do not depend on which one did, nor on how many
there are.

Workers are started with ``spawn`` (never ``fork``: the parent holds torch's thread
pools and Flower's state) and import the ClientApp by reference (``"module:attribute"``,
as Flower's ``clientapp`` setting names it). Like any ``spawn`` process they import the
parent's ``__main__`` module, which therefore needs the usual
``if __name__ == "__main__":`` guard. Each worker runs its clients with ``threads`` torch
threads (1 by default: the workers, not torch, use the cores).

A worker that dies mid-message (killed, out of memory) gives that message an error
reply, and a fresh worker takes its place; the run goes on, as when a real node fails.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from fededge import _flwr_internals as fi

__all__ = ["Job", "JobResult", "SUPERLINK_NODE_ID", "WorkerPool", "load_client_app", "run_message"]

SUPERLINK_NODE_ID = 1  # flwr.common.constant.SUPERLINK_NODE_ID

log = logging.getLogger("fededge.server.inprocess")

# (message id, node id, root object id, message objects, node config, state objects or None)
Job = tuple[str, int, str, dict[str, bytes], dict[str, Any], "dict[str, Any] | None"]
# (message id, reply root id, reply objects, new state objects or None, (reason, traceback) or None)
JobResult = tuple[str, str, dict[str, bytes], "dict[str, Any] | None", "tuple[str, str] | None"]


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


def run_message(client_app: Any, run_id: int, run_config: Mapping[str, Any], node_id: int, mid: str, root: str,
                objects: dict[str, bytes], node_config: Mapping[str, Any], state: Any) -> tuple[Any, Any, Any]:
    """Run one message on ``client_app`` with a fresh Context holding ``state`` (a
    RecordDict). Returns ``(reply message as it arrives over the wire, the Context's
    state afterwards, (reason, traceback) if the ClientApp raised, else None)``. An
    exception becomes an error reply, as in Flower's runtimes."""
    from flwr.app import Context, Error, Message

    from fededge.protocol import CLIENT_APP_RAISED_EXCEPTION

    msg = fi.message_from_objects(root, objects)
    fi.set_message_id(msg, mid)
    ctx = Context(run_id=run_id, node_id=node_id, node_config=dict(node_config), state=state,
                  run_config=dict(run_config))
    failure = None
    try:
        reply = client_app(msg, ctx)
    except Exception as err:  # noqa: BLE001 - becomes an error reply, as in Flower
        failure = (f"{type(err).__name__}: {err}", traceback.format_exc())
        reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, failure[0]), reply_to=msg)
    # The reply crosses the wire too.
    back = fi.message_from_objects(reply.object_id, fi.message_objects(reply))
    fi.set_message_id(back, reply.object_id)
    return back, ctx.state, failure


def _worker_main(conn: Connection, app_ref: str, run_id: int, run_config: dict[str, Any], threads: int) -> None:
    """A worker's loop: jobs in, results out, until ``None`` or the pipe closes."""
    import torch

    torch.set_num_threads(threads)
    app = load_client_app(app_ref)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        mid, node_id, root, objects, node_config, state_objects = job
        state = fi.recorddict_from_objects(state_objects) if state_objects is not None else _empty()
        with fi.task_identity(run_id=run_id, node_id=SUPERLINK_NODE_ID, task_id=run_id):
            back, new_state, failure = run_message(app, run_id, run_config, node_id, mid, root, objects,
                                                   node_config, state)
        conn.send((mid, back.object_id, fi.message_objects(back),
                   fi.recorddict_to_objects(new_state) if len(new_state) else None, failure))


def _empty() -> Any:
    from flwr.app import RecordDict

    return RecordDict()


class _Worker:
    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, *args), daemon=True,
                                name="fededge-inprocess-worker")
        self.proc.start()
        child.close()
        self.job: Job | None = None

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
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
    """

    def __init__(self, app_ref: str, *, run_id: int, run_config: Mapping[str, Any], size: int,
                 threads: int = 1) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self._ctx = multiprocessing.get_context("spawn")
        self._args = (app_ref, run_id, dict(run_config), threads)
        self._workers = [_Worker(self._ctx, self._args) for _ in range(size)]
        self.restarts = 0

    @property
    def size(self) -> int:
        return len(self._workers)

    def idle(self) -> list[_Worker]:
        return [w for w in self._workers if w.job is None]

    def busy(self) -> int:
        return sum(1 for w in self._workers if w.job is not None)

    def submit(self, worker: _Worker, job: Job) -> None:
        worker.job = job
        try:
            worker.conn.send(job)
        except (OSError, ValueError):
            pass  # a dead worker: collect() reports it

    def collect(self, timeout: float | None = None) -> list[tuple[Job, JobResult | None]]:
        """Wait for at least one busy worker to finish (or ``timeout``); return
        ``(job, result)`` pairs, ``result`` None where the worker died (it is replaced)."""
        busy = {w.conn: w for w in self._workers if w.job is not None}
        if not busy:
            return []
        done = []
        for conn in multiprocessing.connection.wait(list(busy), timeout):
            worker = busy[conn]  # type: ignore[index]
            job, worker.job = worker.job, None
            assert job is not None
            try:
                result = worker.conn.recv()
            except (EOFError, OSError):
                done.append((job, None))
                self._replace(worker)
                continue
            done.append((job, result))
        return done

    def _replace(self, worker: _Worker) -> None:
        worker.stop(timeout=1.0)
        code = worker.proc.exitcode
        log.error("an in-process worker (pid %s) died with exit code %s; a new one takes its place",
                  worker.proc.pid, code)
        self.restarts += 1
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self._args)

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
