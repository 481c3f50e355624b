"""The warm worker and the shim ClientApp, without a SuperLink: same replies as the cold
path bit for bit, an error (never a hang) when the worker dies, cold fallback, the socket
closed to other users, and `fededge supernode` leaving nothing behind."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fededge import keys
from fededge._flwr_internals import set_message_id, task_identity
from fededge.clients.shim import WorkerError, WorkerShim
from fededge.clients.workerwire import decode_records, encode_records

# Processes with deadlines and measured times: scripts/test.sh runs these apart from
# the CPU-bound tests.
pytestmark = pytest.mark.timing

RUN_ID, NODE_ID = 7, 11


def _rd_equal(a: RecordDict, b: RecordDict) -> bool:
    if list(a.keys()) != list(b.keys()):
        return False
    for name in a.keys():
        ra, rb = a[name], b[name]
        if type(ra) is not type(rb) or list(ra.keys()) != list(rb.keys()):
            return False
        for k in ra.keys():
            va, vb = ra[k], rb[k]
            if isinstance(va, Array):
                if (va.dtype, tuple(va.shape), va.stype, va.data) != (vb.dtype, tuple(vb.shape), vb.stype, vb.data):
                    return False
            elif repr(va) != repr(vb) or type(va) is not type(vb):
                return False
    return True


def test_wire_round_trip_is_exact():
    rd = RecordDict({
        "arrays": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3) / 7),
                               "bits": Array(np.array([1, 255, 0], dtype=np.uint8)),
                               "i": Array(np.array([-(2**40)], dtype=np.int64))}),
        "config": ConfigRecord({"a": 1, "b": 0.1, "c": "x", "d": b"\x00\xff", "e": True, "f": [1.5, 2.5],
                                "g": [b"p", b"q"], "h": float("nan"), "k": -math.inf, "s": ["u", "v"]}),
        "metrics": MetricRecord({"loss": 1 / 3, "n": 5, "v": [0.25, 1e-300]}),
    })
    blobs: list[bytes] = []
    items = encode_records(rd, blobs)
    back = decode_records(items, blobs)
    assert _rd_equal(rd, back)
    assert back["arrays"]["w"].numpy().tobytes() == rd["arrays"]["w"].numpy().tobytes()


def test_shim_imports_no_torch():
    code = "import sys, fededge.clients.shim; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------ a real worker


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker process on a socket in a private directory; stopped (and checked) afterwards."""
    # Under /tmp itself, not pytest's tmp_path: its parents are 0700 root's, which would hide
    # the socket from another user before the worker's own locks are tested.
    d = Path(tempfile.mkdtemp(prefix="fededge-test-worker-"))
    sock = d / "worker.sock"
    monkeypatch.setenv("FEDEDGE_CACHE_DIR", str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "fededge.clients.worker", "--socket", str(sock)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "worker did not bind"
            time.sleep(0.05)
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
        shutil.rmtree(d, ignore_errors=True)


def _train_message(model_arrays: ArrayRecord, *, steps: int = 3, rnd: int = 1) -> Message:
    conf = ConfigRecord({keys.LOCAL_STEPS: steps, keys.SERVER_ROUND: rnd})
    with task_identity(RUN_ID, NODE_ID, 0):
        msg = Message(RecordDict({keys.ARRAYS: model_arrays, keys.CONFIG: conf}), dst_node_id=NODE_ID,
                      message_type="train", group_id=str(rnd))
        set_message_id(msg, f"m{rnd}")
    return msg


def _context(state: RecordDict | None = None) -> Context:
    return Context(RUN_ID, NODE_ID, {keys.PARTITION_ID: 1, keys.NUM_PARTITIONS: 3}, state or RecordDict(),
                   {"seed": 3, "batch-size": 16})


def _initial() -> ArrayRecord:
    from fededge.config import RunConfig
    from fededge.workload import dataset_for, model_for

    cfg = RunConfig.from_mapping({"seed": 3})
    return ArrayRecord(model_for(cfg, dataset_for(cfg)).state_dict())


def _rounds(app, n: int = 3) -> tuple[list[Message], RecordDict]:
    ctx = _context()
    arrays = _initial()
    replies = []
    for t in range(1, n + 1):
        with task_identity(RUN_ID, NODE_ID, 0):
            reply = app(_train_message(arrays, rnd=t), ctx)
        assert not reply.has_error(), reply.error
        replies.append(reply)
        arrays = reply.content[keys.ARRAYS]
    return replies, ctx.state


def test_warm_replies_equal_cold_bit_for_bit(worker):
    """Three rounds through the worker and three in-process: same weights, metrics
    (but compute-s, a timing) and context.state, bit for bit."""
    from fededge.clients.app import app as cold_app

    _, sock = worker
    shim = WorkerShim(socket_path=str(sock))
    warm, warm_state = _rounds(shim)
    assert shim.last_mode == "warm"
    cold, cold_state = _rounds(cold_app)
    for w, c in zip(warm, cold):
        for rd in (w.content, c.content):
            rd[keys.METRICS][keys.COMPUTE_S] = 0.0
        assert _rd_equal(w.content, c.content)
        assert w.metadata.reply_to_message_id == c.metadata.reply_to_message_id
    assert _rd_equal(warm_state, cold_state) and len(warm_state.keys()) > 0


def test_no_worker_falls_back_to_cold_and_says_so_once(tmp_path, caplog):
    shim = WorkerShim(socket_path=str(tmp_path / "nothing.sock"))
    with caplog.at_level(logging.WARNING, logger="fededge.shim"):
        replies, _ = _rounds(shim, 2)
    assert shim.last_mode == "cold" and len(replies) == 2
    said = [r for r in caplog.records if "running cold" in r.getMessage()]
    assert len(said) == 1 and "nothing.sock" in said[0].getMessage()


def test_worker_dying_mid_message_is_an_error_not_a_hang(worker):
    proc, sock = worker
    shim = WorkerShim(socket_path=str(sock), timeout_s=120)
    _rounds(shim, 1)  # the worker is loaded
    msg = _train_message(_initial(), steps=200_000)  # long enough to be killed in the middle
    killer = subprocess.Popen([sys.executable, "-c", f"import os,time;time.sleep(1.5);os.kill({proc.pid},9)"])
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="did not answer"):
        with task_identity(RUN_ID, NODE_ID, 0):
            shim(msg, _context())
    killer.wait()
    assert time.monotonic() - t0 < 30
    assert proc.wait(5) == -signal.SIGKILL
    # the next message finds no worker and runs cold
    with task_identity(RUN_ID, NODE_ID, 0):
        reply = shim(_train_message(_initial(), steps=1), _context())
    assert shim.last_mode == "cold" and not reply.has_error()


def test_hung_worker_times_out(tmp_path):
    """A worker that takes the message and never answers: an error after the timeout."""
    path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)
    shim = WorkerShim(socket_path=str(path), timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="did not answer"):
        with task_identity(RUN_ID, NODE_ID, 0):
            shim(_train_message(_initial()), _context())
    assert time.monotonic() - t0 < 10
    srv.close()


def test_worker_refuses_a_socket_directory_others_can_use(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "fededge.clients.worker", "--socket", str(d / "w.sock")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "0o755" in r.stderr and not (d / "w.sock").exists()


_AS_NOBODY = """
import os, pwd, socket, struct, sys
nobody = pwd.getpwnam("nobody")
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
head = b'{"protocol": 1, "$blobs": []}'   # a frame as fededge.clients.workerwire writes it
s.sendall(struct.pack("!QI", 4 + len(head), len(head)) + head)
reply = b""
while chunk := s.recv(65536):
    reply += chunk
print("REFUSED" if b'"refused"' in reply else "SERVED " + repr(reply[:200]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user (nobody)")
def test_another_user_cannot_use_the_socket(worker):
    """Two locks: the 0700 directory (connect fails), and, were it opened, SO_PEERCRED."""
    _, sock = worker

    def as_nobody() -> str:
        r = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(sock)], capture_output=True,
                           text=True, timeout=120)
        return r.stdout.strip() or r.stderr

    assert as_nobody() == "EACCES"
    os.chmod(sock.parent, 0o711)  # a careless admin opens the directory and the socket
    os.chmod(sock, 0o666)
    try:
        assert as_nobody() == "REFUSED"
    finally:
        os.chmod(sock.parent, 0o700)
        os.chmod(sock, 0o600)
    shim = WorkerShim(socket_path=str(sock))  # its owner is still served
    _rounds(shim, 1)
    assert shim.last_mode == "warm"


# ------------------------------------------------------------------ fededge supernode


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_fededge_supernode(tmp_path: Path, *extra: str, env: dict | None = None):
    """``fededge supernode`` against a SuperLink that is not there (the SuperNode retries):
    the process, its runtime directory."""
    fededge = Path(sys.executable).with_name("fededge")
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(fededge), "supernode", "--grace", "3", *extra, "--insecure", "--superlink",
                             "127.0.0.1:1", "--node-config", "partition-id=0 num-partitions=1",
                             "--port", str(port)], env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), **(env or {})},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, runtime


def _cmdlines(pids) -> dict[int, str]:
    out = {}
    for k in pids:
        try:
            out[k] = Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass
    return out


def _wait_started(proc) -> set[int]:
    deadline = time.monotonic() + 60
    cmds: dict[int, str] = {}
    while time.monotonic() < deadline:
        cmds = _cmdlines(_descendants(proc.pid))
        text = " ".join(cmds.values())
        if "fededge.clients.worker" in text and "flower-superexec" in text:
            return set(cmds)
        time.sleep(0.2)
    pytest.fail(f"not all started: {cmds}")


def _stop_all(proc, kids: set[int]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for k in kids | _descendants(proc.pid):
        try:
            os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.stderr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_fededge_supernode_starts_both_and_stops_both(tmp_path, sig):
    """One command: the worker and flower-supernode (with its SuperExec) come up; a signal
    to the command stops every one of them and removes the socket's directory."""
    proc, runtime = _start_fededge_supernode(tmp_path)
    kids: set[int] = set()
    try:
        kids = _wait_started(proc)
        socks = list(runtime.glob("fededge-worker-*/worker.sock"))
        assert len(socks) == 1 and (socks[0].parent.stat().st_mode & 0o777) == 0o700
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.1)
        assert not [k for k in kids if _alive(k)], "orphans left"
        assert list(runtime.iterdir()) == []
    finally:
        _stop_all(proc, kids)


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_dead_worker_is_restarted_until_the_restarts_run_out(tmp_path, restarts):
    """A worker killed outright is started again (1 s later, on the same socket), as many
    times as --worker-restarts allows; then the node stays up and runs messages cold."""
    proc, runtime = _start_fededge_supernode(tmp_path, env={"FEDEDGE_WORKER_RESTARTS": str(restarts)})
    kids: set[int] = set()

    def worker_pids() -> list[int]:
        return [k for k, c in _cmdlines(_descendants(proc.pid)).items() if "fededge.clients.worker" in c]

    try:
        kids = _wait_started(proc)
        (first,) = worker_pids()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        again: list[int] = []
        while time.monotonic() < deadline:
            again = [p for p in worker_pids() if p != first and _alive(p)]
            if again:
                break
            time.sleep(0.2)
        if restarts:
            assert len(again) == 1, "the worker was not started again"
            kids |= set(again)
            sock = next(runtime.glob("fededge-worker-*/worker.sock"))
            deadline = time.monotonic() + 60  # it imports torch, then listens on the same socket
            while time.monotonic() < deadline and not sock.exists():
                time.sleep(0.2)
            assert sock.exists()
            os.kill(again[0], signal.SIGKILL)  # the second death: no restarts left
            time.sleep(3)
            assert [p for p in worker_pids() if _alive(p)] == []
        else:
            assert again == []
        assert proc.poll() is None, "the node must stay up without its worker"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        err = proc.stderr.read().decode(errors="replace")
        if restarts:
            assert "restarting it in 1 s (restart 1 of 1)" in err, err
        assert f"no restarts left (--worker-restarts {restarts})" in err, err
    finally:
        _stop_all(proc, kids)


# ------------------------------------------------------------------ computing ahead (previews)


def _dga_messages(initial: ArrayRecord, g1: ArrayRecord) -> list[Message]:
    """Three DGA rounds (D = 1) as DGA(compute_ahead=True) sends them: round 1 in full with
    round 2's content as a preview, then messages that refer to the preview they got."""
    def conf(t: int, g: int) -> ConfigRecord:
        return ConfigRecord({keys.LOCAL_STEPS: 3, keys.SERVER_ROUND: t, keys.DGA_GLOBAL_ROUND: g,
                             keys.DGA_CORRECTION: True})

    def preview(t: int, arrays: ArrayRecord, g: int) -> dict:
        return {keys.PREVIEW_PREFIX + keys.ARRAYS: arrays, keys.PREVIEW_PREFIX + keys.CONFIG: conf(t, g),
                keys.PREVIEW_ID: ConfigRecord({"id": str(t)})}

    contents = [
        {keys.ARRAYS: initial, keys.CONFIG: conf(1, 0), **preview(2, ArrayRecord(), 0)},
        {keys.PREVIEW_OF: ConfigRecord({"id": "2"}), **preview(3, g1, 1)},
        {keys.PREVIEW_OF: ConfigRecord({"id": "3"})},
    ]
    out = []
    for t, c in enumerate(contents, start=1):
        with task_identity(RUN_ID, NODE_ID, 0):
            msg = Message(RecordDict(c), dst_node_id=NODE_ID, message_type="train", group_id=str(t))
            set_message_id(msg, f"m{t}")
        out.append(msg)
    return out


def _dga_context() -> Context:
    return Context(RUN_ID, NODE_ID, {keys.PARTITION_ID: 1, keys.NUM_PARTITIONS: 3}, RecordDict(),
                   {"seed": 3, "batch-size": 16, "strategy": "dga", "dga-delay": 1, "dga-compute-ahead": True})


def _run_dga(app, *, pause_s: float = 0.0) -> tuple[list[Message], RecordDict]:
    initial = _initial()
    g1 = ArrayRecord({k: Array(v.numpy() * 0.5) for k, v in initial.items()})  # any G(1) will do
    ctx, replies = _dga_context(), []
    for msg in _dga_messages(initial, g1):
        with task_identity(RUN_ID, NODE_ID, 0):
            reply = app(msg, ctx)
        assert not reply.has_error(), reply.error
        replies.append(reply)
        time.sleep(pause_s)  # the SuperNode's upload and next pull: the worker computes meanwhile
    return replies, ctx.state


def test_warm_worker_computes_ahead_and_replies_as_cold_bit_for_bit(worker):
    """DGA with compute-ahead: the warm worker runs the preview it got as soon as it has
    replied, and uses that run for the message that refers to it (logged); the replies and
    the node's state are the cold path's (which computes each round when asked), bit for bit."""
    from fededge.clients.app import app as cold_app

    proc, sock = worker
    warm, warm_state = _run_dga(WorkerShim(socket_path=str(sock)), pause_s=0.5)
    cold, cold_state = _run_dga(cold_app)
    for w, c in zip(warm, cold):
        for rd in (w.content, c.content):
            rd[keys.METRICS][keys.COMPUTE_S] = 0.0
        assert _rd_equal(w.content, c.content)
    assert _rd_equal(warm_state, cold_state)
    assert keys.PREVIEW_ID not in warm_state  # the last message carried no preview
    proc.terminate()
    proc.wait(10)
    log = proc.stdout.read().decode()
    assert log.count("the reply computed ahead") == 2, log


def test_a_worker_takes_over_a_stale_socket_only(tmp_path):
    """It unlinked whatever was at its path: a second SuperNode given the same
    --worker-socket took over a live worker's socket (both nodes' messages went to the
    second), and a regular file there was deleted."""
    import socket as socketlib

    from fededge.clients.worker import WorkerSecurityError, _remove_stale_socket

    d = tmp_path / "w"
    d.mkdir(mode=0o700)
    plain = d / "file"
    plain.write_text("mine")
    with pytest.raises(WorkerSecurityError, match="is not a socket"):
        _remove_stale_socket(plain)
    assert plain.read_text() == "mine"
    live = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        live.bind(str(d / "live.sock"))
        live.listen(1)
        with pytest.raises(WorkerSecurityError, match="another worker is listening on"):
            _remove_stale_socket(d / "live.sock")
        assert (d / "live.sock").exists()
    finally:
        live.close()
    _remove_stale_socket(d / "live.sock")  # nobody listens now: stale, removed
    assert not (d / "live.sock").exists()


def test_a_cold_supernode_drops_an_inherited_worker_socket(tmp_path, monkeypatch):
    """--cold kept a FEDEDGE_WORKER_SOCKET of the caller's environment: the node's
    ClientApps sent their messages to that (another node's) worker."""
    from fededge.clients import supernode
    from fededge.clients.shim import ENV_SOCKET

    seen = {}

    class Started:
        returncode = -9  # killed by SIGKILL: the shell's 137

        def poll(self):
            return self.returncode

    def start(self, name, cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        seen[name] = dict(env)
        self.procs[name] = Started()
        return self.procs[name]

    monkeypatch.setenv(ENV_SOCKET, str(tmp_path / "someone-elses.sock"))
    monkeypatch.setattr(supernode._Children, "start", start)
    monkeypatch.setattr(supernode._Children, "stop", lambda self: None)
    monkeypatch.setattr(supernode, "_exe", lambda name: name)
    assert supernode.main(["--cold", "--insecure"]) == 137
    assert ENV_SOCKET not in seen["supernode"] and "worker" not in seen


def test_a_missing_xdg_runtime_dir_falls_back_to_the_temporary_directory(tmp_path, monkeypatch):
    """XDG_RUNTIME_DIR set but missing (after su, sudo -E; in containers) gave a traceback
    where the docs promise the temporary directory."""
    from fededge.clients import supernode
    from fededge.clients.shim import ENV_SOCKET

    seen = {}

    class Done:
        returncode, pid = 0, 1

        def poll(self):
            return 0

    def start(self, name, cmd, env, **kw):  # noqa: ANN001, ANN003, ANN202
        seen[name] = dict(env)
        self.procs[name] = Done()
        return self.procs[name]

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "gone"))
    monkeypatch.setattr(supernode._Children, "start", start)
    monkeypatch.setattr(supernode._Children, "stop", lambda self: None)
    monkeypatch.setattr(supernode, "_exe", lambda name: name)
    assert supernode.main(["--insecure"]) == 0
    sock = Path(seen["supernode"][ENV_SOCKET])
    assert sock.parent.name.startswith("fededge-worker-") and not str(sock).startswith(str(tmp_path / "gone"))
    assert not sock.parent.exists()  # removed when the command ended


def test_a_malformed_request_costs_its_connection_not_the_worker(worker):
    """A frame whose header is not an object raised out of the serving loop: the worker
    died (one of its restarts used, messages cold meanwhile)."""
    import socket as socketlib
    import struct

    proc, sock = worker
    head = b"[1, 2]"  # a header, but not an object
    s = socketlib.socket(socketlib.AF_UNIX)
    s.connect(str(sock))
    s.sendall(struct.pack("!QI", 4 + len(head), len(head)) + head)
    s.shutdown(socketlib.SHUT_WR)
    s.settimeout(10)
    while s.recv(65536):
        pass
    s.close()
    time.sleep(0.5)
    assert proc.poll() is None  # still serving
    again = socketlib.socket(socketlib.AF_UNIX)
    again.connect(str(sock))  # and it accepts the next one
    again.close()
