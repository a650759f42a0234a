from __future__ import annotations

import mmap

import numpy as np
import pytest

from mooncake_connectors.errors import AccessViolation, ConfigError
from mooncake_connectors.transfer_core.memory import LocalSegment, SharedBuffer, buffer_region, view
from mooncake_connectors.types import Access


def test_buffers_of_every_kind() -> None:
    arr = np.arange(100, dtype=np.uint32)
    r = buffer_region(arr)
    assert (r.addr, r.length, r.access, r.writable) == (
        arr.ctypes.data,
        400,
        Access.READ_WRITE,
        True,
    )
    ba = bytearray(b"abc")
    assert buffer_region(ba).length == 3
    ro = buffer_region(b"immutable")
    assert ro.access == Access.READ and not ro.writable
    with pytest.raises(ConfigError):
        buffer_region(b"immutable", access=Access.WRITE)
    mm = mmap.mmap(-1, 4096)
    assert buffer_region(mm).length == 4096
    assert buffer_region(memoryview(ba)).addr == buffer_region(ba).addr
    with pytest.raises(ConfigError):
        buffer_region(np.zeros((4, 4))[:, 1])  # not contiguous
    with pytest.raises(ConfigError):
        buffer_region(object())


def test_torch_tensor_region() -> None:
    torch = pytest.importorskip("torch", reason="torch not installed")
    t = torch.arange(64, dtype=torch.float16)
    r = buffer_region(t)
    assert (r.addr, r.length, r.location) == (t.data_ptr(), 128, "cpu:0")
    with pytest.raises(ConfigError):
        buffer_region(t.view(8, 8).t())


def test_shared_buffer_is_memfd_and_visible() -> None:
    with SharedBuffer(8192) as buf:
        r = buffer_region(buf)
        assert r.memfd == buf.fd and r.memfd_inode > 0
        buf.array[:4] = [1, 2, 3, 4]
        assert bytes(view(buf.addr, 4)) == b"\x01\x02\x03\x04"


def test_segment_checks_ranges_and_rights() -> None:
    seg = LocalSegment()
    a = np.zeros(1000, dtype=np.uint8)
    b = np.zeros(1000, dtype=np.uint8)
    ra = seg.add(buffer_region(a))
    seg.add(buffer_region(b, access=Access.READ))
    assert seg.check(ra.addr + 10, 990, Access.WRITE) is ra
    with pytest.raises(AccessViolation):
        seg.check(ra.addr + 10, 991, Access.READ)  # one byte past the end
    with pytest.raises(AccessViolation, match="lacks"):
        seg.check(b.ctypes.data, 1, Access.WRITE)
    with pytest.raises(AccessViolation):
        seg.check(1, 1, Access.READ)
    with pytest.raises(ConfigError, match="overlaps"):
        seg.add(buffer_region(a[10:20]))
    assert seg.add(buffer_region(a)) is ra  # same range again is a no-op
    epoch = seg.epoch
    seg.remove(ra.addr)
    assert seg.epoch == epoch + 1
    with pytest.raises(AccessViolation):
        seg.check(ra.addr, 1, Access.READ)
    with pytest.raises(ConfigError):
        seg.remove(ra.addr)
