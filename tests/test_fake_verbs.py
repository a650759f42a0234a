"""The Python stand-in for pyverbs behaves as the verbs it stands for where the tests that remain
on it rely on it: in-order completions with selective signalling, flushes after an injected
error, a vanishing device. Driven through our seam (verbs.Nic), two fake NICs of this process.
The RC state machine and rkey/bounds checks are tested on the emulated NIC under the real
pyverbs (test_rdma_fake_ibverbs.py)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import fake_nic
import fake_verbs
import numpy as np
import pytest

from mooncake_connectors.errors import ConfigError, TransportBroken
from mooncake_connectors.transfer_core.transports.rdma.verbs import Completion, Nic, QpAddr, Verbs

e = fake_verbs.e
RW = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


@pytest.fixture(scope="module", autouse=True)
def _own_fabric() -> Iterator[None]:
    # configure() changes this process's environment, which later modules' peers inherit.
    with fake_nic.isolated():
        yield


@pytest.fixture
def pair() -> Iterator[tuple[Nic, Nic]]:
    fake_verbs.configure("a0,b0")
    v = Verbs("fake_verbs")
    a, b = v.open("a0", 1, 0), v.open("b0", 1, 0)
    yield a, b
    fake_verbs.configure("")


def _connect(a: Nic, b: Nic) -> tuple[object, object]:
    qa, qb = a.create_qp(64), b.create_qp(64)
    a.connect(qa, QpAddr(qb.qp_num, 7, b.gid, b.lid), 1)  # type: ignore[attr-defined]
    b.connect(qb, QpAddr(qa.qp_num, 1, a.gid, a.lid), 7)  # type: ignore[attr-defined]
    return qa, qb


def _poll(nic: Nic, n: int) -> list[Completion]:
    out: list[Completion] = []
    end = time.monotonic() + 10
    while len(out) < n and time.monotonic() < end:
        out += nic.poll(16)
        time.sleep(0.001)
    return out


def test_write_read_in_order_with_selective_signalling(pair: tuple[Nic, Nic]) -> None:
    a, b = pair
    qa, _ = _connect(a, b)
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    ma = a.reg_mr(src.ctypes.data, src.size, RW)
    mb = b.reg_mr(dst.ctypes.data, dst.size, RW)
    for i in range(8):  # only the last asks for a completion
        a.post(
            qa,
            i,
            True,
            src.ctypes.data + i * 512,
            512,
            ma.lkey,
            dst.ctypes.data + i * 512,
            mb.rkey,
            i == 7,
        )
    comps = _poll(a, 1)
    assert [(c.wr_id, c.ok) for c in comps] == [(7, True)]
    assert np.array_equal(src, dst)
    back = np.zeros(512, dtype=np.uint8)
    mback = a.reg_mr(back.ctypes.data, back.size, RW)
    a.post(qa, 9, False, back.ctypes.data, 512, mback.lkey, dst.ctypes.data + 512, mb.rkey, True)
    assert [c.wr_id for c in _poll(a, 1)] == [9]
    assert np.array_equal(back, src[512:1024])


def test_an_error_flushes_everything_behind_it(pair: tuple[Nic, Nic]) -> None:
    a, b = pair
    qa, _ = _connect(a, b)
    buf = np.zeros(4096, dtype=np.uint8)
    ma, mb = a.reg_mr(buf.ctypes.data, 4096, RW), b.reg_mr(buf.ctypes.data, 4096, RW)
    fake_verbs.device("a0").fail(1)
    for i in range(3):  # unsignalled: the error and the flushes complete anyway
        a.post(qa, i, True, buf.ctypes.data, 64, ma.lkey, buf.ctypes.data, mb.rkey, False)
    comps = _poll(a, 3)
    assert [(c.wr_id, c.status) for c in comps] == [
        (0, e.IBV_WC_RETRY_EXC_ERR),
        (1, e.IBV_WC_WR_FLUSH_ERR),
        (2, e.IBV_WC_WR_FLUSH_ERR),
    ]


def test_memlock_and_vanishing_device(pair: tuple[Nic, Nic]) -> None:
    a, _ = pair
    buf = ctypes.create_string_buffer(64)
    fake_verbs.device("a0").vanish()
    with pytest.raises(ConfigError, match="a0"):
        a.reg_mr(ctypes.addressof(buf), 64, RW)
    with pytest.raises(TransportBroken):
        a.poll(1)
