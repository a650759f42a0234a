"""The SSD tier of a store server: stripes of evicted objects spilled to files, read back on demand.

One file per stripe, named by the file id the master chose: a 32-byte header (magic ``MCSD``,
format version, payload length, CRC32 of the payload) and the payload. Writes go to a temporary
name and are renamed when complete, so a file that exists is whole; every read checks the
length and the checksum, so a damaged file reads as missing, never as wrong bytes. The
directory is emptied at start: the master learns of disk copies only from a live server, so
files from an earlier run (or a crash mid-spill) are garbage. No fsync: a file is useful only
while this process lives. The server never holds more than ``budget`` bytes here (headers
included), whatever it is asked to write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib
from pathlib import Path

from ..errors import ConfigError
from .protocol import SSD_HEADER

log = logging.getLogger(__name__)
_SUFFIX = ".obj"
_MAGIC = b"MCSD"
_FORMAT = 1
_HEAD = struct.Struct("<4sIQI")  # magic, format, payload length, crc32; zero-padded to SSD_HEADER
MISSING = -1
CORRUPT = -2


class SsdStore:
    def __init__(self, directory: str, budget: int) -> None:
        if budget <= 0:
            raise ConfigError(f"SSD budget must be > 0, got {budget}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use SSD directory {directory}: {exc}") from exc
        for p in list(self.dir.glob(f"*{_SUFFIX}")) + list(self.dir.glob(f"*{_SUFFIX}.tmp")):
            p.unlink(missing_ok=True)
        self.budget = budget
        self.used = 0
        self.corrupt = 0  # reads refused for a bad header or checksum
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def _path(self, fid: int) -> Path:
        return self.dir / f"{fid:x}{_SUFFIX}"

    def write(self, fid: int, data: memoryview) -> bool:
        """Store ``data`` as file ``fid``; False when it would exceed the budget or I/O failed."""
        n = len(data) + SSD_HEADER
        with self._lock:
            if fid in self._sizes or self.used + n > self.budget:
                return False
            self.used += n
            self._sizes[fid] = n
        path = self._path(fid)
        tmp = path.with_name(path.name + ".tmp")
        head = _HEAD.pack(_MAGIC, _FORMAT, len(data), zlib.crc32(data)).ljust(SSD_HEADER, b"\0")
        try:
            with open(tmp, "wb") as fh:
                fh.write(head)
                fh.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("SSD write of %s failed: %s", path, exc)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used -= n
                self._sizes.pop(fid, None)
            return False
        return True

    def read_into(self, fid: int, dest: memoryview) -> int:
        """Read file ``fid`` into ``dest`` (which must be its exact length): that length, or
        ``MISSING`` (no such file) or ``CORRUPT`` (bad header, length or checksum)."""
        path = self._path(fid)
        try:
            with open(path, "rb", buffering=0) as fh:
                head = fh.read(SSD_HEADER)
                if len(head) < SSD_HEADER:
                    return self._corrupt(path, "short header")
                magic, fmt, length, crc = _HEAD.unpack_from(head)
                if magic != _MAGIC or fmt != _FORMAT or length != len(dest):
                    return self._corrupt(path, f"header {magic!r} v{fmt} length {length}")
                got = 0
                while got < length:
                    n = fh.readinto(dest[got:])
                    if not n:
                        return self._corrupt(path, f"truncated at {got} of {length} bytes")
                    got += n
        except FileNotFoundError:
            return MISSING
        if zlib.crc32(dest) != crc:
            return self._corrupt(path, "checksum mismatch")
        return len(dest)

    def _corrupt(self, path: Path, why: str) -> int:
        self.corrupt += 1
        log.error("SSD file %s is damaged (%s); it reads as missing", path, why)
        return CORRUPT

    def delete(self, fid: int) -> None:
        with self._lock:
            n = self._sizes.pop(fid, None)
            if n is None:
                return
            self.used -= n
        with contextlib.suppress(FileNotFoundError):
            self._path(fid).unlink()

    def disk_bytes(self) -> int:
        """Bytes the files take on disk now (what tests check against the budget)."""
        return sum(p.stat().st_size for p in self.dir.glob(f"*{_SUFFIX}"))
