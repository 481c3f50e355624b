"""Runs on one machine never meet (issue 37).

Flower's local simulation SuperLink listens on 127.0.0.1:39091 whatever ``FLWR_HOME``
says, and a ``flwr run`` that finds one there submits to it. fededge starts each run's
SuperLink on a free port of its own (``fededge.deploy.launch``): two ``fededge simulate``
runs at once, with a plain ``flwr run`` beside them, each finish with their own status and
results, and leave no process behind.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fededge.deploy.launch import PORT_ENV, local_superlink_env, start_local_superlink
from fededge.deploy.procs import (
    flower_bin, flower_env, latest_run, list_runs, listener_pids, processes_of, stop_processes_of,
)

ROOT = Path(__file__).resolve().parents[2]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_local_superlink_listens_on_a_port_of_its_own_and_stops(tmp_path):
    link = start_local_superlink(tmp_path / "home")
    try:
        assert link.port not in (39091, 39093)
        assert link.env[PORT_ENV] == str(link.port) and link.env["FLWR_HOME"] == str(tmp_path / "home")
        # The process listening on the port is this SuperLink.
        assert link.proc.pid in listener_pids(link.port)
        assert list_runs(None, env=link.env) == []  # flwr ls reaches it, through its port
        other = start_local_superlink(tmp_path / "home2")
        try:
            assert other.port != link.port and other.proc.pid in listener_pids(other.port)
        finally:
            assert other.stop() == []
    finally:
        assert link.stop() == []
    assert processes_of(str(tmp_path)) == [] and listener_pids(link.port) == []


def test_ctrl_c_while_the_local_superlink_starts_stops_it(tmp_path, monkeypatch):
    """It runs in a session of its own (the terminal's SIGINT never reaches it): a
    KeyboardInterrupt while it started left it running, holding its port, its home
    deleted under it by the caller."""
    from fededge.deploy import launch

    calls = []

    def interrupted(port):  # noqa: ANN001, ANN202 - the first health check: Ctrl-C
        calls.append(port)
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_healthy", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            start_local_superlink(tmp_path / "home")
        assert calls and processes_of(str(tmp_path)) == []
    finally:
        stop_processes_of(str(tmp_path))  # also when the test fails


def test_the_processes_of_a_home_are_those_naming_it_or_a_path_under_it(tmp_path):
    """A substring match took /x/h2's processes for /x/h's (its stop would have stopped
    another run's), and never spared the caller's ancestors."""
    import sys

    sleeper = "import time; time.sleep(60)"
    args = {"under": [f"{tmp_path}/h/state.db"], "flag": [f"--home={tmp_path}/h"], "other": [f"{tmp_path}/h2/db"],
            "inside": [f"/elsewhere{tmp_path}/h/db"],
            "quoted": ["--node-config", f'partition-id=0 deploy-home="{tmp_path}/h"']}  # a SuperNode's
    procs = {k: subprocess.Popen([sys.executable, "-c", sleeper, *a]) for k, a in args.items()}
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(str(tmp_path) in (open(f"/proc/{p.pid}/cmdline").read())
                                                      for p in procs.values()):
            time.sleep(0.05)
        ours = {procs["under"].pid, procs["flag"].pid, procs["quoted"].pid}
        assert set(processes_of(str(tmp_path / "h"))) == ours
        assert set(processes_of(str(tmp_path / "h") + "/")) == ours
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_local_superlink_env_takes_given_ports_and_refuses_one_port_twice(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = local_superlink_env(tmp_path, port=40001, control_port=40002)
    assert env[PORT_ENV] == "40001" and env["FLWR_LOCAL_CONTROL_API_PORT"] == "40002"
    assert env["RAY_ADDRESS"] == "local" and env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    free = local_superlink_env(tmp_path)
    assert free[PORT_ENV] != free["FLWR_LOCAL_CONTROL_API_PORT"]
    assert not {free[PORT_ENV], free["FLWR_LOCAL_CONTROL_API_PORT"]} & {"39091", "39092", "39093"}
    # A cluster named on purpose (docs/deployment.md, section 4) is kept.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert local_superlink_env(tmp_path)["RAY_ADDRESS"] == "10.0.0.1:6379"
    with pytest.raises(ValueError, match="port and control_port must differ, both are 40001"):
        local_superlink_env(tmp_path, port=40001, control_port=40001)


@pytest.mark.slow
def test_two_simulate_runs_and_a_plain_flwr_run_at_once_each_finish_as_their_own(tmp_path):
    conf = "num-rounds=2 local-steps=3 model='mlp' progress='off'"
    runs = {}
    plain_home = tmp_path / "plain-home"
    plain_home.mkdir()
    # The plain run as a user types it: Flower's default port, unless another Flower run on
    # this machine holds it now; then on a port of its own, the way docs/deployment.md
    # tells a user's own `flwr run` to (never on theirs).
    plain_env = (flower_env(plain_home) if _port_free(39091)
                 else local_superlink_env(plain_home))
    procs = {}
    try:
        for name in ("a", "b"):
            results = tmp_path / f"results-{name}"
            runs[name] = results
            procs[name] = subprocess.Popen(
                [flower_bin("fededge"), "simulate", "--num-supernodes", "2", "--timeout", "400",
                 "--run-config", f"{conf} results-dir='{results}' seed={ord(name)}"],
                cwd=ROOT, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
            time.sleep(2)
        plain_results = tmp_path / "results-plain"
        plain = subprocess.run(
            [flower_bin("flwr"), "run", str(ROOT), "--stream", "--federation-config",
             "num-supernodes=2 client-resources-num-cpus=1",
             "--run-config", f"{conf} results-dir='{plain_results}'"],
            env=plain_env, cwd=tmp_path, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
        listed = list_runs(None, env=plain_env)
        info = latest_run(listed) or {}
        rcs = {name: p.wait(timeout=400) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        stop_processes_of(str(plain_home))
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in runs}
    for name, results in runs.items():
        assert rcs[name] == 0, logs[name][-4000:]
        assert "run status finished:completed" in logs[name]
        (run_dir,) = list(results.iterdir())  # its own results, one run
        assert json.loads((run_dir / "config.json").read_text())["config"]["seed"] == ord(name)
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    # The plain run ran on its own SuperLink: only its run is listed there, completed.
    assert info.get("status") == "finished:completed", (info, plain.stdout[-3000:], plain.stderr[-2000:])
    assert len(listed) == 1, listed
    (plain_dir,) = list(plain_results.iterdir())
    assert json.loads((plain_dir / "summary.json").read_text())["status"] == "completed"
    # Nothing is left: no process of any of the three runs.
    assert processes_of(str(tmp_path)) == []
    homes = {name: re.search(r"local SuperLink on 127\.0\.0\.1:(\d+) \(FLWR_HOME (\S+)\)", log)
             for name, log in logs.items()}
    assert all(homes.values()), logs
    assert homes["a"].group(1) != homes["b"].group(1)  # two SuperLinks, two ports
    for m in homes.values():
        assert processes_of(m.group(2)) == [] and not Path(m.group(2)).exists()
