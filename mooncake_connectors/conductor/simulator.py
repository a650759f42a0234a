"""Trace replay in simulated time: the real :class:`Conductor` over modelled instances.

The replay owns the ground truth (what each prefill node's DRAM pool holds, NIC bookings, decode
batches); the conductor only sees what a proxy would: the requests, the instances' cache events
and first-token / stream-end reports. Instance behaviour:

- prefill node: one request at a time, FIFO; a request whose prefix is being fetched waits for
  it; duration = true prefill model x lognormal noise (sigma = ``noise``); afterwards all its blocks
  go into the node's LRU pool (evictions reported as removal events);
- prefix fetch: starts at placement (it overlaps the wait in the queue), serialised on both
  nodes' NICs; the fetched blocks are pinned for the request that asked for them;
- decode node: continuous batching; a request joins when its KV reserve (prompt + output) fits
  the KV capacity, else waits FIFO; every running sequence advances one token per step of
  :meth:`DecodeModel.step_time`. The first token comes from prefill; the wait before the first
  decode step is the first token gap.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import ConfigError
from .cache_index import BlockCache, BlockRemoved, BlockStored
from .estimators import InstanceModels, LinkBook, PrefillModel, fit_prefill_model
from .scheduler import Conductor, ConductorConfig
from .trace import TraceRequest
from .types import Admission, Placement, PlacementPolicy, RejectReason, ScheduleRequest


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one request."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rejected: RejectReason | None
    prefill: str | None = None
    decode: str | None = None
    fetched_blocks: int = 0
    cached_tokens: int = 0
    ttft_s: float = math.nan
    tbt_s: float = math.nan  # mean of the slowest 10% of token gaps (0 for one-token outputs)
    finished_s: float = math.nan
    est_ttft_s: float = math.nan  # the conductor's estimate when it decided


@dataclasses.dataclass(frozen=True)
class SimConfig:
    prefill: int
    decode: int
    placement: PlacementPolicy
    admission: Admission
    models: InstanceModels
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    balancing_threshold: float = 1.5
    noise: float = 0.1
    seed: int = 0
    block_tokens: int = 512

    def __post_init__(self) -> None:
        if self.prefill <= 0 or self.decode <= 0:
            raise ConfigError("prefill and decode instance counts must be > 0")
        if not math.isfinite(self.noise) or not 0 <= self.noise < 1:
            raise ConfigError("noise must be in [0, 1)", noise=self.noise)


@dataclasses.dataclass(frozen=True)
class SimResult:
    config: SimConfig
    outcomes: tuple[Outcome, ...]
    decode_peak_tokens: dict[str, int]
    prefill_peak_running: dict[str, int]
    fitted_prefill: PrefillModel


def profile_prefill(truth: PrefillModel, noise: float, rng: random.Random) -> PrefillModel:
    """Measure ``truth`` on a grid of (prompt, cached) sizes with noise, then fit the estimator.

    Stands in for the offline profiling run of a real deployment, so the conductor plans with a
    fitted regression and not with the replay's ground truth.
    """
    samples = []
    for n in (512, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        for frac in (0.0, 0.25, 0.5, 0.9):
            p = int(n * frac) // 512 * 512
            samples.append((n, p, truth.time(n, p) * math.exp(rng.gauss(0.0, noise))))
    return fit_prefill_model(samples)


@dataclasses.dataclass
class _Job:
    req: TraceRequest
    placement: Placement
    ready_at: float
    fetched: int  # blocks guaranteed present at start (local + fetched, pinned)
    cached_tokens: int = 0
    ttft_done: float = math.nan


@dataclasses.dataclass
class _Seq:
    job: _Job
    remaining: float  # token gaps still to produce
    reserve: int
    kv: float
    first_wait: float
    gaps: list[tuple[float, float]] = dataclasses.field(default_factory=list)


class _DecodeNode:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running: dict[int, _Seq] = {}
        self.waiting: deque[_Job] = deque()
        self.used = 0
        self.peak = 0
        self.last = 0.0
        self.step = 0.0
        self.version = 0


def _tbt(seq: _Seq, gaps_total: int) -> float:
    """Mean of the slowest 10% of the request's token gaps (the §5 TBT definition).

    ``seq.gaps`` holds (gap, count) runs; the first gap also carries the wait for a decode
    slot, so it is split off and ranked on its own.
    """
    if gaps_total <= 0 or not seq.gaps:
        return 0.0
    v0, c0 = seq.gaps[0]
    pool = [(v0 + seq.first_wait, 1.0), (v0, c0 - 1.0), *seq.gaps[1:]]
    pool.sort(key=lambda g: -g[0])
    k = max(1, math.ceil(0.1 * gaps_total))
    need, total = float(k), 0.0
    for v, c in pool:
        if c <= 0:
            continue
        take = min(c, need)
        total += v * take
        need -= take
        if need <= 1e-9:
            break
    return total / (k - need)


class Simulator:
    """Replays requests through a :class:`Conductor` and modelled instances."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        m = config.models
        self._rng = random.Random(config.seed)
        fitted = profile_prefill(m.prefill, config.noise, random.Random(config.seed + 1))
        self.prefill_names = tuple(f"prefill-{i}" for i in range(config.prefill))
        self.decode_names = tuple(f"decode-{i}" for i in range(config.decode))
        self.conductor = Conductor(
            ConductorConfig(
                prefill_instances=self.prefill_names,
                decode_instances=self.decode_names,
                prefill_model=fitted,
                transfer_model=m.transfer,
                decode_model=m.decode,
                placement=config.placement,
                admission=config.admission,
                ttft_slo_s=config.ttft_slo_s,
                tbt_slo_s=config.tbt_slo_s,
                balancing_threshold=config.balancing_threshold,
                block_tokens=config.block_tokens,
                seed=config.seed,
            )
        )
        self.fitted = fitted
        self._caches = {n: BlockCache(m.cache_capacity_blocks) for n in self.prefill_names}
        self._links = LinkBook(m.transfer)
        self._queues: dict[str, deque[_Job]] = {n: deque() for n in self.prefill_names}
        self._busy: dict[str, _Job | None] = dict.fromkeys(self.prefill_names)
        self._peak_running = dict.fromkeys(self.prefill_names, 0)
        self._decode = {n: _DecodeNode(m.decode.capacity_tokens) for n in self.decode_names}
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self._outcomes: dict[int, Outcome] = {}
        self._arrived = 0
        self._progress: Callable[[int], None] | None = None

    # ---- event plumbing ----------------------------------------------------------------------

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def _store(self, inst: str, keys: Sequence[int]) -> None:
        evicted = self._caches[inst].store(keys)
        self.conductor.apply_cache_event(BlockStored(inst, tuple(keys)))
        if evicted:
            self.conductor.apply_cache_event(BlockRemoved(inst, tuple(evicted)))

    def _record(self, outcome: Outcome) -> None:
        if outcome.request_id in self._outcomes:
            raise RuntimeError(f"request {outcome.request_id} recorded twice")
        self._outcomes[outcome.request_id] = outcome

    # ---- prefill side ------------------------------------------------------------------------

    def _arrive(self, req: TraceRequest, now: float) -> None:
        self._arrived += 1
        if self._progress is not None and self._arrived % 64 == 0:
            self._progress(self._arrived)
        sreq = ScheduleRequest(req.request_id, req.input_tokens, req.block_hashes)
        decision = self.conductor.schedule(sreq, now)
        if not isinstance(decision, Placement):
            self._record(Outcome(req.request_id, req.arrival_s, req.input_tokens, req.output_tokens,
                                 decision.reason, est_ttft_s=decision.est_ttft_s))  # fmt: skip
            return
        job = _Job(req, decision, now, 0)
        if decision.fetch_from is not None:
            bt = self.config.block_tokens
            lo = decision.local_blocks
            hi = lo + decision.fetch_blocks
            tokens = min(hi * bt, req.input_tokens) - lo * bt
            job.ready_at = self._links.book(decision.fetch_from, decision.prefill, now, tokens)
            job.fetched = hi
            keys = req.block_hashes[:hi]
            self._at(job.ready_at, functools.partial(self._fetched, job, keys))
        self._queues[decision.prefill].append(job)
        self._try_start(decision.prefill, now)

    def _fetched(self, job: _Job, keys: Sequence[int], now: float) -> None:
        self._store(job.placement.prefill, keys)
        self._try_start(job.placement.prefill, now)

    def _try_start(self, inst: str, now: float) -> None:
        if self._busy[inst] is not None or not self._queues[inst]:
            return
        job = self._queues[inst][0]
        if job.ready_at > now:
            return  # its prefix is still on the wire; _fetched calls back
        self._queues[inst].popleft()
        self._busy[inst] = job
        self._peak_running[inst] = max(self._peak_running[inst], 1)
        cache = self._caches[inst]
        keys = job.req.block_hashes
        blocks = max(cache.match(keys), job.fetched)
        cache.touch(keys[:blocks])
        job.cached_tokens = min(blocks * self.config.block_tokens, job.req.input_tokens)
        dur = self.config.models.prefill.time(job.req.input_tokens, job.cached_tokens)
        dur *= math.exp(self._rng.gauss(0.0, self.config.noise))
        self._at(now + dur, functools.partial(self._prefill_done, inst))

    def _prefill_done(self, inst: str, now: float) -> None:
        job = self._busy[inst]
        if job is None:
            raise RuntimeError(f"{inst} finished a prefill it was not running")
        self._busy[inst] = None
        job.ttft_done = now
        self._store(inst, job.req.block_hashes)
        self.conductor.prefill_finished(job.req.request_id, now)
        # KV streams to decode layer by layer during prefill; only the last layer is left.
        tail = self.config.models.transfer.time(job.req.input_tokens) / 80
        self._at(now + tail, functools.partial(self._decode_arrive, job))
        self._try_start(inst, now)

    # ---- decode side -------------------------------------------------------------------------

    def _advance(self, node: _DecodeNode, now: float) -> None:
        if node.running and node.step > 0:
            steps = (now - node.last) / node.step
            if steps > 0:
                for s in node.running.values():
                    s.remaining -= steps
                    s.kv += steps
                    s.gaps.append((node.step, steps))
        node.last = now

    def _decode_arrive(self, job: _Job, now: float) -> None:
        name = job.placement.decode
        node = self._decode[name]
        self._advance(node, now)
        node.waiting.append(job)
        self._admit_and_reschedule(name, now)

    def _admit_and_reschedule(self, name: str, now: float) -> None:
        node = self._decode[name]
        while node.waiting:
            job = node.waiting[0]
            reserve = job.req.input_tokens + job.req.output_tokens
            if reserve > node.capacity:
                raise RuntimeError(f"request {job.req.request_id} can never fit {name}")
            if node.used + reserve > node.capacity:
                break
            node.waiting.popleft()
            node.used += reserve
            node.peak = max(node.peak, node.used)
            self.conductor.decode_started(job.req.request_id, now)
            gaps = job.req.output_tokens - 1
            seq = _Seq(job, float(gaps), reserve, float(job.req.input_tokens), now - job.ttft_done)
            if gaps <= 0:
                self._finish(name, seq, now)
            else:
                node.running[job.req.request_id] = seq
        model = self.config.models.decode
        node.step = model.step_time(len(node.running), sum(s.kv for s in node.running.values()))
        node.version += 1
        if node.running:
            soonest = min(s.remaining for s in node.running.values())
            v = node.version
            self._at(
                now + max(soonest, 0.0) * node.step, functools.partial(self._decode_tick, name, v)
            )

    def _decode_tick(self, name: str, version: int, now: float) -> None:
        node = self._decode[name]
        if version != node.version:
            return  # superseded by a later arrival or completion
        self._advance(node, now)
        for rid, seq in list(node.running.items()):
            if seq.remaining <= 1e-6:
                del node.running[rid]
                self._finish(name, seq, now)
        self._admit_and_reschedule(name, now)

    def _finish(self, name: str, seq: _Seq, now: float) -> None:
        node = self._decode[name]
        node.used -= seq.reserve
        job = seq.job
        req = job.req
        self.conductor.decode_finished(req.request_id, now, req.output_tokens)
        self._record(Outcome(
            request_id=req.request_id, arrival_s=req.arrival_s, prompt_tokens=req.input_tokens,
            output_tokens=req.output_tokens, rejected=None, prefill=job.placement.prefill,
            decode=name, fetched_blocks=job.placement.fetch_blocks,
            cached_tokens=job.cached_tokens, ttft_s=job.ttft_done - req.arrival_s,
            tbt_s=_tbt(seq, req.output_tokens - 1), finished_s=now,
            est_ttft_s=job.placement.est_ttft_s,
        ))  # fmt: skip

    # ---- driver ------------------------------------------------------------------------------

    def run(
        self, requests: Sequence[TraceRequest], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        """Replay ``requests`` (arrival order) to the end; ``progress(n)`` after each arrival."""
        if not requests:
            raise ConfigError("nothing to replay")
        for req in requests:
            self._at(req.arrival_s, functools.partial(self._arrive, req))
        self._progress = progress
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            fn(t)
        if progress is not None:
            progress(len(requests))
        missing = {r.request_id for r in requests} - self._outcomes.keys()
        if missing:
            raise RuntimeError(f"{len(missing)} requests neither finished nor rejected")
        return SimResult(
            config=self.config,
            outcomes=tuple(self._outcomes[r.request_id] for r in requests),
            decode_peak_tokens={n: d.peak for n, d in self._decode.items()},
            prefill_peak_running=dict(self._peak_running),
            fitted_prefill=self.fitted,
        )
