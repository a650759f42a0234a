"""TLS on our listeners and their clients (stdlib ``ssl``): opt-in, mutual when a CA is given.

Trust model. A cluster's CA is its root of trust: a listener given ``ca`` asks every client for a
certificate and accepts only one signed by that CA; a client given ``ca`` accepts only a server
whose certificate that CA signed. Host names are not checked: a certificate identifies a member
of the cluster, not an address (nodes move, ports are ephemeral), so any CA-signed certificate
is accepted on any address. Without ``ca`` a listener encrypts but asks for no certificate, and a
client encrypts but checks none (a man in the middle is then possible; the token, not TLS,
authenticates such a connection).

Composition with the shared token: on a connection where both sides verified each other
against the CA (``mutual``), the certificates are the proof of membership and the token is not
asked for; on any other connection the token rules apply as without TLS.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import ssl

from .errors import AuthenticationError, ConfigError, MooncakeConnectorsError, ProtocolError


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM files: this node's certificate and key, and the CA that signs its peers.

    A listener needs ``cert`` and ``key``; a client may have only ``ca`` (it checks servers but
    presents nothing, so a listener with a CA refuses it)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"tls_{name}: no such file", path=path)

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual(self) -> bool:
        """Whether peers must present a certificate signed by ``ca``."""
        return self.ca is not None

    def fields(self) -> dict[str, str]:
        """As an EngineConfig's ``tls_*`` keywords."""
        named = {"tls_cert": self.cert, "tls_key": self.key, "tls_ca": self.ca}
        return {k: v for k, v in named.items() if v is not None}

    @classmethod
    def of(cls, cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
        cfg = cls(cert or None, key or None, ca or None)
        return cfg if cfg.enabled else None


@functools.lru_cache(maxsize=16)  # one per configuration: loading the files costs ms
def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    if cfg.cert is None or cfg.key is None:
        raise ConfigError("a TLS listener needs tls_cert and tls_key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # A session ticket is written by the server after the handshake; with none, reads never
    # write, so one thread may read while another writes the same connection.
    ctx.num_tickets = 0
    _load(ctx, cfg)
    if cfg.ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@functools.lru_cache(maxsize=16)
def client_context(cfg: TlsConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # see the module docstring: the CA, not the address, identifies
    ctx.verify_mode = ssl.CERT_REQUIRED if cfg.ca is not None else ssl.CERT_NONE
    _load(ctx, cfg)
    return ctx


def _load(ctx: ssl.SSLContext, cfg: TlsConfig) -> None:
    try:
        if cfg.cert is not None:
            ctx.load_cert_chain(cfg.cert, cfg.key)
        if cfg.ca is not None:
            ctx.load_verify_locations(cafile=cfg.ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"cannot load the TLS files: {exc}") from exc


def handshake_error(exc: ssl.SSLError, peer: str, path: str = "") -> MooncakeConnectorsError:
    """Our error for a failed TLS handshake (or a first read that carried a TLS alert)."""
    reason = getattr(exc, "reason", None) or str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError) or any(
        word in reason.upper() for word in ("CERTIFICATE", "UNKNOWN_CA")
    ):
        return AuthenticationError(f"TLS: certificate refused ({reason})", peer=peer, path=path)
    if reason in ("WRONG_VERSION_NUMBER", "UNEXPECTED_EOF_WHILE_READING", "HTTP_REQUEST"):
        return ProtocolError(
            f"TLS handshake failed ({reason}): the peer does not speak TLS, or TLS is off here",
            peer=peer,
            path=path,
        )
    return ProtocolError(f"TLS handshake failed: {reason}", peer=peer, path=path)


def refusal(sock: ssl.SSLSocket, exc: ssl.SSLError, peer: str) -> MooncakeConnectorsError:
    """Our error for a write that failed after the handshake: with TLS 1.3 a server refuses
    a client's certificate after the client's handshake is done, so the first write meets a
    closed connection; the server's alert, still unread, says why."""
    try:
        sock.settimeout(0.5)
        sock.recv(1)
    except ssl.SSLError as alert:
        return handshake_error(alert, peer)
    except OSError:
        pass
    return handshake_error(exc, peer)


def wrap_client(
    ctx: ssl.SSLContext, sock: socket.socket, timeout: float, peer: str, path: str = ""
) -> ssl.SSLSocket:
    """Run the client handshake within ``timeout``; the socket keeps that timeout."""
    sock.settimeout(timeout)
    try:
        return ctx.wrap_socket(sock, server_side=False)
    except ssl.SSLError as exc:
        raise handshake_error(exc, peer, path) from exc


def wrap_server(ctx: ssl.SSLContext, sock: socket.socket, timeout: float) -> ssl.SSLSocket:
    """Run the server handshake within ``timeout`` (ssl.SSLError, OSError on failure)."""
    sock.settimeout(timeout)
    return ctx.wrap_socket(sock, server_side=True)
