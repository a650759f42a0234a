"""vLLM ``general_plugins`` entry point: makes our connector names known to vLLM.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), and
its registry raises on a duplicate name, so registering is guarded: a second call (the same
process loading plugins twice) is a no-op, and a different class already holding the name is an
error rather than a silent overwrite. It also registers the ``mooncake_p2p`` load format (a model
loader that fetches the checkpoint from the P2P swarm first); switches the opt-in ``mooncake``
alias on when ``MOONCAKE_CONNECTORS_AS_MOONCAKE=1`` (vLLM's own Mooncake connectors then run on our
engine and store); and, when ``MOONCAKE_CONNECTORS_EPLB_POLICY=mooncake`` is set, installs our EPLB
policy (:mod:`.eplb`), and with ``MOONCAKE_CONNECTORS_EPLB_COMMUNICATOR=mooncake`` our expert
weight mover (:mod:`.eplb_transfer`).
"""

from __future__ import annotations

from ...errors import PluginError
from ..eplb_switch import EPLB_COMMUNICATOR_ENV, EPLB_POLICY_ENV, wants_ours
from .config import CONNECTOR_NAME
from .store_config import STORE_CONNECTOR_NAME

CONNECTORS = {
    CONNECTOR_NAME: ("mooncake_connectors.adapters.vllm.connector", "MooncakeConnectorsPD"),
    STORE_CONNECTOR_NAME: (
        "mooncake_connectors.adapters.vllm.store_connector",
        "MooncakeConnectorsStore",
    ),
}


def register() -> None:
    # First, so that a connector's own ``import mooncake.store`` (lazy, in the worker) finds
    # our facades when MOONCAKE_CONNECTORS_AS_MOONCAKE=1 is set for this vLLM.
    from ...compat_alias import install_from_env

    install_from_env()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, (module, cls) in CONNECTORS.items():
        loader = KVConnectorFactory._registry.get(name)
        if loader is None:
            KVConnectorFactory.register_connector(name, module, cls)
            continue
        held = loader()
        if (held.__module__, held.__name__) != (module, cls):
            raise PluginError(
                f"vLLM connector name {name!r} is already taken by "
                f"{held.__module__}.{held.__name__}"
            )
        # else: registered by an earlier call in this process
    from .p2p_loader import register as register_p2p_loader

    register_p2p_loader()
    # vLLM's EPLB modules are imported only by deployments that ask for our pieces.
    if wants_ours(EPLB_POLICY_ENV):
        from .eplb import install as install_eplb_policy

        install_eplb_policy()
    if wants_ours(EPLB_COMMUNICATOR_ENV):
        from .eplb_transfer import install as install_eplb_communicator

        install_eplb_communicator()
