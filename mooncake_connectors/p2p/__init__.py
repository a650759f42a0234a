"""The P2P store: swarm distribution of large read-only objects (checkpoints, weights).

A publisher registers files or tensors zero-copy and writes a manifest (chunk size, per-chunk
SHA-256, version) to the transfer engine's metadata service; every fetcher pulls chunks from any
holder, verifies each, and serves it onward at once. See docs/p2p.md.
"""

from .fetch import FetchStats
from .manifest import FetchFailed, Manifest, ObjectNotFound, P2PError
from .store import ObjectInfo, P2PStore, read_marker

__all__ = [
    "FetchFailed",
    "FetchStats",
    "Manifest",
    "ObjectInfo",
    "ObjectNotFound",
    "P2PError",
    "P2PStore",
    "read_marker",
]
