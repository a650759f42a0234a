"""The store connector's pure parts: extra-config validation and key layout (no vLLM).

The block hashes: test_kv_keys."""

from __future__ import annotations

import pytest

from mooncake_connectors.adapters.keys import Shard
from mooncake_connectors.adapters.vllm.store_config import STORE_KEYS, StoreConnectorConfig
from mooncake_connectors.adapters.vllm.store_keys import BlockKeys, layout_tag
from mooncake_connectors.errors import ConfigError


def test_defaults_are_loopback_and_every_key_is_documented() -> None:
    c = StoreConnectorConfig.from_extra_config(None)
    assert c.master.startswith("127.0.0.1:") and c.host == "127.0.0.1"
    assert {f for f in StoreConnectorConfig.__dataclass_fields__} == set(STORE_KEYS)


def test_unknown_key_names_it_and_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"\['timout'\].*allowed: \[.*'timeout'"):
        StoreConnectorConfig.from_extra_config({"timout": 3})


def test_reconnect_interval_is_a_deprecated_name_of_cooldown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.warns(DeprecationWarning, match=r"\['reconnect_interval'\] is deprecated"):
        c = StoreConnectorConfig.from_extra_config({"reconnect_interval": 2})
    assert c.cooldown == 2.0 and "deprecated" in caplog.text
    assert StoreConnectorConfig.from_extra_config({"cooldown": 3}).cooldown == 3.0
    with pytest.raises(ConfigError, match="'cooldown' twice"), pytest.warns(DeprecationWarning):
        StoreConnectorConfig.from_extra_config({"cooldown": 3, "reconnect_interval": 2})


@pytest.mark.parametrize(
    "extra",
    [
        {"timeout": 0},
        {"timeout": "5"},
        {"replicas": 0},
        {"replicas": 1.5},
        {"namespace": "a/b"},
        {"master": ""},
        {"master": "nohostport"},
        {"transports": []},
        {"lookup_timeout": True},
        {"cooldown": 0},
        {"load_async": "yes"},
        {"model_name": 5},
    ],
)
def test_bad_values_are_clear_errors(extra: dict) -> None:
    with pytest.raises(ConfigError):
        StoreConnectorConfig.from_extra_config(extra)


def test_values_are_converted() -> None:
    c = StoreConnectorConfig.from_extra_config(
        {"transports": "tcp, shm", "timeout": 2, "replicas": 2, "model_name": "m/x"}
    )
    assert c.transports == ("tcp", "shm") and c.timeout == 2.0 and c.replicas == 2
    client = c.client_config(c.timeout)
    assert client.timeout == 2.0 and client.rpc_timeout <= 2.0 and client.master == c.master
    assert client.replica_timeout <= client.timeout / 2  # time left to try another replica
    assert StoreConnectorConfig.from_extra_config({"metadata": None}).metadata is None


def test_keys_differ_by_model_layout_rank_and_layer() -> None:
    base = BlockKeys(
        "vllm", "org/model", layout_tag("torch.bfloat16", 16, 2, 64), Shard(False, 0, 2)
    )
    (k,) = base.keys(["ab"], ["layer0"])
    assert k == "vllm/v2/org%2Fmodel/bfloat16.b16.h2x64/tp0-2.pp0-1/ab/layer0"
    assert base.for_rank(1).keys(["ab"], ["layer0"]) != [k]
    assert base.keys(["ab", "cd"], ["l0", "l1"]) == [
        f"{base.prefix}/ab/l0",
        f"{base.prefix}/ab/l1",
        f"{base.prefix}/cd/l0",
        f"{base.prefix}/cd/l1",
    ]
    with pytest.raises(ConfigError):
        layout_tag("bfloat16", 16, 0, 64)
