"""Local memory: registered regions, access checks, and memfd-backed shared buffers."""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import dataclasses
import functools
import mmap
import operator
import os
import threading
from typing import Any

from ..errors import AccessViolation, ConfigError
from ..types import Access, LocationKind, parse_location
from .descriptor import RegionDesc


def view(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes at ``addr`` (the caller checked the range)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


Maps = list[tuple[int, int, bytes]]

# The last map read: the permissions a fast check takes on trust while the range is still mapped
# (see ``_still_granted``). Replaced whole, never mutated, so readers need no lock.
_last_maps: Maps | None = None


def mappings() -> Maps | None:
    """This process's memory map as (start, end, permissions), in address order; None where
    the kernel does not publish one (not Linux). Reading it costs ~0.4 ms in a process with a
    few hundred mappings (a vLLM worker), most of it the kernel writing the text."""
    global _last_maps
    try:
        with open("/proc/self/maps", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        span, perms = line.split(b" ", 2)[:2]
        lo, _, hi = span.partition(b"-")
        out.append((int(lo, 16), int(hi, 16), perms))
    _last_maps = out
    return out


def _libc_msync() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).msync
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_msync = _libc_msync()
_MS_ASYNC = 1


def _mapped_now(addr: int, length: int) -> bool:
    """Whether every page of ``[addr, addr+length)`` is mapped right now: ``msync(MS_ASYNC)``
    does nothing on Linux but fail with ENOMEM over an unmapped page (one syscall, no map
    read). False where it cannot tell."""
    if _msync is None or addr <= 0 or length <= 0:
        return False
    lo = addr - addr % mmap.PAGESIZE
    return bool(_msync(lo, addr + length - lo, _MS_ASYNC) == 0)


def _still_granted(addr: int, length: int, write: bool) -> bool:
    """The fast check: the range is mapped now, and the last map read granted it (readable,
    writable with ``write``). A range unmapped since then fails the first half; one still
    mapped keeps the permissions it had then unless the process ``mprotect``-ed it in
    between, the one change this misses (as a racing munmap is missed by any check)."""
    maps = _last_maps
    if maps is None or not _mapped_now(addr, length):
        return False
    try:
        _check_in(maps, addr, length, write)
    except AccessViolation:
        return False
    return True


_MAX_END = 1 << 64  # sorts after every real end: (addr, _MAX_END) follows (addr, end, perms)


def _check_in(maps: Maps, addr: int, length: int, write: bool) -> None:
    end = addr + length
    pos = addr
    # from the last mapping that starts at or below addr: a worker has ~860 of them
    first = max(0, bisect.bisect_right(maps, (addr, _MAX_END)) - 1)
    for i in range(first, len(maps)):
        start, stop, perms = maps[i]
        if stop <= pos:
            continue
        if start > pos:
            break
        if perms[:1] != b"r" or (write and perms[1:2] != b"w"):
            need = "writable" if write else "readable"
            raise AccessViolation(f"{addr:#x}+{length} is not {need} memory of this process")
        pos = stop
        if pos >= end:
            return
    raise AccessViolation(f"{addr:#x}+{length} is not mapped in this process")


def check_mapped(addr: int, length: int, *, write: bool = False, maps: Maps | None = None) -> None:
    """Raise AccessViolation unless ``[addr, addr+length)`` is mapped readable (and writable,
    with ``write``) in this process, so that a bad raw address is an error, not a crash.

    The kernel's map (``maps``, else the last one read if the range is still mapped and it
    granted the range, else read now) answers without touching the memory; where there is
    none (not Linux) the range is taken on trust. A range unmapped after this check can still
    fault: the check is for mistakes, not for a racing munmap.
    """
    if length <= 0:
        return
    if maps is None:
        if _still_granted(addr, length, write):
            return
        maps = mappings()
        if maps is None:
            return
    _check_in(maps, addr, length, write)


def unmapped(ranges: list[tuple[int, int]], *, write: bool = False) -> dict[int, AccessViolation]:
    """``check_mapped`` for several ranges, reading the map at most once: index -> error of
    each range that is not this process's memory (empty where there is no map to read)."""
    todo = [
        (i, addr, length)
        for i, (addr, length) in enumerate(ranges)
        if length > 0 and not _still_granted(addr, length, write)
    ]
    if not todo:
        return {}
    maps = mappings()
    if maps is None:
        return {}
    bad: dict[int, AccessViolation] = {}
    for i, addr, length in todo:
        try:
            _check_in(maps, addr, length, write)
        except AccessViolation as exc:
            bad[i] = exc
    return bad


class SharedBuffer:
    """Memory backed by a memfd, so a peer on the same host can map it and copy at memcpy speed.

    ``array`` is a numpy uint8 view; ``addr`` its address. Pages are pre-faulted (MAP_POPULATE)
    so the first transfer does not pay for page faults. Close it after unregistering.
    """

    def __init__(self, size: int, name: str = "mooncake-connectors") -> None:
        import numpy as np

        try:
            size = operator.index(size)  # numpy ints too; a float or str is refused
        except TypeError:
            raise ConfigError(f"buffer size must be an int, got {size!r}") from None
        if size <= 0:
            raise ConfigError(f"buffer size must be > 0, got {size}")
        self.size = size
        try:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot create a {size}-byte buffer: {exc.strerror}") from exc
        try:
            os.ftruncate(self.fd, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(self.fd, size, flags=flags)
        except (OSError, OverflowError) as exc:
            # ENOMEM/EFBIG/ENOSPC: the host cannot back this size (the memfd is sparse until
            # mapped, so this is where an oversized request is refused).
            os.close(self.fd)
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ConfigError(f"cannot allocate a {size}-byte buffer: {why}", size=size) from exc
        except BaseException:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self.array
        # A view may still be alive somewhere; then the mapping goes with its last view.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self.fd)

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Region:
    """One registered range of this process's memory."""

    addr: int
    length: int
    location: str = "cpu:0"
    access: Access = Access.READ_WRITE
    memfd: int = -1
    memfd_inode: int = 0
    memfd_offset: int = 0
    writable: bool = True  # may local READs land here (False for bytes and read-only arrays)
    # Keeps the Python object that owns the memory alive while registered; not compared.
    owner: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.addr + self.length

    @functools.cached_property
    def kind(self) -> LocationKind:
        return parse_location(self.location)[0]

    @functools.cached_property
    def device(self) -> int:
        """The CUDA ordinal of a GPU region; -1 for host memory."""
        kind, rest = parse_location(self.location)
        return int(rest) if kind is LocationKind.CUDA else -1

    @functools.cached_property
    def mv(self) -> memoryview:
        """A byte view of the whole region; slicing it is far cheaper than building views.
        Host memory only: reading a GPU address as host memory would crash the process."""
        if self.device >= 0:
            raise AccessViolation(f"{self.addr:#x} is GPU memory ({self.location}), not host")
        return view(self.addr, self.length)

    def slice(self, addr: int, length: int) -> memoryview:
        off = addr - self.addr
        return self.mv[off : off + length]

    def to_desc(self) -> RegionDesc:
        return RegionDesc(
            addr=self.addr,
            length=self.length,
            location=self.location,
            access=int(self.access),
            cuda_device=self.device,
        )


def buffer_region(
    buffer: Any, *, location: str | None = None, access: Access | None = None
) -> Region:
    """Describe any supported buffer as a Region (not yet registered).

    Supported: SharedBuffer, numpy arrays, torch tensors (contiguous), and any object exposing
    the buffer protocol (bytearray, memoryview, mmap, bytes — the last read-only).
    """
    if isinstance(buffer, SharedBuffer):
        if buffer.closed:
            raise ConfigError("cannot register a closed SharedBuffer")
        return Region(
            buffer.addr,
            buffer.size,
            location or "cpu:0",
            Access.READ_WRITE if access is None else access,
            memfd=buffer.fd,
            memfd_inode=buffer.inode,
            owner=buffer,
        )
    mod = type(buffer).__module__
    if mod.startswith("torch"):
        if not buffer.is_contiguous():
            raise ConfigError("only contiguous tensors can be registered")
        dev = buffer.device
        actual = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu:0"
        if location is not None and parse_location(location)[0] is not parse_location(actual)[0]:
            raise ConfigError(f"a tensor on {dev} cannot be registered as {location!r} memory")
        return Region(
            int(buffer.data_ptr()),
            int(buffer.numel() * buffer.element_size()),
            location or actual,
            Access.READ_WRITE if access is None else access,
            owner=buffer,
        )
    import numpy as np

    if isinstance(buffer, np.ndarray):
        arr = buffer
        if not arr.flags.c_contiguous:
            raise ConfigError("only C-contiguous numpy arrays can be registered")
    else:
        try:
            arr = np.frombuffer(buffer, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"cannot register {type(buffer).__name__}: not a buffer, array or tensor"
            ) from exc
    writable = bool(arr.flags.writeable)
    rights = Access.READ_WRITE if writable else Access.READ
    if access is not None:
        if access & Access.WRITE and not writable:
            raise ConfigError("a read-only buffer cannot be registered with WRITE access")
        rights = access
    return Region(
        int(arr.ctypes.data),
        int(arr.nbytes),
        location or "cpu:0",
        rights,
        writable=writable,
        owner=arr,
    )


class LocalSegment:
    """The registered regions of this process, kept sorted for O(log n) range checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self.epoch = 0
        # The epoch again, as 8 bytes at a fixed address: compiled loops that serve requests
        # without the interpreter lock read it before each one (tcp's ``_tcp_fast.serve``).
        self._epoch_cell = array.array("Q", [0])
        self.epoch_addr: int = self._epoch_cell.buffer_info()[0]

    def add(self, region: Region) -> Region:
        if region.length < 0 or region.addr < 0:
            raise ConfigError(f"bad region address/length: {region.addr:#x}+{region.length}")
        if region.length == 0:
            raise ConfigError("cannot register an empty region")
        parse_location(region.location)  # raises ValueError (ConfigError below) if malformed
        with self._lock:
            i = bisect.bisect_right(self._starts, region.addr)
            prev = self._regions[i - 1] if i else None
            nxt = self._regions[i] if i < len(self._regions) else None
            if prev is not None and prev.addr == region.addr and prev.length == region.length:
                return prev  # registering the same range twice is harmless
            if (prev is not None and prev.end > region.addr) or (
                nxt is not None and region.end > nxt.addr
            ):
                raise ConfigError(
                    f"region {region.addr:#x}+{region.length} overlaps a registered region"
                )
            self._starts.insert(i, region.addr)
            self._regions.insert(i, region)
            self.epoch += 1
            self._epoch_cell[0] = self.epoch
            return region

    def remove(self, addr: int) -> Region:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                raise ConfigError(f"no region registered at {addr:#x}")
            del self._starts[i]
            region = self._regions.pop(i)
            self.epoch += 1
            self._epoch_cell[0] = self.epoch
            return region

    def find(self, addr: int, length: int) -> Region | None:
        # Lock-free read: list replacement under the lock keeps a consistent snapshot in CPython
        # only if we read both lists once; take the lock, it is uncontended on the data path.
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            r = self._regions[i]
        if addr + length <= r.end and length >= 0:
            return r
        return None

    def check(self, addr: int, length: int, need: Access, *, who: str = "") -> Region:
        """Return the region holding [addr, addr+length) with rights ``need``, else raise."""
        r = self.find(addr, length)
        if r is None:
            raise AccessViolation(
                f"{addr:#x}+{length} is not inside a registered region", peer=who or None
            )
        if need & ~r.access:
            raise AccessViolation(
                f"{addr:#x}+{length} lacks {need!r} rights (region allows {r.access!r})",
                peer=who or None,
            )
        return r

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions)
