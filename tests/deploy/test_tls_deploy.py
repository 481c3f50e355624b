"""End to end on loopback: TLS with certificates from ``fededge.deploy.certs`` and SuperNode
authentication, as docs/deployment.md describes it.

A SuperLink with ``--ssl-* --enable-supernode-auth``; one SuperNode whose public key is
registered with ``flwr supernode register`` and one whose key is not; ``flwr run`` over a
connection with ``root-certificates`` (not ``insecure``) in a private ``FLWR_HOME``. The
registered node trains one round; the unregistered one is refused (its log, the
SuperLink's log, its exit code, the node list and the round's participants all say so).
Every process has the temporary directory on its command line (certificate paths,
``--database``, a ``deploy-home`` node-config key, ``results-dir``), and
``stop_processes_of`` stops them and their children in ``finally``. About 55-70 s on 2
cores, most of it Flower's 3-second polls and the ``flwr-serverapp``/``flwr-clientapp``
process starts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fededge.deploy.certs import generate_certs
from fededge.server.launch import format_run_config, processes_of, stop_processes_of

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
CONNECTION = "fededge-tls"
APP_DIR = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _bin(name: str) -> str:
    exe = BIN / name
    return str(exe) if exe.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}"
    except OSError as err:
        return f"--- {path.name}: {err}"


def test_tls_deployment_with_supernode_auth_rejects_an_unregistered_node():
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="fededge-tls-deploy-")).resolve()
    marker = str(root)
    certs = generate_certs(root / "certs", hosts=f"{HOST},localhost", supernodes=2, days=1)
    home, logs = root / "flwr-home", root / "logs"
    home.mkdir()
    logs.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{HOST}:{port}"\n'
        f'root-certificates = "{certs.ca_cert}"\n')
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1",
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
    })
    procs: dict[str, subprocess.Popen[bytes]] = {}
    files = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - closed in finally
        files.append(log)
        procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=root)
        return procs[name]

    def flwr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_bin("flwr"), *args], check=False, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd=root)

    def tails() -> str:
        return "\n".join(_tail(p) for p in sorted(logs.iterdir()))

    def supernode(i: int) -> subprocess.Popen[bytes]:
        priv, _ = certs.supernode_keys[i]
        node_config = {"partition-id": i, "num-partitions": 2, "deploy-home": marker}
        return spawn(f"supernode-{i}", [
            _bin("flower-supernode"), "--superlink", f"{HOST}:{port}",
            "--root-certificates", str(certs.ca_cert), "--auth-supernode-private-key", str(priv),
            "--node-config", format_run_config(node_config), "--host", HOST, "--port", str(_free_port())])

    try:
        link = spawn("superlink", [
            _bin("flower-superlink"), "--ssl-ca-certfile", str(certs.ca_cert),
            "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
            "--enable-supernode-auth", "--host", HOST, "--port", str(port),
            "--database", str(home / "state.db"), "--disable-runtime-dependency-installation"])
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                assert link.poll() is None, f"SuperLink exited with {link.returncode}\n{tails()}"
                assert time.monotonic() < deadline, f"SuperLink never listened\n{tails()}"
                time.sleep(0.2)

        # The SuperLink speaks TLS with our server certificate (hostname 127.0.0.1 checked).
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        with socket.create_connection((HOST, port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            assert tls.version() is not None

        reg = flwr("supernode", "register", str(certs.supernode_keys[0][1]), CONNECTION, "--format", "json")
        assert reg.returncode == 0, f"{reg.stdout}\n{reg.stderr}\n{tails()}"
        node_id = str(json.loads(reg.stdout)["node-id"])

        supernode(0)
        intruder = supernode(1)  # its key was never registered
        try:
            intruder_rc = intruder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            intruder_rc = None
        assert intruder_rc not in (None, 0), f"the unregistered SuperNode was not refused\n{tails()}"
        assert "Failed to activate SuperNode" in (logs / "supernode-1.log").read_text(errors="replace"), tails()
        assert "No SuperNode found with the given public key" in (logs / "superlink.log").read_text(
            errors="replace"), tails()

        results = root / "results"
        run_cfg = {"num-rounds": 1, "local-steps": 2, "min-available-nodes": 1, "progress": "off",
                   "results-dir": str(results), "fraction-evaluate": 0.0}
        run = flwr("run", str(APP_DIR), CONNECTION, "--stream", "--run-config", format_run_config(run_cfg),
                   timeout=300)
        assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-2000:]}\n{tails()}"
        deadline = time.monotonic() + 20  # `--stream` may return a moment before the status is final
        while True:
            runs = json.loads(flwr("ls", CONNECTION, "--format", "json").stdout)["runs"]
            if (runs and runs[-1]["status"].startswith("finished")) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert len(runs) == 1 and runs[0]["status"] == "finished:completed", f"{runs}\n{run.stdout[-3000:]}"

        nodes = json.loads(flwr("supernode", "list", CONNECTION, "--format", "json").stdout)["nodes"]
        assert [n["node-id"] for n in nodes] == [node_id], nodes  # the intruder never got a node id
        assert nodes[0]["status"] == "online"
        (metrics,) = list(results.glob("*/metrics.jsonl"))
        last = json.loads(metrics.read_text().splitlines()[-1])
        assert last["round"] == 1 and last["num_clients"] == 1 and last["failures"] == 0
        assert [c["partition"] for c in last["clients"]] == [0]  # only the registered node trained
    finally:
        survivors = stop_processes_of(marker, grace_s=5)
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for f in files:
            f.close()
        left = processes_of(marker)
        if not survivors and not left:
            shutil.rmtree(root, ignore_errors=True)
    assert survivors == [] and left == [], f"processes left behind: {survivors} {left} (logs in {root})"
    print(f"TLS deployment test: {time.perf_counter() - t_start:.1f} s")
