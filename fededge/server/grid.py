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

:func:`run_server` runs a ServerApp on it. Nothing here is fededge's own app (that is
:func:`fededge.server.inprocess.run_inprocess`), so a user's tests import this with
their own apps. Private Flower internals used here live in :mod:`fededge._flwr_internals`.
"""

from __future__ import annotations

import logging
import random
import traceback
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fededge import _flwr_internals as fi
from fededge import keys
from fededge.protocol import CLIENT_APP_RAISED_EXCEPTION

__all__ = ["InProcessGrid", "run_server", "SUPERLINK_NODE_ID"]

#: The runtime's logger, named as when it shared fededge.server.inprocess with run_inprocess.
log = logging.getLogger("fededge.server.inprocess")

SUPERLINK_NODE_ID = 1  # flwr.common.constant.SUPERLINK_NODE_ID

_checked = False


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp each node runs (fededge's, or any other).
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
    """

    #: Each node's messages run one at a time, in push order (checked by strategies
    #: that push rounds ahead; see ``fededge._flwr_internals.runs_messages_in_order``).
    runs_messages_in_order = True

    def __init__(
        self,
        client_app: ClientApp,
        *,
        num_nodes: int,
        run_config: Mapping[str, Any],
        run_id: int = 1,
        node_configs: Sequence[Mapping[str, Any]] | None = None,
        seed: int = 0,
        keep_client_states: bool = True,
    ) -> None:
        global _checked
        if not _checked:
            fi.check()  # fail loudly, naming the internal, if Flower changed
            _checked = True
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"node_configs has {len(node_configs)} entries for {num_nodes} nodes")
        self.client_app = client_app
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
        self.contexts: dict[int, Context] = {}
        for i, nid in enumerate(ids):
            node_config = {keys.PARTITION_ID: i, keys.NUM_PARTITIONS: num_nodes}
            if node_configs is not None:
                node_config.update(node_configs[i])
            self.contexts[nid] = Context(
                run_id=run_id, node_id=nid, node_config=node_config,
                state=RecordDict(), run_config=dict(run_config),
            )
        self._run = fi.empty_run(run_id)
        # message id -> (destination node, root object id, serialised objects), in push order
        self._pending: OrderedDict[str, tuple[int, str, dict[str, bytes]]] = OrderedDict()
        self._replies: dict[str, Message] = {}
        self.messages_run = 0
        self._errors_seen: set[str] = set()  # errors whose traceback was logged already

    def data_splits(self) -> list[tuple[int, str | None]]:
        """Every distinct ``(num-partitions, data-dir)`` of the nodes' configs (data-dir
        None when a node has none of its own): the splits its clients will make."""
        return sorted({
            (int(c.node_config[keys.NUM_PARTITIONS]), str(c.node_config.get(keys.DATA_DIR, "")) or None)
            for c in self.contexts.values() if keys.NUM_PARTITIONS in c.node_config
        }, key=lambda s: (s[0], s[1] or ""))

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every node's ``context.state`` (error-feedback residuals, PowerSGD's Q, DGA's
        and gossip's client state, batch-sampler positions), serialised as Flower would
        store it, for a checkpoint. Taken between rounds: a message still pending (pushed,
        not yet run) would be lost, so it raises instead."""
        if self._pending or self._replies:
            raise RuntimeError(f"a checkpoint of the in-process grid needs no message in flight; "
                               f"{len(self._pending)} pending, {len(self._replies)} replies not pulled")
        states = {}
        for nid, ctx in self.contexts.items():
            states[nid] = fi.recorddict_to_objects(ctx.state)
        return {"nodes": list(self.contexts), "states": states, "messages_run": self.messages_run}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give every node the ``context.state`` of :meth:`state_dict` (same node ids:
        the grid's are seeded, so the same ``seed`` and ``num_nodes`` give them)."""
        if list(state["nodes"]) != list(self.contexts):
            raise ValueError("the checkpoint's in-process nodes are not this grid's: build the grid with the "
                             "same num_nodes and seed as the run that wrote it")
        for nid, saved in state["states"].items():
            self.contexts[int(nid)].state = fi.recorddict_from_objects(saved)
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
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            dst = msg.metadata.dst_node_id
            if dst not in self.contexts:
                raise ValueError(f"message for unknown node {dst}; nodes: {list(self.contexts)}")
            if msg.metadata.reply_to_message_id:
                raise ValueError("push_messages takes instruction messages, not replies")
            fi.set_run_id(msg, self._run.run_id)
            # The SuperLink's id for a message is its object id (HttpGrid does the same),
            # so replies carry a 64-hex-char reply_to id, as on the real wire.
            mid = msg.object_id
            if mid in self._pending or mid in self._replies:
                raise ValueError(f"message {mid} was pushed twice")
            self._pending[mid] = (dst, msg.object_id, fi.message_objects(msg))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ids = list(message_ids)
        wanted = set(ids)
        # Run, in push order, every pending message up to the last one wanted: a node
        # handles its messages strictly in order, as a SuperNode does.
        for mid in list(self._pending):
            if wanted.isdisjoint(self._pending):
                break
            self._replies[mid] = self._execute(mid, *self._pending.pop(mid))
        return [self._replies.pop(mid) for mid in ids if mid in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        replies = {r.metadata.reply_to_message_id: r for r in self.pull_messages(ids)}
        return [replies[i] for i in ids if i in replies]

    # -- delivery ------------------------------------------------------------------
    def _execute(self, mid: str, node_id: int, root: str, objects: dict[str, bytes]) -> Message:
        msg = fi.message_from_objects(root, objects)
        fi.set_message_id(msg, mid)
        ctx = self.contexts[node_id]
        self.messages_run += 1
        try:
            reply = self.client_app(msg, ctx)
        except Exception as err:  # noqa: BLE001 - becomes an error reply, as in Flower
            reason = f"{type(err).__name__}: {err}"
            first = reason not in self._errors_seen
            self._errors_seen.add(reason)
            log.log(logging.ERROR if first else logging.DEBUG, "ClientApp on node %d raised%s:\n%s", node_id,
                    "" if first else " (again)", traceback.format_exc())
            reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
        # The reply crosses the wire too.
        back = fi.message_from_objects(reply.object_id, fi.message_objects(reply))
        fi.set_message_id(back, reply.object_id)
        return back


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
