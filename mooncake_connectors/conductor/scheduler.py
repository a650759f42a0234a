"""The Conductor: per-request placement on (prefill, decode) instances or an early 429.

A proxy (or the trace replayer) drives it with four kinds of calls, all non-blocking and
I/O-free:

- :meth:`Conductor.schedule` per incoming request → :class:`Placement` or :class:`Rejection`;
- :meth:`Conductor.apply_cache_event` for each KV event of a prefill instance (blocks stored,
  removed, cleared: vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``);
- :meth:`Conductor.prefill_finished` when the first token comes back;
- :meth:`Conductor.decode_started` / :meth:`Conductor.decode_finished` as the stream runs and
  ends, which is also where the typical output length is learned.

Estimates are the conductor's own (queued work, fitted prefill model, transfer model, decode
model); the reports replace them with facts as they arrive.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

from ..errors import ConfigError
from .cache_index import BlockCache, BlockRemoved, BlockStored, CacheEvent, CacheIndex
from .estimators import DecodeModel, LinkBook, PrefillModel, TransferModel
from .policies import PLACEMENTS, PlanContext, PrefillPlan
from .state import DecodeView, LoadOrder, PrefillView
from .types import (
    STORE,
    Admission,
    Placement,
    PlacementPolicy,
    Rejection,
    RejectReason,
    ScheduleRequest,
)

_ERROR_WINDOW = 256
_MAX_SLOWDOWN = 20.0  # learned instance speed stays within 1/20..20x of the prefill model


@dataclasses.dataclass(frozen=True)
class ConductorConfig:
    """Instances, policy, SLOs and the estimators' models.

    ``balancing_threshold``: Algorithm 1's ``kvcache_balancing_threshold`` (unpublished; ours).
    ``expected_output_tokens``: prior for the output length until finished requests teach it.
    ``error_quantile``: the adaptive admission scales TTFT estimates by this quantile of the
    observed actual/estimated ratio (never below 1).
    ``best_effort_idle_fraction``: the adaptive admission still places a request expected to miss
    the TTFT SLO while at least this fraction of prefill instances is idle (None: never).
    ``learn_instance_speed``: scale each prefill instance's estimates by how much slower (or
    faster) than ``prefill_model`` its finished prefill legs really ran (a live proxy, where
    instances share hardware or drift from their profile; off in a replay).
    ``store``: the prefill instances save to and load from a shared KV store, and the fetching
    policies fetch from it (``transfer_model`` is then a store load). The store's contents come
    with each request (``ScheduleRequest.store_blocks``) or from ``BlockStored`` events of the
    instance named :data:`~.types.STORE`.
    ``exhaustive_up_to``: pools of at most this many prefill instances are costed instance by
    instance (ties go to the first in order, as replays expect); larger ones only look at the
    instances holding part of the prompt and the least loaded others.
    """

    prefill_instances: tuple[str, ...]
    decode_instances: tuple[str, ...]
    prefill_model: PrefillModel
    transfer_model: TransferModel
    decode_model: DecodeModel
    placement: PlacementPolicy = PlacementPolicy.GLOBAL_CACHE
    admission: Admission = Admission.NONE
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    balancing_threshold: float = 1.5
    block_tokens: int = 512
    expected_output_tokens: float = 256.0
    error_quantile: float = 0.5
    best_effort_idle_fraction: float | None = 0.25
    learn_instance_speed: bool = False
    store: bool = False
    exhaustive_up_to: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for what, names in (("prefill", self.prefill_instances), ("decode", self.decode_instances)):
            if not names:
                raise ConfigError(f"at least one {what} instance is needed")
            if len(set(names)) != len(names):
                raise ConfigError(f"{what} instance names must be unique", instances=list(names))
        if set(self.prefill_instances) & set(self.decode_instances):
            raise ConfigError("an instance cannot be both prefill and decode")
        if STORE in self.prefill_instances or STORE in self.decode_instances:
            raise ConfigError(f"{STORE!r} names the store, not an instance")
        for name in ("ttft_slo_s", "tbt_slo_s", "expected_output_tokens"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite number > 0", **{name: v})
        if not math.isfinite(self.balancing_threshold) or self.balancing_threshold < 1:
            raise ConfigError(
                "balancing_threshold must be >= 1", threshold=self.balancing_threshold
            )
        if self.block_tokens <= 0:
            raise ConfigError("block_tokens must be > 0", block_tokens=self.block_tokens)
        if not 0 < self.error_quantile <= 1:
            raise ConfigError(
                "error_quantile must be in (0, 1]", error_quantile=self.error_quantile
            )
        frac = self.best_effort_idle_fraction
        if frac is not None and not (math.isfinite(frac) and 0 < frac <= 1):
            raise ConfigError("best_effort_idle_fraction must be in (0, 1] or None", fraction=frac)


@dataclasses.dataclass
class _Pending:
    placed_at: float
    est_ttft_s: float
    prefill: str
    decode: str


class Conductor:
    """KV-aware scheduler state machine; see the module docstring for the call protocol."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.index = CacheIndex(config.prefill_instances)
        self.store_index = BlockCache() if config.store else None
        self._prefill = {name: PrefillView() for name in config.prefill_instances}
        self._decode = {name: DecodeView(config.decode_model) for name in config.decode_instances}
        self._links = LinkBook(config.transfer_model, frozenset({STORE}))
        large = len(config.prefill_instances) > config.exhaustive_up_to
        self._order = LoadOrder(config.prefill_instances) if large else None
        # first block key of each queued request -> instance -> how many (large pools only)
        self._queued_first: dict[int, dict[str, int]] = {}
        self._rng = random.Random(config.seed)
        self._pending: dict[int, _Pending] = {}
        self._out_tokens = config.expected_output_tokens
        self._ratios: deque[float] = deque(maxlen=_ERROR_WINDOW)
        self._place = PLACEMENTS[config.placement]

    # ---- per request -------------------------------------------------------------------------

    def schedule(self, req: ScheduleRequest, now: float) -> Placement | Rejection:
        """Choose instances for ``req`` arriving at ``now`` (seconds, any monotonic clock)."""
        if req.request_id in self._pending:
            raise ConfigError("request already scheduled", request_id=req.request_id)
        cfg = self.config
        store_blocks = None
        if self.store_index is not None:
            store_blocks = req.store_blocks
            if store_blocks is None:
                store_blocks = self.store_index.match(req.block_hashes)
        ctx = PlanContext(
            now, cfg.prefill_instances, self.index, self._prefill, cfg.prefill_model,
            cfg.transfer_model, self._links, cfg.block_tokens, cfg.balancing_threshold, self._rng,
            store_blocks, self._order, self._queued_first,
            1 / _MAX_SLOWDOWN if cfg.learn_instance_speed else 1.0,
        )  # fmt: skip
        plan = self._place(ctx, req)
        decode, tbt, fits = self._choose_decode(req, plan, now)
        rejection = self._admit(req, plan, tbt, fits, now)
        if rejection is not None:
            return rejection
        self._commit(req, plan, decode, now)
        return Placement(
            request_id=req.request_id,
            prefill=plan.instance,
            decode=decode,
            local_blocks=plan.local_blocks,
            fetch_from=plan.fetch_from,
            fetch_blocks=plan.fetch_blocks,
            est_queue_s=plan.queue_s,
            est_transfer_s=plan.transfer_s,
            est_prefill_s=plan.prefill_s,
            est_ttft_s=plan.ttft_s,
            est_tbt_s=tbt,
            best_effort=plan.ttft_s > cfg.ttft_slo_s,
        )

    def _decode_seconds(self, tbt: float) -> float:
        return self._out_tokens * max(tbt, self.config.decode_model.base_s)

    def _choose_decode(
        self, req: ScheduleRequest, plan: PrefillPlan, now: float
    ) -> tuple[str, float, bool]:
        """(instance, its TBT estimate, whether it is expected to have KV room)."""
        names = self.config.decode_instances
        model = self.config.decode_model
        out = self._out_tokens
        if self.config.placement is PlacementPolicy.RANDOM:
            d = self._rng.choice(list(names))
            return d, self._decode[d].current_tbt(req.prompt_tokens, out), True
        if self.config.admission in (Admission.NONE, Admission.EARLY):
            # Algorithm 1's SelectDecodingInstance: the least loaded right now.
            tbts = {d: self._decode[d].current_tbt(req.prompt_tokens, out) for d in names}
            d = min(names, key=tbts.__getitem__)
            return d, tbts[d], True
        # Predict each instance's batch for when this request's KV gets there.
        arrive = now + plan.ttft_s
        own = req.prompt_tokens + out
        best: tuple[float, str, bool] | None = None
        for d in names:
            view = self._decode[d]
            dur = self._decode_seconds(view.current_tbt(0, out))
            batch, kv, reserved = view.predicted(now, arrive, dur, out)
            tbt = model.step_time(batch + 1, kv + req.prompt_tokens + out / 2)
            fits = reserved + own <= model.capacity_tokens
            key = (0.0 if fits else 1.0) * 1e9 + tbt
            if best is None or key < best[0]:
                best = (key, d, fits)
        assert best is not None  # decode_instances is never empty (checked by the config)
        _, d, fits = best
        dur = self._decode_seconds(self._decode[d].current_tbt(0, out))
        batch, kv, _ = self._decode[d].predicted(now, arrive, dur, out)
        return d, model.step_time(batch + 1, kv + req.prompt_tokens + out / 2), fits

    def _ttft_margin(self) -> float:
        if len(self._ratios) < 16:
            return 1.0
        ordered = sorted(self._ratios)
        k = min(len(ordered) - 1, int(self.config.error_quantile * len(ordered)))
        return max(1.0, ordered[k])

    def _best_effort(self, now: float) -> bool:
        """Whether a request expected to miss the TTFT SLO is still worth running.

        It no longer counts for goodput, but its KV does: the next turn of the conversation
        reuses it, and rejecting a long turn makes every later turn too long as well. While a
        good part of the prefill pool is idle, running it takes nothing from anyone else.
        """
        frac = self.config.best_effort_idle_fraction
        if self.config.admission is not Admission.ADAPTIVE or frac is None:
            return False
        idle = sum(1 for v in self._prefill.values() if v.queue_time(now) == 0.0)
        return idle >= frac * len(self._prefill)

    def _admit(
        self, req: ScheduleRequest, plan: PrefillPlan, tbt: float, fits: bool, now: float
    ) -> Rejection | None:
        cfg = self.config
        adm = cfg.admission
        if adm is Admission.NONE:
            return None
        ttft = plan.ttft_s * (self._ttft_margin() if adm is Admission.ADAPTIVE else 1.0)
        if ttft > cfg.ttft_slo_s and not self._best_effort(now):
            reason, detail = (
                RejectReason.TTFT_SLO,
                (f"estimated time to first token {ttft:.3g}s exceeds the {cfg.ttft_slo_s:g}s SLO"),
            )
        elif tbt > cfg.tbt_slo_s:
            reason, detail = (
                RejectReason.TBT_SLO,
                (
                    f"estimated time between tokens {tbt * 1e3:.0f}ms exceeds the "
                    f"{cfg.tbt_slo_s * 1e3:g}ms SLO"
                ),
            )
        elif adm is Admission.ADAPTIVE and not fits:
            reason, detail = (
                RejectReason.DECODE_CAPACITY,
                "no decode instance expected to have KV room",
            )
        else:
            return None
        return Rejection(req.request_id, reason, detail, plan.ttft_s, tbt)

    def _commit(self, req: ScheduleRequest, plan: PrefillPlan, decode: str, now: float) -> None:
        ready = plan.ready_at
        if plan.fetch_from is not None:
            fetch_tokens = (
                min(
                    (plan.local_blocks + plan.fetch_blocks) * self.config.block_tokens,
                    req.prompt_tokens,
                )
                - plan.local_blocks * self.config.block_tokens
            )
            booked = self._links.book(plan.fetch_from, plan.instance, now, fetch_tokens)
            ready = (
                max(ready, booked) if self.config.placement is PlacementPolicy.ADAPTIVE else ready
            )
        view = self._prefill[plan.instance]
        view.add(req.request_id, now, ready, plan.prefill_s, req.block_hashes)
        if self._order is not None:
            self._order.update(plan.instance, view.drain_time(now))
            if req.block_hashes:
                holders = self._queued_first.setdefault(req.block_hashes[0], {})
                holders[plan.instance] = holders.get(plan.instance, 0) + 1
        self._decode[decode].add(req.request_id, now + plan.ttft_s, req.prompt_tokens)
        self._pending[req.request_id] = _Pending(now, plan.ttft_s, plan.instance, decode)

    # ---- reports from instances --------------------------------------------------------------

    def apply_cache_event(self, event: CacheEvent) -> None:
        """A prefill instance (or the store, :data:`~.types.STORE`) stored, removed or cleared
        prefix blocks."""
        if event.instance == STORE and self.store_index is not None:
            if isinstance(event, BlockStored):
                self.store_index.store(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.store_index.remove(event.block_hashes)
            else:
                self.store_index.clear()
            return
        self.index.apply(event)

    def prefill_finished(self, request_id: int, now: float) -> None:
        """The first token of ``request_id`` came back (its prefill instance is free of it)."""
        p = self._pending.get(request_id)
        if p is None:
            raise ConfigError("prefill_finished for an unknown request", request_id=request_id)
        view = self._prefill[p.prefill]
        keys = view.finish_keys(request_id, now)
        if self._order is not None:
            self._order.update(p.prefill, view.drain_time(now))
            if keys:
                holders = self._queued_first[keys[0]]
                holders[p.prefill] -= 1
                if not holders[p.prefill]:
                    del holders[p.prefill]
                    if not holders:
                        del self._queued_first[keys[0]]
        if self.config.learn_instance_speed and p.est_ttft_s > 0:
            # Geometric moving average of actual / estimated: the estimate already carries the
            # current factor, so the product tracks the instance's real speed; bounded so that
            # one stall cannot shut an instance out for long.
            ratio = (now - p.placed_at) / p.est_ttft_s
            view.slowdown = min(_MAX_SLOWDOWN, max(1 / _MAX_SLOWDOWN, view.slowdown * ratio**0.5))
        if p.est_ttft_s > 1.0:
            # Short estimates are dominated by noise and would inflate the margin for nothing.
            self._ratios.append((now - p.placed_at) / p.est_ttft_s)

    def decode_started(self, request_id: int, now: float) -> None:
        p = self._pending.get(request_id)
        if p is not None:
            self._decode[p.decode].started(request_id, now)

    def decode_finished(self, request_id: int, now: float, output_tokens: int) -> None:
        """The stream of ``request_id`` ended after ``output_tokens`` tokens."""
        p = self._pending.pop(request_id, None)
        if p is None:
            raise ConfigError("decode_finished for an unknown request", request_id=request_id)
        self._decode[p.decode].finish(request_id)
        if output_tokens > 0:
            # Slow EWMA: the system-level prediction needs the typical length, not the last one.
            self._out_tokens += 0.01 * (output_tokens - self._out_tokens)

    def set_external_load(
        self,
        instance: str,
        *,
        prefill_s: float | None = None,
        decode_requests: int | None = None,
        decode_kv_tokens: float | None = None,
    ) -> None:
        """Load an instance has beyond what this conductor placed (a live proxy's metrics feed).

        ``prefill_s``: seconds of prefill work queued or running there that were not placed
        here; ``decode_requests`` / ``decode_kv_tokens``: sequences decoding there that were not
        sent from here. Each replaces the previous observation.
        """
        if prefill_s is not None:
            if not math.isfinite(prefill_s) or prefill_s < 0:
                raise ConfigError("prefill_s must be a finite time >= 0", prefill_s=prefill_s)
            try:
                self._prefill[instance].external_s = prefill_s
            except KeyError:
                raise ConfigError(f"unknown prefill instance {instance!r}") from None
            if self._order is not None:
                now = self._prefill[instance].anchor
                self._order.update(instance, self._prefill[instance].drain_time(now))
        if decode_requests is not None or decode_kv_tokens is not None:
            view = self._decode.get(instance)
            if view is None:
                raise ConfigError(f"unknown decode instance {instance!r}")
            if decode_requests is not None:
                if decode_requests < 0:
                    raise ConfigError("decode_requests must be >= 0")
                view.external_requests = decode_requests
            if decode_kv_tokens is not None:
                if not math.isfinite(decode_kv_tokens) or decode_kv_tokens < 0:
                    raise ConfigError("decode_kv_tokens must be >= 0")
                view.external_kv_tokens = decode_kv_tokens

    def placed_on(self, instance: str) -> int:
        """Requests placed on ``instance`` (prefill or decode) and not reported done there."""
        if instance in self._prefill:
            return len(self._prefill[instance])
        if instance in self._decode:
            return len(self._decode[instance])
        raise ConfigError(f"unknown instance {instance!r}")

    @property
    def expected_output_tokens(self) -> float:
        return self._out_tokens

    def slowdown(self, instance: str) -> float:
        """What this prefill instance's estimates are scaled by (1.0 unless learned)."""
        return self._prefill[instance].slowdown

    def queue_time(self, instance: str, now: float) -> float:
        try:
            return self._prefill[instance].queue_time(now)
        except KeyError:
            raise ConfigError(f"unknown prefill instance {instance!r}") from None
