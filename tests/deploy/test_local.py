"""LocalDeployment: a real SuperLink and SuperNodes on loopback, and a clean teardown.

The slow tests start Flower's deployment runtime (each message runs in a fresh
``flwr-clientapp`` process; an idle SuperNode polls every 3 s): tens of seconds each.
"""

import json
import threading
import time
from pathlib import Path

import pytest

from fededge.deploy.certs import generate_certs
from fededge.netem.profiles import Direction, LinkProfile
from fededge.deploy.local import LocalDeployment, write_app_variant
from fededge.deploy.procs import (
    processes_of,
    superlink_command,
    supernode_command,
    write_connection,
    write_insecure_connection,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _metrics(results: Path) -> list[dict]:
    (run_dir,) = list(results.iterdir())
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ without processes


def test_arguments_are_validated_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="num_supernodes must be an integer >= 1"):
        LocalDeployment(ROOT, num_supernodes=0, workdir=tmp_path)
    with pytest.raises(ValueError, match="no pyproject.toml"):
        LocalDeployment(tmp_path, num_supernodes=1, workdir=tmp_path)
    with pytest.raises(ValueError, match="2 profiles given for 3 SuperNodes"):
        LocalDeployment(ROOT, num_supernodes=3, profile=["4g", "wifi"], workdir=tmp_path)
    with pytest.raises(ValueError, match="unknown link profile 'nope'"):
        LocalDeployment(ROOT, num_supernodes=1, profile="nope", workdir=tmp_path)
    with pytest.raises(ValueError, match="must not set partition-id"):
        LocalDeployment(ROOT, num_supernodes=1, node_config={"partition-id": 3}, workdir=tmp_path)
    prof = LinkProfile(name="t", up=Direction(delay_s=0.01), down=Direction(), source="test")
    dep = LocalDeployment(ROOT, num_supernodes=2, profile=[prof, "4g"], workdir=tmp_path)
    assert [p.name for p in dep.profiles] == ["t", "4g"]
    with pytest.raises(RuntimeError, match="needs a started deployment"):
        dep.run({})
    assert dep.stop() == [] and dep.stop() == []  # idempotent, also when never started
    with pytest.raises(TypeError, match="secure must be True or False"):
        LocalDeployment(ROOT, num_supernodes=1, secure="yes", workdir=tmp_path)  # type: ignore[arg-type]


def test_secure_command_lines_and_connection_file(tmp_path):
    """secure=True's pieces: TLS flags instead of --insecure, node auth only with TLS,
    and a connection that trusts the CA instead of being insecure."""
    certs = generate_certs(tmp_path / "certs", hosts="127.0.0.1", supernodes=1, days=1)
    (key, _), = certs.supernode_keys

    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    link = superlink_command(host="127.0.0.1", port=9092, home=tmp_path, certs=certs, supernode_auth=True)
    assert "--insecure" not in link and "--enable-supernode-auth" in link
    assert (flag(link, "--ssl-ca-certfile"), flag(link, "--ssl-certfile"), flag(link, "--ssl-keyfile")) == \
        (str(certs.ca_cert), str(certs.server_cert), str(certs.server_key))
    tls_only = superlink_command(host="127.0.0.1", port=9092, home=tmp_path, certs=certs)
    assert "--enable-supernode-auth" not in tls_only and "--insecure" not in tls_only
    assert "--insecure" in superlink_command(host="127.0.0.1", port=9092, home=tmp_path)
    with pytest.raises(ValueError, match="supernode_auth needs TLS"):
        superlink_command(host="127.0.0.1", port=9092, home=tmp_path, supernode_auth=True)

    common = {"superlink": "127.0.0.1:9092", "partition_id": 0, "num_partitions": 1, "home": tmp_path,
              "runtime_port": 9094}
    node = supernode_command(**common, root_certificates=certs.ca_cert, auth_key=key)
    assert "--insecure" not in node
    assert (flag(node, "--root-certificates"), flag(node, "--auth-supernode-private-key")) == (str(certs.ca_cert), str(key))
    assert "--insecure" in supernode_command(**common)
    with pytest.raises(ValueError, match="auth_key needs TLS"):
        supernode_command(**common, auth_key=key)

    conf = tomllib.loads(write_connection(tmp_path, "c", "127.0.0.1:9092", root_certificates=certs.ca_cert).read_text())
    assert conf["superlink"] == {"default": "c", "c": {"address": "127.0.0.1:9092",
                                                       "root-certificates": str(certs.ca_cert)}}
    conf = tomllib.loads(write_insecure_connection(tmp_path, "c", "127.0.0.1:9092").read_text())
    assert conf["superlink"]["c"] == {"address": "127.0.0.1:9092", "insecure": True}


# ------------------------------------------------------------------ a real SuperLink


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True], ids=["pushed", "computed-ahead"])
def test_dga_pipelines_rounds_on_a_real_superlink(tmp_path, ahead):
    """DGA with D=1 pushes round t+1 before round t's replies are in: each SuperNode
    runs its messages in order, so the strategy picks the pipelined loop. With
    dga-compute-ahead, each node's warm worker computes rounds 2 and 3 from the previews
    it got, as soon as it has replied, and uses them when their messages come."""
    results = tmp_path / "results"
    # Warm nodes (fededge supernode): the strategy's behaviour is the point here, not the
    # per-message process start (the cold path has its own tests below).
    with LocalDeployment(ROOT, num_supernodes=2, workdir=tmp_path / "dep", warm=True,
                         env={"FEDEDGE_CACHE_DIR": str(tmp_path / "cache")}) as dep:
        # No checkpoints: one is a stop for the pipeline (nothing of a later round is out
        # when it is written), and the first comes after round 1 (tests/server/test_resume).
        run = dep.run({"strategy": "dga", "dga-delay": 1, "num-rounds": 3, "local-steps": 2,
                       "dga-compute-ahead": ahead, "results-dir": str(results), "progress": "lines",
                       "checkpoint-every": 0}, timeout_s=400)
        logs = dep.log_tails(chars=200_000)
    assert processes_of(str(dep.home)) == []
    assert logs.count("the reply computed ahead") == (4 if ahead else 0), logs
    assert run.ok, run.describe()
    lines = _metrics(results)
    assert [r["round"] for r in lines] == [0, 1, 2, 3], run.describe()
    assert all(r["pipelined"] is True and r["num_clients"] == 2 for r in lines[1:]), lines
    # Rounds of a client's own updates in flight: none in round 1, then D = 1.
    assert [r["staleness"] for r in lines[1:]] == [0, 1, 1], lines
    # Round t starts from G(t - 1 - D): rounds 1 and 2 from the initial model.
    assert [r["dga_global_round"] for r in lines[1:]] == [0, 0, 1], lines
    assert all(r["bytes_up"] > 0 for r in lines[1:])
    (summary,) = results.rglob("summary.json")
    assert json.loads(summary.read_text())["status"] == "completed"


@pytest.mark.slow
def test_teardown_leaves_nothing_behind_after_a_failed_run_and_an_interrupt(tmp_path):
    """A run that fails (bad run config) leaves the deployment up; an interrupt in the
    with block then stops the SuperLink, the SuperNode and all their children."""
    dep = LocalDeployment(ROOT, num_supernodes=1, workdir=tmp_path / "dep", warm=False)
    home = str(dep.home)
    with pytest.raises(KeyboardInterrupt), dep:
        alive = processes_of(home)
        assert len(alive) >= 2, alive  # the SuperLink and the SuperNode carry the marker
        run = dep.run({"local-lr": -1.0, "results-dir": str(tmp_path / "results")}, timeout_s=300)
        # flwr run exits 0 regardless; the run's status tells the truth.
        assert run.status is not None and run.status != "finished:completed", run.describe()
        assert not run.ok
        assert "'local-lr' must be > 0" in run.output, run.describe()
        assert processes_of(home), "a failed run must not stop the deployment"
        raise KeyboardInterrupt
    assert processes_of(home) == []
    assert all(p.poll() is not None for p in dep._procs.values())
    assert dep.stop() == []  # idempotent
    with pytest.raises(RuntimeError, match="needs a started deployment"):
        dep.run({})



@pytest.mark.slow
def test_fedasync_uses_replies_in_real_arrival_order_on_a_real_superlink(tmp_path):
    """FedAsync on a SuperLink: node 1 uploads through a 50 kbit/s proxy (about 60 s for
    the model), node 0 does not. The fast node's update makes a version while the slow
    one's is still on the wire; the slow update then lands stale. Real asynchrony: the
    order is the order replies reach the SuperLink. (Before replies were pulled one by
    one, Flower's pull of both at once waited for the slow upload, and the fast node's
    second update landed 1 s after the slow one's instead of long before.)"""
    slow = LinkProfile(name="slow-up", up=Direction(rate_bps=50_000), down=Direction(), source="test")
    fast = LinkProfile(name="loopback", up=Direction(), down=Direction(), source="test")
    results = tmp_path / "results"
    with LocalDeployment(ROOT, num_supernodes=2, profile=[fast, slow], workdir=tmp_path / "dep", warm=True,
                         env={"FEDEDGE_CACHE_DIR": str(tmp_path / "cache")}) as dep:
        # No checkpoints: under arrival order a checkpoint waits for every reply still out
        # (the slow upload), and the first comes after version 1 (strategies.asyncloop).
        run = dep.run({"strategy": "fedasync", "num-rounds": 3, "local-steps": 2, "partition": "iid",
                       "results-dir": str(results), "progress": "lines", "checkpoint-every": 0},
                      timeout_s=400)
    assert processes_of(str(dep.home)) == []
    assert run.ok, run.describe()
    lines = _metrics(results)
    assert [r["round"] for r in lines] == [0, 1, 2, 3], run.describe()
    assert all(r["async_order"] == "arrival" and r["num_clients"] == 1 for r in lines[1:]), lines
    who = [r["contributors"][0] for r in lines[1:]]
    # Both nodes got version 0 at once. The fast one's update makes version 1 and, while
    # the slow upload is still on the wire, its next one makes version 2: replies are
    # pulled one by one (strategies.asyncloop.Puller), so the slow upload holds up nothing.
    assert who[:2] == [0, 0], lines
    assert all(r["staleness_max"] >= 1 for r in lines[1:] if r["contributors"] == [1]), lines
    (summary,) = results.rglob("summary.json")
    assert json.loads(summary.read_text())["status"] == "completed"


# ------------------------------------------------------------------ warm mode (issue 17)


def _final_model(results: Path) -> dict:
    import torch

    (path,) = list(results.glob("*/model.pt"))
    return torch.load(path, map_location="cpu", weights_only=True)


def _warm_run(tmp_path: Path, name: str, *, warm: bool, rounds: int = 3, during=None):
    app = write_app_variant(ROOT, tmp_path / "shim-app")
    results = tmp_path / f"results-{name}"
    cfg = {"num-rounds": rounds, "local-steps": 2, "seed": 5, "fraction-evaluate": 0.0, "progress": "off",
           "results-dir": str(results), "save-model": True}
    env = {"FEDEDGE_CACHE_DIR": str(tmp_path / f"cache-{name}")}
    with LocalDeployment(app, num_supernodes=2, workdir=tmp_path / f"dep-{name}", env=env, warm=warm) as dep:
        extra = during(dep, results) if during is not None else None
        run = dep.run(cfg, timeout_s=600)
        assert run.ok, run.describe()
        if extra is not None:
            extra.join(timeout=60)
        logs = dep.log_tails(20000)
    assert dep.survivors == [] and processes_of(str(dep.home)) == []
    return results, logs


def _worker_pids(home: Path) -> list[int]:
    from fededge.deploy.procs import cmdline

    return [p for p in processes_of(str(home)) if "fededge.clients.worker" in cmdline(p)]


@pytest.mark.slow
def test_warm_deployment_trains_the_same_model_as_cold_bit_for_bit(tmp_path):
    """The shim app on two SuperNodes: cold (no worker: every message in its own process)
    and warm (fededge supernode): the same final model, bit for bit, for the same seed."""
    import torch

    cold, cold_logs = _warm_run(tmp_path, "cold", warm=False, rounds=2)
    warm, warm_logs = _warm_run(tmp_path, "warm", warm=True, rounds=2)
    assert "running cold" in cold_logs and "warm worker pid" in warm_logs
    a, b = _final_model(cold), _final_model(warm)
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert [len(m["clients"]) for m in _metrics(warm)][-1] == 2


@pytest.mark.slow
def test_killing_the_worker_mid_run_is_survived_and_leaves_nothing(tmp_path):
    """SIGKILL to a node's warm worker after round 1: fededge supernode starts it again
    (messages run cold until it is back), the run finishes every round, and the stop
    leaves no process and no socket directory behind."""
    import os
    import signal
    import threading
    import time

    from fededge.deploy.procs import cmdline

    killed: dict = {}

    def during(dep, results):
        def kill_after_round_1():
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                if list(results.glob("*/metrics.jsonl")) and _metrics(results):
                    pids = _worker_pids(dep.home)
                    if pids:
                        killed["socket"] = [cmdline(p).split()[-1] for p in pids]
                        os.kill(pids[0], signal.SIGKILL)
                        killed["pid"] = pids[0]
                    return
                time.sleep(0.2)

        t = threading.Thread(target=kill_after_round_1, daemon=True)
        t.start()
        return t

    results, logs = _warm_run(tmp_path, "kill", warm=True, rounds=3, during=during)
    assert "pid" in killed, "the worker was never found to kill"
    assert "the warm worker exited" in logs and "restarting it in 1 s (restart 1 of" in logs, logs
    rounds = _metrics(results)
    assert [m["round"] for m in rounds][-1] == 3
    for sock in killed["socket"]:  # fededge supernode made these directories; it removed them
        assert Path(sock).parent.name.startswith("fededge-worker-") and not Path(sock).parent.exists()


@pytest.mark.slow
def test_a_killed_superlink_and_serverapp_resume_and_the_clients_resync(tmp_path):
    """Issue 18 on a real deployment: the SuperLink and its ServerApp are SIGKILLed after
    round 2's checkpoint; a SuperLink started again on the same port and database takes
    the SuperNodes back, ``resume-from`` finishes the run in the same run directory, and
    each node takes up the state it kept on its disk at the checkpoint (a new Flower run
    gives it an empty context.state), then goes on writing its own."""
    results, state = tmp_path / "results", tmp_path / "state"
    conf = {"num-rounds": 4, "local-steps": 2, "model": "mlp", "results-dir": str(results), "checkpoint-every": 2,
            "compressor": "topk", "error-feedback": True, "progress": "lines"}
    env = {"FEDEDGE_CACHE_DIR": str(tmp_path / "cache"), "FEDEDGE_STATE_DIR": str(state)}
    with LocalDeployment(ROOT, num_supernodes=2, workdir=tmp_path / "dep", warm=True, env=env) as dep:
        box: dict = {}
        first = threading.Thread(target=lambda: box.update(run=dep.run(conf, timeout_s=400)))
        first.start()
        deadline = time.monotonic() + 300
        while not list(results.glob("*/checkpoints/round-000002.ckpt")):
            assert first.is_alive() and time.monotonic() < deadline, box.get("run") and box["run"].describe()
            time.sleep(0.1)
        assert dep.kill_superlink()
        first.join(120)
        assert not first.is_alive() and not box["run"].ok
        (run_dir,) = list(results.iterdir())
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"  # it never finished
        dep.restart_superlink()
        again = dep.run({**conf, "resume-from": str(run_dir)}, timeout_s=400)
    assert processes_of(str(dep.home)) == []
    assert again.ok, again.describe()
    assert "resumed after round 2" in again.output
    lines = _metrics(results)
    assert [r["round"] for r in lines] == [0, 1, 2, 3, 4] and all(r["num_clients"] == 2 for r in lines[1:])
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    for part in ("partition-0", "partition-1"):
        files = sorted((state / run_dir.name / part).glob("*.state"))
        rounds = [int(p.name[6:12]) for p in files]
        attempts = [p.name.split(".")[1] for p in files]
        # The state of the checkpoint's round, kept from the killed attempt and taken up;
        # rounds 3 and 4 written by the resumed one (a killed attempt's round 3 is dropped).
        assert rounds == [2, 3, 4] and attempts[0] != attempts[1] == attempts[2], files


def test_ctrl_c_during_a_submitted_run_stops_it_on_the_superlink(tmp_path, monkeypatch):
    """Only the `flwr run` client was killed: the run went on on the SuperLink, beside
    (and interleaved with) the next one."""
    from fededge.deploy import procs

    log = tmp_path / "flwr-run.log"

    def interrupted(cmd, *, log_path, **kw):  # noqa: ANN001, ANN003, ANN202
        log_path.write_text("Loading project ...\nSuccessfully started run 4242\n")
        raise KeyboardInterrupt

    stops = []
    monkeypatch.setattr(procs, "stream", interrupted)
    monkeypatch.setattr(procs, "flwr_cli", lambda args, **kw: stops.append(list(args)))
    with pytest.raises(KeyboardInterrupt):
        procs.submit_run(tmp_path, "local", env={}, cwd=tmp_path, log_path=log)
    assert stops == [["stop", "4242", "local"]]
