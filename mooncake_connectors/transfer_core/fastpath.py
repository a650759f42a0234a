"""The engine's shortest way for ``transfer`` of one request to a peer it reached before.

After one request went the general way (``_plan``: the peer's descriptor, the remote region,
the route, the local registration) over a transport that offers ``run_one``, the engine keeps
what it found as a ``Route`` for that peer. A later request whose ranges fall inside the same
remote region and the same local registration, while neither the peer's descriptor nor the
local registrations changed and no path to that peer is recorded as failing, is handed straight
to the transport's ``run_one``: no Slice, no Batch, no plan. Any other request takes the general
way; a request that fails on the short way goes on as a first attempt that failed does there
(retry on another lane or transport within its deadline, cool-down, the error reported).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import MooncakeConnectorsError
from ..types import Access, TransferOp
from . import metrics

if TYPE_CHECKING:
    from .batch import TransferRequest
    from .descriptor import RegionDesc, SegmentDesc
    from .engine import TransferEngine, _PeerView
    from .memory import Region
    from .transport import Transport


class Route:
    __slots__ = ("epoch", "hi", "lhi", "llo", "lo", "peer", "read", "transport", "view", "write")

    def __init__(
        self,
        view: _PeerView,
        epoch: int,
        region: RegionDesc,
        local: Region,
        transport: Transport,
        read: bool,
        write: bool,
    ) -> None:
        self.view = view
        self.peer: SegmentDesc = view.desc
        self.epoch = epoch
        self.lo, self.hi = region.addr, region.addr + region.length
        self.llo, self.lhi = local.addr, local.addr + local.length
        self.transport = transport
        self.read = read  # the remote region may be read and the local one written
        self.write = write


def remember(
    engine: TransferEngine,
    target: str,
    epoch: int,
    region: RegionDesc,
    transport: Transport,
    local: Region,
) -> None:
    """Keep the route a request to ``target`` just took (host memory both ends only)."""
    view = engine._peers.get(target)
    if view is None or local.device >= 0 or region.cuda_device >= 0:
        return
    readable = bool(region.access & Access.READ) and local.writable
    writable = bool(region.access & Access.WRITE)
    engine._routes[target] = Route(view, epoch, region, local, transport, readable, writable)


def run(
    engine: TransferEngine, route: Route, req: TransferRequest, deadline: float, t0: float
) -> MooncakeConnectorsError | bool:
    """Move ``req`` the short way: True when done; False, having done nothing, for the general
    way; or the attempt's error, which the engine handles as a first attempt's failure."""
    n = req.length
    remote = req.remote_addr
    local = req.local_addr
    op = req.op
    if (
        type(remote) is not int
        or type(local) is not int
        or remote < route.lo
        or remote + n > route.hi
        or local < route.llo
        or local + n > route.lhi
        or not (route.read if op is TransferOp.READ else route.write)
        or engine._peers.get(req.target) is not route.view
        or engine.local.epoch != route.epoch
        or (engine.health.any_recorded() and engine.health.recorded_for(req.target))
    ):
        return False
    transport = route.transport
    got = transport.run_one(route.peer, op, remote, local, n, deadline)
    if got is True:
        name = op._name_
        metrics.moved(transport.name, name, n)
        metrics.finished(name, "COMPLETED", time.perf_counter() - t0)
    return got
