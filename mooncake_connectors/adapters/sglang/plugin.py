"""SGLang ``sglang.srt.plugins`` entry point (SGLang runs it in every process it starts).

It imports SGLang's EPLB code only when ``MOONCAKE_CONNECTORS_EPLB_POLICY`` asks for our policy.
"""

from __future__ import annotations

from ..eplb_switch import EPLB_POLICY_ENV, wants_ours


def register() -> None:
    if wants_ours(EPLB_POLICY_ENV):
        from .eplb import register as register_eplb

        register_eplb()
