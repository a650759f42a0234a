"""A second LMCache instance in its own process, driven by JSON lines on stdin/stdout.

    python lmcache_instance.py MASTER      then   {"cmd": "put"|"get"|"contains", "seeds": [...],
                                                   "tokens": N}  or  {"cmd": "quit"}

Builds LMCache's StorageManager with our plugin exactly as the test process does.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lmcache_env as env


def main() -> None:
    sm = env.storage_manager(sys.argv[1])
    backend = env.remote(sm)
    where = f"RemoteBackend-{env.PLUGIN}"
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            req: dict[str, Any] = json.loads(line)
            cmd, seeds, tokens = req["cmd"], req.get("seeds", []), req.get("tokens", env.CHUNK)
            if cmd == "quit":
                break
            if cmd == "put":
                env.put(sm, seeds, tokens)
                env.wait_stored(sm, seeds)
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
