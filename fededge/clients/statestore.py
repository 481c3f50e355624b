"""A node keeps its ``context.state`` on its own disk, so that a resumed run continues it.

Error-feedback residuals, PowerSGD's Q, DGC's buffers, DGA's and gossip's client state
and the batch sampler's position live in the node's ``context.state``. Under fededge's
in-process runtime the server's checkpoint holds every node's state
(:class:`fededge.server.grid.InProcessGrid`). Under Flower's Ray simulation and on a
SuperLink it cannot: a resumed run is a new Flower run, and its nodes start with an
empty ``context.state`` (a restarted SuperNode too). :class:`StateStoreMod` closes that
gap on the node's side.

**What the server sends.** When a run writes checkpoints and its runtime does not keep
the clients' states, :class:`fededge.server.experiment.Experiment` adds to every train
message's config: ``state-key`` (the run's id, the same after a resume),
``state-resumed-from`` (the checkpoint round the run continues after; 0 for a fresh
run), ``state-attempt`` (a new id each time the server starts), ``state-base-attempt``
and ``state-base-from`` (the attempt that wrote that checkpoint and the round it continued
after; a fresh run's own and 0) and ``state-every`` (``checkpoint-every``). Without
``state-key`` the mod does nothing.

**What the node does.** After each train reply that is not an error, it writes its
``context.state`` as ``<root>/<state-key>/<node>/round-<t>.<attempt>.state``
(:mod:`fededge.safefile`: atomic, checksummed). ``<node>`` is the node config's
``partition-id`` (stable across runs, unlike Ray's node ids), else the node id. On the
first message of a run whose ``context.state`` does not carry this run and attempt (a
new Flower run, a restarted process), it first drops what killed attempts wrote in
rounds the run has redone (the checkpoint's writer's states after the checkpoint, any
other attempt's after ``state-base-from``: so also a state of an attempt that died before
the one that wrote the checkpoint, which never sampled this node), then
loads the newest state left from before this message's round: the state the node held
at the checkpoint. So a resumed run's clients continue with the residuals they had.

**What is kept.** The server keeps its two newest checkpoints (rounds that are multiples
of ``state-every``, or the round it resumed from). The node keeps every state newer than
the older of the two that may exist by now, and the newest one at or before it, so
either checkpoint can be resumed; older ones are deleted. That is at most
``state-every + 1`` states (each about one model's size with error feedback) per node.

**Old runs.** A finished run's states stay (the node cannot know that no resume will
come). When a node starts on a run, it deletes the directories of other runs it has not
written to for ``max_age_days`` (default 7).

**Failures.** A state file that is truncated or corrupt is refused by name (a warning),
and the node starts again from an empty state, as a node without this mod would: the
protocol resynchronises it (the residual starts again; DGA and gossip resend the model).
It never uses an older state in its place. ``root="off"`` (or ``$FEDEDGE_STATE_DIR=off``)
switches the mod off, logged once.

The root: the ``state-dir`` node config key, else ``$FEDEDGE_STATE_DIR``, else
``$XDG_CACHE_HOME/fededge/client-state`` (``~/.cache/fededge/client-state``).

**Idle nodes' state on disk** (:class:`StateSpillMod`, issue 21). Under Flower's Ray
simulation one process (the simulation's SuperLink) holds every node's Context, and a
node's ``context.state`` stays in memory for the rest of the run once it has trained:
with 1,000 clients and error feedback that is 1,000 residuals (each one model's size),
although only the clients of one round need theirs. (A SuperNode holds its own state
only; the mod works there too.) :class:`StateSpillMod` keeps the state of a node that is
not running on the node's disk, so that memory follows the clients per round, not the
clients: on every message it loads ``<root>/spill/<run id>/<node id>.state``, if there
is one, into ``context.state`` (replacing it), runs the message, writes ``context.state``
back (atomically, :mod:`fededge.safefile`; an empty state deletes the file instead) and
leaves ``context.state`` empty. The run id is Flower's ``context.run_id`` (unique per
run under Ray and on a SuperLink), the node id its ``context.node_id``. A reply that is
an error still writes what the context holds, as Flower keeps the context of such a
message; a message that raises writes nothing, as Flower then keeps the context from
before it (the file is that state), and it too leaves ``context.state`` empty. A corrupt
or truncated file is refused by name (a warning) and the node starts from an empty
state, as with :class:`StateStoreMod`. When a run first spills under a root, it deletes
the ``spill/<run id>`` directories of other runs not written for ``max_age_days``
(default 1): a run's last states stay until then, since a node cannot know that a run
has ended.

The cost: one file write (serialise, sha256, write; no fsync unless ``durable=True``:
the file has to outlive the process's next message, not the machine) and one read
(sha256, load) per message.
The state is stored as its records' plain fields
(:func:`fededge.protocol.recorddict_to_bytes`, what the in-process runtime's store uses),
read back with an unpickler that refuses anything naming a class: about 1.3 ms a message
in all for a 0.2 MB state (a 50,000-float residual), 0.25 s for a ResNet-18's 45 MB, on
a 2-core VM (benchmarks/bench_spill.py; 6 ms and 0.8 s with Flower's serialised objects
and two fsyncs, as before 2026-11-26). Files written that way still read.
The mod is the outermost of the mods that keep state (outside :class:`StateStoreMod`
and the compression, DGA and gossip mods), so that they find the state loaded and it is
saved after they ran. Under fededge's in-process runtime use its own
``client_states="disk"`` instead (:class:`fededge.server.grid.InProcessGrid`): its
checkpoints hold the nodes' states, which this mod would take out of the Contexts.
fededge's app adds this mod, everywhere else, when the run config says
``client-states="disk"``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fededge import keys
from fededge._flwr_internals import ClientAppCallable, recorddict_from_objects
from fededge.protocol import checkpoint_rounds, recorddict_from_bytes, recorddict_to_bytes
from fededge.safefile import SafeFileError, bytes_from_tensor, read_file, tensor_of_bytes, write_file

__all__ = ["ENV_STATE_DIR", "StateSpillMod", "StateStoreMod", "default_state_dir"]

log = logging.getLogger("fededge")

ENV_STATE_DIR = "FEDEDGE_STATE_DIR"
_NAME = re.compile(r"round-(\d{6,})\.([0-9A-Za-z_-]+)\.state")
_SAFE = re.compile(r"[^0-9A-Za-z._-]")
SPILL = "spill"  # <root>/spill/<run id>/: StateSpillMod's, never a StateStoreMod run's
STATE_BYTES = "state-bytes"  # a state file's state (before 2026-11-26: "state", Flower's serialised objects)


def default_state_dir() -> Path | None:
    """The root from the environment (None: switched off)."""
    env = os.environ.get(ENV_STATE_DIR)
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fededge" / "client-state"


def _resolve_root(root: Any, context: Context) -> Path | None:
    """A mod's root: its own, else the ``state-dir`` node config key, else
    :func:`default_state_dir` (None: switched off)."""
    if root is None:
        root = context.node_config.get(keys.STATE_DIR)
    if root is None or str(root) == "":
        return default_state_dir()
    return None if str(root).strip().lower() == "off" else Path(str(root))


def _collect(parent: Path, mine: Path, max_age_days: float, what: str, skip: tuple[str, ...] = ()) -> None:
    """Delete the run directories in ``parent`` other than ``mine`` (and names in
    ``skip``) with no ``*.state`` written for ``max_age_days``."""
    if not parent.is_dir():
        return
    cutoff = time.time() - max_age_days * 86400
    for run in parent.iterdir():
        if run == mine or run.name in skip or not run.is_dir():
            continue
        try:
            newest = max((f.stat().st_mtime for f in run.rglob("*.state")), default=run.stat().st_mtime)
        except OSError:
            continue  # another node of this machine is pruning it right now
        if newest < cutoff:
            shutil.rmtree(run, ignore_errors=True)
            log.info("%s of run %s deleted: not written for %g days", what, run.name, max_age_days)


def _state_payload(state: RecordDict) -> torch.Tensor:
    """``state`` as the file holds it: :func:`fededge.protocol.recorddict_to_bytes` in a
    uint8 tensor (:func:`fededge.safefile.tensor_of_bytes`)."""
    return tensor_of_bytes(recorddict_to_bytes(state))


def _read_state(path: Path) -> RecordDict | None:
    """The ``context.state`` saved in ``path``; None, with a warning naming the file, if
    it cannot be used (the node then starts again from an empty state). Reads the files
    of fededge before 2026-11-26 too (the state as Flower's serialised objects)."""
    try:
        saved = read_file(path, what="client state")
        if STATE_BYTES in saved:
            blob = bytes_from_tensor(saved[STATE_BYTES], f"client state {path}: its '{STATE_BYTES}'")
            try:
                state: RecordDict = recorddict_from_bytes(blob)
            except Exception as err:  # noqa: BLE001 - whatever the bytes do wrong, the file is refused by name
                raise SafeFileError(f"client state {path}: unreadable state: {type(err).__name__}: {err}") from err
        else:
            state = recorddict_from_objects(saved["state"])
    except (SafeFileError, KeyError) as err:
        log.warning("%s; this node starts again from an empty state (the protocol resynchronises it)", err)
        return None
    return state


def _replace_state(context: Context, state: RecordDict) -> None:
    """Make ``context.state`` hold exactly ``state``'s records (in place: a caller may
    hold the RecordDict)."""
    for name in list(context.state.keys()):
        del context.state[name]
    for name, record in state.items():
        context.state[name] = record


def _files(d: Path) -> list[tuple[int, str, Path]]:
    """(round, attempt, path) of the states in ``d``, oldest round first."""
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), m.group(2), p) for p in d.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found, key=lambda f: (f[0], f[1]))


def keep_from(resumed: int, every: int, t: int) -> int:
    """The older of the (at most) two checkpoint rounds the server may hold once round
    ``t`` is done: the node must keep its newest state at or before it, and all after."""
    candidates = checkpoint_rounds(resumed, every, t)
    return candidates[-2] if len(candidates) > 1 else candidates[-1]


class StateStoreMod:
    """Keep this node's ``context.state`` on its disk, per run, for a resumed run (module
    docstring). Outermost of the mods that keep state, so that they find it restored.

    Parameters
    ----------
    root : str or Path, optional
        Where the states go; default: the ``state-dir`` node config key, else
        :func:`default_state_dir`. ``"off"`` switches the mod off.
    max_age_days : float
        Other runs' states not written for this long are deleted when a run starts here.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp(mods=[StateStoreMod()])  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, max_age_days: float = 7.0) -> None:
        if not max_age_days > 0:
            raise ValueError(f"max_age_days must be > 0, got {max_age_days!r}")
        self.root = root
        self.max_age_days = max_age_days
        self._said_off = False

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content.config_records else None
        if conf is None or keys.STATE_KEY not in conf or not msg.metadata.message_type.startswith("train"):
            return call_next(msg, context)
        root = _resolve_root(self.root, context)
        if root is None:
            if not self._said_off:
                log.warning("the server asks this node to keep its state for a resume, but the state store "
                            "is off (state-dir / %s = off): a resumed run's clients start afresh", ENV_STATE_DIR)
                self._said_off = True
            return call_next(msg, context)
        key, attempt = str(conf[keys.STATE_KEY]), str(conf[keys.STATE_ATTEMPT])
        resumed, every = int(conf[keys.STATE_RESUMED_FROM]), int(conf[keys.STATE_EVERY])
        t = int(conf[keys.SERVER_ROUND])
        who = context.node_config.get(keys.PARTITION_ID)
        d = root / _SAFE.sub("_", key) / (f"partition-{int(who)}" if who is not None else f"node-{context.node_id}")
        mark = context.state.config_records.get(keys.STATE_STORE)
        if mark is None or mark.get("key") != key or mark.get("attempt") != attempt:
            _collect(root, d.parent, self.max_age_days, "client states", skip=(SPILL,))
            base = conf.get(keys.STATE_BASE_ATTEMPT)
            self._take_up(d, t, resumed, attempt, context,
                          None if base is None else (str(base), int(conf.get(keys.STATE_BASE_FROM, 0))))
            context.state[keys.STATE_STORE] = ConfigRecord({"key": key, "attempt": attempt})
        reply = call_next(msg, context)
        if not reply.has_error():
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_file(d / f"round-{t:06d}.{_SAFE.sub('_', attempt)}.state",
                       {"round": t, "key": key, STATE_BYTES: _state_payload(context.state)})
            self._prune(d, keep_from(resumed, every, t))
        return reply

    @staticmethod
    def _take_up(d: Path, t: int, resumed: int, attempt: str, context: Context,
                 base: tuple[str, int] | None = None) -> None:
        """Drop a killed attempt's states from rounds the run has redone; load the newest
        one from before round ``t`` into ``context.state`` (in place).

        ``base``: the attempt that wrote the checkpoint resumed, and the round it continued
        after. Its states up to the checkpoint are the timeline's; another attempt's only up
        to that round (after it, that attempt had died and been redone, whether this node
        heard of it or not: with ``resumed`` alone, after two kills a node that the middle
        attempt never sampled took up the first attempt's state of a round the middle one
        redid). A node left out of two successive attempts could still hold such a state
        from three attempts back. Without ``base`` (a server of a fededge before it), other
        attempts' states after ``resumed`` are dropped, as before."""
        mine = _SAFE.sub("_", attempt)
        base_att = None if base is None else _SAFE.sub("_", base[0])
        files = []
        for rnd, att, path in _files(d):
            if att == mine:
                dead = False
            elif base_att is not None:
                dead = rnd > (resumed if att == base_att else base[1])
            else:
                dead = rnd > resumed
            if dead:
                path.unlink(missing_ok=True)  # written by an attempt in rounds the timeline has redone
            else:
                files.append((rnd, path))
        before = [(rnd, path) for rnd, path in files if rnd < t]
        if not before:
            return
        rnd, path = before[-1]
        state = _read_state(path)
        if state is None:
            return
        _replace_state(context, state)
        log.info("client state of round %d taken up from %s", rnd, path)

    @staticmethod
    def _prune(d: Path, older: int) -> None:
        files = _files(d)
        base = [rnd for rnd, _, _ in files if rnd <= older]
        if not base:
            return
        for rnd, _, path in files:
            if rnd < base[-1]:
                path.unlink(missing_ok=True)


class StateSpillMod:
    """Keep ``context.state`` on this node's disk between messages, so that an idle node
    holds none in memory (module docstring: why, what it costs). Outermost of the mods
    that keep state (outside :class:`StateStoreMod`), so that they find it loaded.

    Parameters
    ----------
    root : str or Path, optional
        The states go to ``<root>/spill/<run id>/<node id>.state``; default: the
        ``state-dir`` node config key, else :func:`default_state_dir`. ``"off"``
        switches the mod off (states stay in memory), logged once.
    max_age_days : float
        Other runs' spilled states not written for this long are deleted when a run
        first spills here.
    durable : bool
        fsync every file written (default False). A spilled state has to outlive this
        process's next message, not the machine: without fsync a power loss can leave a
        node's file holding an older state (or none), which it would then continue
        from. Under Flower's simulation a power loss ends the run (a new run has new
        files); on a SuperNode that must carry on after one, set ``durable=True``.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp(mods=[StateSpillMod()])  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, max_age_days: float = 1.0,
                 durable: bool = False) -> None:
        if not max_age_days > 0:
            raise ValueError(f"max_age_days must be > 0, got {max_age_days!r}")
        self.root = root
        self.max_age_days = max_age_days
        self.durable = durable
        self._said_off = False

    def path(self, context: Context) -> Path | None:
        """The file this node's state is spilled to (None: switched off)."""
        root = _resolve_root(self.root, context)
        if root is None:
            return None
        return root / SPILL / _SAFE.sub("_", str(context.run_id)) / f"{_SAFE.sub('_', str(context.node_id))}.state"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        path = self.path(context)
        if path is None:
            if not self._said_off:
                log.warning("StateSpillMod is off (state-dir / %s = off): the nodes' states stay in memory",
                            ENV_STATE_DIR)
                self._said_off = True
            return call_next(msg, context)
        if not path.parent.is_dir():  # the first message of this run under this root
            _collect(path.parent.parent, path.parent, self.max_age_days, "spilled client states")
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        elif path.exists():  # else nothing spilled: what the context holds is the state
            loaded = _read_state(path)
            _replace_state(context, loaded if loaded is not None else RecordDict())
        try:
            reply = call_next(msg, context)
        except BaseException:
            # Flower keeps the Context from before a message that raised: so does the file.
            _replace_state(context, RecordDict())
            raise
        # An error reply keeps its context in Flower: what the context holds is written.
        if len(context.state) > 0:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # in case another run collected it
            write_file(path, {"run": str(context.run_id), "node": str(context.node_id),
                              STATE_BYTES: _state_payload(context.state)}, durable=self.durable)
        else:
            path.unlink(missing_ok=True)
        _replace_state(context, RecordDict())
        return reply
