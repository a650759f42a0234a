"""vLLM OpenAI servers and our proxy as subprocesses, with deadlines on every wait.

Used by the vLLM integration tests and ``mooncake-connectors bench vllm-pd``; no vLLM import
(the servers are other processes). Each server runs in its own session (process group) so that
stopping or killing it takes its engine-core and worker children along; its output goes to a log
file (``tail()``). Engines are pinned to one CPU core each (``VLLM_CPU_OMP_THREADS_BIND``): two
engines sharing a core starve each other.

Ports: a vLLM engine needs its numbers before it starts, so they are reserved
(:func:`~.ports.free_port`) and another process may take one before the engine binds it. A
server whose log says so while it starts is started again on fresh numbers, up to
``PORT_ATTEMPTS`` starts, then fails naming the holder. A server whose command line names
another's URL (the proxy) is restarted when that one moved.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .ports import clashes, describe_clash, free_port, reported
from .procs import CLI

# Two engines starting at once on two shared cores are slow; on a machine loaded by other work
# a start can take longer still: MOONCAKE_CONNECTORS_ENGINE_START_TIMEOUT (seconds) sets it.
ENGINE_START_TIMEOUT = float(os.environ.get("MOONCAKE_CONNECTORS_ENGINE_START_TIMEOUT") or 300.0)
PORT_ATTEMPTS = 3  # starts of a server whose reserved port was taken before it bound it
FRESH_PORT = "<fresh port>"  # a VllmServer env or kv extra-config value: reserved per start

# Our connectors, which ask Linux for AMX tile state themselves (cpu_amx.py).
OUR_CONNECTORS = frozenset({"MooncakeConnectorsPD", "MooncakeConnectorsStore"})
# vLLM-CPU's attention kernel uses AMX on AMX hosts but leaves asking Linux for the tile state to
# oneDNN's first large matmul: an engine whose first forward is a few tokens over KV it loaded
# (a PD decode, a store hit) dies with SIGILL (worker exit -4). Our connectors ask when the KV
# cache is registered; an engine running another connector (vLLM's NixlConnector,
# MooncakeConnector, MooncakeStoreConnector, with the wheel or on our alias) gets this as its
# ``sitecustomize``, so what is compared is the connector, not the crash.
AMX_SITECUSTOMIZE = """\
# Written by mooncake-connectors' bench launcher for an engine running a connector not ours.
try:
    import ctypes

    ctypes.CDLL(None).syscall(158, 0x1023, 18)  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
except Exception:
    pass
"""


def runs_only_our_connectors(kv: dict[str, Any] | None) -> bool:
    """Whether ``--kv-transfer-config`` ``kv`` names only our connectors (MultiConnector: each
    of its connectors); no config at all counts as ours (no connector, nothing loaded)."""
    if kv is None:
        return True
    if kv.get("kv_connector") == "MultiConnector":
        subs = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
        return all(runs_only_our_connectors(sub) for sub in subs)
    return kv.get("kv_connector") in OUR_CONNECTORS


def http_ok(url: str) -> bool:
    """True when ``url`` answers 200 within half a second."""
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class Server(abc.ABC):
    """A subprocess answering HTTP on 127.0.0.1:port; ``url`` is its base URL."""

    name = "server"

    def __init__(
        self, log_dir: Path, port: int | None = None, reserved: Sequence[str] = ()
    ) -> None:
        self.fixed_port = port  # the caller's number: never replaced
        self.port = port or 0
        self.reserved = dict.fromkeys(reserved, 0)  # more ports it binds, by name
        self.reserve()
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.attempts = PORT_ATTEMPTS  # starts before a taken port fails wait_ready
        self._launched: list[str] = []  # the command line of the running start
        self._log_from = 0  # where this start's output begins in the log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reserve(self) -> None:
        """Fresh numbers for every port of this server but one the caller fixed."""
        if not self.fixed_port:
            self.port = free_port()
        for name in self.reserved:
            self.reserved[name] = free_port()

    def ports(self) -> list[int]:
        return [self.port, *self.reserved.values()]

    def movable(self) -> bool:
        """Whether a start on fresh numbers can help: some port is ours to choose."""
        return not self.fixed_port or bool(self.reserved)

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The argv that starts this server."""

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def cpus(self) -> set[int] | None:
        """CPUs the whole process tree is confined to (None: wherever the OS puts it)."""
        return None

    def launch(self) -> Server:
        cpus = self.cpus()
        self._launched = self.command()
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            self.proc = subprocess.Popen(
                self._launched,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                # In the child before exec, so every process it starts inherits the set.
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
            )
        return self

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT) -> Server:
        end = time.monotonic() + timeout
        starts = 1
        while time.monotonic() < end:
            if self._launched and self._launched != self.command():  # a server it names moved
                self.stop()
                self.launch()
            exited = self.proc is not None and self.proc.poll() is not None
            taken = clashes(self.output())  # read after the poll: an exited start's is whole
            if taken:
                if starts >= self.attempts or not self.movable():
                    raise RuntimeError(
                        f"{self.name}: a port it binds was taken ({starts} start(s)): "
                        f"{describe_clash(self.ports(), taken)}\n{self.tail()}"
                    )
                starts += 1
                self.stop()
                self.reserve()
                self.launch()
                end = time.monotonic() + timeout  # each start gets the whole time
                continue
            if exited and self.proc is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while starting:\n{self.tail()}"
                )
            if http_ok(self.url + "/health"):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.tail()}")

    def output(self) -> str:
        """What the running start wrote to the log so far."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_from)
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(t for t in text[-lines:] if not t.startswith("WARNING: Location"))

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as peers can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # the API server shuts its engine processes down itself
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # children left behind by a parent that died first
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class VllmServer(Server):
    """``python -m vllm.entrypoints.openai.api_server`` on the tiny model, pinned to one core."""

    name = "vllm"

    def __init__(
        self,
        log_dir: Path,
        model: Path,
        *,
        core: int,
        kv_transfer_config: dict[str, Any] | None = None,
        max_model_len: int = 4096,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        pin_all: bool = False,
        dtype: str = "bfloat16",
        sitecustomize: str = "",
    ) -> None:
        self.env = env or {}
        self.kv_transfer_config = kv_transfer_config
        # Python run by the engine's processes at start (a patch a foreign connector needs on a
        # CPU-only host); every foreign connector's engine also gets AMX_SITECUSTOMIZE.
        if not runs_only_our_connectors(kv_transfer_config):
            sitecustomize = AMX_SITECUSTOMIZE + sitecustomize
        self.sitecustomize = sitecustomize
        extra = (kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        fresh = [f"env:{k}" for k, v in self.env.items() if v == FRESH_PORT]
        fresh += [f"kv:{k}" for k, v in extra.items() if v == FRESH_PORT]
        super().__init__(log_dir, reserved=fresh)
        self.model = model
        self.core = core
        self.pin_all = pin_all
        # Everything of the command line but the port, which is chosen at start.
        self.engine_args = [
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            *args,
        ]

    def env_port(self, name: str) -> int:
        """The number this start reserved for environment variable ``name``."""
        return self.reserved[f"env:{name}"]

    def command(self) -> list[str]:
        api = "vllm.entrypoints.openai.api_server"
        cmd = [sys.executable, "-m", api, "--port", str(self.port), *self.engine_args]
        kv = self.kv_transfer_config
        if kv is not None:
            extra = dict(kv.get("kv_connector_extra_config") or {})
            for k in extra:
                extra[k] = self.reserved.get(f"kv:{k}", extra[k])
            if extra:
                kv = {**kv, "kv_connector_extra_config": extra}
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        return cmd

    def cpus(self) -> set[int] | None:
        # vLLM binds only the worker's compute threads; pin_all adds the API server and the
        # engine core (the scheduler), which otherwise float onto the other engine's core.
        return {self.core} if self.pin_all else None

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            VLLM_HOST_IP="127.0.0.1",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        env.update({k[4:]: str(n) for k, n in self.reserved.items() if k.startswith("env:")})
        if self.sitecustomize:
            patch = self.log_path.parent / f"{self.log_path.stem}-site"
            patch.mkdir(parents=True, exist_ok=True)
            (patch / "sitecustomize.py").write_text(self.sitecustomize)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(patch), env.get("PYTHONPATH")]))
        return env

    def metric(self, name: str, label: str = "", timeout: float = 60) -> float:
        """Sum of a Prometheus metric over its label sets that contain ``label`` (0: absent).
        ``timeout``: an engine's API server shares two cores with a decoding engine in the
        tests and answered its first ``/metrics`` in over 10 s there."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


class ProxyServer(Server):
    """``mooncake-connectors proxy`` as a user runs it; its engines as URLs, or as the
    :class:`Server` objects, whose URLs it takes at each start (they may move while starting)."""

    name = "proxy"

    def __init__(
        self,
        log_dir: Path,
        prefill: Sequence[Server | str],
        decode: Sequence[Server | str],
        *extra: str,
    ) -> None:
        super().__init__(log_dir)
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.extra = list(extra)  # more proxy flags, e.g. --layerwise-push

    def command(self) -> list[str]:
        cmd = [*CLI, "proxy", "--port", str(self.port)]
        for flag, engines in (("--prefill", self.prefill), ("--decode", self.decode)):
            for e in engines:
                cmd += [flag, e if isinstance(e, str) else e.url]
        return cmd + self.extra


def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (the tests' and benchmarks' prompts: reproducible)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]


def pd_kv_config(role: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of our PD connector in ``role``, recomputing failed loads."""
    return {
        "kv_connector": "MooncakeConnectorsPD",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url} -> {exc.code}: {exc.read()[:2000]!r}") from None


def iter_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """The ``data:`` events of a streaming answer as they arrive, up to ``[DONE]``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def post_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """All the ``data:`` events of a streaming answer, up to ``[DONE]``."""
    return list(iter_stream(url, body, timeout))


def completion_body(prompt: list[int], max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """A greedy, fixed-length completion request of a token-id prompt that asks for the answer's
    token ids too (every benchmark compares or counts them)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
    return body


def stream_completion(
    url: str,
    prompt: list[int],
    max_tokens: int,
    extra: dict[str, Any] | None = None,
    *,
    t0: float | None = None,
    timeout: float = 300.0,
) -> tuple[float, float, list[int]]:
    """Stream a greedy, fixed-length completion of a token-id prompt from ``url``.

    Returns (seconds from ``t0`` (default: the send) to the first token, seconds to the end,
    all token ids)."""
    body = completion_body(prompt, max_tokens, stream=True) | (extra or {})
    start = time.perf_counter() if t0 is None else t0
    first = 0.0
    ids: list[int] = []
    for event in iter_stream(url + "/v1/completions", body, timeout):
        for choice in event.get("choices") or []:
            got = choice.get("token_ids") or []
            if got and not first:
                first = time.perf_counter() - start
            ids.extend(got)
    if not first:
        raise RuntimeError(f"{url} streamed no token")
    return first, time.perf_counter() - start, ids


def completion(
    url: str, prompt: list[int], max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Greedy, fixed-length completion of a token-id prompt; returns the whole answer."""
    body = completion_body(prompt, max_tokens, stream=False) | (extra or {})
    return post(url + "/v1/completions", body)


def token_ids(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0].get("token_ids")
    if ids is None:
        raise RuntimeError(f"no token_ids in answer: {answer}")
    return list(ids)


class StoreMaster(Server):
    """``mooncake-connectors master`` on loopback; ``address`` is its control-plane address.

    Short heartbeat timers, so a killed store server is noticed within about a second.
    """

    name = "store-master"

    def __init__(self, log_dir: Path, server_ttl: float = 1.0) -> None:
        super().__init__(log_dir)  # ``port``: the HTTP /health and /metrics port, once reported
        self.server_ttl = server_ttl
        # Reserved, not port 0: engines are configured with the address before it starts, so
        # a taken port fails the start (naming the holder) rather than moving.
        self.rpc_port = free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"

    def command(self) -> list[str]:
        return [
            *CLI,
            "master",
            "--port",
            str(self.rpc_port),
            "--metrics-port",
            "0",  # it binds one of its own choosing and reports it
            "--heartbeat-interval",
            "0.2",
            "--server-ttl",
            str(self.server_ttl),
        ]

    def ports(self) -> list[int]:
        return [self.rpc_port]

    def movable(self) -> bool:
        return False

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT) -> Server:
        proc = self.proc
        try:
            alive = (lambda: proc.poll() is None) if proc is not None else (lambda: False)
            self.port = int(reported(self.output, "metrics_port", timeout, alive))
        except RuntimeError:
            pass  # it exited: the generic wait says why (a port taken, or its log)
        return super().wait_ready(timeout)


class StoreServerProcess(Server):
    """``mooncake-connectors store-server``; ready once a probe value can be stored."""

    name = "store-server"

    def __init__(self, log_dir: Path, master: str, memory: str = "1G") -> None:
        super().__init__(log_dir)  # the port is unused: the server has no HTTP endpoint
        self.master = master
        self.memory = memory

    def command(self) -> list[str]:
        return [
            *CLI,
            "store-server",
            "--memory",
            self.memory,
            "--master",
            self.master,
        ]

    def wait_ready(self, timeout: float = 60.0) -> Server:
        from ..errors import MooncakeConnectorsError
        from ..store import ClientConfig, StoreClient

        end = time.monotonic() + timeout
        key = f"probe-{self.port}"
        with StoreClient(ClientConfig(master=self.master, timeout=5.0)) as client:
            while time.monotonic() < end:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"store server exited while starting:\n{self.tail()}")
                try:
                    client.put(key, b"x")
                    client.remove(key, force=True)
                    return self
                except MooncakeConnectorsError:
                    time.sleep(0.2)
        raise TimeoutError(f"store server not ready after {timeout}s:\n{self.tail()}")
