"""``certs init``: a development CA and node certificates (``cryptography``), for TLS tests and
trials. Production clusters bring their own PKI; any CA and certificates in PEM work the same.

Keys are ECDSA P-256 (fast handshakes); certificates name ``localhost``, 127.0.0.1, ::1 and the
node's own name, although our clients do not check names (the CA is what identifies a member).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from .errors import ConfigError

DAYS = 365


def init(directory: str | os.PathLike[str], nodes: tuple[str, ...] = ("node",)) -> dict[str, Path]:
    """Write ``ca.pem``/``ca.key`` and ``NAME.pem``/``NAME.key`` per node into ``directory``.
    Returns the paths written, by file name without extension for the CA (``ca``, ``ca-key``)
    and by node name (``NAME``, ``NAME-key``). An existing CA there is reused, never replaced."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - an install without the tls extra
        raise ConfigError(
            "certs init needs the 'cryptography' package: pip install 'mooncake-connectors[tls]'"
        ) from exc
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in nodes:
        if not name or "/" in name or name.startswith(".") or name == "ca":
            raise ConfigError(f"bad node name {name!r}")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=DAYS)

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        data = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    ca_pem, ca_key_path = out / "ca.pem", out / "ca.key"
    if ca_pem.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ConfigError("the existing ca.key is not an EC key", path=str(ca_key_path))
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        # a name of its own: a verifier looks a chain's issuer up by name, and two dev CAs of
        # one name make a foreign certificate fail as a bad signature instead of an unknown CA
        label = f"mooncake-connectors dev CA {os.urandom(4).hex()}"
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_key(ca_key_path, ca_key)
        ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths = {"ca": ca_pem, "ca-key": ca_key_path}
    for name in nodes:
        key = ec.generate_private_key(ec.SECP256R1())
        alt = x509.SubjectAlternativeName(
            [
                x509.DNSName(name),
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(alt, critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_key(out / f"{name}.key", key)
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[name], paths[f"{name}-key"] = out / f"{name}.pem", out / f"{name}.key"
    return paths
