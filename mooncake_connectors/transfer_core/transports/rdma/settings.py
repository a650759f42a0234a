"""``transport_settings["rdma"]``: the rdma transport's settings, checked when loaded."""

from __future__ import annotations

from ....errors import ConfigError
from ...transport import TransportSettings


class RdmaSettings(TransportSettings, frozen=True, forbid_unknown_fields=True):
    """``transport_settings["rdma"]``.

    verbs: the module with pyverbs' objects ("pyverbs"; tests name a fake). nics: devices to use
    (empty: all). port: the port of each NIC. gid_index: the GID table entry of every NIC, or
    -1 (default) for each NIC's own best: InfiniBand 0, RoCE its RoCE v2 (IPv4-mapped first)
    GID, as Mooncake probes. slice_size: bytes
    per work request. max_wr: work requests in flight per QP. signal_every: ask for a completion
    every N requests. rail_timeout: seconds a rail may owe a completion before it is failed.
    min_memlock: the locked-memory limit (bytes) below which start fails. max_passive: QPs
    peers may have us make (a flood of connects cannot exhaust the NIC); when full, those of
    initiators whose segment is gone are destroyed. traffic_class / service_level: the RoCE
    GRH traffic class and the IB service level of every QP; -1 takes MC_IB_TC / MC_IB_SL, else
    0 (DSCP 0 is the lossy class on PFC/ECN fabrics, so RoCE deployments set it). gpu_mr: "auto"
    (dma-buf, else peermem), "dmabuf" or "peermem". sysfs: where topology is read. direct_qps:
    on the compiled data path, a second QP per rail, with a CQ of its own, that requests and
    batches go on in one compiled call (direct.py); doubles the QPs a peer makes on each side.
    """

    verbs: str = "pyverbs"
    nics: tuple[str, ...] = ()
    port: int = 1
    gid_index: int = -1
    slice_size: int = 64 * 1024
    max_wr: int = 128
    signal_every: int = 16
    rail_timeout: float = 2.0
    min_memlock: int = 64 * 1024 * 1024
    max_passive: int = 4096
    traffic_class: int = -1
    service_level: int = -1
    gpu_mr: str = "auto"
    sysfs: str = "/sys"
    direct_qps: bool = True

    def __post_init__(self) -> None:
        checks = (
            (4096 <= self.slice_size <= 1 << 30, "slice_size must be in 4 KiB..1 GiB"),
            (1 <= self.max_wr <= 16384, "max_wr must be in 1..16384"),
            (1 <= self.signal_every <= self.max_wr, "signal_every must be in 1..max_wr"),
            (self.rail_timeout > 0, "rail_timeout must be > 0"),
            (self.max_passive >= 1, "max_passive must be >= 1"),
            (-1 <= self.traffic_class <= 255, "traffic_class must be -1 (MC_IB_TC) or 0..255"),
            (-1 <= self.service_level <= 15, "service_level must be -1 (MC_IB_SL) or 0..15"),
            (self.gid_index >= -1, "gid_index must be -1 (probe each NIC) or a table index"),
            (self.gpu_mr in ("auto", "dmabuf", "peermem"), "gpu_mr: auto, dmabuf or peermem"),
        )
        for ok, why in checks:
            if not ok:
                raise ConfigError(f"rdma {why}", transport="rdma")
