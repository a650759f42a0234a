"""The vLLM PD connector's ``kv_connector_extra_config`` (parsed without vLLM).

The engine-free PD protocol it configures is tested under ``tests/pd``.
"""

from __future__ import annotations

import pytest

from mooncake_connectors.adapters.vllm.config import PD_KEYS, PDConfig
from mooncake_connectors.errors import ConfigError

# -- extra config -------------------------------------------------------------------------------


def test_defaults_are_loopback_p2p_and_valid() -> None:
    cfg = PDConfig.from_extra_config({})
    assert cfg.host == "127.0.0.1" and cfg.metadata == "p2p" and cfg.side_channel_port == 0
    ec = cfg.engine_config()
    assert ec.host == "127.0.0.1" and ec.metadata == "p2p" and ec.timeout == cfg.transfer_timeout


def test_unknown_key_names_itself_and_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        PDConfig.from_extra_config({"transfer_timout": 3, "host": "127.0.0.1"})
    msg = str(info.value)
    assert "'transfer_timout'" in msg
    for key in PD_KEYS:
        assert key in msg


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"transfer_timeout": "5"}, "must be a number"),
        ({"transfer_timeout": -1}, "must be > 0"),
        ({"side_channel_port": 1.5}, "must be an integer"),
        ({"side_channel_port": 70000}, "0..65535"),
        ({"kv_lease": 5, "transfer_timeout": 10}, "must exceed"),
        ({"sync_load_max_bytes": -1}, "must be >= 0"),
        ({"sync_load_max_bytes": 1.5}, "must be an integer"),
        ({"transports": 3}, "list of names"),
        ({"tcp_lanes": 0}, "tcp_lanes"),
        ({"host": ""}, "not an address"),
        ({"auth_token": "short"}, "at least 8"),
        ({"accept_push": "yes"}, "true or false"),
    ],
)
def test_bad_values_are_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PDConfig.from_extra_config(extra)


def test_transports_accept_a_comma_list_and_env_fills_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MOONCAKE_CONNECTORS_SLICE_SIZE", str(1 << 20))
    cfg = PDConfig.from_extra_config({"transports": "tcp", "transfer_timeout": 2.5})
    ec = cfg.engine_config()
    assert ec.transports == ("tcp",) and ec.timeout == 2.5 and ec.slice_size == 1 << 20
