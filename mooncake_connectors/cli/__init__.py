"""The ``mooncake-connectors`` command line.

Each subcommand imports what it needs inside its function so ``--help`` stays fast. The commands
live in this package's modules by kind; importing them registers them on ``app``.
"""

from __future__ import annotations

import sys

from . import bench, bench_moe, doctor, p2p, serve, tools  # noqa: F401  (their commands register on app)
from .common import app


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]
