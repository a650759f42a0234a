"""Where an engine's GPU work stands, for copies that must follow it without a host sync.

An inference engine writes its KV cache from kernels queued on torch's current stream of the
cache's device; our copies run on streams of their own. :func:`stream_fence` gives a callable
that records a :class:`~mooncake_connectors.transfer_core.cuda_driver.Fence` at that stream's
current end (``torch.cuda.current_stream(device)``: the KV cache's device, whichever device is
current; neither is changed), which the engine's copy streams then wait for on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..transfer_core.cuda_driver import Fence

if TYPE_CHECKING:
    import torch


def stream_fence(device: torch.device) -> Callable[[], Fence]:
    """A maker of fences at the end of torch's current stream on ``device`` (a CUDA device)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()

    def fence() -> Fence:
        stream = torch.cuda.current_stream(index)  # of that device; the current one stays
        return Fence(index, int(stream.cuda_stream))

    return fence
