"""vLLM's ``EplbCommunicator`` over our transfer engine: expert weights moved by one-sided reads.

vLLM 0.32 moves expert weights during a rearrangement through an ``EplbCommunicator``
(``vllm/distributed/eplb/eplb_communicator.py``): per MoE layer it calls
``set_transfer_context(old_indices, layer)``, then ``add_send`` / ``add_recv`` per expert with
the rows involved (a sender's weight rows, a receiver's buffer rows), then ``execute()``, after
which every receive buffer must hold its expert and the senders may overwrite their weights.

Like vLLM's NIXL backend this one is receiver-driven: at construction every rank registers all
layers' expert weight tensors (and its receive buffers) with a :class:`TransferEngine` and the
ranks exchange segment names and base addresses; ``add_send`` is then a no-op, ``add_recv``
issues the READ of the sender's row at once, and ``execute`` waits for the reads under the
engine's deadline and then meets every rank at a barrier, so no rank overwrites rows a peer is
still reading. Transports, authentication and deadlines are the engine's (its config, from the
environment by default).

The exchange and the barrier go through :class:`Exchange`; :class:`TorchGroupExchange` is the
one vLLM's process groups provide (its CPU group, gloo), as the NIXL backend uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch
from vllm.distributed.eplb import eplb_state
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

from ...errors import ConfigError, PluginError, TransferError, TransferTimeout
from ...transfer_core import Batch, TransferEngine, TransferRequest
from ...types import TransferOp
from ..eplb_switch import EPLB_COMMUNICATOR_ENV, wants_ours

# Per rank: segment name, and (layer, tensor) -> (base address, bytes per expert row).
RankMeta = tuple[str, dict[tuple[int, int], tuple[int, int]]]


class Exchange(Protocol):
    """What the communicator needs from the ranks' group: one all-gather, one barrier."""

    def all_gather(self, value: RankMeta) -> list[RankMeta]: ...

    def barrier(self, timeout: float) -> None: ...


class TorchGroupExchange:
    """:class:`Exchange` over a ``torch.distributed`` CPU group (vLLM's ``cpu_group``)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def all_gather(self, value: RankMeta) -> list[RankMeta]:
        out: list[Any] = [None] * self.group.size()
        torch.distributed.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self, timeout: float) -> None:
        # An all_reduce with a deadline rather than monitored_barrier, which stateless (elastic
        # EP) groups do not support.
        work = torch.distributed.all_reduce(
            torch.zeros(1, dtype=torch.int32), group=self.group, async_op=True
        )
        work.wait(timeout=timedelta(seconds=timeout))


class MooncakeEplbCommunicator(EplbCommunicator):  # type: ignore[misc]
    """Receiver-driven expert weight moves over a started :class:`TransferEngine`.

    rank / exchange: this rank and its group; ``exchange.all_gather`` returns every rank's
        value in rank order.
    all_expert_weights: ``[layers][tensors]`` contiguous tensors of ``[local_experts, ...]``.
    expert_buffer: the receive buffers, one per tensor of a layer, same row sizes.
    timeout: seconds for one layer's reads and for the barrier after them.
    """

    def __init__(
        self,
        engine: TransferEngine,
        rank: int,
        exchange: Exchange,
        all_expert_weights: Sequence[Sequence[torch.Tensor]],
        expert_buffer: Sequence[torch.Tensor],
        *,
        timeout: float = 60.0,
        owns_engine: bool = False,
    ) -> None:
        if not all_expert_weights or not all_expert_weights[0] or not expert_buffer:
            raise ConfigError("expert weights and receive buffers must be non-empty")
        self._engine = engine
        self._owns_engine = owns_engine
        self._rank = rank
        self._exchange = exchange
        self._timeout = timeout
        self._num_local = int(all_expert_weights[0][0].shape[0])
        local: dict[tuple[int, int], tuple[int, int]] = {}
        tensors = [t for layer in all_expert_weights for t in layer] + list(expert_buffer)
        for t in tensors:
            if not t.is_contiguous():
                raise ConfigError("expert weight and buffer tensors must be contiguous")
        for layer, layer_tensors in enumerate(all_expert_weights):
            for index, t in enumerate(layer_tensors):
                if t.shape[0] != self._num_local:
                    raise ConfigError(f"layer {layer} tensor {index}: {t.shape[0]} expert rows")
                local[(layer, index)] = (t.data_ptr(), t.nbytes // self._num_local)
        self._regions = [engine.register(t) for t in tensors]
        self._peers = exchange.all_gather((engine.segment_name, local))
        for peer, (_, meta) in enumerate(self._peers):
            if {k: v[1] for k, v in meta.items()} != {k: v[1] for k, v in local.items()}:
                raise ConfigError(f"rank {peer}'s expert weight layout differs from ours")
        self._batches: list[Batch] = []
        self._rows: list[dict[int, int]] | None = None
        self._layer: int | None = None

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        return False  # reads land in the registered buffers; nothing to reserve

    def set_transfer_context(self, old_indices: np.ndarray, layer_idx: int) -> None:
        if self._batches:
            raise TransferError("set_transfer_context before execute() finished the last layer")
        ranks = len(self._peers)
        rows = np.asarray(old_indices)[: ranks * self._num_local].reshape(ranks, self._num_local)
        self._rows = [{int(e): i for i, e in enumerate(row) if e != -1} for row in rows]
        self._layer = layer_idx

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        pass  # the receiver reads; our rows are registered and readable in place

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        if self._rows is None or self._layer is None:
            raise TransferError("add_recv before set_transfer_context")
        row = self._rows[src_rank].get(expert_id)
        if row is None:
            raise TransferError(f"rank {src_rank} holds no expert {expert_id} in this layer")
        segment, meta = self._peers[src_rank]
        requests = []
        for index, t in enumerate(tensors):
            base, stride = meta[(self._layer, index)]
            if t.nbytes != stride:
                raise ConfigError(f"receive row of {t.nbytes} bytes for {stride}-byte rows")
            requests.append(
                TransferRequest(TransferOp.READ, segment, t.data_ptr(), base + row * stride, stride)
            )
        self._batches.append(self._engine.submit(requests, self._timeout))

    def execute(self) -> None:
        try:
            for batch in self._batches:
                if not batch.wait():
                    raise TransferTimeout(f"expert weight reads of layer {self._layer} timed out")
                batch.raise_for_status()
        finally:
            self._batches.clear()
            self._rows = None
            self._layer = None
        # Every rank passes here once per layer, reads finished: now weights may be overwritten.
        self._exchange.barrier(self._timeout)

    def close(self) -> None:
        """Unregister the tensors; close the engine too when this communicator started it."""
        for region in self._regions:
            self._engine.unregister(region)
        self._regions = []
        if self._owns_engine:
            self._engine.close()


def install(
    environ: Mapping[str, str] | None = None,
    engine_factory: Callable[[], TransferEngine] = TransferEngine,
) -> bool:
    """With ``MOONCAKE_CONNECTORS_EPLB_COMMUNICATOR=mooncake``, make vLLM's ``EplbState`` build
    our communicator (whatever ``EPLBConfig.communicator`` names); True if installed.

    vLLM picks its backend in ``eplb_communicator.create_eplb_communicator`` with a fixed
    if/elif over a ``Literal`` of names, and ``eplb_state`` calls it through its own module
    global; replacing that global is the one seam. Each communicator starts its own engine
    (configured from the environment, like our connectors') and closes it in ``close()``.
    """
    if not wants_ours(EPLB_COMMUNICATOR_ENV, environ):
        return False
    held = eplb_state.create_eplb_communicator
    if getattr(held, "_mooncake", False):
        return True
    if held.__module__ != "vllm.distributed.eplb.eplb_communicator":
        raise PluginError(f"vLLM's EPLB communicator factory is already replaced by {held!r}")

    def create(
        group_coordinator: Any,
        backend: str,
        expert_weights: Sequence[Sequence[torch.Tensor]],
        expert_buffer: Sequence[torch.Tensor],
    ) -> EplbCommunicator:
        group = group_coordinator.cpu_group
        engine = engine_factory().start()
        try:
            return MooncakeEplbCommunicator(
                engine,
                group.rank(),
                TorchGroupExchange(group),
                expert_weights,
                expert_buffer,
                timeout=engine.config.timeout,
                owns_engine=True,
            )
        except BaseException:
            engine.close()
            raise

    create._mooncake = True  # type: ignore[attr-defined]
    eplb_state.create_eplb_communicator = create
    return True
