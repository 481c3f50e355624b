"""The node-side state store (fededge.clients.statestore): what it keeps, takes up and refuses."""

from __future__ import annotations

import logging

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fededge import keys
from fededge._flwr_internals import task_identity
from fededge.clients.statestore import StateStoreMod, keep_from


@pytest.fixture(autouse=True)
def _identity():
    with task_identity(run_id=1, node_id=7, task_id=1):  # replies (reply_to) need it; the store does not
        yield


def _ctx() -> Context:
    return Context(run_id=1, node_id=7, node_config={keys.PARTITION_ID: 2}, state=RecordDict(), run_config={})


def _msg(t: int, attempt: str = "a1", resumed: int = 0, every: int = 2,
         base: tuple[str, int] | None = None) -> Message:
    conf = ConfigRecord({keys.SERVER_ROUND: t, keys.STATE_KEY: "run/1", keys.STATE_ATTEMPT: attempt,
                         keys.STATE_RESUMED_FROM: resumed, keys.STATE_EVERY: every,
                         **({keys.STATE_BASE_ATTEMPT: base[0], keys.STATE_BASE_FROM: base[1]} if base else {})})
    return Message(RecordDict({keys.CONFIG: conf}), dst_node_id=7, message_type="train")


def _count(msg: Message, ctx: Context) -> Message:
    """A train function whose state is how many rounds it ran, and the last one."""
    n = int(ctx.state[keys.STATE_SAMPLER]["n"]) if keys.STATE_SAMPLER in ctx.state else 0
    t = int(msg.content[keys.CONFIG][keys.SERVER_ROUND])
    ctx.state[keys.STATE_SAMPLER] = ConfigRecord({"n": n + 1, "last": t})
    return Message(RecordDict({keys.METRICS: MetricRecord({"n": n + 1})}), reply_to=msg)


def _rounds(store) -> list[tuple[int, str]]:
    return [(int(p.name[6:12]), p.name.split(".")[1]) for p in sorted(store.glob("run_1/partition-2/*.state"))]


def test_keep_from_is_the_older_of_the_two_checkpoints_the_server_may_hold():
    # checkpoints after round 1 and every 2nd: the older of the last two
    assert keep_from(0, 2, 1) == 0 and keep_from(0, 2, 2) == 1 and keep_from(0, 2, 4) == 2
    assert keep_from(0, 5, 1) == 0 and keep_from(0, 5, 4) == 0 and keep_from(0, 5, 5) == 1 and keep_from(0, 5, 10) == 5
    assert keep_from(0, 2, 5) == 2 and keep_from(3, 2, 4) == 3 and keep_from(3, 2, 6) == 4
    assert keep_from(3, 0, 9) == 3


def test_a_fresh_context_takes_up_the_state_of_the_checkpoint_and_a_killed_attempt_is_dropped(tmp_path):
    mod = StateStoreMod(tmp_path)
    ctx = _ctx()
    for t in range(1, 6):  # attempt a1 runs rounds 1-5; the server checkpoints 2 and 4
        mod(_msg(t), ctx, _count)
    assert _rounds(tmp_path) == [(2, "a1"), (3, "a1"), (4, "a1"), (5, "a1")]  # <= 2 is the older checkpoint
    # It died in round 6; a2 resumes after 4 with a new, empty context.
    ctx2 = _ctx()
    reply = mod(_msg(5, "a2", resumed=4), ctx2, _count)
    assert reply.content[keys.METRICS]["n"] == 5  # rounds 1-4 taken up, then round 5 again
    assert _rounds(tmp_path) == [(4, "a1"), (5, "a2")]  # a1's round 5 (after the checkpoint) is gone


def test_a_node_not_in_the_first_rounds_after_a_resume_takes_up_its_state_at_the_checkpoint(tmp_path):
    mod = StateStoreMod(tmp_path)
    ctx = _ctx()
    for t in (1, 3, 4, 6):
        mod(_msg(t, every=3), ctx, _count)
    ctx2 = _ctx()  # resumed after 3; this node's first message is round 5
    reply = mod(_msg(5, "a2", resumed=3, every=3), ctx2, _count)
    assert reply.content[keys.METRICS]["n"] == 3  # rounds 1 and 3, not 4 or 6 of the dead attempt
    assert [r for r, _ in _rounds(tmp_path)] == [3, 5]


def test_after_two_kills_a_node_takes_up_its_state_of_the_timeline_not_of_a_dead_attempt(tmp_path):
    """a1 trains the node in rounds 1-3 and dies; a2 resumes after 2, never samples the node
    (so it cannot drop a1's round 3), checkpoints 4 and dies; a3 resumes after 4. Told only
    'resumed after 4', the node took up a1's round 3, a round a2 redid without it; told the
    checkpoint's writer (a2) and where it started (2), it takes up its state of round 2."""
    mod = StateStoreMod(tmp_path)
    ctx = _ctx()
    for t in (1, 2, 3):
        mod(_msg(t, base=("a1", 0)), ctx, _count)
    reply = mod(_msg(5, "a3", resumed=4, base=("a2", 2)), _ctx(), _count)
    assert reply.content[keys.METRICS]["n"] == 3  # rounds 1 and 2 taken up (not a1's round 3), then round 5
    assert _rounds(tmp_path) == [(2, "a1"), (5, "a3")]
    # The checkpoint's writer's own states up to the checkpoint are the timeline's.
    mod(_msg(6, "a3", resumed=4, base=("a2", 2)), _ctx(), _count)
    ctx = _ctx()
    assert mod(_msg(7, "a4", resumed=6, base=("a3", 4)), ctx, _count).content[keys.METRICS]["n"] == 5
    # A server of a fededge before it (no base): the rule before, a1's round 3 kept.
    old = StateStoreMod(tmp_path / "old")
    ctx = _ctx()
    for t in (1, 2, 3):
        old(_msg(t), ctx, _count)
    assert old(_msg(5, "a3", resumed=4), _ctx(), _count).content[keys.METRICS]["n"] == 4


def test_a_resumed_servers_messages_name_the_checkpoints_writer_in_as_many_bytes():
    """The base the nodes get: the checkpoint's writer and where it started; a fresh run
    names itself and 0 (ids of one length: a resumed run's messages weigh what the
    uninterrupted run's do)."""
    from fededge.server.experiment import _RoundCloser

    closer = _RoundCloser.__new__(_RoundCloser)
    closer.attempt, closer.base, closer.resumed = "a" * 12, ("a" * 12, 0), 0
    closer.exp = type("E", (), {"checkpoint_every": 2})()
    closer.uncheckpointable = None
    closer.recorder = type("R", (), {"run_id": "run"})()
    closer._inner_grid = lambda: None
    fresh = closer.client_state_config(None)
    assert (fresh[keys.STATE_BASE_ATTEMPT], fresh[keys.STATE_BASE_FROM]) == ("a" * 12, 0)
    closer.attempt, closer.base, closer.resumed = "b" * 12, ("a" * 12, 0), 4  # restore() of a1's checkpoint 4
    resumed = closer.client_state_config(None)
    assert (resumed[keys.STATE_BASE_ATTEMPT], resumed[keys.STATE_BASE_FROM]) == ("a" * 12, 0)


def test_a_corrupt_state_is_refused_by_name_and_the_node_starts_afresh(tmp_path, caplog):
    mod = StateStoreMod(tmp_path)
    ctx = _ctx()
    for t in (1, 2):
        mod(_msg(t), ctx, _count)
    newest = sorted(tmp_path.glob("run_1/partition-2/*.state"))[-1]
    newest.write_bytes(newest.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING, logger="fededge"):
        reply = mod(_msg(3, "a2", resumed=2), _ctx(), _count)
    assert reply.content[keys.METRICS]["n"] == 1  # never the older state in its place
    assert "client state" in caplog.text and newest.name in caplog.text and "truncated" in caplog.text


def test_without_the_servers_keys_or_switched_off_it_does_nothing(tmp_path, monkeypatch, caplog):
    plain = Message(RecordDict({keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 1})}), dst_node_id=7,
                    message_type="train")
    StateStoreMod(tmp_path)(plain, _ctx(), _count)
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("FEDEDGE_STATE_DIR", "off")
    mod = StateStoreMod()
    with caplog.at_level(logging.WARNING, logger="fededge"):
        mod(_msg(1), _ctx(), _count)
        mod(_msg(2), _ctx(), _count)
    assert caplog.text.count("state store is off") == 1


@pytest.mark.parametrize("root", ["off", "OFF"])
def test_the_node_config_can_switch_it_off(tmp_path, root):
    ctx = _ctx()
    ctx.node_config[keys.STATE_DIR] = root
    StateStoreMod()(_msg(1), ctx, _count)
    assert keys.STATE_STORE not in ctx.state


def test_other_runs_not_written_for_max_age_days_are_deleted_when_a_run_starts(tmp_path):
    import os
    import time

    StateStoreMod(tmp_path)(_msg(1), _ctx(), _count)
    old, recent = tmp_path / "old-run" / "partition-2", tmp_path / "recent-run" / "partition-2"
    for d, age_days in ((old, 8), (recent, 6)):
        d.mkdir(parents=True)
        f = d / "round-000003.x.state"
        f.write_bytes(b"x")
        t = time.time() - age_days * 86400
        os.utime(f, (t, t))
    mod = StateStoreMod(tmp_path, max_age_days=7)
    mod(_msg(2), _ctx(), _count)  # a fresh context: the run starts here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recent-run", "run_1"]
    with pytest.raises(ValueError, match="max_age_days"):
        StateStoreMod(tmp_path, max_age_days=0)
