"""Credentials of a deployment's planes (docs/architecture.md, "9. Security").

- **Internal gRPC** (router to stages and draft): mutual TLS. Every service holds the
  deployment's CA certificate and a certificate of its own signed by it (or all share
  one), and accepts only peers whose certificate that CA signed. Certificates name the
  deployment (`DEFAULT_SERVER_NAME`), not a host: pods are reached by addresses nobody
  can list in advance, so channels check that name
  (`grpc.ssl_target_name_override`) against the peer's certificate.
- **Data plane**: frames authenticated with the deployment's secret
  (`transport/auth.py`): `data.key` when given, else derived from the TLS private key
  (the single Secret that cert-manager fills is then enough; services with certificates
  of their own need a shared `data.key`).
- **Public API** (router's gRPC and HTTP ports): API keys (`auth.py`) and optional
  server TLS (`PublicTls`).

A TLS directory holds `ca.crt`, `tls.crt` and `tls.key` (the layout of a Kubernetes TLS
Secret filled by cert-manager) and optionally `data.key`. `make_pki` writes a throwaway
one (`specpipe up --secure`, tests).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from .transport.auth import MIN_SECRET_BYTES, FrameAuth

CA_FILE, CERT_FILE, KEY_FILE, DATA_KEY_FILE = "ca.crt", "tls.crt", "tls.key", "data.key"
DEFAULT_SERVER_NAME = "specpipe-internal"
_DERIVE_LABEL = b"specpipe data-plane secret v1"


class SecurityError(ValueError):
    """Credentials that are missing or cannot be used; the message names the file."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise SecurityError(f"cannot read the {what} {path}: {e.strerror}") from None


def _data_secret(path: Path) -> bytes:
    """A data.key file: hex (64 digits for 32 bytes) or raw bytes."""
    raw = _read(path, "data-plane key").strip()
    try:
        secret = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = raw
    if len(secret) < MIN_SECRET_BYTES:
        raise SecurityError(f"the data-plane key {path} has fewer than {MIN_SECRET_BYTES} bytes")
    return secret


@dataclass(frozen=True)
class Security:
    """The internal planes' credentials (`--secure --tls-dir DIR`)."""

    ca: bytes
    cert: bytes
    key: bytes
    data_secret: bytes
    server_name: str = DEFAULT_SERVER_NAME

    @classmethod
    def load(
        cls,
        tls_dir: str | Path,
        data_key_file: str | Path | None = None,
        server_name: str = DEFAULT_SERVER_NAME,
    ) -> Security:
        d = Path(tls_dir)
        ca = _read(d / CA_FILE, "CA certificate")
        cert = _read(d / CERT_FILE, "certificate")
        key = _read(d / KEY_FILE, "private key")
        if data_key_file is None and (d / DATA_KEY_FILE).is_file():
            data_key_file = d / DATA_KEY_FILE
        if data_key_file is not None:
            secret = _data_secret(Path(data_key_file))
        else:
            secret = hmac.digest(key, _DERIVE_LABEL, hashlib.sha256)
        return cls(ca, cert, key, secret, server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS that requires a client certificate signed by the deployment's CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]

    def frame_auth(self) -> FrameAuth:
        return FrameAuth(self.data_secret)


@dataclass(frozen=True)
class PublicTls:
    """Server TLS of the router's public ports (`--public-tls-cert/--public-tls-key`);
    clients authenticate with API keys, not certificates."""

    cert_file: Path
    key_file: Path

    @classmethod
    def load(cls, cert_file: str | Path, key_file: str | Path) -> PublicTls:
        tls = cls(Path(cert_file), Path(key_file))
        tls.server_credentials()  # fail at start, with the file's name, not at the first call
        return tls

    def server_credentials(self) -> grpc.ServerCredentials:
        key = _read(self.key_file, "public TLS key")
        cert = _read(self.cert_file, "public TLS certificate")
        return grpc.ssl_server_credentials([(key, cert)])


def _ca_usage():
    from cryptography import x509

    flags = dict.fromkeys(
        ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
         "encipher_only", "decipher_only"), False,
    )  # fmt: skip
    return x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, **flags)


def make_pki(
    out_dir: str | Path,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    server_name: str = DEFAULT_SERVER_NAME,
    days: int = 30,
) -> Path:
    """A throwaway CA, one certificate (server and client use) for every service of a
    deployment, and a data-plane key, in `out_dir` (created, private). The CA's private
    key is not kept: nothing can be signed by it later. Returns `out_dir`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_usage = _ca_usage()
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specpipe throwaway CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca_usage, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(server_name)]
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(d / CA_FILE, ca.public_bytes(pem), 0o644)
    _write(d / CERT_FILE, cert.public_bytes(pem), 0o644)
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(d / KEY_FILE, key_pem, 0o600)
    _write(d / DATA_KEY_FILE, os.urandom(32).hex().encode() + b"\n", 0o600)
    return d


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
