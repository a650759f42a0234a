"""Two processes, one-sided READ and WRITE over the embedded metadata server.

    python examples/transfer_two_processes.py

The parent starts a metadata server, spawns a target that registers 16 MiB, then reads and
writes it and checks the bytes.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.transfer_core import TransferEngine
from mooncake_connectors.transfer_core.metadata.http import MetadataHTTPServer

SIZE = 16 << 20


def target(url: str, ready: mp.Queue, done: mp.Event) -> None:  # type: ignore[type-arg]
    with TransferEngine(EngineConfig(metadata=url)) as engine:
        buf = engine.allocate_buffer(SIZE)
        buf.array[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        ready.put((engine.segment_name, buf.addr))
        done.wait(60)


def main() -> None:
    server = MetadataHTTPServer("127.0.0.1", 0).start()
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(server.url, ready, done))
    proc.start()
    segment, remote = ready.get(timeout=60)
    with TransferEngine(EngineConfig(metadata=server.url)) as engine:
        local = engine.allocate_buffer(SIZE)
        engine.read(segment, local.addr, remote, SIZE)
        assert (local.array == np.arange(SIZE, dtype=np.uint64).astype(np.uint8)).all()
        local.array[:4] = [1, 2, 3, 4]
        engine.write(segment, local.addr, remote + 100, 4)
        engine.read(segment, local.addr + 8, remote + 100, 4)
        print("read", SIZE, "bytes; wrote and read back", [int(x) for x in local.array[8:12]])
    done.set()
    proc.join(30)
    server.stop()


if __name__ == "__main__":
    main()
