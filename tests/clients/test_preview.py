"""PreviewMod without a worker: a message that refers to a preview gets the preview's
content, an evaluate message in between leaves the preview held, a lost preview is an
error that names it, and the replies are those of the same rounds sent in full."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fededge import keys
from fededge._flwr_internals import set_message_id, task_identity
from fededge.clients.app import app
from fededge.clients.preview import PREVIEW_ERROR_CODE, held_preview, state_digest

RUN_ID, NODE_ID = 7, 11


def _conf(t: int, g: int) -> ConfigRecord:
    return ConfigRecord({keys.LOCAL_STEPS: 2, keys.SERVER_ROUND: t, keys.DGA_GLOBAL_ROUND: g,
                         keys.DGA_CORRECTION: True})


def _initial() -> ArrayRecord:
    from fededge.config import RunConfig
    from fededge.workload import dataset_for, model_for

    cfg = RunConfig.from_mapping({"seed": 3})
    return ArrayRecord(model_for(cfg, dataset_for(cfg)).state_dict())


def _msg(records: dict, t: int, kind: str = "train") -> Message:
    with task_identity(RUN_ID, NODE_ID, 0):
        msg = Message(RecordDict(records), dst_node_id=NODE_ID, message_type=kind, group_id=str(t))
        set_message_id(msg, f"{kind}{t}")
    return msg


def _context() -> Context:
    return Context(RUN_ID, NODE_ID, {keys.PARTITION_ID: 1, keys.NUM_PARTITIONS: 3}, RecordDict(),
                   {"seed": 3, "batch-size": 16, "strategy": "dga", "dga-delay": 1, "dga-compute-ahead": True})


def _send(msg: Message, ctx: Context) -> Message:
    with task_identity(RUN_ID, NODE_ID, 0):
        return app(msg, ctx)


def test_previewed_rounds_reply_as_rounds_sent_in_full_and_an_evaluate_in_between_keeps_the_preview():
    g0 = _initial()
    g1 = ArrayRecord({k: Array(v.numpy() * 0.5) for k, v in g0.items()})
    # In full: round 1 (G(0)), round 2 (no arrays: G(0) again), round 3 (G(1)).
    full_ctx = _context()
    full = [_send(_msg({keys.ARRAYS: a, keys.CONFIG: _conf(t, g)}, t), full_ctx)
            for t, a, g in [(1, g0, 0), (2, ArrayRecord(), 0), (3, g1, 1)]]
    # Previewed: each round's content comes with the message before.
    ctx = _context()
    pre = lambda t, a, g: {keys.PREVIEW_PREFIX + keys.ARRAYS: a, keys.PREVIEW_PREFIX + keys.CONFIG: _conf(t, g),  # noqa: E731
                           keys.PREVIEW_ID: ConfigRecord({"id": str(t)})}
    r1 = _send(_msg({keys.ARRAYS: g0, keys.CONFIG: _conf(1, 0), **pre(2, ArrayRecord(), 0)}, 1), ctx)
    assert held_preview(ctx.state) == "2"
    before = state_digest(ctx.state)
    ev = _send(_msg({keys.ARRAYS: g0, keys.CONFIG: ConfigRecord({})}, 1, "evaluate"), ctx)
    assert not ev.has_error(), ev.error
    assert held_preview(ctx.state) == "2" and state_digest(ctx.state) == before
    r2 = _send(_msg({keys.PREVIEW_OF: ConfigRecord({"id": "2"}), **pre(3, g1, 1)}, 2), ctx)
    r3 = _send(_msg({keys.PREVIEW_OF: ConfigRecord({"id": "3"})}, 3), ctx)
    assert held_preview(ctx.state) is None
    for a, b in zip(full, [r1, r2, r3]):
        assert not a.has_error() and not b.has_error()
        for name in (keys.ARRAYS,):
            assert a.content[name].keys() == b.content[name].keys()
            for k in a.content[name].keys():
                assert a.content[name][k].numpy().tobytes() == b.content[name][k].numpy().tobytes(), k
    assert state_digest(ctx.state) == state_digest(full_ctx.state)


def test_a_message_for_a_preview_the_node_lost_is_an_error_that_names_it():
    reply = _send(_msg({keys.PREVIEW_OF: ConfigRecord({"id": "2"})}, 2), _context())
    assert reply.has_error() and reply.error.code == PREVIEW_ERROR_CODE
    assert "preview 2" in reply.error.reason and "holds no preview" in reply.error.reason
    # It keeps the preview that message brought: a later message may refer to it.
    ctx = _context()
    nxt = {keys.PREVIEW_PREFIX + keys.CONFIG: _conf(3, 1), keys.PREVIEW_ID: ConfigRecord({"id": "3"})}
    reply = _send(_msg({keys.PREVIEW_OF: ConfigRecord({"id": "2"}), **nxt}, 2), ctx)
    assert reply.has_error() and held_preview(ctx.state) == "3"
    # A preview of another round is no better.
    ctx = _context()
    ctx.state[keys.PREVIEW_ID] = ConfigRecord({"id": "5"})
    reply = _send(_msg({keys.PREVIEW_OF: ConfigRecord({"id": "2"})}, 2), ctx)
    assert reply.has_error() and "holds preview 5" in reply.error.reason
