"""The SSD tier of a store server: evicted objects spilled to files, served back on demand.

One file per object, named by the file id the master chose. Writes go to a temporary name and
are renamed when complete, so a file that exists is whole. The directory is emptied at start: the
master learns of disk copies only from a live server, so files from an earlier run are garbage.
The server never holds more than ``budget`` bytes here, whatever it is asked to write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger(__name__)
_SUFFIX = ".obj"


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
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def _path(self, fid: int) -> Path:
        return self.dir / f"{fid:x}{_SUFFIX}"

    def write(self, fid: int, data: memoryview) -> bool:
        """Store ``data`` as file ``fid``; False when it would exceed the budget or I/O failed."""
        n = len(data)
        with self._lock:
            if fid in self._sizes or self.used + n > self.budget:
                return False
            self.used += n
            self._sizes[fid] = n
        path = self._path(fid)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as fh:
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
        """Read file ``fid`` into ``dest``; its length, or -1 if there is no such file."""
        try:
            with open(self._path(fid), "rb", buffering=0) as fh:
                got = 0
                while got < len(dest):
                    n = fh.readinto(dest[got:])
                    if not n:
                        break
                    got += n
                return got
        except FileNotFoundError:
            return -1

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
