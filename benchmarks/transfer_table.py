"""Markdown table from one or more `mooncake-connectors bench transfer -o FILE` runs.

    python benchmarks/transfer_table.py run1.json run2.json run3.json

GB/s cells are the median over runs of each run's median; ratios are taken within each run
(same window for both systems) and then the median over runs.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

SYSTEMS = ["ours_tcp", "ours_shm", "mooncake_tcp", "raw_socket"]
CEILINGS = ["memcpy", "memcpy_shm"]
RATIOS = [
    "tcp_vs_mooncake_tcp",
    "tcp_vs_raw_socket",
    "shm_vs_mooncake_tcp",
    "shm_vs_memcpy",
    "shm_vs_memcpy_shm",
]


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def main(paths: list[str]) -> None:
    runs: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as fh:
            runs.append(json.load(fh))
    labels = [k for k in runs[0]["results"] if not k.startswith("COPY")]
    head = ["case", *SYSTEMS, *CEILINGS, *RATIOS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label in labels:
        copy = label.replace("READ", "COPY").replace("WRITE", "COPY")
        cells = [label]
        for system in SYSTEMS:
            cells.append(
                med(
                    [
                        r["results"][label][system]
                        for r in runs
                        if system in r["results"].get(label, {})
                    ]
                )
            )
        for ceiling in CEILINGS:
            cells.append(
                med(
                    [
                        r["results"][copy][ceiling]
                        for r in runs
                        if ceiling in r["results"].get(copy, {})
                    ]
                )
            )
        for ratio in RATIOS:
            cells.append(
                med(
                    [r["ratios"][label][ratio] for r in runs if ratio in r["ratios"].get(label, {})]
                )
            )
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
