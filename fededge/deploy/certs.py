"""Certificates and SuperNode keys for a TLS deployment with node authentication.

:func:`generate_certs` writes, into one directory:

==================  =====  ==========================================================
file                mode   what
==================  =====  ==========================================================
``ca.crt``          0644   a self-signed CA (``CA:TRUE``, path length 0); give it to
                           every SuperNode (``--root-certificates``), to ``flwr``
                           (``root-certificates`` in ``config.toml``) and to the
                           SuperLink (``--ssl-ca-certfile``)
``ca.key``          0600   the CA's private key; keep it off the devices
``server.pem``      0644   the SuperLink's certificate, signed by the CA, with every
                           host as a subjectAltName (DNS names and IP addresses told
                           apart): ``--ssl-certfile``
``server.key``      0600   its private key: ``--ssl-keyfile``
``supernode-i.key`` 0600   SuperNode ``i``'s authentication key: EC P-256 in OpenSSH
                           format (``--auth-supernode-private-key``)
``supernode-i.pub`` 0644   its public key, one ``ecdsa-sha2-nistp256 ...`` line, for
                           ``flwr supernode register supernode-i.pub CONNECTION``
``manifest.json``   0644   the list of files, hosts, validity and CA fingerprint
==================  =====  ==========================================================

Private keys are created with mode 0600 by ``os.open`` (never written first and
narrowed after). Nothing is overwritten unless ``force=True``; then every file is
replaced (a new CA too: SuperNodes need the new ``ca.crt`` and their new keys must be
registered again). The checks run before any key is made, so a refusal writes nothing.

This module uses ``cryptography`` only, not Flower, so that it runs on a machine that
only prepares certificates. Example::

    from fededge.deploy.certs import generate_certs
    bundle = generate_certs("certs", hosts="superlink,127.0.0.1", supernodes=3)
    print(bundle.server_cert, bundle.supernode_keys[0])
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT", "CA_KEY", "MANIFEST", "SERVER_CERT", "SERVER_KEY", "CertBundle", "CertError",
    "CertOverwriteError", "generate_certs", "parse_hosts", "supernode_key_names",
]

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
MANIFEST = "manifest.json"
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644
MAX_DAYS = 3650
# One DNS label: letters, digits and inner hyphens, 1-63 characters (RFC 1123).
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


class CertError(ValueError):
    """Bad input to :func:`generate_certs` (hosts, counts, days, output directory)."""


class CertOverwriteError(CertError, FileExistsError):
    """A file :func:`generate_certs` would write exists and ``force`` was not given."""


def supernode_key_names(index: int) -> tuple[str, str]:
    """File names of SuperNode ``index``'s private and public key."""
    return f"supernode-{index}.key", f"supernode-{index}.pub"


def _parse_host(raw: str) -> str | ipaddress.IPv4Address | ipaddress.IPv6Address:
    host = raw.strip()
    if host.startswith("[") and host.endswith("]"):  # "[::1]" as in URLs
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if ":" in host or "/" in host:
        raise CertError(f"host {raw!r} is neither an IP address nor a DNS name: give names "
                        f"without a port or scheme (superlink, not superlink:9092)")
    name = host.rstrip(".").lower()
    labels = name.split(".")
    if labels and labels[0] == "*" and len(labels) > 2:  # a wildcard for one level
        labels = labels[1:]
    if not name or len(name) > 253 or not all(_LABEL.match(lab) for lab in labels):
        hint = " (underscores are not allowed in host names; use a hyphen)" if "_" in host else ""
        raise CertError(f"host {raw!r} is not a valid DNS name{hint}: letters, digits, hyphens "
                        f"and dots, each label 1-63 characters")
    return name


def parse_hosts(hosts: str | Sequence[str]) -> list[str | ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """``"superlink, 127.0.0.1"`` (or a list) -> DNS names (lower case) and IP addresses.

    Duplicates are dropped and the order is kept (the first host is the certificate's
    common name). Raises :class:`CertError` when no host is given or one is malformed.
    """
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    out: list[str | ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for raw in items:
        if not str(raw).strip():
            continue
        host = _parse_host(str(raw))
        if host not in out:
            out.append(host)
    if not out:
        raise CertError("hosts must name at least one DNS name or IP address the SuperLink is "
                        "reached by, e.g. --hosts superlink,127.0.0.1")
    return out


@dataclass(frozen=True)
class CertBundle:
    """Paths of the files :func:`generate_certs` wrote."""

    out_dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    supernode_keys: tuple[tuple[Path, Path], ...]  # (private, public) per SuperNode
    manifest: Path
    hosts: tuple[str, ...]

    @property
    def private_keys(self) -> list[Path]:
        return [self.ca_key, self.server_key, *(priv for priv, _ in self.supernode_keys)]

    @property
    def files(self) -> list[Path]:
        keys = [p for pair in self.supernode_keys for p in pair]
        return [self.ca_cert, self.ca_key, self.server_cert, self.server_key, *keys, self.manifest]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _build_ca(key: ec.EllipticCurvePrivateKey, name: str, start: _dt.datetime,
              end: _dt.datetime) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fededge"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    pub = key.public_key()
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(pub)
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .sign(key, hashes.SHA256()))


def _build_server(key: ec.EllipticCurvePrivateKey, hosts: list, ca: x509.Certificate,
                  ca_key: ec.EllipticCurvePrivateKey, start: _dt.datetime,
                  end: _dt.datetime) -> x509.Certificate:
    sans: list[x509.GeneralName] = [
        x509.DNSName(h) if isinstance(h, str) else x509.IPAddress(h) for h in hosts]
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fededge"),
                         x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0])[:64])])
    pub = key.public_key()
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject).public_key(pub)
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))


def _write(path: Path, data: bytes, mode: int, force: bool) -> None:
    # O_EXCL: the file is created here, with its mode, never reused (nor a symlink
    # followed). With force the old file (or link) is removed first, so that an old,
    # wider mode does not survive.
    if force and os.path.lexists(path):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate_certs(
    out_dir: str | os.PathLike[str],
    *,
    hosts: str | Sequence[str],
    supernodes: int = 0,
    days: int = 365,
    force: bool = False,
    ca_name: str = "fededge CA",
) -> CertBundle:
    """Write a CA, a server certificate for ``hosts`` and ``supernodes`` node key pairs.

    Parameters
    ----------
    out_dir : path
        Directory to write into; made (with parents) when missing.
    hosts : str or sequence of str
        Every name and address SuperNodes and ``flwr`` dial the SuperLink by
        (``"superlink,192.168.1.20"``): TLS checks the dialled name against these SANs.
        IP addresses become IP SANs, everything else DNS SANs. ``127.0.0.1`` and
        ``localhost`` are always added: Flower's SuperLink starts its own SuperExec,
        which dials it at 127.0.0.1 over TLS (without them every run stops there, while
        the SuperLink and the nodes look healthy).
    supernodes : int
        Number of SuperNode authentication key pairs (0 for TLS without node auth).
    days : int
        Validity of the CA and the server certificate, 1 to 3650. They start five
        minutes in the past, to tolerate small clock differences between machines.
    force : bool
        Replace existing files. Without it, any existing target raises
        :class:`CertOverwriteError` naming the file, before anything is written.
    ca_name : str
        The CA's common name.
    """
    if isinstance(supernodes, bool) or not isinstance(supernodes, int) or supernodes < 0:
        raise CertError(f"supernodes must be an integer >= 0, got {supernodes!r}")
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise CertError(f"days must be an integer from 1 to {MAX_DAYS}, got {days!r}")
    parsed = parse_hosts(hosts)
    for own in (ipaddress.ip_address("127.0.0.1"), "localhost"):  # (the SuperLink's own SuperExec)
        if own not in parsed:
            parsed.append(own)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CertError(f"--out {str(out)!r} exists and is not a directory")

    node_files = tuple((out / priv, out / pub) for priv, pub in map(supernode_key_names, range(supernodes)))
    bundle = CertBundle(out_dir=out, ca_cert=out / CA_CERT, ca_key=out / CA_KEY, server_cert=out / SERVER_CERT,
                        server_key=out / SERVER_KEY, supernode_keys=node_files, manifest=out / MANIFEST,
                        hosts=tuple(str(h) for h in parsed))
    if not force:
        existing = [str(p) for p in bundle.files if os.path.lexists(p)]
        if existing:
            raise CertOverwriteError(f"refusing to overwrite {', '.join(existing)}: "
                                     f"{'it exists' if len(existing) == 1 else 'they exist'} "
                                     f"(pass --force, or force=True, to replace every file)")
    elif any(p.is_dir() for p in bundle.files):
        raise CertError(f"cannot replace {next(p for p in bundle.files if p.is_dir())}: it is a directory")

    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    start, end = now - _dt.timedelta(minutes=5), now + _dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _build_ca(ca_key, ca_name, start, end)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _build_server(server_key, parsed, ca, ca_key, start, end)

    existed = out.exists()
    out.mkdir(mode=0o700, parents=True, exist_ok=True)  # (private keys in it; not the umask's)
    if not existed:
        out.chmod(0o700)
    _write(bundle.ca_key, _pem_key(ca_key), PRIVATE_MODE, force)
    _write(bundle.ca_cert, ca.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE, force)
    _write(bundle.server_key, _pem_key(server_key), PRIVATE_MODE, force)
    _write(bundle.server_cert, server.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE, force)
    nodes = []
    for i, (priv_path, pub_path) in enumerate(node_files):
        key = ec.generate_private_key(ec.SECP256R1())
        priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                 serialization.NoEncryption())
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        _write(priv_path, priv, PRIVATE_MODE, force)
        _write(pub_path, pub + f" fededge-supernode-{i}\n".encode(), PUBLIC_MODE, force)
        nodes.append({"index": i, "private-key": priv_path.name, "public-key": pub_path.name})
    manifest = {
        "created": now.isoformat(),
        "not-valid-after": end.isoformat(),
        "hosts": list(bundle.hosts),
        "ca": {"cert": CA_CERT, "key": CA_KEY,
               "sha256": hashlib.sha256(ca.public_bytes(serialization.Encoding.DER)).hexdigest()},
        "server": {"cert": SERVER_CERT, "key": SERVER_KEY},
        "supernodes": nodes,
        "private-keys-mode": oct(PRIVATE_MODE),
    }
    _write(bundle.manifest, (json.dumps(manifest, indent=2) + "\n").encode(), PUBLIC_MODE, force)
    return bundle
