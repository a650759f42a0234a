"""``engine.submit`` plans a batch's request once for a run of requests of the same op and peer
inside the same local registration and remote region (a layer's KV blocks); what it would
refuse request by request, it still refuses request by request."""

from __future__ import annotations

import numpy as np

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import AccessViolation
from mooncake_connectors.transfer_core import TransferEngine, TransferRequest
from mooncake_connectors.types import Access, TransferOp, TransferStatus

W, R = TransferOp.WRITE, TransferOp.READ


def test_a_batch_planned_once_per_run_refuses_what_each_request_would() -> None:
    cfg = EngineConfig(metadata="memory", transports=("tcp",))
    with TransferEngine(cfg) as a, TransferEngine(cfg) as b:
        peer = b.segment_name
        dst = b.allocate_buffer(1 << 20)
        src = a.allocate_buffer(1 << 20)
        src.array[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        ro = np.full(8192, 9, np.uint8)
        ro.flags.writeable = False  # local READs may not land here
        a.register(ro, access=Access.READ)
        other = a.allocate_buffer(8192)
        other.array[:] = 5
        d = dst.addr
        reqs = [TransferRequest(W, peer, src.addr + i * 4096, d + i * 4096, 4096) for i in range(8)]
        reqs += [
            TransferRequest(W, peer, src.addr, d + (1 << 20) - 2048, 4096),  # past b's region
            TransferRequest(W, peer, int(ro.ctypes.data), d + 8 * 4096, 4096),  # from read-only
            TransferRequest(R, peer, int(ro.ctypes.data), d, 4096),  # into read-only: refused
            TransferRequest(W, peer, other.addr, d + 9 * 4096, 8192),  # another registration
            TransferRequest(W, peer, src.addr + (1 << 20) - 100, d + 11 * 4096, 200),  # past src
            TransferRequest(W, peer, src.addr, d + 12 * 4096, 0),  # nothing to move
            TransferRequest(W, peer, src.addr + 12 * 4096, d + 13 * 4096, 4096),
        ]
        batch = a.submit(reqs)
        assert batch.wait(10)
        ok, failed = TransferStatus.COMPLETED, TransferStatus.FAILED
        assert batch.statuses == [ok] * 8 + [failed, ok, failed, ok, failed, ok, ok]
        for i in (8, 10, 12):
            assert isinstance(batch.errors[i], AccessViolation), (i, batch.errors[i])
        got = dst.array
        assert (got[: 8 * 4096] == src.array[: 8 * 4096]).all()
        assert (got[8 * 4096 : 9 * 4096] == 9).all()
        assert (got[9 * 4096 : 11 * 4096] == 5).all()
        assert not got[11 * 4096 : 12 * 4096].any()
        assert (got[13 * 4096 : 14 * 4096] == src.array[12 * 4096 : 13 * 4096]).all()
        assert (ro == 9).all()
