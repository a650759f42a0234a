"""``BufferHandle`` and its pool (``compat_handles``): what a handle offers, that a handle's block
is reused once the handle is gone (and only then), the idle cap, registration once per kept
block, and close."""

from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest

from mooncake_connectors.compat_handles import REGISTER_MIN, BufferHandle, HandlePool


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.registered = 0
        self.unregistered = 0

    def register(self, addr: int, size: int) -> None:
        assert addr not in self.live
        self.live[addr] = size
        self.registered += 1

    def unregister(self, addr: int) -> None:
        del self.live[addr]
        self.unregistered += 1


def test_a_handle_is_a_writable_byte_buffer_with_ptr_and_size() -> None:
    pool = HandlePool(1 << 20)
    h, addr = pool.alloc(11)
    ctypes.memmove(addr, b"hello world", 11)
    assert isinstance(h, BufferHandle)
    assert len(h) == h.size() == 11 and h.ptr() == addr
    view = memoryview(h)
    assert view.itemsize == 1 and view.shape == (11,) and not view.readonly
    assert view.format in ("B", "<B") and view.cast("B").tobytes() == b"hello world"
    assert bytes(view) == bytes(h) == b"hello world"
    assert np.frombuffer(h, np.uint8)[:5].tobytes() == b"hello"
    view.cast("B")[0] = ord("j")  # ctypes' format is "<B": index through a cast
    assert bytes(h[:5]) == b"jello"
    empty, eaddr = pool.alloc(0)
    assert len(empty) == 0 and empty.ptr() == 0 == eaddr and bytes(empty) == b""


def test_torch_reads_a_handle() -> None:
    torch = pytest.importorskip("torch")
    pool = HandlePool(1 << 20)
    h, addr = pool.alloc(8)
    ctypes.memmove(addr, bytes(range(8)), 8)
    t = torch.frombuffer(h, dtype=torch.uint8, offset=2, count=4)
    assert t.tolist() == [2, 3, 4, 5]
    del h
    gc.collect()
    _, again = pool.alloc(8)
    assert again != addr  # the tensor keeps the handle, so its block is not handed out
    assert t.tolist() == [2, 3, 4, 5]


def test_a_block_comes_back_only_when_its_handle_is_gone() -> None:
    pool = HandlePool(8 << 20)
    a, pa = pool.alloc(4096)
    b, pb = pool.alloc(4096)
    assert pa != pb  # held handles never share memory
    ctypes.memmove(pa, b"A" * 4096, 4096)
    del a
    gc.collect()
    c, pc = pool.alloc(4096)
    assert pc == pa  # the warm block again
    d, pd = pool.alloc(8192)
    assert pd not in (pa, pb)  # sizes are kept apart
    assert bytes(b) == bytes(4096)  # the other handle untouched
    del b, c, d


def test_idle_blocks_are_capped_and_the_rest_let_go() -> None:
    reg = Registry()
    pool = HandlePool(3 * REGISTER_MIN, reg.register, reg.unregister)
    handles = [pool.alloc(REGISTER_MIN)[0] for _ in range(5)]
    assert reg.registered == 5 and len(reg.live) == 5
    del handles
    gc.collect()
    pool.alloc(1)  # the pool drains what came back on its next allocation
    assert pool.idle_bytes == 3 * REGISTER_MIN
    assert len(reg.live) == 3 and reg.unregistered == 2  # the two over the cap
    again = [pool.alloc(REGISTER_MIN) for _ in range(3)]
    assert {a for _, a in again} == set(reg.live) and reg.registered == 5  # reused, not anew


def test_small_blocks_are_not_registered() -> None:
    reg = Registry()
    pool = HandlePool(1 << 20, reg.register, reg.unregister)
    h, _ = pool.alloc(REGISTER_MIN - 1)
    assert reg.registered == 0
    del h


def test_close_unregisters_idle_blocks_and_held_handles_stay_valid() -> None:
    reg = Registry()
    pool = HandlePool(1 << 22, reg.register, reg.unregister)
    held, addr = pool.alloc(REGISTER_MIN)
    ctypes.memmove(addr, b"kept", 4)
    idle = pool.alloc(REGISTER_MIN)[0]
    del idle
    gc.collect()
    pool.close()
    assert reg.live == {addr: REGISTER_MIN}  # the idle one unregistered (the held one goes
    # with the client's engine, which the facade closes next)
    assert bytes(held[:4]) == b"kept"
    del held
    gc.collect()
    assert pool.idle_bytes == 0  # a closed pool takes nothing back


def test_threads_allocating_and_dropping_never_share_a_block() -> None:
    pool = HandlePool(16 * 65536)
    errors: list[str] = []

    def work(n: int) -> None:
        for i in range(200):
            h, addr = pool.alloc(65536)
            stamp = bytes([n]) * 65536
            ctypes.memmove(addr, stamp, 65536)
            if bytes(h) != stamp:
                errors.append(f"thread {n} round {i}: another thread wrote into its block")
            del h

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    assert pool.idle_bytes <= 16 * 65536
