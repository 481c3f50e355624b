"""Messages that bring the next round's content early, and a warm worker that computes it ahead.

A Flower SuperNode pulls its next message only after it has sent its reply, and each
message starts a fresh ``flwr-clientapp`` process (shared/reference/flower-notes.md). So
on a real node the download, the start-up, the compute and the upload of one round are
serial, whatever the server pushes ahead. Delayed Gradient Averaging
(:mod:`fededge.algorithms.dga`) lets a client keep computing while averages are in
flight; to do that on such a node, the computing must happen *between* messages.

The protocol (:attr:`fededge.algorithms.dga.DGAConfig.compute_ahead`):

- A message may carry a **preview**: the next message's own content, as records named
  ``fededge.preview/<name>``, and its id in ``fededge.preview-id`` (a ConfigRecord with
  ``id``).
- The next message then carries ``fededge.preview-of`` (``id``) instead of repeating that
  content (the bytes travel once, earlier).
- :class:`PreviewMod` (on the client, outside fededge's other mods but the state-spill
  mod, which must load the state first) keeps the preview
  in ``context.state`` and hands the inner mods the content a message stands for. With
  no warm worker, that is all: the replies are those of the same run without previews,
  bit for bit.
- A node's **warm worker** (:mod:`fededge.clients.worker`), once it has sent a reply,
  runs the app on the preview it now holds, in the background (:func:`speculate`). When
  the next message arrives and refers to that preview, and the node's state is the one
  the background run started from (a SHA-256 of its records), the mod returns the
  background run's reply and state instead of computing again. Anything else (another
  preview, a state that changed, an evaluate message) runs as usual; nothing computed
  ahead is ever used for a message it was not computed for.

A message that refers to a preview the node does not hold (a SuperNode that restarted
and lost its ``context.state``) gets an error reply that names it; the server then sends
the full content again (:class:`fededge.strategies.dga.DGA` resynchronises such a node).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from fededge._flwr_internals import ClientAppCallable

from fededge import keys
from fededge.clients.workerwire import decode_records, encode_records

__all__ = ["PREVIEW_ERROR_CODE", "PreviewMod", "discard_ahead", "held_preview", "speculate", "state_digest"]

_log = logging.getLogger("fededge.preview")

#: The error code of a reply to a message whose preview the node does not hold.
PREVIEW_ERROR_CODE = 0xFEDE


def state_digest(rd: RecordDict) -> str:
    """SHA-256 of a RecordDict's records (names, values, array bytes), whatever their order."""
    h = hashlib.sha256()
    for name in sorted(rd.keys()):
        blobs: list[bytes] = []
        h.update(json.dumps(encode_records(RecordDict({name: rd[name]}), blobs), sort_keys=True).encode())
        for b in blobs:
            h.update(len(b).to_bytes(8, "big"))
            h.update(b)
    return h.hexdigest()


def _is_preview(name: str) -> bool:
    return name.startswith(keys.PREVIEW_PREFIX) or name == keys.PREVIEW_ID


def held_preview(state: RecordDict) -> str | None:
    """The id of the preview a node's ``context.state`` holds, if any."""
    return str(state[keys.PREVIEW_ID]["id"]) if keys.PREVIEW_ID in state else None


def _take(state: RecordDict) -> tuple[str | None, RecordDict]:
    """Remove the held preview from ``state``: its id and its content."""
    pid = held_preview(state)
    content = RecordDict({name[len(keys.PREVIEW_PREFIX):]: state[name] for name in list(state.keys())
                          if name.startswith(keys.PREVIEW_PREFIX)})
    for name in [n for n in state.keys() if _is_preview(n)]:
        del state[name]
    return pid, content


@dataclass
class _Ahead:
    """A reply computed ahead: for which node, run, preview and starting state."""

    key: tuple[int, int, str, str]
    content: RecordDict | None
    error: Error | None
    state: RecordDict


# The warm worker's one reply computed ahead (a worker serves one node, one message at a
# time, and joins the background run before it handles the next message).
_ahead: list[_Ahead] = []
_lock = threading.Lock()


class PreviewMod:
    """The client side of previews (module docstring): keeps the preview a message brings,
    gives the inner mods the content a message stands for, and uses a reply the warm
    worker computed ahead when it was computed for exactly this message and state.

    Register it outside fededge's other mods (after a state-loading mod such as
    :class:`~fededge.clients.statestore.StateStoreMod`), for example::

        ClientApp(mods=[PreviewMod(), CompressionMod(update), DGAMod()])

    A message without preview records passes through untouched.
    """

    def __repr__(self) -> str:
        return "PreviewMod()"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        content = msg.content
        names = list(content.keys())
        if not any(_is_preview(n) or n == keys.PREVIEW_OF for n in names):
            # Neither refers to a preview nor brings one (say, an evaluate message between
            # two train messages): the held preview stays for the message that refers to it.
            return call_next(msg, context)
        ref = content[keys.PREVIEW_OF] if keys.PREVIEW_OF in content else None
        speculative = ref is not None and bool(ref.get("speculative", False))
        # What a reply computed ahead is keyed by: the node's whole state, preview included.
        start = state_digest(context.state) if ref is not None else None
        held_id, held = _take(context.state)
        nxt_id = str(content[keys.PREVIEW_ID]["id"]) if keys.PREVIEW_ID in content else None
        nxt = {n: content[n] for n in names if n.startswith(keys.PREVIEW_PREFIX)}
        reply = None
        if ref is not None:
            want = str(ref["id"])
            if held_id != want:
                why = (f"this message is preview {want} sent earlier, but the node holds "
                       f"{'no preview' if held_id is None else f'preview {held_id}'} (its context.state was lost "
                       f"or replaced); the server resends the full message")
                _log.warning("fededge: %s", why)
                reply = Message(Error(code=PREVIEW_ERROR_CODE, reason=why), reply_to=msg)
            elif not speculative:
                assert start is not None
                reply = self._computed_ahead(msg, context, want, start)
            own = held
        else:
            own = RecordDict({n: content[n] for n in names if not _is_preview(n)})
        if reply is None:
            msg.content = own
            try:
                reply = call_next(msg, context)
            finally:
                msg.content = content
            if speculative:
                assert ref is not None and start is not None
                with _lock:
                    _ahead.clear()
                    _ahead.append(_Ahead((int(msg.metadata.run_id), int(context.node_id), str(ref["id"]), start),
                                         None if reply.has_error() else reply.content,
                                         reply.error if reply.has_error() else None, context.state))
        # Kept also after an error (a preview this node had lost): a message the server
        # pushed before it learnt of the error may refer to this one.
        if nxt_id is not None:
            for n, rec in nxt.items():
                context.state[n] = rec
            context.state[keys.PREVIEW_ID] = ConfigRecord({"id": nxt_id})
        return reply

    @staticmethod
    def _computed_ahead(msg: Message, context: Context, pid: str, start: str) -> Message | None:
        """The reply computed ahead for this message and state (``start``: the state's
        digest as the message found it), with its state put in ``context``; None when
        there is none (or it was computed for something else, which is then dropped)."""
        with _lock:
            ahead = _ahead.pop() if _ahead else None
            _ahead.clear()
        if ahead is None:
            return None
        if ahead.key != (int(msg.metadata.run_id), int(context.node_id), pid, start):
            _log.info("fededge: the reply computed ahead was for another message or state; computing again")
            return None
        context.state.clear()
        for n, rec in ahead.state.items():
            context.state[n] = rec
        _log.info("fededge: preview %s: the reply computed ahead", pid)
        if ahead.error is not None:
            return Message(ahead.error, reply_to=msg)
        return Message(ahead.content, reply_to=msg)


def discard_ahead() -> None:
    """Forget a reply computed ahead (the worker, when a run ahead failed)."""
    with _lock:
        _ahead.clear()


def speculate(app: ClientAppCallable, *, run_id: int, node_id: int, node_config: dict, run_config: dict,
              state: RecordDict) -> bool:
    """Run ``app`` on the preview ``state`` holds, as the message that will refer to it,
    and keep the reply and state for that message (:class:`PreviewMod`). A copy of
    ``state`` is used; returns False (and does nothing) when it holds no preview, or that
    preview was already computed from the same state. Called
    by the warm worker, in a background thread, after it has sent a reply."""
    from flwr.app import MessageType

    from fededge._flwr_internals import set_message_id, task_identity

    pid = held_preview(state)
    if pid is None:
        return False
    with _lock:
        done = [a.key for a in _ahead]
    if done and done[0] == (run_id, node_id, pid, state_digest(state)):
        # Already computed for this preview and state (a message in between, such as an
        # evaluate message, left both as they were).
        return False
    blobs: list[bytes] = []
    copy = decode_records(encode_records(state, blobs), blobs)  # nothing shared with the caller's
    ctx = Context(run_id, node_id, dict(node_config), copy, dict(run_config))
    with task_identity(run_id, node_id, 0):
        msg = Message(RecordDict({keys.PREVIEW_OF: ConfigRecord({"id": pid, "speculative": True})}),
                      dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=pid)
        set_message_id(msg, f"ahead-{pid}")
        app(msg, ctx)
    return True
