#!/usr/bin/env python3
"""GPU check: SGLang serves a tiny model with HiCache on our store backend, and a second server
gets the first one's prefix from the store.

Needs a CUDA GPU, SGLang (>= 0.5.23) and this package installed in the running Python. It has not
been run by the project yet (see docs/sglang.md: no GPU machine with SGLang was available).

  1. builds a tiny random Llama (2 layers, hidden 256, 4 heads, 2 KV heads) in a temp dir;
  2. starts our ``master`` and a ``store-server`` (loopback) as processes;
  3. starts SGLang server A with ``--enable-hierarchical-cache --hicache-storage-backend dynamic``
     on our backend, sends a long prompt (token ids), waits until its pages are in the store;
  4. starts server B the same way (empty GPU and host caches), sends the same prompt:
     PASS if B reports cached tokens (they can only have come from the store), B's greedy
     output equals A's, and the store holds objects of this model.

Every wait has a deadline; any failure prints the servers' log tails and exits 1.

    python scripts/gpu/sglang_hicache_check.py [--keep] [--page-size 16] [--prompt-tokens 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(pred: Any, timeout: float, what: str, procs: list[Any]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited ({p.proc.returncode}) while waiting for {what}"
                )
        if pred():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


class Proc:
    def __init__(self, name: str, args: list[str], workdir: str, env: dict[str, str] | None = None):
        self.name = name
        self.log = os.path.join(workdir, f"{name}.log")
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                args, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def tail(self, n: int = 40) -> str:
        with open(self.log, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, 9)
                self.proc.wait(30)


def build_tiny_model(path: str) -> None:
    """A random 2-layer Llama with a small byte-level BPE tokenizer; seed fixed."""
    code = r"""
import glob, os, sys, sysconfig, torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
out = sys.argv[1]
torch.manual_seed(0)
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:60]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(files, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
fast.save_pretrained(out)
cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
                  torch_dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
"""
    subprocess.run([PY, "-c", code, path], check=True, timeout=600)


def post(port: int, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def store_stats(master: str) -> dict[str, float]:
    from mooncake_connectors.store import ClientConfig, StoreClient

    with StoreClient(ClientConfig(master=master, timeout=5.0)) as c:
        return c.stats()


def sglang_server(name: str, model: str, port: int, extra: dict[str, Any], args: Any, work: str):
    return Proc(
        name,
        [
            PY,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--mem-fraction-static",
            "0.05",
            "--page-size",
            str(args.page_size),
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "2",
            "--hicache-write-policy",
            "write_through",
            "--hicache-mem-layout",
            args.layout,
            "--hicache-storage-prefetch-policy",
            "wait_complete",
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
        ],
        work,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, model)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sglang-hicache-check-")
    procs: list[Proc] = []
    ok = False
    try:
        model = os.path.join(work, "model")
        build_tiny_model(model)
        mport = free_port()
        master = f"127.0.0.1:{mport}"
        cli = [PY, "-m", "mooncake_connectors"]
        procs.append(Proc("master", [*cli, "master", "--port", str(mport)], work))
        procs.append(
            Proc("store", [*cli, "store-server", "--master", master, "--memory", "2G"], work)
        )
        wait(lambda: store_stats(master)["servers"] == 1, 60, "the store server", procs)
        extra = {
            "backend_name": "mooncake_connectors",
            "module_path": "mooncake_connectors.adapters.sglang",
            "class_name": "HiCacheStore",
            "interface_v1": 1,
            "master": master,
        }
        ids = [2 + (i * 7919) % 1000 for i in range(args.prompt_tokens)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}

        pa, pb = free_port(), free_port()
        a = sglang_server("server-a", model, pa, extra, args, work)
        procs.append(a)
        wait(lambda: healthy(pa), 900, "server A", procs)
        out_a = post(pa, body)
        print("A:", json.dumps(out_a.get("meta_info", {}), default=str)[:400])
        page_objs = 2 * (args.prompt_tokens // args.page_size)  # K and V per full page
        wait(lambda: store_stats(master)["keys"] >= page_objs * 0.9, 120, "A's pages", procs)
        stats_a = store_stats(master)
        print("store after A:", {k: stats_a[k] for k in ("keys", "used_bytes")})

        b = sglang_server("server-b", model, pb, extra, args, work)
        procs.append(b)
        wait(lambda: healthy(pb), 900, "server B", procs)
        out_b = post(pb, body)
        meta_b = out_b.get("meta_info", {})
        print("B:", json.dumps(meta_b, default=str)[:400])
        cached = int(meta_b.get("cached_tokens", 0))
        details = meta_b.get("cached_tokens_details") or {}
        same = out_a.get("output_ids") == out_b.get("output_ids")
        print(f"B cached_tokens={cached} details={details} same_output={same}")
        ok = cached >= args.prompt_tokens // 2 and same
        print("PASS" if ok else "FAIL")
    except Exception as exc:  # report everything, then the logs
        print(f"FAIL: {exc!r}")
    finally:
        if not ok:
            for p in procs:
                print(f"----- {p.name} (last lines) -----\n{p.tail()}")
        for p in reversed(procs):
            p.stop()
        if args.keep or not ok:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
