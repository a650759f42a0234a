"""``process_vm_copy_many``: many ranges per system call, each range's own outcome."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_connectors.transfer_core.transports.shm import process_vm_copy_many

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = mmap.PAGESIZE


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@pytest.fixture
def half_readable() -> Iterator[int]:
    """Two pages: the first readable (bytes 7), the second with no access at all."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = _libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(base, 7, 2 * PAGE)
    assert _libc.mprotect(base + PAGE, PAGE, 0) == 0  # PROT_NONE
    yield base
    _libc.munmap(base, 2 * PAGE)


def test_more_ranges_than_one_call_takes_are_all_copied() -> None:
    src = np.arange(3000 * 7, dtype=np.uint32).view(np.uint8)  # 3000 ranges of 28 bytes
    n = 28
    for write in (False, True):
        dst = np.zeros_like(src)
        ranges = [
            (
                (_addr(src) if write else _addr(dst)) + i * n,
                (_addr(dst) if write else _addr(src)) + i * n,
                n,
            )
            for i in range(src.size // n)
        ]
        assert process_vm_copy_many(os.getpid(), ranges, write) == [None] * len(ranges)
        assert np.array_equal(src, dst)


def test_an_unreadable_range_fails_alone(half_readable: int) -> None:
    src = np.arange(4 * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    ranges = [
        (_addr(dst), _addr(src), PAGE),
        (_addr(dst) + PAGE, half_readable + PAGE, 100),  # no access: faults at once
        (_addr(dst) + 2 * PAGE, _addr(src) + 2 * PAGE, PAGE),
        (_addr(dst) + 3 * PAGE, _addr(src) + 3 * PAGE, PAGE),
    ]
    out = process_vm_copy_many(os.getpid(), ranges, write=False)
    assert out[0] is None and out[2] is None and out[3] is None
    assert isinstance(out[1], OSError) and out[1].errno == errno.EFAULT
    assert np.array_equal(dst[:PAGE], src[:PAGE])
    assert not dst[PAGE : 2 * PAGE].any()  # nothing landed for the failed range
    assert np.array_equal(dst[2 * PAGE :], src[2 * PAGE :])


def test_a_range_running_into_unreadable_memory_fails_and_the_next_still_goes(
    half_readable: int,
) -> None:
    # Readable start, unreadable end: the kernel copies the readable part and stops there; that
    # range then reports its error and the range after it is still copied.
    dst = np.zeros(3 * PAGE, dtype=np.uint8)
    src = np.full(PAGE, 9, dtype=np.uint8)
    ranges = [
        (_addr(dst), half_readable + PAGE // 2, PAGE),
        (_addr(dst) + 2 * PAGE, _addr(src), PAGE),
    ]
    out = process_vm_copy_many(os.getpid(), ranges, write=False)
    assert isinstance(out[0], OSError) and out[0].errno == errno.EFAULT
    assert (dst[: PAGE // 2] == 7).all()  # what was readable arrived
    assert out[1] is None and (dst[2 * PAGE :] == 9).all()


def test_a_gone_process_fails_every_range() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out = process_vm_copy_many(
        pid, [(_addr(buf), _addr(buf), 8), (_addr(buf) + 8, _addr(buf), 8)], False
    )
    assert all(isinstance(e, OSError) and e.errno == errno.ESRCH for e in out)
