"""The PD side channel: a worker's KV layout on request, "done reading" notices, and the two
messages of layer-wise push.

Each prefill worker (one per TP rank) serves a zmq ROUTER socket, on loopback unless configured
otherwise. A decode worker asks it once per prefill engine for its :class:`WorkerLayout` (where
each layer's KV blocks live in the prefill's registered memory) and, after reading a request's
blocks, sends :class:`Done` so the prefill frees them before its lease runs out. Bytes never go
through here: the decode side reads them one-sided through the transfer engine.

Layer-wise push (opt-in): a decode worker that allocated blocks for a request sends the prefill
worker a :class:`PushTarget` (its layout and block ids); the prefill worker WRITEs each layer's
blocks there as the engine computes them and answers with :class:`PushDone` on the decode
worker's own side channel.

Messages are the msgspec msgpack structs of :mod:`.messages`. Clients are DEALER sockets owned by
one thread each, with a deadline on every exchange; a reply carries the request's nonce so a late
answer to an abandoned request is never taken for a newer one.

With TLS and a CA the side channel speaks CURVE with keys bound to the TLS certificates
(:mod:`.curve`): each message is preceded by a frame with the sender's binding, and one that does
not prove a certificate of the CA is dropped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85

from ..errors import (
    AuthenticationError,
    MooncakeConnectorsError,
    ProtocolError,
    TransferTimeout,
    TransportBroken,
)
from ..netguard import RateLimitedLog, SiteLogs
from .curve import CurveIdentity, split_endpoint
from .messages import (
    Done,
    LayoutReply,
    LayoutRequest,
    Message,
    PushDone,
    PushTarget,
    WorkerLayout,
    decode,
    encode,
)

log = logging.getLogger(__name__)
MAX_MESSAGE = 16 << 20  # far above a layout or a push target of 10^5 blocks
_AUTH_STOP = 5.0  # seconds close() waits for the ZAP authenticator to stop


class SideChannelServer:
    """A ROUTER socket on ``host:port`` (0: any free port) answered by one daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        layout: Callable[[], WorkerLayout],
        on_done: Callable[[Done], None],
        on_push_target: Callable[[PushTarget], None] | None = None,
        on_push_done: Callable[[PushDone], None] | None = None,
        curve: CurveIdentity | None = None,
    ) -> None:
        self._layout = layout
        self._curve = curve
        self._refused = RateLimitedLog(log)
        self._noisy = SiteLogs(log)  # what peers send: bounded lines, however much they send
        self._on_done = on_done
        self._on_push_target = on_push_target
        self._on_push_done = on_push_done
        self._auth: Any = None
        if curve is None:
            self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        else:
            from zmq.auth import CURVE_ALLOW_ANY
            from zmq.auth.thread import ThreadAuthenticator

            # A context of its own: one ZAP handler per context, and the shared one is not ours.
            # ZAP admits any CURVE key and names it in each message's User-Id; the binding frame
            # then decides (a key is only as good as the certificate that signed it).
            self._ctx = zmq.Context()
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self._sock.curve_secretkey = z85.encode(curve.secret)
            self._sock.curve_publickey = z85.encode(curve.public)
            self._sock.curve_server = True
        # libzmq allocates a message's declared size when its header arrives: a peer announcing
        # more is disconnected instead. A peer that never finishes the ZMTP handshake is dropped
        # after HANDSHAKE_IVL.
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
        h = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            if port:
                self._sock.bind(f"tcp://{h}:{port}")
            else:
                self._sock.bind(f"tcp://{h}:*")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._close_auth()
            raise TransportBroken(f"side channel cannot bind {host}:{port}: {exc}") from exc
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        if curve is not None:
            self.endpoint = curve.endpoint(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mc-pd-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                got = self._recv()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if got is None:
                continue
            identity, payload = got
            try:
                msg = decode(payload)
            except ProtocolError as exc:
                self._noisy("undecodable").warning("side channel %s: %s", self.endpoint, exc)
                continue
            try:
                if isinstance(msg, LayoutRequest):
                    reply = LayoutReply(msg.nonce, self._layout())
                    mine = [self._curve.binding] if self._curve is not None else []
                    self._sock.send_multipart([identity, *mine, encode(reply)])
                elif isinstance(msg, Done):
                    self._on_done(msg)
                elif isinstance(msg, PushTarget) and self._on_push_target is not None:
                    self._on_push_target(msg)
                elif isinstance(msg, PushDone) and self._on_push_done is not None:
                    self._on_push_done(msg)
            except Exception:  # one bad exchange must not end the side channel
                self._noisy("unhandled").exception(
                    "side channel %s: cannot handle %r", self.endpoint, msg
                )

    def _recv(self) -> tuple[bytes, bytes] | None:
        """(sender, message) of the next message; None for one dropped (a frame count we do not
        speak, or a CURVE key no certificate of the CA binds)."""
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if self._curve is None:
            return (frames[0].bytes, frames[1].bytes) if len(frames) == 2 else None
        if len(frames) != 3:
            return None
        identity, binding, payload = frames
        user = payload.get("User-Id")  # the client's CURVE key, named by the ZAP handler
        if not isinstance(user, str) or not self._curve.check(binding.bytes, z85.decode(user)):
            self._refused.warning(
                "side channel %s: dropped a message whose sender's key no certificate of the "
                "CA binds",
                self.endpoint,
            )
            return None
        return identity.bytes, payload.bytes

    def _close_auth(self) -> None:
        """Stop the ZAP thread and end our context, waiting ``_AUTH_STOP`` seconds at most:
        pyzmq's ``stop`` joins its thread and ``term`` waits for every socket, both unbounded."""
        auth, ctx = self._auth, self._ctx
        if auth is None:
            return
        self._auth = None

        def stop() -> None:
            auth.stop()
            ctx.term()

        worker = threading.Thread(target=stop, name="mc-pd-zap-stop", daemon=True)
        worker.start()
        worker.join(_AUTH_STOP)
        if worker.is_alive():
            log.warning(
                "the side channel's authenticator did not stop within %.0f s; left to end "
                "with the process",
                _AUTH_STOP,
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._close_auth()


class SideChannelClient:
    """DEALER sockets to peers' side channels; use one instance per thread (zmq rule)."""

    def __init__(self, timeout: float, curve: CurveIdentity | None = None) -> None:
        self.timeout = timeout
        self._curve = curve
        self._server_keys: dict[str, bytes] = {}  # endpoint -> its CURVE key (raw)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._nonce = itertools.count(1)

    def _sock(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is None:
            address, key = split_endpoint(endpoint)
            if (key is None) != (self._curve is None):
                why = "speaks CURVE (TLS there)" if key else "has no CURVE key (no TLS there)"
                raise AuthenticationError(
                    f"side channel {endpoint} {why}; both ends need the same TLS settings",
                    peer=endpoint,
                )
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)  # a reply is a layout at most
            sock.setsockopt(zmq.SNDHWM, 1000)
            if self._curve is not None and key is not None:
                sock.curve_secretkey = z85.encode(self._curve.secret)
                sock.curve_publickey = z85.encode(self._curve.public)
                sock.curve_serverkey = z85.encode(key)
                self._server_keys[endpoint] = key
            if address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            self._socks[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def fetch_layout(self, endpoint: str) -> WorkerLayout:
        """Ask ``endpoint`` for its layout; TransferTimeout when it does not answer in time."""
        sock = self._sock(endpoint)
        nonce = next(self._nonce)
        deadline = time.monotonic() + self.timeout
        try:
            sock.send_multipart([*self._mine(), encode(LayoutRequest(nonce))], zmq.NOBLOCK)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    break
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if self._curve is not None and not (
                    len(frames) == 2 and self._curve.check(frames[0], self._server_keys[endpoint])
                ):
                    log.warning("side channel %s: a reply without a valid binding", endpoint)
                    continue
                msg = decode(frames[-1])
                if isinstance(msg, LayoutReply) and msg.nonce == nonce:
                    return msg.layout
        except zmq.ZMQError as exc:
            self._drop(endpoint)
            raise TransportBroken(f"side channel {endpoint}: {exc}", peer=endpoint) from exc
        # A dead or stuck peer: forget the socket so queued requests do not pile up on it.
        self._drop(endpoint)
        raise TransferTimeout(
            f"side channel {endpoint} did not answer within {self.timeout}s", peer=endpoint
        )

    def notify_done(
        self,
        endpoint: str,
        engine_id: str,
        request_ids: list[str],
        reader: int = 0,
        readers: int = 1,
    ) -> None:
        """Best effort: the peer also frees the blocks when its lease runs out."""
        self.send(endpoint, Done(engine_id, request_ids, reader, readers))

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue one message without waiting; False when it could not be (dead peer)."""
        try:
            self._sock(endpoint).send_multipart([*self._mine(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again: the queue to a dead peer is full
            log.debug("could not send to %s: %s", endpoint, exc)
            self._drop(endpoint)
            return False
        except MooncakeConnectorsError as exc:  # TLS on one end only
            log.warning("could not send to %s: %s", endpoint, exc)
            return False
        return True

    def _mine(self) -> list[bytes]:
        return [self._curve.binding] if self._curve is not None else []

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._drop(endpoint)
