"""What a :class:`~mooncake_connectors.pd.session.TransferSession` needs from its host engine's
adapter: settings and a place to record what happened. Both are structural, so an adapter's own
config and stats classes serve as they are."""

from __future__ import annotations

from typing import Protocol

from ..config import EngineConfig


class SessionSettings(Protocol):
    @property
    def host(self) -> str: ...  # the side channel binds and advertises this address
    @property
    def side_channel_port(self) -> int: ...  # first port; TP rank r uses port+r (0: any)
    @property
    def transfer_timeout(self) -> float: ...  # deadline of one KV read, and of a push
    @property
    def handshake_timeout(self) -> float: ...  # deadline of one side-channel exchange
    @property
    def kv_lease(self) -> float: ...  # how long finished prefill blocks wait for a decode
    @property
    def accept_push(self) -> bool: ...  # peers may write into our KV blocks

    def engine_config(self) -> EngineConfig: ...


class SessionStats(Protocol):
    def record_load(self, seconds: float, nbytes: int, nrequests: int) -> None: ...
    def record_push(
        self, tail_seconds: float, nbytes: int, nrequests: int, overlapped: int
    ) -> None: ...
    def record_failed_load(self) -> None: ...
    def record_expired_lease(self) -> None: ...
