"""End to end on loopback: ``LocalDeployment(secure=True)``, TLS with certificates from
``fededge.deploy.certs`` and SuperNode authentication, as docs/deployment.md describes it.

The deployment starts a SuperLink with ``--ssl-* --enable-supernode-auth``, registers its
SuperNode's public key with ``flwr supernode register`` and starts it with
``--root-certificates`` and its private key; ``flwr run`` goes over a connection with
``root-certificates`` (not ``insecure``) in a private ``FLWR_HOME``. The test adds a
second SuperNode whose key was never registered. The registered node trains one round;
the unregistered one is refused (its log, the SuperLink's log, its exit code, the node
list and the round's participants all say so). Every process has the deployment's
``FLWR_HOME`` on its command line (``--database``, the ``deploy-home`` node-config key),
so leaving the ``with`` block stops them and their children, also when an assertion
fails; the test then checks that none is left. About 40 s on 2 cores, most of it
Flower's 3-second polls and the ``flwr-serverapp``/``flwr-clientapp`` process starts.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from fededge.deploy.certs import generate_certs
from fededge.deploy.local import HOST, LocalDeployment
from fededge.deploy.procs import processes_of, stop_processes_of, supernode_command

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

pytestmark = pytest.mark.slow

APP_DIR = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}"
    except OSError as err:
        return f"--- {path.name}: {err}"


def test_tls_deployment_with_supernode_auth_rejects_an_unregistered_node(tmp_path):
    t_start = time.perf_counter()
    # A key pair the SuperLink never hears of (from another, throwaway bundle).
    (intruder_key, _), = generate_certs(tmp_path / "intruder", hosts=HOST, supernodes=1, days=1).supernode_keys
    results = tmp_path / "results"
    intruder_log_path = tmp_path / "supernode-intruder.log"
    intruder_port = _free_port()
    # The SuperNode starts its SuperExec (`--runtime-api-address 127.0.0.1:PORT`) before it
    # asks to be activated; refused, it exits and leaves that child to notice on its own
    # (it did, some 30 s later): stop it here.
    intruder_exec = f"{HOST}:{intruder_port} "
    dep = LocalDeployment(APP_DIR, num_supernodes=1, secure=True, workdir=tmp_path / "dep", warm=False)
    home = str(dep.home)
    try:
        _run_checks(dep, intruder_key, intruder_port, intruder_log_path, results)
    finally:
        intruder_left = stop_processes_of(intruder_exec, grace_s=5)

    # Teardown: nothing with the deployment's FLWR_HOME on its command line is left.
    assert dep.survivors == [] and processes_of(home) == [], \
        f"processes left behind: {dep.survivors} {processes_of(home)} (logs in {dep.log_dir})"
    assert intruder_left == [] and processes_of(intruder_exec) == []
    assert all(p.poll() is not None for p in dep._procs.values())

    (metrics,) = list(results.glob("*/metrics.jsonl"))
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["round"] == 1 and last["num_clients"] == 1 and last["failures"] == 0
    assert [c["partition"] for c in last["clients"]] == [0]  # only the registered node trained
    print(f"TLS deployment test: {time.perf_counter() - t_start:.1f} s")


def _run_checks(dep: LocalDeployment, intruder_key: Path, intruder_port: int, intruder_log_path: Path,
                results: Path) -> None:
    intruder: subprocess.Popen[bytes] | None = None
    with dep, open(intruder_log_path, "wb") as intruder_log:
        certs = dep.certs
        assert certs is not None and len(dep.node_ids) == 1

        def tails() -> str:
            return dep.log_tails() + "\n" + _tail(intruder_log_path)

        # The SuperLink speaks TLS with our server certificate (hostname 127.0.0.1 checked).
        host, port = dep.superlink_address.rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            assert tls.version() is not None
        # ... and a client that does not trust our CA is refused.
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(raw, server_hostname=HOST)
        # flwr's connection: TLS with the root certificate, not insecure.
        conn = tomllib.loads((dep.home / "config.toml").read_text())["superlink"][dep.connection]
        assert conn == {"address": dep.superlink_address, "root-certificates": str(certs.ca_cert)}
        superlink_argv = dep.log_path("superlink").read_text().splitlines()[0]  # "$ COMMAND"
        assert "--enable-supernode-auth" in superlink_argv and "--insecure" not in superlink_argv

        # The intruder: the deployment's CA (it trusts the SuperLink), an unregistered key,
        # the deployment's FLWR_HOME on its command line (so that stop() finds it too). It
        # is refused while the run goes on.
        intruder = subprocess.Popen(
            supernode_command(superlink=dep.superlink_address, partition_id=1, num_partitions=2,
                              home=dep.home, runtime_port=intruder_port, root_certificates=certs.ca_cert,
                              auth_key=intruder_key),
            env=dep.env, stdout=intruder_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=dep.workdir)

        run = dep.run({"num-rounds": 1, "local-steps": 2, "min-available-nodes": 1, "progress": "off",
                       "results-dir": str(results), "fraction-evaluate": 0.0}, timeout_s=300)
        assert run.returncode == 0, run.describe()
        runs = dep.list_runs()
        assert len(runs) == 1 and runs[0]["status"] == "finished:completed", f"{runs}\n{run.describe()}"
        assert run.ok

        try:
            intruder_rc = intruder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            intruder_rc = None
        assert intruder_rc not in (None, 0), f"the unregistered SuperNode was not refused\n{tails()}"
        assert "Failed to activate SuperNode" in intruder_log_path.read_text(errors="replace"), tails()
        assert "No SuperNode found with the given public key" in dep.log_path("superlink").read_text(
            errors="replace"), tails()

        nodes = dep.list_nodes()
        assert [int(n["node-id"]) for n in nodes] == dep.node_ids, nodes  # the intruder never got a node id
        assert nodes[0]["status"] == "online"
    assert intruder is not None and intruder.poll() is not None
