"""SGLang ``sglang.srt.plugins`` entry point (SGLang runs it in every process it starts).

It switches the ``mooncake`` alias on when ``MOONCAKE_CONNECTORS_AS_MOONCAKE`` says so (SGLang's
PD backend and HiCache ``mooncake`` backend then import our facades), and imports SGLang's EPLB
code only when ``MOONCAKE_CONNECTORS_EPLB_POLICY`` asks for our policy.
"""

from __future__ import annotations

from ..eplb_switch import EPLB_POLICY_ENV, wants_ours


def register() -> None:
    # SGLang's scheduler loads its plugins before it builds the KV managers or the HiCache
    # backend, so the lazy ``from mooncake.engine import TransferEngine`` there finds the alias.
    from ...compat_alias import install_from_env

    install_from_env()
    if wants_ours(EPLB_POLICY_ENV):
        from .eplb import register as register_eplb

        register_eplb()
