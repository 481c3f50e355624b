"""An in-process Flower runtime for any ServerApp and ClientApp: no SuperLink, no Ray.

Flower's Ray simulation costs about 10 s of start-up per run on a small machine, too much
for tests, benchmarks and quick sweeps. :class:`InProcessGrid` is a Flower ``Grid`` that
delivers each message to the ClientApp by calling it in this process, with one
``Context`` per node that persists across rounds (as a SuperNode's does).

Messages still travel as Flower's serialised object trees: each one is deflated to the
bytes a SuperLink would store and inflated again on the other side, so the client never
shares memory with the server and the bytes counted are those of the real transport.

Semantics match a deployment's: messages to a node run one at a time, in the order they
were pushed; a ServerApp may push several rounds ahead and pull later (execution
happens when a reply is pulled). An exception in the ClientApp becomes an error reply,
as Flower's runtimes do, and the strategy leaves that node out. Its traceback is logged
the first time that error (type and message) occurs in the grid; repeats, one per
failing client and round, are logged at DEBUG, since the server reports every failure
in one line anyway.

**Scale.** ``client_states="disk"`` keeps the state of every node that is not running
on disk (:mod:`fededge.server.nodestates`), so that memory follows the clients per round,
not the clients; a node's Context is built for each message (its config and run config
are the grid's), so 100,000 nodes cost little more than their ids. ``workers=N`` runs
the clients' messages on N processes (this one and N-1 spawned workers,
:mod:`fededge.server.workers`): a node's messages still run one at a time and in order,
and results are the same whatever N (each message gets its node's state as bytes and
returns it; clients run with ``worker_threads`` torch threads in every process).

:func:`run_server` runs a ServerApp on it. Nothing here is fededge's own app (that is
:func:`fededge.server.inprocess.run_inprocess`), so a user's tests import this with
their own apps. Private Flower internals used here live in :mod:`fededge._flwr_internals`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.safefile import bytes_from_tensor, tensor_of_bytes
from fededge.server.nodestates import (INLINE_STATES_MAX, NodeStates, make_states, read_states_file,
                                      write_states_file)
from fededge.server.workers import (SUPERLINK_NODE_ID, UNSTARTED, Job, WorkerPool, error_reply, load_client_app,
                                    over_the_wire, received, run_message, run_message_direct)

__all__ = ["InProcessGrid", "run_server", "SUPERLINK_NODE_ID"]

#: The runtime's logger, named as when it shared fededge.server.inprocess with run_inprocess.
log = logging.getLogger("fededge.server.inprocess")


_checked = False


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process (or in its workers).

    Parameters
    ----------
    client_app : ClientApp or str
        The ClientApp each node runs (fededge's, or any other), or its reference
        ``"module:attribute"``. With ``workers > 1`` the workers import it, so it must
        be a reference (or ``client_app_ref`` must give one).
    num_nodes : int
        Number of nodes. Node ``i`` gets node config ``partition-id=i,
        num-partitions=num_nodes`` (as in Flower's simulation) merged with
        ``node_configs[i]`` if given.
    run_config : mapping
        The run config every node's Context carries (any keys: the grid reads none).
    run_id : int
        The run id messages and Contexts carry.
    seed : int
        Seeds the (random, 63-bit) node ids.
    keep_client_states : bool
        Whether checkpoints hold the nodes' states (:meth:`state_dict`).
    client_states : {"memory", "disk", "auto"}
        Where idle nodes' ``context.state`` is kept (:mod:`fededge.server.nodestates`):
        ``"auto"`` keeps them in memory until they total the larger of ``states_budget_mb``
        and ``states_round_clients``' states, then on disk.
    states_dir : path, optional
        Where ``"disk"`` states go (a private temporary directory in it; default ``$TMPDIR``).
    states_budget_mb : float
        ``"auto"``'s budget, in MiB.
    states_round_clients : int
        The clients of a round: ``"auto"`` keeps that many of the largest state in memory,
        at most 4 x the budget and a quarter of the memory
        (:class:`~fededge.server.nodestates.AutoStates`); 0, the budget alone.
    workers : int
        Processes that run the clients' messages: this one and ``workers - 1`` spawned ones.
    worker_threads : int
        torch threads for the clients in every process when ``workers > 1``.
    client_app_ref : str, optional
        ``"module:attribute"`` of ``client_app`` for the workers.
    cohort : bool
        Run a batch of messages (a round's) together in this process
        (:func:`fededge.clients.cohort.run_together`): each message still runs its
        ClientApp and mods on its own, one at a time and in order, but the local SGD of
        fededge's ClientApp trains the round's clients as one batched program. A ClientApp
        that does not call :func:`fededge.clients.cohort.local_sgd` runs as it would
        without it. The workers (``workers > 1``) are then not used for such batches.
    client_device : str, optional
        The device fededge's ClientApp trains on where the run config says
        ``device=auto`` (node config ``fededge-client-device``): one choice for every
        node, made by :func:`fededge.server.inprocess.client_device_choice`.
    direct : bool
        Hand each message and reply over as a copy (:func:`fededge._flwr_internals.detached_copy`:
        new records and Arrays, the arrays' immutable bytes shared) instead of
        serialising it and rebuilding it on the other side, and count its bytes on the
        wire from the format (:func:`~fededge._flwr_internals.direct_wire_size`: the
        same number, without hashing or copying 45 MB per message). Needs ``workers=1``
        (a worker process needs the bytes). A ClientApp whose replies Flower could not
        serialise would pass here and fail on a SuperLink: :func:`run_inprocess` uses it
        for fededge's own ClientApp only.
    """

    #: Each node's messages run one at a time, in push order (checked by strategies
    #: that push rounds ahead; see ``fededge._flwr_internals.runs_messages_in_order``).
    runs_messages_in_order = True
    #: The grid notes each message's size on the wire as it serialises it (pushed
    #: messages and replies): :class:`~fededge.server.metering.MeteredGrid` then counts
    #: after the push and serialises nothing again (``fi.take_noted_wire_size``).
    notes_wire_sizes = True

    def __init__(
        self,
        client_app: ClientApp | str,
        *,
        num_nodes: int,
        run_config: Mapping[str, Any],
        run_id: int = 1,
        node_configs: Sequence[Mapping[str, Any]] | None = None,
        seed: int = 0,
        keep_client_states: bool = True,
        client_states: str = "memory",
        states_dir: str | None = None,
        states_budget_mb: float = 256,
        states_round_clients: int = 0,
        workers: int = 1,
        worker_threads: int = 1,
        client_app_ref: str | None = None,
        cohort: bool = False,
        client_device: str | None = None,
        direct: bool = False,
    ) -> None:
        global _checked
        if not _checked:
            fi.check()  # fail loudly, naming the internal, if Flower changed
            _checked = True
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"node_configs has {len(node_configs)} entries for {num_nodes} nodes")
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (this process counts as one), got {workers}")
        if worker_threads < 1:
            raise ValueError(f"worker_threads must be >= 1, got {worker_threads}")
        if direct and workers > 1:
            raise ValueError("direct delivery runs every message in this process: it needs workers=1")
        if isinstance(client_app, str):
            client_app_ref, client_app = client_app, load_client_app(client_app)
        if workers > 1 and client_app_ref is None:
            raise ValueError("workers > 1 start processes that import the ClientApp: pass it as "
                             "'module:attribute' (client_app='mypkg.client:app' or client_app_ref=...)")
        self.client_app = client_app
        self.client_app_ref = client_app_ref
        self.run_config = dict(run_config)
        # Whether a checkpoint holds the nodes' context.state (state_dict). False stands for
        # a runtime that cannot (Ray, a SuperLink): the nodes then keep their own state
        # (fededge.clients.statestore), and a resumed run's grid starts with empty contexts.
        self.keeps_client_states = keep_client_states
        rng = random.Random(seed)
        ids: dict[int, None] = {}  # ordered, with O(1) membership: 10,000 nodes in ms, not seconds
        while len(ids) < num_nodes:
            nid = rng.getrandbits(63)
            if nid > SUPERLINK_NODE_ID and nid not in ids:
                ids[nid] = None
        # A node is its id, its index (partition) and its state; its Context is built for
        # each message, so idle nodes hold no copy of the run config.
        self._index = {nid: i for i, nid in enumerate(ids)}
        self._node_configs = None if node_configs is None else [dict(c) for c in node_configs]
        self.states: NodeStates = make_states(client_states, states_dir, int(states_budget_mb * 2**20),
                                              round_clients=states_round_clients)
        self.workers = workers
        self.worker_threads = worker_threads
        self.cohort = cohort
        if cohort:  # this run's cohorts are timed and judged afresh (its threads, its models)
            from fededge.clients.cohort import reset_measurements

            reset_measurements()
        self.client_device = client_device
        self.direct = direct
        # direct delivery: messages pushed (for their ids, with this grid's salt), and the
        # Messages pushed and still pending, held so that one pushed twice is refused (held:
        # a freed message's id() could be a new one's)
        self._pushed = 0
        self._salt = os.urandom(8).hex()
        self._origins: dict[str, Message] = {}
        #: The runtime's choices in words, for the run's first line and config.json
        #: (:func:`fededge.server.inprocess.run_inprocess` says why it chose them).
        self.runtime_note = (f"{workers} process{'es' if workers > 1 else ''}; client states {client_states}"
                             + ("; messages handed over directly" if direct else ""))
        self._pool: WorkerPool | None = None
        self._run = fi.empty_run(run_id)
        # message id -> (destination node, root object id, serialised objects), in push order
        self._pending: OrderedDict[str, tuple[int, str, dict[str, bytes]]] = OrderedDict()
        self._replies: dict[str, Message] = {}
        self.messages_run = 0
        self._errors_seen: set[str] = set()  # errors whose traceback was logged already

    def node_config(self, node_id: int) -> dict[str, Any]:
        """The node config node ``node_id``'s Context carries."""
        i = self._index[node_id]
        # The in-process mark tells fededge's ClientApp that the grid keeps the states
        # (it adds no StateSpillMod of its own for client-states="disk").
        config: dict[str, Any] = {keys.PARTITION_ID: i, keys.NUM_PARTITIONS: len(self._index),
                                  keys.INPROCESS_NODE: True}
        if self.client_device is not None:  # device=auto's choice, made once for every node
            config[keys.CLIENT_DEVICE] = self.client_device
        if self._node_configs is not None:
            config.update(self._node_configs[i])
        return config

    @property
    def contexts(self) -> Mapping[int, Context]:
        """Every node's Context as its next message would see it (a view, built on access;
        with ``client_states="disk"`` the states are copies, and with ``"auto"`` they are
        live until the states move to disk, copies after)."""
        return _Contexts(self)

    def data_splits(self) -> list[tuple[int, str | None]]:
        """Every distinct ``(num-partitions, data-dir)`` of the nodes' configs (data-dir
        None when a node has none of its own): the splits its clients will make."""
        if self._node_configs is None:
            return [(len(self._index), None)]
        configs = (self.node_config(nid) for nid in self._index)
        return sorted({
            (int(c[keys.NUM_PARTITIONS]), str(c.get(keys.DATA_DIR, "")) or None)
            for c in configs if keys.NUM_PARTITIONS in c
        }, key=lambda s: (s[0], s[1] or ""))

    def start_workers(self) -> WorkerPool:
        """Start the worker processes now (else the first message starts them): a worker
        that cannot start raises :class:`~fededge.server.workers.WorkerStartError` here."""
        if self._pool is None:
            if self.workers == 1:
                raise RuntimeError("this grid runs every message in this process (workers=1)")
            assert self.client_app_ref is not None
            self._pool = WorkerPool(self.client_app_ref, run_id=self._run.run_id, run_config=self.run_config,
                                    size=self.workers - 1, threads=self.worker_threads)
        return self._pool

    def close(self) -> None:
        """Stop the workers and remove the on-disk states (the grid is done)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.states.close()

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self, states_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Every node's ``context.state`` (error-feedback residuals, PowerSGD's Q, DGA's
        and gossip's client state, batch-sampler positions), for a checkpoint: under
        ``state_bytes``, node id -> its :func:`~fededge.server.nodestates.state_to_bytes`
        as a uint8 tensor (:func:`fededge.safefile.tensor_of_bytes`; the file stores it
        raw). Taken between rounds: a message still pending (pushed, not yet run) would
        be lost, so it raises instead.

        With a ``states_file``, the states go to that file instead where they are on disk
        (a copy of the grid's SQLite file, :meth:`DiskStates.save_file`: a checkpoint of
        10,000 clients' states then costs no memory) or hold more than
        :data:`~fededge.server.nodestates.INLINE_STATES_MAX` bytes in memory (written one
        at a time, :func:`~fededge.server.nodestates.write_states_file`: in the body the
        checkpoint's peak would be about three times the states: ten ResNet-18 clients'
        45 MB PowerSGD states added 891 MB); the dict names the file and its SHA-256.
        :meth:`load_state_dict` reads it back from ``states_dir``."""
        if self._pending or self._replies:
            raise RuntimeError(f"a checkpoint of the in-process grid needs no message in flight; "
                               f"{len(self._pending)} pending, {len(self._replies)} replies not pulled")
        out: dict[str, Any] = {"nodes": list(self._index), "messages_run": self.messages_run}
        disk = self.states.disk
        blobs = ((nid, self.states.take_bytes(nid)) for nid in self.states.nodes())  # one at a time
        if states_file is not None and (disk is not None or self.states.held_bytes() > INLINE_STATES_MAX):
            out["states_file"] = Path(states_file).name
            out["states_sha256"] = disk.save_file(states_file) if disk is not None else \
                write_states_file(states_file, blobs)
        else:
            out["state_bytes"] = {nid: tensor_of_bytes(blob) for nid, blob in blobs if blob is not None}
        return out

    def load_state_dict(self, state: Mapping[str, Any], states_dir: str | os.PathLike[str] | None = None) -> None:
        """Give every node the ``context.state`` of :meth:`state_dict` (same node ids:
        the grid's are seeded, so the same ``seed`` and ``num_nodes`` give them); a states
        file is looked for in ``states_dir``. A checkpoint of fededge before 2026-11-26
        holds the states as Flower's serialised objects (``states``): it reads too."""
        if list(state["nodes"]) != list(self._index):
            raise ValueError("the checkpoint's in-process nodes are not this grid's: build the grid with the "
                             "same num_nodes and seed as the run that wrote it")
        for nid in list(self.states.nodes()):
            self.states.put_objects(nid, None)
        if "states_file" in state:
            if states_dir is None:
                raise ValueError(f"the checkpoint keeps its client states in {state['states_file']}: "
                                 "give the directory it is in (states_dir)")
            path = Path(states_dir) / str(state["states_file"])
            if not path.is_file():
                raise ValueError(f"{path}: the checkpoint's client states file is missing")
            if self.states.disk is not None:
                self.states.disk.load_file(path, str(state["states_sha256"]))
            else:  # a grid that keeps its states in memory (for now): one row at a time
                with contextlib.closing(read_states_file(path, str(state["states_sha256"]))) as rows:
                    for nid, blob in rows:
                        self.states.put_bytes(nid, blob)
        elif "state_bytes" in state:
            for nid, blob in state["state_bytes"].items():
                self.states.put_bytes(int(nid), bytes_from_tensor(blob, f"the checkpoint's state of node {nid}"))
        else:
            for nid, saved in state["states"].items():
                self.states.put_objects(int(nid), saved)
        self.messages_run = int(state["messages_run"])

    # -- Grid API ----------------------------------------------------------------
    def set_run(self, run) -> None:  # noqa: ANN001
        self._run = run

    @property
    def run(self):  # noqa: ANN201
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001,ANN201
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._index)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        for msg in messages:
            dst = msg.metadata.dst_node_id
            if dst not in self._index:
                raise ValueError(f"message for unknown node {dst}; the grid has {len(self._index)} nodes")
            if msg.metadata.reply_to_message_id:
                raise ValueError("push_messages takes instruction messages, not replies")
            fi.set_run_id(msg, self._run.run_id)
        if self.direct:
            return self._push_direct(messages)
        ids = []
        # The SuperLink's id for a message is its object id (HttpGrid does the same), so
        # replies carry a 64-hex-char reply_to id, as on the real wire. A model the
        # messages share is serialised once for all of them.
        serialised = fi.serialise_all(messages)
        seen: set[str] = set()
        for mid, _ in serialised:  # all or none, as the direct path: checked before any is queued
            if mid in self._pending or mid in self._replies or mid in seen:
                raise ValueError(f"message {mid} was pushed twice")
            seen.add(mid)
        for msg, (mid, objects) in zip(messages, serialised):
            self._pending[mid] = (msg.metadata.dst_node_id, mid, objects)
            fi.note_wire_size(msg, sum(map(len, objects.values())))  # for the meter
            ids.append(mid)
        return ids

    def _push_direct(self, messages: list[Message]) -> list[str]:
        """Push ``messages`` as the copies their nodes will get, each one's size on the
        wire noted, all or none (as serialising them all first does). An id has the
        length of a SuperLink's (64 hex digits, an object id), so that a reply's
        ``reply_to`` costs the same bytes; it is unique to this grid."""
        pushed = {id(m) for m in messages}  # the messages are alive: their ids are theirs
        if len(pushed) < len(messages) or any(id(m) in pushed for m in self._origins.values()):
            raise ValueError("a message was pushed twice")
        queued = []
        # A model pushed to many nodes: messages whose contents are the same record
        # objects (alive and unchanged while this runs) have contents of the same size,
        # computed once; only each message's own object (its metadata) is sized apart.
        content_bytes: dict[tuple, int] = {}
        for msg in messages:
            copy = fi.detached_copy(msg)
            same = tuple((name, id(r)) for name, r in msg.content.items()) if msg.has_content() else None
            if same is not None and same in content_bytes:
                size = fi.message_own_bytes(copy) + content_bytes[same]
            else:
                own, content = fi.direct_wire_split(copy)
                size = own + content
                if same is not None:
                    content_bytes[same] = content
            self._pushed += 1
            mid = hashlib.sha256(f"fededge-direct:{self._salt}:{self._pushed}".encode()).hexdigest()
            queued.append((msg, mid, copy, size))
        for msg, mid, copy, size in queued:
            fi.note_wire_size(msg, size)  # for the meter
            self._pending[mid] = (msg.metadata.dst_node_id, mid, copy)
            self._origins[mid] = msg
        return [mid for _, mid, _, _ in queued]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ids = list(message_ids)
        wanted = set(ids)
        # Run, in push order, every pending message up to the last one wanted: a node
        # handles its messages strictly in order, as a SuperNode does.
        batch = []
        for mid in list(self._pending):
            if wanted.isdisjoint(self._pending):
                break
            batch.append((mid, *self._pending.pop(mid)))
            self._origins.pop(mid, None)
        if batch:
            self._replies.update(self._run_batch(batch))
        return [self._replies.pop(mid) for mid in ids if mid in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        replies = {r.metadata.reply_to_message_id: r for r in self.pull_messages(ids)}
        return [replies[i] for i in ids if i in replies]

    # -- delivery ------------------------------------------------------------------
    def _run_batch(self, batch: list[tuple[str, int, str, dict[str, bytes]]]) -> dict[str, Message]:
        """Run ``batch`` (in push order); one node's messages in order, one at a time.

        The server's own work after it (its evaluation, the aggregation) runs with this
        process's torch threads again: a ClientApp sets its own (``client-threads``), and
        had that leaked, the server's float sums would depend on whether the batch's last
        message ran here or in a worker, and so on ``workers``."""
        threads = torch.get_num_threads()
        try:
            return self._deliver(batch)
        finally:
            torch.set_num_threads(threads)

    def _deliver(self, batch: list[tuple[str, int, str, dict[str, bytes]]]) -> dict[str, Message]:
        if self.cohort and len(batch) > 1:
            return self._run_cohorts(batch)
        if self.workers == 1 or len(batch) == 1:
            return {mid: self._execute(mid, nid, root, objects) for mid, nid, root, objects in batch}
        pool = self.start_workers()
        # This process is a worker too, with the workers' threads for the whole batch.
        torch.set_num_threads(self.worker_threads)
        return self._run_on_workers(pool, batch)

    def _run_on_workers(self, pool: WorkerPool, batch: list[tuple[str, int, str, dict[str, bytes]]]
                        ) -> dict[str, Message]:
        waiting = deque(batch)
        running: set[int] = set()  # nodes with a message in a worker
        replies: dict[str, Message] = {}

        def next_job() -> tuple[str, int, str, dict[str, bytes]] | None:
            blocked: set[int] = set()
            for item in waiting:
                nid = item[1]
                if nid not in running and nid not in blocked:
                    waiting.remove(item)
                    return item
                blocked.add(nid)  # a later message of this node waits for this one
            return None

        while waiting or pool.busy():
            # A worker takes a second job (ready when it finishes the first) only while
            # more jobs wait than the idle workers take, one being left for this process:
            # near the batch's end none waits behind another while a process could run it.
            slots = pool.free()
            for worker in slots[:max(len(pool.free(depth=1)), len(waiting) - 1)]:
                item = next_job()
                if item is None:
                    break
                mid, nid, root, objects = item
                running.add(nid)
                self.messages_run += 1
                pool.submit(worker, (mid, nid, root, objects, self.node_config(nid), self.states.take_bytes(nid)))
            item = next_job()
            if item is not None:
                replies[item[0]] = self._execute(*item)
                collected = pool.collect(timeout=0)
            else:
                collected = pool.collect(timeout=None)
            for job, result in collected:
                if result is UNSTARTED:  # held by a worker that died before it began: run it still
                    running.discard(job[1])
                    self.messages_run -= 1
                    waiting.appendleft(tuple(job[:4]))
                else:
                    replies[job[0]] = self._finish(job, result, running)
        return replies

    def _run_cohorts(self, batch: list[tuple[str, int, str, dict[str, bytes]]]) -> dict[str, Message]:
        """Run ``batch`` in waves of messages to distinct nodes (a node's second message
        is in the next wave: its messages stay in order), each wave's with
        :func:`~fededge.clients.cohort.run_together`, so that their local SGD trains as
        cohorts. Everything else is :meth:`_execute`'s: the node's state, the wire, the
        error replies."""
        from fededge.clients.cohort import run_together

        replies: dict[str, Message] = {}
        waves: list[list[tuple[str, int, str, dict[str, bytes]]]] = []
        last_wave: dict[int, int] = {}
        for item in batch:
            w = last_wave.get(item[1], -1) + 1
            if w == len(waves):
                waves.append([])
            waves[w].append(item)
            last_wave[item[1]] = w
        for wave in waves:
            # The states are taken and put back here (the disk store's SQLite connection is
            # this thread's); the calls may run on run_together's threads (its fallback).
            results = run_together([self._call(*item) for item in wave])
            replies.update((item[0], self._settle(item[1], result)) for item, result in zip(wave, results))
        return replies

    def _finish(self, job: Job, result: Any, running: set[int]) -> Message:
        mid, nid, root, objects = job[0], job[1], job[2], job[3]
        running.discard(nid)
        if result is None:  # the worker died: an error reply, the node keeps its last state
            reason = "the in-process worker running this message died (see the log)"
            return over_the_wire(error_reply(received(root, dict(objects), mid), reason))
        _, reply_root, reply_objects, state_bytes, failure = result
        self.states.put_bytes(nid, state_bytes)
        if failure is not None:
            self._log_failure(nid, *failure)
        return received(reply_root, reply_objects, reply_root)

    def _execute(self, mid: str, node_id: int, root: str, objects: dict[str, bytes]) -> Message:
        return self._settle(node_id, self._call(mid, node_id, root, objects)())

    def _call(self, mid: str, node_id: int, root: str, objects: dict[str, bytes]) -> Callable[[], tuple]:
        """The message as a call of the ClientApp, with the node's state taken now."""
        if isinstance(objects, Message):  # direct delivery: the message's copy
            return partial(run_message_direct, self.client_app, self._run.run_id, self.run_config, node_id, mid,
                           objects, self.node_config(node_id), self.states.take(node_id))
        return partial(run_message, self.client_app, self._run.run_id, self.run_config, node_id, mid, root, objects,
                       self.node_config(node_id), self.states.take(node_id))

    def _settle(self, node_id: int, result: tuple) -> Message:
        """A call's result: the node's new state kept, a failure logged; the reply."""
        back, state, failure = result
        self.messages_run += 1
        self.states.put(node_id, state)
        if failure is not None:
            self._log_failure(node_id, *failure)
        return back

    def _log_failure(self, node_id: int, reason: str, tb: str) -> None:
        first = reason not in self._errors_seen
        self._errors_seen.add(reason)
        log.log(logging.ERROR if first else logging.DEBUG, "ClientApp on node %d raised%s:\n%s", node_id,
                "" if first else " (again)", tb)


class _Contexts(Mapping[int, Context]):
    """:attr:`InProcessGrid.contexts`: each node's Context, built on access."""

    def __init__(self, grid: InProcessGrid) -> None:
        self._grid = grid

    def __getitem__(self, node_id: int) -> Context:
        g = self._grid
        if node_id not in g._index:
            raise KeyError(node_id)
        return Context(run_id=g.run.run_id, node_id=node_id, node_config=g.node_config(node_id),
                       state=g.states.view(node_id), run_config=dict(g.run_config))

    def __iter__(self) -> Iterator[int]:
        return iter(self._grid._index)

    def __len__(self) -> int:
        return len(self._grid._index)


def run_server(server_app: ServerApp, grid: InProcessGrid) -> Context:
    """Run any ServerApp on an in-process grid, as a SuperLink would; return its Context.

    For a user's own app (its own run-config keys, which fededge never parses): the
    server's Context carries the grid's run config, and its ``state`` holds whatever the
    ServerApp left there.

    Examples
    --------
    >>> grid = InProcessGrid(my_client_app, num_nodes=4, run_config={"num-server-rounds": 3})  # doctest: +SKIP
    >>> context = run_server(my_server_app, grid)  # doctest: +SKIP
    """
    run_id = grid.run.run_id
    server_ctx = Context(
        run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={},
        state=RecordDict(), run_config=dict(grid.run_config),
    )
    threads = torch.get_num_threads()  # the ClientApp may set its own; restore ours
    try:
        with fi.task_identity(run_id=run_id, node_id=SUPERLINK_NODE_ID, task_id=run_id):
            server_app(grid, server_ctx)
    finally:
        torch.set_num_threads(threads)
    return server_ctx
