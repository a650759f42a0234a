"""A second LMCache instance in its own process, driven by JSON lines on stdin/stdout.

    python lmcache_instance.py MASTER [BACKEND]
    then JSON lines: {"cmd": "put"|"get"|"contains", "seeds": [...], "tokens": N}
    or {"cmd": "quit"}

Builds LMCache's StorageManager with our plugin exactly as the test process does; with BACKEND
``mooncakestore``, with LMCache's own Mooncake connector instead, the ``mooncake`` alias switched
on from ``MOONCAKE_CONNECTORS_AS_MOONCAKE`` (as vLLM's plugin loader would).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lmcache_env as env


def main() -> None:
    plugin = sys.argv[2] if len(sys.argv) > 2 else env.PLUGIN
    if plugin == env.MOONCAKESTORE:
        from mooncake_connectors.compat_alias import install_from_env

        if not install_from_env():
            raise SystemExit("mooncakestore: set MOONCAKE_CONNECTORS_AS_MOONCAKE=1")
    sm = env.storage_manager(sys.argv[1], plugin)
    backend = env.remote(sm, plugin)
    where = f"RemoteBackend-{plugin}"
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            req: dict[str, Any] = json.loads(line)
            cmd, seeds, tokens = req["cmd"], req.get("seeds", []), req.get("tokens", env.CHUNK)
            if cmd == "quit":
                break
            if cmd == "put":
                env.put(sm, seeds, tokens)
                env.wait_stored(sm, seeds, plugin=plugin)
                reply: dict[str, Any] = {"ok": True}
            elif cmd == "get":
                objs = sm.batched_get([env.key(s) for s in seeds], location=where)
                pairs = zip(objs, seeds, strict=True)
                reply = {"match": [env.matches(o, s, tokens) for o, s in pairs]}
                for o in objs:
                    if o is not None:
                        o.ref_count_down()
            elif cmd == "contains":
                reply = {"prefix": backend.batched_contains([env.key(s) for s in seeds])}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        sm.close()


if __name__ == "__main__":
    main()
