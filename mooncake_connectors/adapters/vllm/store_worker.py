"""Worker side of the store connector (runs in each vLLM worker, one per TP rank).

vLLM's KV cache tensors are registered with this worker's store client, so loads read straight
into vLLM's blocks (``batch_get_into``) and saves write straight from them (``batch_put_from``):
no staging copy on either side, whether the KV cache is in host or GPU memory (GPU blocks move
over cuda_ipc on one host, and through pinned staging buffers over tcp). One object per block
per layer (:mod:`.store_keys`); where a layer keeps K and V apart (vLLM's GPU backends), V is a
second object, ``{layer}/v``. With several KV cache groups (vLLM's hybrid KV cache manager) a
block spec names each group's block per hash (:class:`.store_scheduler.BlockSpec`), and a
group's blocks are read and written for that group's layers only, under that group's keys.

Saves, and loads with ``load_async``, run on one thread of their own (loads first), so the model
runner does not wait for them; without ``load_async`` a load runs inside ``start_load_kv`` of the
step that computes the rest of the request, which is the shortest path to its first token (no
extra scheduler steps, no thread hand-off inside a busy engine process). A lock keeps the two
from using the client at once. Every call ends by the configured deadline; a load that misses,
fails or times out reports its blocks (from the first one not loaded) through vLLM's load-error
channel, and ``kv_load_failure_policy="recompute"`` recomputes them. A save that fails is logged
and counted; the request is released either way.

Step saves (``save_during_prefill``: the blocks a step completed, while the request runs) are
queued in ``wait_for_save``, after the step's forward pass wrote them, and are not reported done;
a request that ends after step saves gets one more save, queued behind them, that reports it, so
vLLM frees its blocks only once every save has read them. Before a step's forward pass
overwrites a preempted request's freed blocks, ``handle_preemptions`` waits for the saves queued.
With several KV cache groups a sliding-window group frees the blocks that leave its window at
the next step, while the request runs: a step that queued step saves of several groups makes
the next step wait (bounded) for them before anything may write those blocks. vLLM 0.32's model
runner calls ``handle_preemptions`` first in every step, before it zeroes freshly allocated
blocks and makes its copy-on-write copies (``_update_states``), and long before the loads and
the forward pass; the wait is there (``start_load_kv`` waits instead if it was not called).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...config import for_gpu
from ...errors import ConfigError, MooncakeConnectorsError, ObjectExists
from ...pd.layout import layer_layouts, register_spans
from ...pd.messages import LayerLayout
from ...store.client import StoreClient
from ...store.guarded import FAILED, GuardedStore
from ...store.writer import Result
from .stats import StoreStats
from .store_config import StoreConnectorConfig
from .store_events import stored_event
from .store_keys import BlockKeys
from .store_scheduler import BlockSpec, StoreConnectorMetadata

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_events import KVCacheEvent

log = logging.getLogger(__name__)

_LOAD, _SAVE, _STOP = 0, 1, 2  # job priorities: loads first


class _Refused(MooncakeConnectorsError):
    """A load that is not attempted (its reason is logged); its blocks are recomputed."""


class StoreWorker:
    def __init__(
        self,
        config: StoreConnectorConfig,
        keys: BlockKeys,
        layer_names: list[str],
        num_blocks: int,
        num_kv_heads: int = 0,
        groups: list[tuple[BlockKeys, list[str]]] | None = None,
    ) -> None:
        """``groups``: with several KV cache groups, each one's keys and layers; then
        ``layer_names`` is every layer of every group."""
        self.config = config
        self.keys = keys
        self.layer_names = layer_names
        self.groups = groups
        # per group: its keys, layouts and key names (set by register_kv_caches)
        self._group_plan: list[tuple[BlockKeys, list[LayerLayout], list[str]]] = []
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.layers: list[LayerLayout] = []
        self.key_names = list(layer_names)  # one per entry of self.layers
        self.store: GuardedStore | None = None
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one store call at a time (main thread and store thread)
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._events: list[KVCacheEvent] = []
        self._jobs: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()
        self._step_saves: list[BlockSpec] = []  # queued at this step's wait_for_save
        # step saves of several KV cache groups queued: the next step waits for them first
        self._fence = False
        self._thread = threading.Thread(target=self._run, name="mc-store-io", daemon=True)
        self._thread.start()

    # -- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], tp_rank: int) -> None:
        if not kv_caches:
            raise ConfigError("no KV cache tensors to register")
        if set(kv_caches) != set(self.layer_names):
            raise ConfigError(
                f"KV cache layers {sorted(kv_caches)} differ from the KV cache group's "
                f"{sorted(self.layer_names)}"
            )
        by_name = {}
        for name, tensor in kv_caches.items():
            # One range per block (vLLM's CPU layout, FlashInfer), or K and V apart (vLLM's
            # GPU backends): then V is an object of its own, "{layer}/v", beside K's "{layer}".
            by_name[name] = layer_layouts(name, tensor, self.num_blocks, self.num_kv_heads)
        self.layers = [lay for n in self.layer_names for lay in by_name[n]]
        self.key_names = [
            n if i == 0 else f"{n}/v" for n in self.layer_names for i in range(len(by_name[n]))
        ]
        self.keys = self.keys.for_rank(tp_rank)
        for keys, names in self.groups or ():
            lays = [lay for n in names for lay in by_name[n]]
            knames = [n if i == 0 else f"{n}/v" for n in names for i in range(len(by_name[n]))]
            self._group_plan.append((keys.for_rank(tp_rank), lays, knames))
        spans = register_spans(self.layers)  # layers of different groups may share memory
        first = next(iter(kv_caches.values()))
        on_gpu = first.device.type == "cuda"
        location = f"cuda:{first.device.index or 0}" if on_gpu else "cpu:0"

        def on_connect(client: StoreClient) -> None:
            for addr, size in spans:  # zero-copy: the store reads and writes vLLM's blocks
                client.register_buffer(addr, size, location=location)

        client_cfg = self.config.client_config(self.config.timeout)
        if on_gpu:
            client_cfg = dataclasses.replace(client_cfg, transports=for_gpu(client_cfg.transports))
        self.store = GuardedStore(
            client_cfg,
            cooldown=self.config.cooldown,
            name=f"store worker {tp_rank}",
            on_connect=on_connect,
        )
        log.info(
            "store worker %d: %d layers in %d KV cache groups, %d blocks of %d bytes, keys %s/...",
            tp_rank,
            len(self.layers),
            max(1, len(self._group_plan)),
            self.num_blocks,
            self.layers[0].block_bytes,
            self.keys.prefix,
        )

    # -- per step ----------------------------------------------------------------------------
    def start_load_kv(self, meta: StoreConnectorMetadata) -> None:
        self._wait_fence()  # handle_preemptions waited already, where vLLM calls it
        for spec in meta.loads:
            if self.config.load_async:
                self._submit(_LOAD, lambda s=spec: self._load(s))  # type: ignore[misc]
            else:
                self._load(spec, report=False)  # done before this step's forward pass
        for spec in meta.saves:
            if spec.step:
                self._step_saves.append(spec)
            else:
                self._submit(_SAVE, lambda s=spec: self._save(s))  # type: ignore[misc]

    def wait_for_save(self) -> None:
        """Queue this step's step saves: the forward pass has written their blocks now."""
        specs, self._step_saves = self._step_saves, []
        for spec in specs:
            self._submit(_SAVE, lambda s=spec: self._save(s, report=False))  # type: ignore[misc]
            self._fence = self._fence or bool(spec.groups)

    def handle_preemptions(self, meta: StoreConnectorMetadata) -> None:
        """Called first in every step: wait (bounded) for the saves queued so far when a
        preempted request's blocks are free, or the last step's step saves of several KV cache
        groups may still read blocks this step frees and writes."""
        if meta.preempted:
            self._fence = False
            self._wait_saves(f"a preemption of {sorted(meta.preempted)}")
        self._wait_fence()

    def _wait_fence(self) -> None:
        if self._fence:  # the last step's window blocks may be freed and written from now on
            self._fence = False
            self._wait_saves("step saves of sliding-window blocks")

    def _wait_saves(self, why: str) -> None:
        """Wait for every save queued so far; bounded by twice a store call's deadline (each
        save ends by its own), then a warning and on."""
        done = threading.Event()
        self._submit(_SAVE, done.set)
        if not done.wait(2 * self.config.timeout + 5):
            log.warning("saves still running at %s", why)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            saved, self._saved = self._saved, set()
            loaded, self._loaded = self._loaded, set()
        return saved or None, loaded or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- the store thread --------------------------------------------------------------------
    def _submit(self, prio: int, job: Callable[[], None] | None) -> None:
        self._jobs.put((prio, next(self._seq), job))

    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            job()

    def _plan(self, spec: BlockSpec) -> tuple[list[str], list[int], list[int]]:
        if spec.groups:
            return self._plan_groups(spec)
        keys = self.keys.keys(spec.hashes, self.key_names)
        addrs, sizes = [], []
        for b in spec.block_ids:
            if not 0 <= b < self.num_blocks:
                raise _Refused(f"block id {b} outside 0..{self.num_blocks - 1}")
            for lay in self.layers:
                addrs.append(lay.addr + b * lay.stride)
                sizes.append(lay.block_bytes)
        return keys, addrs, sizes

    def _plan_groups(self, spec: BlockSpec) -> tuple[list[str], list[int], list[int]]:
        """Block by block, then group by group (none where the group holds no block)."""
        if len(spec.groups) != len(self._group_plan):
            raise _Refused(f"{len(spec.groups)} KV cache groups, {len(self._group_plan)} known")
        keys: list[str] = []
        addrs, sizes = [], []
        for i, h in enumerate(spec.hashes):
            for ids, (gkeys, lays, knames) in zip(spec.groups, self._group_plan, strict=True):
                if len(ids) != len(spec.hashes):
                    raise _Refused(f"{len(ids)} blocks of a group for {len(spec.hashes)} hashes")
                b = ids[i]
                if b == 0:
                    continue  # vLLM's null block: the group holds none there
                if not 0 < b < self.num_blocks:
                    raise _Refused(f"block id {b} outside 1..{self.num_blocks - 1}")
                keys.extend(gkeys.keys([h], knames))
                for lay in lays:
                    addrs.append(lay.addr + b * lay.stride)
                    sizes.append(lay.block_bytes)
        return keys, addrs, sizes

    def _key_blocks(self, spec: BlockSpec) -> list[int]:
        """The index in ``spec.hashes`` of each key :meth:`_plan` gives."""
        if not spec.groups:
            return [i for i in range(len(spec.hashes)) for _ in self.layers]
        out = []
        for i in range(len(spec.hashes)):
            for ids, (_, lays, _) in zip(spec.groups, self._group_plan, strict=True):
                if ids[i]:
                    out.extend([i] * len(lays))
        return out

    def _blocks_from(self, spec: BlockSpec, first: int) -> set[int]:
        """The blocks of ``spec.hashes[first:]`` (of every group)."""
        if not spec.groups:
            return set(spec.block_ids[first:])
        return {b for ids in spec.groups for b in ids[first:] if b}

    def _store(self) -> GuardedStore:
        if self.store is None or self.store.ready() is None:
            raise _Refused("no store connection")
        return self.store

    def _load(self, spec: BlockSpec, report: bool = True) -> None:
        failed = set(spec.block_ids)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            if spec.error:
                raise _Refused(spec.error)
            if not spec.groups and len(spec.hashes) != len(spec.block_ids):
                raise _Refused(f"{len(spec.hashes)} hashes for {len(spec.block_ids)} blocks")
            keys, addrs, sizes = self._plan(spec)
            store = self._store()
            with self._io:
                got = store.call("load", lambda client: client.batch_get_into(keys, addrs, sizes))
            if got is FAILED:
                raise _Refused("the store call failed (logged above)")
            bad = next((i for i, n in enumerate(got) if n != sizes[i]), None)
            if bad is None:
                failed = set()
                nbytes = sum(sizes)
            else:
                first = self._key_blocks(spec)[bad]
                failed = self._blocks_from(spec, first)
                raise _Refused(f"block {first} of {len(spec.block_ids)}: {got[bad]!r}")
        except MooncakeConnectorsError as exc:
            log.warning(
                "request %s: KV load from the store failed, %d blocks will be recomputed: %s",
                spec.request_id,
                len(failed),
                exc,
            )
        except Exception:  # never lose a request: anything else is a failed load too
            log.exception("request %s: KV load from the store failed", spec.request_id)
            failed = set(spec.block_ids)
        finally:
            if failed:
                self.stats.record_failed_load()
            else:
                self.stats.record_load(time.perf_counter() - t0, nbytes, len(spec.block_ids))
            with self._lock:
                self._load_errors.update(failed)
                if report:  # asynchronous loads end in get_finished
                    self._loaded.add(spec.request_id)

    def _save(self, spec: BlockSpec, report: bool = True) -> None:
        t0 = time.perf_counter()
        try:
            if not spec.block_ids:
                return  # nothing left to write: only the report below
            keys, addrs, sizes = self._plan(spec)
            store = self._store()

            def save(client: StoreClient) -> tuple[list[int], list[Result]]:
                present = client.batch_exists(keys)
                todo = [i for i, p in enumerate(present) if not p]
                return todo, client.batch_put_from(
                    [keys[i] for i in todo],
                    [addrs[i] for i in todo],
                    [sizes[i] for i in todo],
                    replicas=self.config.replicas,
                )

            with self._io:
                got = store.call("save", save)
            if got is FAILED:
                raise MooncakeConnectorsError("the store call failed (logged above)")
            todo, results = got
            errors = [e for e in results if e is not None and not isinstance(e, ObjectExists)]
            if errors:
                self.stats.record_failed_save()
                log.warning(
                    "request %s: %d of %d KV objects not saved: %s",
                    spec.request_id,
                    len(errors),
                    len(todo),
                    errors[0],
                )
            owner = self._key_blocks(spec)
            self._record_held(spec, todo, results, owner)
            written = len({owner[i] for i in todo})
            self.stats.record_save(
                time.perf_counter() - t0,
                sum(sizes[i] for i in todo),
                written,
                len(set(owner)) - written,
            )
        except _Refused as exc:
            log.info("request %s: KV not saved: %s", spec.request_id, exc)
        except MooncakeConnectorsError as exc:
            self.stats.record_failed_save()
            log.warning("request %s: KV save failed: %s", spec.request_id, exc)
        except Exception:
            self.stats.record_failed_save()
            log.exception("request %s: KV save failed", spec.request_id)
        finally:
            if report:  # a step save's request still runs
                with self._lock:
                    self._saved.add(spec.request_id)

    def _record_held(
        self, spec: BlockSpec, todo: list[int], results: list[Result], owner: list[int]
    ) -> None:
        """Queue the KV event for the leading blocks now held for every layer of this rank
        (``owner``: the block of each key)."""
        failed = {
            owner[i]
            for i, e in zip(todo, results, strict=True)
            if e is not None and not isinstance(e, ObjectExists)
        }
        held = min(failed, default=len(spec.hashes))
        event = stored_event(spec, held)
        if event is not None:
            with self._lock:
                self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (``get_kv_connector_kv_cache_events``)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self._submit(_STOP, None)
        self._thread.join(timeout=self.config.timeout + 5)
        if self.store is not None:
            self.store.close()
