from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_connectors.config import EngineConfig, engine_config_from_env, ib_qos_from_env
from mooncake_connectors.errors import ConfigError


def test_defaults_bind_loopback() -> None:
    cfg = EngineConfig()
    assert cfg.host == "127.0.0.1"
    assert cfg.metadata.startswith("http://127.0.0.1:")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000},
        {"host": ""},
        {"tcp_lanes": 0},
        {"slice_size": 100},
        {"transports": ()},
        {"transports": ("tcp", "tcp")},
        {"auth_token": "short"},
        {"timeout": 0},
        {"backoff_initial": 10.0, "backoff_max": 1.0},
        {"metadata": ""},
    ],
)
def test_bad_values_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_env_names_ours_then_mooncakes() -> None:
    env = {
        "MC_TCP_BIND_ADDRESS": "127.0.0.2",
        "MOONCAKE_TE_META_DATA_SERVER": "etcd://127.0.0.1:2379",
        "MOONCAKE_CONNECTORS_TRANSPORTS": "tcp",
        "MOONCAKE_CONNECTORS_TCP_LANES": "2",
    }
    cfg = engine_config_from_env(env)
    assert cfg.host == "127.0.0.2"
    assert cfg.metadata == "etcd://127.0.0.1:2379"
    assert cfg.transports == ("tcp",)
    assert cfg.tcp_lanes == 2
    env["MOONCAKE_CONNECTORS_HOST"] = "127.0.0.3"  # ours wins over Mooncake's name
    assert engine_config_from_env(env).host == "127.0.0.3"
    assert engine_config_from_env(env, tcp_lanes=8).tcp_lanes == 8


def test_env_bad_number_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="MOONCAKE_CONNECTORS_TCP_LANES"):
        engine_config_from_env({"MOONCAKE_CONNECTORS_TCP_LANES": "many"})


def test_no_settings_repr_shows_the_token(tmp_path: Path) -> None:
    """Settings get logged and printed in tracebacks (pytest prints fixtures' reprs)."""
    from mooncake_connectors.adapters.lmcache.config import PluginConfig
    from mooncake_connectors.adapters.sglang.config import HiCacheStoreConfig
    from mooncake_connectors.adapters.vllm.config import PDConfig
    from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
    from mooncake_connectors.store.config import ClientConfig, MasterConfig, ServerConfig

    secret = "s3cret-token-value"
    need = {"master": "127.0.0.1:50051"}
    made = [
        EngineConfig(auth_token=secret),
        PDConfig(auth_token=secret),
        StoreConnectorConfig(auth_token=secret),
        PluginConfig(auth_token=secret, **need),
        HiCacheStoreConfig(auth_token=secret, **need),
        ClientConfig(auth_token=secret),
        MasterConfig(auth_token=secret),
        ServerConfig(auth_token=secret),
    ]
    for cfg in made:
        assert cfg.auth_token == secret and secret not in repr(cfg), type(cfg).__name__
    # The adapters pass the same four settings on to the engine or the store client.
    ca = tmp_path / "ca.pem"
    ca.write_text("")  # only its existence is checked here
    pd = PDConfig(auth_token=secret, tls_ca=str(ca))
    assert pd.credentials() == {
        "auth_token": secret,
        "tls_cert": None,
        "tls_key": None,
        "tls_ca": str(ca),
    }


def test_ib_qos_from_env_reads_mooncakes_names_and_refuses_out_of_range() -> None:
    assert ib_qos_from_env({}) == {}
    assert ib_qos_from_env({"MC_IB_TC": "106", "MC_IB_SL": "3"}) == {
        "traffic_class": 106,
        "service_level": 3,
    }
    for bad in ({"MC_IB_TC": "256"}, {"MC_IB_SL": "16"}, {"MC_IB_TC": "high"}):
        with pytest.raises(ConfigError, match="must be an integer"):
            ib_qos_from_env(bad)
