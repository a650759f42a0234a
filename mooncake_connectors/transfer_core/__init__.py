"""The transfer engine: move bytes between registered memory of processes and machines."""

from .engine import Batch, TransferEngine, TransferRequest
from .memory import Region, SharedBuffer

__all__ = ["Batch", "Region", "SharedBuffer", "TransferEngine", "TransferRequest"]
