"""ZMQ CURVE keys bound to the TLS identities, for the PD side channel.

libzmq speaks CURVE (Curve25519 with per-connection keys), not TLS. So that a node's side
channel belongs to the same identity as its TLS listeners, each node derives its CURVE key pair
from its TLS private key (HKDF-SHA256, a label of ours) and holds a *binding*: its certificate
and a signature, by its TLS key, of its CURVE public key. Every side-channel message carries the
sender's binding; the receiver accepts it only when the certificate is one the cluster's CA
signed, is within its validity, and signed the very CURVE key the connection was authenticated
with (the server learns a client's key from the ZAP handshake, a client knows the server's key
from the endpoint it was given). A CA-signed certificate is thus the only way in, as on the TLS
ports; libzmq itself refuses a peer that does not speak CURVE at all.

An endpoint advertises its key after the address: ``tcp://HOST:PORT;curve=HEX``.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import msgspec

from ..errors import ConfigError
from ..tls import TlsConfig

LABEL = b"mooncake-connectors side channel curve25519"
_SIGNED = b"mc-side-channel-curve\0"  # what a binding signs, before the CURVE public key
KEY_MARK = ";curve="


def split_endpoint(endpoint: str) -> tuple[str, bytes | None]:
    """The zmq address and the server's CURVE public key (raw 32 bytes, or None)."""
    address, mark, key = endpoint.partition(KEY_MARK)
    if not mark:
        return endpoint, None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"side channel endpoint {endpoint!r}: bad CURVE key")
    return address, raw


@dataclasses.dataclass(frozen=True)
class CurveIdentity:
    """This node's CURVE key pair (raw bytes), its binding, and the CA that checks peers'."""

    public: bytes
    secret: bytes
    binding: bytes
    ca_der: bytes
    _checked: dict[tuple[bytes, bytes], bool] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, compare=False, repr=False
    )

    @classmethod
    def from_tls(cls, tls: TlsConfig) -> CurveIdentity:
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF
        except ImportError as exc:  # pragma: no cover - an install without the tls extra
            raise ConfigError(
                "the side channel with TLS needs the 'cryptography' package: "
                "pip install 'mooncake-connectors[tls]'"
            ) from exc

        if tls.cert is None or tls.key is None or tls.ca is None:
            raise ConfigError(
                "the side channel binds CURVE keys to certificates: it needs tls_cert, "
                "tls_key and tls_ca together"
            )
        with open(tls.key, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
        with open(tls.cert, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        with open(tls.ca, "rb") as f:
            ca = x509.load_pem_x509_certificate(f.read())
        der = key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        seed = HKDF(hashes.SHA256(), 32, salt=None, info=LABEL).derive(der)
        curve = X25519PrivateKey.from_private_bytes(seed)
        public = curve.public_key().public_bytes_raw()
        binding = msgspec.msgpack.encode(
            (cert.public_bytes(serialization.Encoding.DER), _sign(key, _SIGNED + public))
        )
        ca_der = ca.public_bytes(serialization.Encoding.DER)
        return cls(public, curve.private_bytes_raw(), binding, ca_der)

    def endpoint(self, address: str) -> str:
        return f"{address}{KEY_MARK}{self.public.hex()}"

    def check(self, binding: bytes, peer_public: bytes) -> bool:
        """Whether ``binding`` proves that a certificate of our CA owns ``peer_public``."""
        key = (peer_public, binding)
        with self._lock:
            known = self._checked.get(key)
        if known is None:
            known = _verify(binding, peer_public, self.ca_der)
            with self._lock:
                if len(self._checked) > 4096:  # peers come and go: bounded, not a leak
                    self._checked.clear()
                self._checked[key] = known
        return known


def _sign(key: Any, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    if isinstance(key, ec.EllipticCurvePrivateKey):
        return bytes(key.sign(data, ec.ECDSA(hashes.SHA256())))
    if isinstance(key, rsa.RSAPrivateKey):
        return bytes(key.sign(data, padding.PKCS1v15(), hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return bytes(key.sign(data))
    raise ConfigError(f"unsupported TLS key type for the side channel: {type(key).__name__}")


def _verify(binding: bytes, peer_public: bytes, ca_der: bytes) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    try:
        cert_der, signature = msgspec.msgpack.decode(binding, type=tuple[bytes, bytes])
        cert = x509.load_der_x509_certificate(cert_der)
        ca = x509.load_der_x509_certificate(ca_der)
        cert.verify_directly_issued_by(ca)
        now = datetime.datetime.now(datetime.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return False
        pub = cert.public_key()
        data = _SIGNED + peer_public
        if isinstance(pub, ec.EllipticCurvePublicKey):
            pub.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(pub, rsa.RSAPublicKey):
            pub.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(pub, ed25519.Ed25519PublicKey):
            pub.verify(signature, data)
        else:
            return False
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return False
    except InvalidSignature:
        return False
    return True
