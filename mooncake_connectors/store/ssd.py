"""The SSD tier of a store server: stripes of evicted objects spilled to files, read back on demand.

One file per stripe, named by the file id the master chose: a 32-byte header (magic ``MCSD``,
format version, payload length, CRC32 of the payload) and the payload. Writes go to a temporary
name and are renamed when complete, so a file that exists is whole; every read checks the
length and the checksum, so a damaged file reads as missing, never as wrong bytes. The
server never holds more than ``budget`` bytes here (headers included), whatever it is asked to
write.

Restart: once the master tells the server which object stripe a file holds, the server writes
that description (the ``Part`` it would re-report) beside it as ``ID.part``. A server started
on the same directory keeps each file that has a description and whose length and CRC check
(:meth:`SsdStore.reindex`), and re-reports them to the master; files without one (a spill the
master never confirmed, a crash mid-write) and damaged files are deleted. No fsync: the files
survive a process crash or restart, not necessarily a power loss.
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
_META = ".part"
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
        for p in self.dir.glob("*.tmp"):
            p.unlink(missing_ok=True)
        self.budget = budget
        self.used = 0
        self.corrupt = 0  # reads refused for a bad header or checksum
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def _path(self, fid: int) -> Path:
        return self.dir / f"{fid:x}{_SUFFIX}"

    def _meta_path(self, fid: int) -> Path:
        return self.dir / f"{fid:x}{_META}"

    def reindex(self) -> list[tuple[int, bytes]]:
        """Files an earlier run left that are whole and described: (file id, description).
        Everything else in the directory is deleted; the kept files count against the budget."""
        kept: list[tuple[int, bytes]] = []
        for path in sorted(self.dir.glob(f"*{_SUFFIX}")):
            try:
                fid = int(path.name[: -len(_SUFFIX)], 16)
                meta = self._meta_path(fid).read_bytes()
                n = path.stat().st_size
            except (ValueError, OSError):
                path.unlink(missing_ok=True)
                continue
            if n < SSD_HEADER or self.used + n > self.budget or not self._whole(path, n):
                self.delete_files(fid)
                continue
            self.used += n
            self._sizes[fid] = n
            kept.append((fid, meta))
        for meta_path in self.dir.glob(f"*{_META}"):  # descriptions without their file
            fid_text = meta_path.name[: -len(_META)]
            if not self.dir.joinpath(fid_text + _SUFFIX).exists():
                meta_path.unlink(missing_ok=True)
        if kept:
            log.info("SSD %s: %d file(s) kept from an earlier run", self.dir, len(kept))
        return kept

    def _whole(self, path: Path, size: int) -> bool:
        try:
            with open(path, "rb", buffering=0) as fh:
                head = fh.read(SSD_HEADER)
                magic, fmt, length, crc = _HEAD.unpack_from(head)
                if magic != _MAGIC or fmt != _FORMAT or length + SSD_HEADER != size:
                    return False
                got = 0
                while chunk := fh.read(1 << 20):
                    got = zlib.crc32(chunk, got)
                return bool(got == crc)
        except (OSError, struct.error):
            return False

    def describe(self, fid: int, meta: bytes) -> None:
        """Record what file ``fid`` holds, so that a restarted server can re-report it."""
        with self._lock:
            if fid not in self._sizes:
                return
        path = self._meta_path(fid)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(meta)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("SSD description %s not written: %s", path, exc)
            tmp.unlink(missing_ok=True)

    def delete_files(self, fid: int) -> None:
        for path in (self._path(fid), self._meta_path(fid)):
            with contextlib.suppress(OSError):
                path.unlink()

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
        self.delete_files(fid)

    def disk_bytes(self) -> int:
        """Bytes the files take on disk now (what tests check against the budget)."""
        return files_bytes(self.dir, f"*{_SUFFIX}")


def files_bytes(directory: Path, pattern: str = "*") -> int:
    """Bytes of the files in ``directory`` matching ``pattern``, read while the server may
    be writing and deleting them: a file gone between the listing and its ``stat`` counts 0."""
    total = 0
    for path in directory.glob(pattern):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total
