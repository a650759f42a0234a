"""Value types of the scheduler API: what a proxy hands in and gets back per request."""

from __future__ import annotations

import dataclasses
import enum
import math

from ..errors import ConfigError

# The prefix source of global-cache and adaptive in a store deployment: every prefill instance
# saves its prompts' KV to the distributed store and loads any prefix held there, so "fetch"
# means "load from the store" rather than "copy from one named instance".
STORE = "store"


class PlacementPolicy(enum.Enum):
    """How the prefill instance is chosen (the Mooncake paper's Figure 5 plus ours)."""

    RANDOM = "random"
    LOAD_BALANCE = "load-balance"  # least estimated queue time, cache ignored
    LOCAL_CACHE = "local-cache"  # min queue + prefill using only the instance's own cache
    GLOBAL_CACHE = "global-cache"  # Algorithm 1: may fetch the best prefix from another instance
    ADAPTIVE = "adaptive"  # ours: cost-based fetch, transfer/queue overlap, NIC congestion


class Admission(enum.Enum):
    """When a request is refused (HTTP 429) instead of placed."""

    NONE = "none"  # never: every request is placed
    EARLY = "early"  # Algorithm 1 lines 24-26: estimated TTFT or current decode TBT over SLO
    PREDICTIVE = "predictive"  # §7.3: decode load predicted for when the request gets there
    # ours: PREDICTIVE + decode KV room + learned estimate error margin; a request expected to
    # miss the TTFT SLO still runs, best effort, while a quarter of the prefill pool is idle
    ADAPTIVE = "adaptive"


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"  # no prefill instance is expected to produce the first token in time
    TBT_SLO = "tbt_slo"  # every decode instance is expected to be slower than the TBT SLO
    DECODE_CAPACITY = "decode_capacity"  # no decode instance is expected to have KV room


@dataclasses.dataclass(frozen=True)
class ScheduleRequest:
    """A request as the scheduler sees it: its prompt size and chained prefix-block keys.

    ``block_hashes`` come from :func:`~mooncake_connectors.conductor.hashing.prefix_block_hashes`
    (or a trace's ``hash_ids``). The output length is not known in advance, so it is not here.
    """

    request_id: int
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    # Leading blocks of this prompt the store holds, when the caller asked the store (a live
    # proxy asks its master); None: the conductor's own store index answers (store events).
    store_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ConfigError("prompt_tokens must be > 0", request_id=self.request_id)
        if self.store_blocks is not None and self.store_blocks < 0:
            raise ConfigError("store_blocks must be >= 0", request_id=self.request_id)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where to run a request, and what the scheduler expects to happen.

    ``fetch_from``/``fetch_blocks``: the prefill instance should first pull that many leading
    prefix blocks from ``fetch_from`` (a hot prefix being replicated); ``None``/0 when it computes
    from its own cache. Times are seconds from the decision.
    """

    request_id: int
    prefill: str
    decode: str
    local_blocks: int
    fetch_from: str | None
    fetch_blocks: int
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    best_effort: bool = False  # expected to miss the TTFT SLO, placed anyway (see Admission)

    def __post_init__(self) -> None:
        for name in ("est_queue_s", "est_transfer_s", "est_prefill_s", "est_ttft_s", "est_tbt_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name} must be a finite time >= 0", **{name: v})
        if (self.fetch_from is None) != (self.fetch_blocks == 0):
            raise ConfigError("fetch_from and fetch_blocks go together", request_id=self.request_id)


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A refusal with its reason; a proxy answers HTTP 429 with ``detail``."""

    request_id: int
    reason: RejectReason
    detail: str
    est_ttft_s: float
    est_tbt_s: float

    http_status: int = 429
