"""fededge.deploy.certs and ``fededge certs``: the chain verifies (signature, SANs, by
cryptography's own path validation and by a real TLS handshake), private keys are 0600
from creation, nothing is overwritten without --force, and the SuperNode keys are the
OpenSSH EC keys Flower loads."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fededge.cli import main
from fededge.deploy.certs import (
    CertError,
    CertOverwriteError,
    generate_certs,
    parse_hosts,
)

HOST = "127.0.0.1"
HOSTS = "superlink,127.0.0.1,localhost,::1"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return generate_certs(tmp_path_factory.mktemp("certs") / "out", hosts=HOSTS, supernodes=2, days=30)


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_cert_is_signed_by_the_ca_and_carries_every_host(bundle):
    ca, server = _load(bundle.ca_cert), _load(bundle.server_cert)
    server.verify_directly_issued_by(ca)  # raises on a bad signature or issuer
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                        ipaddress.ip_address("::1")]
    # A different CA did not sign it.
    other = generate_certs(bundle.out_dir.parent / "other", hosts="superlink")
    with pytest.raises((ValueError, InvalidSignature)):
        server.verify_directly_issued_by(_load(other.ca_cert))


@pytest.mark.parametrize("name", [x509.DNSName("superlink"), x509.DNSName("localhost"),
                                  x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                  x509.IPAddress(ipaddress.ip_address("::1"))])
def test_path_validation_accepts_every_san(bundle, name):
    verifier = PolicyBuilder().store(Store([_load(bundle.ca_cert)])).build_server_verifier(name)
    chain = verifier.verify(_load(bundle.server_cert), [])
    assert chain[-1] == _load(bundle.ca_cert)


@pytest.mark.parametrize("name", [x509.DNSName("evil.example"),
                                  x509.IPAddress(ipaddress.ip_address("10.0.0.1"))])
def test_path_validation_rejects_other_names(bundle, name):
    verifier = PolicyBuilder().store(Store([_load(bundle.ca_cert)])).build_server_verifier(name)
    with pytest.raises(VerificationError):
        verifier.verify(_load(bundle.server_cert), [])


def test_private_keys_are_0600_and_public_files_0644_whatever_the_umask(tmp_path):
    old = os.umask(0)  # a permissive umask must not widen the private keys
    try:
        b = generate_certs(tmp_path / "c", hosts="superlink", supernodes=2)
    finally:
        os.umask(old)
    assert len(b.private_keys) == 4
    for path in b.files:
        assert path.is_file()
        assert _mode(path) == (0o600 if path in b.private_keys else 0o644), path


def test_manifest_lists_every_file(bundle):
    m = json.loads(bundle.manifest.read_text())
    named = {m["ca"]["cert"], m["ca"]["key"], m["server"]["cert"], m["server"]["key"]}
    named |= {n[k] for n in m["supernodes"] for k in ("private-key", "public-key")}
    assert {bundle.out_dir / n for n in named} | {bundle.manifest} == set(bundle.files)
    assert m["hosts"] == ["superlink", "127.0.0.1", "localhost", "::1"]
    der = _load(bundle.ca_cert).public_bytes(serialization.Encoding.DER)
    assert m["ca"]["sha256"] == __import__("hashlib").sha256(der).hexdigest()


def test_supernode_keys_are_openssh_ec_p256_pairs_that_match(bundle):
    assert len(bundle.supernode_keys) == 2
    seen = set()
    for priv_path, pub_path in bundle.supernode_keys:
        priv_bytes, pub_bytes = priv_path.read_bytes(), pub_path.read_bytes()
        assert priv_bytes.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
        assert pub_bytes.startswith(b"ecdsa-sha2-nistp256 ") and pub_bytes.count(b"\n") == 1
        priv = serialization.load_ssh_private_key(priv_bytes, password=None)
        pub = serialization.load_ssh_public_key(pub_bytes)
        assert isinstance(priv, ec.EllipticCurvePrivateKey) and isinstance(pub, ec.EllipticCurvePublicKey)
        assert priv.curve.name == pub.curve.name == "secp256r1"
        assert priv.public_key().public_numbers() == pub.public_numbers()
        sig = priv.sign(b"node", ec.ECDSA(hashes.SHA256()))
        pub.verify(sig, b"node", ec.ECDSA(hashes.SHA256()))  # raises if the pair does not match
        seen.add(pub.public_numbers())
    assert len(seen) == 2  # each node its own key


def test_refuses_to_overwrite_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "c"
    out.mkdir()
    (out / "supernode-1.pub").write_text("mine\n")
    with pytest.raises(CertOverwriteError, match="supernode-1.pub: it exists"):
        generate_certs(out, hosts="superlink", supernodes=2)
    assert sorted(p.name for p in out.iterdir()) == ["supernode-1.pub"]  # checked before writing
    assert main(["certs", "--out", str(out), "--hosts", "superlink", "--supernodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "supernode-1.pub" in err and "--force" in err
    assert (out / "supernode-1.pub").read_text() == "mine\n"


def test_a_second_run_without_force_is_refused(tmp_path):
    generate_certs(tmp_path / "c", hosts="superlink")
    with pytest.raises(CertOverwriteError, match="ca.crt, .*ca.key, .*manifest.json: they exist"):
        generate_certs(tmp_path / "c", hosts="superlink")


def test_force_replaces_everything_and_narrows_an_old_wide_key(tmp_path, capsys):
    out = tmp_path / "c"
    first = generate_certs(out, hosts="superlink", supernodes=1)
    old_ca, old_pub = first.ca_cert.read_bytes(), first.supernode_keys[0][1].read_bytes()
    os.chmod(first.server_key, 0o644)  # as if someone had widened it
    assert main(["certs", "--out", str(out), "--hosts", "superlink,10.1.2.3", "--supernodes", "1",
                 "--force"]) == 0
    assert "0600" in capsys.readouterr().out
    assert first.ca_cert.read_bytes() != old_ca
    assert first.supernode_keys[0][1].read_bytes() != old_pub
    assert _mode(first.server_key) == 0o600
    san = _load(first.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # 127.0.0.1 and localhost always: the SuperLink's own SuperExec dials it there over TLS
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3"),
                                                        ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["superlink", "localhost"]
    _load(first.server_cert).verify_directly_issued_by(_load(first.ca_cert))


def test_force_does_not_follow_a_symlink(tmp_path):
    out, victim = tmp_path / "c", tmp_path / "victim"
    out.mkdir()
    victim.write_text("keep")
    (out / "ca.key").symlink_to(victim)
    generate_certs(out, hosts="superlink", force=True)
    assert victim.read_text() == "keep"
    assert not (out / "ca.key").is_symlink() and _mode(out / "ca.key") == 0o600


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hosts": " , "}, "at least one"),
    ({"hosts": ""}, "at least one"),
    ({"hosts": []}, "at least one"),
    ({"hosts": "superlink:9092"}, "without a port"),
    ({"hosts": "https://superlink"}, "without a port or scheme"),
    ({"hosts": "my_superlink"}, "underscores"),
    ({"hosts": "bad..name"}, "not a valid DNS name"),
    ({"hosts": "superlink", "supernodes": -1}, "supernodes must be an integer >= 0, got -1"),
    ({"hosts": "superlink", "days": 0}, "days must be"),
])
def test_bad_input_is_named(tmp_path, kwargs, match):
    with pytest.raises(CertError, match=match):
        generate_certs(tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()


def test_out_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CertError, match="not a directory"):
        generate_certs(f, hosts="superlink")
    assert main(["certs", "--out", str(f), "--hosts", "superlink"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "c"), "--hosts", ",", "--supernodes", "1"]) == 2
    assert "at least one" in capsys.readouterr().err
    assert main(["certs", "--out", str(tmp_path / "c"), "--hosts", "a", "--supernodes", "-2"]) == 2
    assert ">= 0, got -2" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_parse_hosts_tells_ips_from_names():
    got = parse_hosts(["SuperLink.", "[::1]", "127.0.0.1", "superlink", "*.lab.example"])
    assert got == ["superlink", ipaddress.ip_address("::1"), ipaddress.ip_address("127.0.0.1"),
                   "*.lab.example"]


# ------------------------------------------------------------------- TLS over loopback
def _tls_server(bundle, attempts: int):
    """Serve ``attempts`` TLS connections on 127.0.0.1:0, echoing one message each.

    Returns (port, thread, errors): handshake errors seen by the server side."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(bundle.server_cert, bundle.server_key)
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(4)
    lsock.settimeout(10)
    errors: list[str] = []

    def serve() -> None:
        with lsock:
            for _ in range(attempts):
                try:
                    conn, _ = lsock.accept()
                except OSError as err:
                    errors.append(f"accept: {err}")
                    return
                conn.settimeout(10)
                try:
                    with ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(tls.recv(64))
                except (ssl.SSLError, OSError) as err:
                    errors.append(type(err).__name__)
                    conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], t, errors


def _dial(port: int, ctx: ssl.SSLContext, server_hostname: str) -> bytes:
    with socket.create_connection((HOST, port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
        tls.sendall(b"ping")
        return tls.recv(64)


def test_tls_handshake_trusting_only_the_ca(bundle):
    port, thread, errors = _tls_server(bundle, attempts=3)
    trusting = ssl.create_default_context(cafile=str(bundle.ca_cert))  # only our CA, hostname checked
    assert trusting.check_hostname and trusting.verify_mode == ssl.CERT_REQUIRED
    assert _dial(port, trusting, HOST) == b"ping"

    untrusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, trusts nothing of ours
    other = generate_certs(bundle.out_dir.parent / "other-ca", hosts=HOST)
    untrusting.load_verify_locations(cafile=str(other.ca_cert))
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer|self.signed|verify failed"):
        _dial(port, untrusting, HOST)

    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch|match"):
        _dial(port, trusting, "evil.example")  # trusted CA, name not in the SANs
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 2  # the server saw both refusals


def test_certs_module_does_not_import_flower():
    code = ("import sys, fededge.deploy.certs\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_new_certs_directory_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        bundle = generate_certs(tmp_path / "new", hosts="superlink")
    finally:
        os.umask(old)
    assert _mode(bundle.out_dir) == 0o700
