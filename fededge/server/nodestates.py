"""Where the in-process runtime keeps its nodes' ``context.state`` between messages.

A node's state (error-feedback residual, PowerSGD's Q, DGA's and gossip's client state,
the batch sampler's position) lives as long as the run. With 10,000 clients and a
stateful compressor that is 10,000 residuals, ~2 GB for a 0.19 MB MLP and ~450 GB for a
ResNet-18, although only the clients of one round (a hundred) need theirs at a time.

- :class:`MemoryStates` keeps every state on the heap as the live ``RecordDict``: no
  copy, no serialisation; the right choice for tens or hundreds of clients.
- :class:`DiskStates` keeps the state of every node that is not running on disk, in one
  SQLite file in a private temporary directory (removed by :meth:`DiskStates.close`).
- :class:`AutoStates` (``client-states=auto``, the default) starts as
  :class:`MemoryStates` and moves every state to a :class:`DiskStates` once the states
  it holds pass a budget (``client-states-memory-mb``), saying so once in the log: a run
  of tens of clients never touches the disk, and one of 10,000 keeps its memory
  bounded by the budget and the clients of a round.
  Peak memory then follows the clients per round, not the clients. A process that is
  killed cannot remove its directory (as large as all its nodes' states: about 2 GB
  for 10,000 MLP residuals): the directory holds a lock for as long as its store is
  open, and the next store made in the same place removes every such directory whose
  lock nobody holds.

A state travels and rests as :func:`state_to_bytes`
(:func:`fededge.protocol.recorddict_to_bytes`): each record's plain fields (an
Array's dtype, shape, stype and bytes; a config or metric record's values) pickled.
It reads back equal bit for bit (the same Flower serialisation, the same object id), at
a tenth of the cost of Flower's own serialisation, which hashes every object for its id
and wraps every array in protobuf: on a hundred messages a round, both ways, that was
most of the state's cost. Rows that hold Flower's serialised objects (written by
fededge before 2026-11-25, a states file in an older checkpoint) still read.

Both stores speak three dialects: live ``RecordDict`` (:meth:`take`/:meth:`put`, for a
message run in this process), those bytes (:meth:`take_bytes`/:meth:`put_bytes`, for a
message run by a worker process, and for checkpoints: the disk store hands its rows over
untouched) and Flower's serialised objects (:meth:`take_objects`/:meth:`put_objects`,
for checkpoints written before 2026-11-26, which held those).
Nothing here knows Flower's message flow or the grid: pure storage.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; a killed run's directory stays
    fcntl = None  # type: ignore[assignment]

from flwr.app import RecordDict

from fededge import _flwr_internals as fi
from fededge.config import CLIENT_STATES
from fededge.machine import cgroup_dirs, runs_sharing
from fededge.protocol import recorddict_from_bytes, recorddict_to_bytes
from fededge.safefile import fsync_dir

__all__ = ["CLIENT_STATES", "INLINE_STATES_MAX", "OWNER_LOCK", "PREFIX", "AutoStates", "DiskStates", "MemoryStates",
           "NodeStates", "collect_orphans", "make_states", "read_states_file", "state_from_bytes", "state_to_bytes",
           "write_states_file"]

#: A node's state as bytes and back (:func:`fededge.protocol.recorddict_to_bytes`; the
#: clients' :class:`~fededge.clients.statestore.StateSpillMod` writes the same).
state_to_bytes = recorddict_to_bytes
state_from_bytes = recorddict_from_bytes


class MemoryStates:
    """Every node's state on the heap, as the live ``RecordDict`` the ClientApp left."""

    #: The store's SQLite side, for checkpoints (none: every state is on the heap).
    disk: DiskStates | None = None

    def __init__(self) -> None:
        self._states: dict[int, RecordDict] = {}

    def take(self, node: int) -> RecordDict:
        """The node's state to run a message with (the live object; empty if none)."""
        return self._states.get(node) or RecordDict()

    def put(self, node: int, state: RecordDict) -> None:
        if len(state):
            self._states[node] = state
        else:
            self._states.pop(node, None)

    def take_bytes(self, node: int) -> bytes | None:
        state = self._states.get(node)
        return state_to_bytes(state) if state else None

    def put_bytes(self, node: int, blob: bytes | None) -> None:
        self.put(node, RecordDict() if blob is None else state_from_bytes(blob))

    def take_objects(self, node: int) -> dict[str, Any] | None:
        state = self._states.get(node)
        return fi.recorddict_to_objects(state) if state else None

    def put_objects(self, node: int, objects: dict[str, Any] | None) -> None:
        if objects is None:
            self._states.pop(node, None)
        else:
            self._states[node] = fi.recorddict_from_objects(objects)

    def view(self, node: int) -> RecordDict:
        """The state to show (a test reading ``grid.contexts``): live, and kept if changed."""
        if node not in self._states:
            self._states[node] = RecordDict()
        return self._states[node]

    def nodes(self) -> Iterator[int]:
        """Nodes that hold a non-empty state."""
        return iter([n for n, s in self._states.items() if len(s)])

    def held_bytes(self) -> int:
        """The bytes the states hold on the heap (:func:`state_nbytes`)."""
        return sum(state_nbytes(s) for s in self._states.values() if len(s))

    def __len__(self) -> int:
        return sum(1 for _ in self.nodes())

    def close(self) -> None:
        self._states.clear()


def _states_db(path: Path) -> sqlite3.Connection:
    """A new SQLite file of node states (the table :class:`DiskStates` reads and writes)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA page_size=65536")
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("CREATE TABLE states (node INTEGER PRIMARY KEY, objects BLOB NOT NULL)")
    except BaseException:
        db.close()
        raise
    return db


def _node_key(node: int) -> int:
    # SQLite integers are signed 64-bit; Flower's node ids are up to 2**64 - 1.
    return node - (1 << 64) if node >= 1 << 63 else node


def _node_of(key: int) -> int:
    """The node id of a row's key (:func:`_node_key` undone)."""
    return key + (1 << 64) if key < 0 else key


def _write_atomically(path: str | os.PathLike[str], fill: Callable[[Path], None]) -> str:
    """``fill`` a temporary file beside ``path``, fsync it, rename it into place and fsync
    the directory; return its SHA-256 (hex). A failure leaves no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fill(tmp)
        digest = _sha256(tmp, fsync=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return digest


def write_states_file(path: str | os.PathLike[str], items: Iterable[tuple[int, bytes | None]]) -> str:
    """Write ``(node, state bytes)`` pairs (:func:`state_to_bytes`; None: no state) into a
    states file at ``path``, the format of :meth:`DiskStates.save_file`, one pair at a
    time; return its SHA-256 (hex). For a checkpoint of states held in memory: a generator
    of pairs keeps one state serialised at a time, where the checkpoint's body (serialised
    whole) would hold them all at once, twice."""
    def fill(tmp: Path) -> None:
        db = _states_db(tmp)
        try:
            for node, blob in items:
                if blob is not None:
                    db.execute("INSERT OR REPLACE INTO states (node, objects) VALUES (?, ?)", (_node_key(node), blob))
        finally:
            db.close()
    return _write_atomically(path, fill)


def _open_states_file(path: str | os.PathLike[str], sha256: str) -> sqlite3.Connection:
    """A read-only connection to a states file, after checking its SHA-256 (``ValueError``
    naming the file when it differs)."""
    got = _sha256(Path(path))
    if got != sha256:
        raise ValueError(f"{path}: the states file is corrupt or not this checkpoint's (sha256 {got[:12]}..., "
                         f"the checkpoint says {sha256[:12]}...)")
    # A URI: the path percent-encoded (as_uri), so that a '#', '?' or '%' in it (a
    # results-dir of the user's) is a character of the name, not SQLite's fragment,
    # query or escape: unencoded, "results #2/..." opened "results " read-write.
    return sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)


def read_states_file(path: str | os.PathLike[str], sha256: str) -> Iterator[tuple[int, bytes]]:
    """The ``(node, state bytes)`` pairs of a states file (:meth:`DiskStates.save_file`,
    :func:`write_states_file`), one at a time, after checking its SHA-256: a grid that
    keeps its states in memory reads a checkpoint's side file without copying it."""
    src = _open_states_file(path, sha256)
    try:
        for key, blob in src.execute("SELECT node, objects FROM states ORDER BY rowid"):
            yield _node_of(key), blob
    finally:
        src.close()


class DiskStates:
    """Every node's state in one SQLite file, off the heap while the node is idle.

    Parameters
    ----------
    directory : path, optional
        Where the temporary directory goes (default: the system's, ``$TMPDIR``). The
        directory is private (mode 0700) and removed by :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.disk = self  # the store's SQLite side, for checkpoints
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        collect_orphans(Path(directory) if directory is not None else Path(tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=directory))
        self.path = self.dir / "states.sqlite"
        self.bytes_written = 0
        self._db: sqlite3.Connection | None = None
        self._lock: int | None = None
        try:
            self._lock = _hold_lock(self.dir)
            # One writer (the grid), temporary data: no journal, no fsync. A state is a
            # blob of 0.2 MB (the MLP's residual) or more: in SQLite's largest pages
            # (64 KiB, set before the table exists) replacing one moves 4 pages, not 48
            # (bench_message_costs on a 2-core EPYC: 0.22 against 0.28 ms a message). A
            # state much under 64 KiB takes a whole page on disk (not measured here).
            self._db = _states_db(self.path)
        except BaseException:
            self.close()
            raise

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"the node states in {self.dir} were closed")
        return self._db

    _key = staticmethod(_node_key)

    def take_bytes(self, node: int) -> bytes | None:
        """The node's row as stored (:func:`state_to_bytes`), None if it has no state."""
        row = self.db.execute("SELECT objects FROM states WHERE node = ?", (self._key(node),)).fetchone()
        return None if row is None else row[0]

    def put_bytes(self, node: int, blob: bytes | None) -> None:
        if blob is None:
            self.db.execute("DELETE FROM states WHERE node = ?", (self._key(node),))
            return
        self.bytes_written += len(blob)
        self.db.execute("INSERT OR REPLACE INTO states (node, objects) VALUES (?, ?)", (self._key(node), blob))

    def take(self, node: int) -> RecordDict:
        blob = self.take_bytes(node)
        return RecordDict() if blob is None else state_from_bytes(blob)

    def put(self, node: int, state: RecordDict) -> None:
        self.put_bytes(node, state_to_bytes(state) if len(state) else None)

    def take_objects(self, node: int) -> dict[str, Any] | None:
        blob = self.take_bytes(node)
        return None if blob is None else fi.recorddict_to_objects(state_from_bytes(blob))

    def put_objects(self, node: int, objects: dict[str, Any] | None) -> None:
        self.put(node, RecordDict() if objects is None else fi.recorddict_from_objects(objects))

    def view(self, node: int) -> RecordDict:
        """A copy of the node's state (changing it changes nothing stored)."""
        return self.take(node)

    def nodes(self) -> Iterator[int]:
        for (key,) in self.db.execute("SELECT node FROM states ORDER BY rowid").fetchall():
            yield _node_of(key)

    def __len__(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM states").fetchone()[0])

    def save_file(self, path: str | os.PathLike[str]) -> str:
        """Copy every state into the SQLite file ``path`` (SQLite's online backup, page by
        page, so memory stays flat whatever the states weigh), fsync'ed and renamed into
        place; return its SHA-256 (hex). For a checkpoint that would otherwise hold every
        state in memory at once."""
        def fill(tmp: Path) -> None:
            dest = sqlite3.connect(tmp)
            try:
                # no rollback journal beside the temporary file (a killed copy would leave
                # one that the checkpoints' clean-up does not know): the file is renamed
                # into place only when complete, as write_states_file's
                dest.execute("PRAGMA journal_mode=OFF")
                self.db.backup(dest)
            finally:
                dest.close()
        return _write_atomically(path, fill)

    def load_file(self, path: str | os.PathLike[str], sha256: str) -> None:
        """Replace every state with those of :meth:`save_file`'s ``path``, after checking
        its SHA-256 (``ValueError`` naming the file when it differs)."""
        src = _open_states_file(path, sha256)
        try:
            src.backup(self.db)
        finally:
            src.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __del__(self) -> None:  # a grid that was never closed leaves no file behind
        try:
            if hasattr(self, "_lock"):  # else __init__ failed before making its directory
                self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def state_nbytes(state: RecordDict) -> int:
    """The bytes ``state`` holds in its arrays and byte strings (what dominates a node's
    state: a residual, a momentum buffer, PowerSGD's Q), not Python's object overhead."""
    total = 0
    for record in state.array_records.values():
        total += sum(len(a.data) for a in record.values())
    for record in state.config_records.values():
        total += sum(len(v) for v in record.values() if isinstance(v, bytes))
    return total


#: A checkpoint of the in-process grid holds the states kept in memory in its own body up
#: to this many bytes (:func:`state_nbytes`); more go to a side file, one state at a time
#: (:func:`write_states_file`): the body is serialised whole, so inline states would be in
#: memory three times at its peak (the live states, their bytes, the serialised body).
INLINE_STATES_MAX = 64 << 20

#: One round's clients' states are kept in memory up to this many times the budget
#: (``client-states-memory-mb``): 1 GiB by default, so that a run whose rounds sample all
#: of 10,000 clients, or a sweep of runs side by side, stays near the budget it was given.
ROUND_SHARE_MAX = 4


class AutoStates:
    """Memory first; every state on disk once those held pass the budget.

    The states stay live ``RecordDict`` objects (:class:`MemoryStates`, no copy, no
    serialisation) while their arrays total at most the budget: the larger of
    ``budget_bytes`` and the states of one round's clients (``round_clients`` times the
    largest state seen: every round stores that many states, and a store on disk pays to
    pickle each), the latter at most ``ROUND_SHARE_MAX`` times ``budget_bytes`` and
    ``memory_cap`` (default a quarter of the memory this process may use,
    :func:`_physical_memory`, over the runs that share the machine,
    :func:`~fededge.machine.runs_sharing`: a sweep's runs side by side). The first :meth:`put` that takes them over the budget moves
    every state to a :class:`DiskStates` in ``directory``, logged once with the count and
    the size; the store stays on disk for the rest of the run. So a run of a few clients
    never writes a file, and one of ten ResNet clients a round with 45 MB of error
    feedback each (450 MB, over 256 MiB: each message then paid about 70 ms to pickle and
    store its state) keeps them in memory where all ten are its clients; a run of 10,000
    clients keeps at most the budget (or four times it, where a round samples them all)
    plus the states of the nodes that are running in memory. ``budget_bytes=0`` moves to
    disk at the first non-empty state, whatever ``round_clients``.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, budget_bytes: int = 256 << 20, *,
                 round_clients: int = 0, memory_cap: int | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if round_clients < 0:
            raise ValueError(f"round_clients must be >= 0, got {round_clients}")
        self.budget_bytes = budget_bytes
        self.round_clients = round_clients
        self.sharing = runs_sharing() if memory_cap is None else 1  # a sweep's runs: each its share of the memory
        self.memory_cap = _physical_memory() // 4 // self.sharing if memory_cap is None else memory_cap
        self._largest = 0  # the largest state seen
        self._directory = directory
        self._memory: MemoryStates | None = MemoryStates()
        self._sizes: dict[int, int] = {}  # node -> bytes of its state on the heap
        self._held = 0
        self._move_failed = False  # a move to disk failed once: memory for the rest of the run
        self.disk: DiskStates | None = None

    @property
    def kind(self) -> str:
        """Where the states are now: ``"memory"`` or ``"disk"``."""
        return "memory" if self.disk is None else "disk"

    @property
    def _store(self) -> MemoryStates | DiskStates:
        return self.disk if self.disk is not None else self._memory  # type: ignore[return-value]

    @property
    def budget(self) -> int:
        """Bytes of states kept in memory now: the larger of ``budget_bytes`` and one
        round's clients' states (at most ``ROUND_SHARE_MAX`` x ``budget_bytes`` and
        ``memory_cap``); 0 where ``budget_bytes`` is 0 (disk from the first state, as asked)."""
        if not self.budget_bytes:
            return 0
        return max(self.budget_bytes, min(self.round_clients * self._largest, self.round_cap))

    @property
    def round_cap(self) -> int:
        """The most bytes of one round's states kept in memory: ``ROUND_SHARE_MAX`` x
        ``budget_bytes``, or ``memory_cap`` where that is less."""
        return min(ROUND_SHARE_MAX * self.budget_bytes, self.memory_cap)

    def _account(self, node: int, size: int) -> None:
        self._held += size - self._sizes.pop(node, 0)
        if size:
            self._sizes[node] = size
            self._largest = max(self._largest, size)
        if self._held > self.budget and not self._move_failed:
            self._to_disk()

    def _to_disk(self) -> None:
        memory = self._memory
        assert memory is not None
        nodes = list(memory.nodes())
        disk = None
        try:
            disk = DiskStates(self._directory)
            for node in nodes:
                disk.put(node, memory.take(node))
        except (OSError, sqlite3.Error) as err:  # a full or read-only $TMPDIR: memory goes on, as "memory" would
            if disk is not None:
                disk.close()
            self._move_failed = True
            log.warning("client-states=auto: the states of %d clients (%.1f MiB) could not move to disk (%s: %s); "
                        "they stay in memory for the rest of the run (client-states='memory'); give a writable "
                        "states directory ($TMPDIR) with room for them", len(nodes), self._held / 2**20,
                        type(err).__name__, err)
            return
        log.info("client-states=auto: the states of %d client%s reached %.1f MiB, over the %.1f MiB budget "
                 "(the larger of client-states-memory-mb, %g MiB, and %d clients of a round x %.1f MiB, at most "
                 "%d x the former and a quarter of the memory%s); idle clients' states are kept on disk from now on, "
                 "in %s",
                 len(nodes), "" if len(nodes) == 1 else "s", self._held / 2**20, self.budget / 2**20,
                 self.budget_bytes / 2**20, self.round_clients, self._largest / 2**20, ROUND_SHARE_MAX,
                 f" over {self.sharing} runs sharing the machine" if self.sharing > 1 else "", disk.dir)
        memory.close()
        self._memory, self.disk, self._sizes, self._held = None, disk, {}, 0

    def take(self, node: int) -> RecordDict:
        return self._store.take(node)

    def put(self, node: int, state: RecordDict) -> None:
        self._store.put(node, state)
        if self.disk is None:
            self._account(node, state_nbytes(state) if len(state) else 0)

    def take_bytes(self, node: int) -> bytes | None:
        return self._store.take_bytes(node)

    def put_bytes(self, node: int, blob: bytes | None) -> None:
        if self.disk is not None:
            self.disk.put_bytes(node, blob)
        else:
            self.put(node, RecordDict() if blob is None else state_from_bytes(blob))

    def take_objects(self, node: int) -> dict[str, Any] | None:
        return self._store.take_objects(node)

    def put_objects(self, node: int, objects: dict[str, Any] | None) -> None:
        if self.disk is not None:
            self.disk.put_objects(node, objects)
        else:
            self.put(node, RecordDict() if objects is None else fi.recorddict_from_objects(objects))

    def view(self, node: int) -> RecordDict:
        """As the store's :meth:`MemoryStates.view` / :meth:`DiskStates.view`. A state
        changed through a memory view is not counted against the budget until its next
        :meth:`put`."""
        return self._store.view(node)

    def nodes(self) -> Iterator[int]:
        return self._store.nodes()

    def held_bytes(self) -> int:
        """The bytes of the states held on the heap (0 once they are on disk)."""
        return self._held

    def __len__(self) -> int:
        return len(self._store)

    def close(self) -> None:
        if self._memory is not None:
            self._memory.close()
        if self.disk is not None:
            self.disk.close()


NodeStates = MemoryStates | DiskStates | AutoStates


def _physical_memory(cgroup: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The memory this process may use, in bytes: the machine's (``sysconf``; 4 GiB where
    it cannot be read) lowered to the smallest memory limit of its cgroup and the cgroups
    above it (v2 ``memory.max``, v1 ``memory.limit_in_bytes``: ``docker --memory``, a
    Kubernetes or Slurm limit), found from ``/proc/self/cgroup`` (and at the mount's root,
    which a container's cgroup namespace makes its own)."""
    try:
        total = int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        total = 0
    if total <= 0:
        total = 4 << 30
    for d in cgroup_dirs("memory", cgroup, proc_cgroup):
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                text = Path(d, name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and 0 < int(text) < total:
                total = int(text)
    return total


#: The name of a :class:`DiskStates` directory starts with this.
PREFIX = "fededge-states-"
#: The file whose lock a :class:`DiskStates` holds while open.
OWNER_LOCK = "owner.lock"

log = logging.getLogger(__name__)


def _hold_lock(d: Path) -> int | None:
    """Lock ``d``'s :data:`OWNER_LOCK` for as long as the returned descriptor is open
    (None: this system or file system has no flock; the directory is then never taken
    for an orphan). The file holds this host's name, and gets its own name only once
    locked, so that no other process can find it unlocked while this one starts."""
    if fcntl is None:
        return None
    tmp = d / f".{OWNER_LOCK}.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, socket.gethostname().encode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:  # ENOLCK, ENOSYS: some network and FUSE file systems
            log.warning("node states in %s: no file lock here (%s); if this run is killed, remove the "
                        "directory by hand", d, err)
            os.close(fd)
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, d / OWNER_LOCK)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def collect_orphans(parent: Path) -> list[Path]:
    """Remove every :class:`DiskStates` directory in ``parent`` whose lock no process
    holds (its store's process was killed); return them. Left alone: a directory
    without the lock file (one being made, one on a file system without flock, or one
    written by fededge before 2026-11-26), another user's (also when this process is
    root), and another host's (a shared file system, whose locks that host may hold
    unseen)."""
    if fcntl is None:
        return []
    removed = []
    uid, host = os.getuid(), socket.gethostname().encode()
    for d in parent.glob(f"{PREFIX}*"):
        try:
            fd = os.open(d / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != uid or os.read(fd, 1024) != host:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its store is open
        else:
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d node-state director%s left by killed runs in %s", len(removed),
                 "y" if len(removed) == 1 else "ies", parent)
    return removed


def _sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def make_states(kind: str, directory: str | os.PathLike[str] | None = None, budget_bytes: int = 256 << 20,
                round_clients: int = 0) -> NodeStates:
    """``"memory"``, ``"disk"`` (in ``directory``, default ``$TMPDIR``) or ``"auto"``
    (:class:`AutoStates`: memory up to the larger of ``budget_bytes`` and
    ``round_clients``' states, the latter at most :data:`ROUND_SHARE_MAX` x the budget and
    a quarter of the memory, then disk)."""
    if kind == "memory":
        return MemoryStates()
    if kind == "disk":
        return DiskStates(directory)
    if kind == "auto":
        return AutoStates(directory, budget_bytes, round_clients=round_clients)
    raise ValueError(f"client states are kept in 'memory', on 'disk' or 'auto' (memory, then disk past a "
                     f"budget), not {kind!r}")
