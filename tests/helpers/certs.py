"""Certificates for TLS tests (`cryptography`, a test extra): a CA, and host certificates it
signs, written as the PEM files an agent's `tls_cert_file`/`tls_key_file` and a client's
`[agents] tls_root_file` name. What docs/deploy.md does with openssl, done in Python."""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Ca:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    pem: Path           # the CA certificate: a client's tls_root_file

    def host(self, folder: Path, name: str = "localhost", days: int = 1) -> tuple[Path, Path]:
        """A certificate for `name` (and 127.0.0.1) signed by this CA: (cert.pem, key.pem), the
        key 0600."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=1))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        folder.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        return cert_path, key_path


def make_ca(folder: Path, name: str = "hintfs test CA") -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    pem = folder / f"{name.replace(' ', '-')}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(key, cert, pem)


def write_token(path: Path, token: str) -> Path:
    """A token file as agents and mounts require it: 0600, this user's."""
    _write_private(path, token.encode() + b"\n")
    return path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
