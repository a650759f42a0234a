"""The fuzzer's zmq ports: the PD side channel and the P2P grant server.

Most of what they get are well-framed zmq messages through a DEALER socket (hostile msgpack
bodies, wrong frame counts, floods of well-typed ``Done`` notices for ids nobody holds, messages
over the socket's size cap); the rest are raw bytes in place of the ZMTP greeting, through
:meth:`Port.open`. Each probe is the exchange a real peer makes.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from typing import Any

import msgspec

from .fuzz_frames import Port, addr_port, hostile_value


class ZmqPort(Port):
    """A zmq listener: ``send_message`` sends one message (its parts drawn from ``rng``)."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info)
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self._dealer: Any = None

    def endpoint(self) -> str:
        raise NotImplementedError

    def address(self) -> tuple[str, int]:
        return addr_port(self.endpoint().removeprefix("tcp://"))

    def parts(self, rng: random.Random, payload: bytes) -> list[bytes]:
        return [payload] if rng.random() < 0.9 else [payload, payload]

    def send_message(self, rng: random.Random, payload: bytes) -> None:
        zmq = self.zmq
        if self._dealer is None or rng.random() < 0.01:  # now and then a new connection
            if self._dealer is not None:
                self._dealer.close(linger=0)
            self._dealer = self.ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.SNDHWM, 1000)
            self._dealer.connect(self.endpoint())
        with contextlib.suppress(zmq.Again):
            self._dealer.send_multipart(self.parts(rng, payload), zmq.NOBLOCK)
        while True:  # answers to well-formed requests: read and drop
            try:
                self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break

    def close(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self.ctx.term()


def _encode(rng: random.Random, fields: dict[Any, Any]) -> bytes:
    try:
        return msgspec.msgpack.encode(fields)
    except (OverflowError, TypeError):
        return rng.randbytes(32)


class SidePort(ZmqPort):
    """The PD side channel (zmq ROUTER) of a prefill worker's real session."""

    name = "side"

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info)
        from ..pd.side_channel import SideChannelClient

        self.client = SideChannelClient(timeout=10.0)
        self._ids = itertools.count()

    def endpoint(self) -> str:
        return str(self.info["side"])

    def structured(self, rng: random.Random) -> bytes:
        from ..pd.messages import MAX_DONE_IDS, Done, encode

        if rng.random() < 0.2:  # a flood: Done for fresh ids, sometimes more than one may name
            n = MAX_DONE_IDS if rng.random() < 0.9 else 20 * MAX_DONE_IDS
            ids = [f"flood-{next(self._ids):012d}" for _ in range(n)]  # one length: replays
            return encode(Done("fuzz", ids, 0, 1))
        tag = rng.choice(["layout", "done", "push_target", "push_done", "layout_reply", "x"])
        fields = {str(hostile_value(rng))[:40]: hostile_value(rng) for _ in range(rng.randrange(5))}
        fields["type"] = tag
        return _encode(rng, fields)

    def probe(self) -> None:
        layout = self.client.fetch_layout(self.endpoint())
        if layout.engine_id != "fuzz":
            raise AssertionError(f"side probe: {layout}")

    def close(self) -> None:
        self.client.close()
        super().close()


class GrantPort(ZmqPort):
    """The P2P grant server (zmq ROUTER behind REQ clients): REQ envelopes around hostile
    grant and have requests, wrong MACs, wrong frame counts, and messages over its size cap."""

    name = "grant"

    def endpoint(self) -> str:
        return f"tcp://{self.info['grant']}"

    def structured(self, rng: random.Random) -> bytes:
        from ..p2p.serve import MAX_REQUEST

        r = rng.random()
        if r < 0.002:
            return b"\0" * (MAX_REQUEST * 64)  # over the cap: the peer is disconnected
        tag = rng.choice(["grant", "have", "x"])
        fields: dict[Any, Any] = {"type": tag}
        for key in ("name", "version", "chunk", "peer"):
            if rng.random() < 0.8:
                good = {"name": "fuzz", "version": 1, "chunk": 0, "peer": "p"}[key]
                fields[key] = good if rng.random() < 0.5 else hostile_value(rng)
        return _encode(rng, fields)

    def parts(self, rng: random.Random, payload: bytes) -> list[bytes]:
        r = rng.random()
        if r < 0.8:  # a REQ envelope: empty delimiter, MAC (none: the target has no token), body
            return [b"", rng.choice([b"", rng.randbytes(32)]), payload]
        if r < 0.9:
            return [b"", payload]
        return [payload] * rng.randrange(1, 5)

    def probe(self) -> None:
        from ..p2p.serve import Grant, GrantClient

        client = GrantClient(None, 10.0)
        try:
            ans = client.ask(self.info["grant"], Grant("fuzz", 1, 0, "probe"))
        finally:
            client.close()
        if ans is None or ans.status != "ok":
            raise AssertionError(f"grant probe: {ans}")
