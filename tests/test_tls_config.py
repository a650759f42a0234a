"""TLS settings: the same three keys in every adapter's extra config, the environment as the
fallback, and clear errors for half a pair or a missing file."""

from __future__ import annotations

import pytest

from mooncake_connectors import certs
from mooncake_connectors.adapters.lmcache.config import from_extra_config as lmcache_config
from mooncake_connectors.adapters.sglang.config import from_extra_config as sglang_config
from mooncake_connectors.adapters.vllm.config import PDConfig
from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
from mooncake_connectors.config import engine_config_from_env, tls_from_env
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.tls import TlsConfig


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    p = certs.init(tmp_path_factory.mktemp("pki"), ("node",))
    return {"tls_cert": str(p["node"]), "tls_key": str(p["node-key"]), "tls_ca": str(p["ca"])}


def want(files: dict[str, str]) -> TlsConfig:
    return TlsConfig(files["tls_cert"], files["tls_key"], files["tls_ca"])


def test_every_adapter_takes_the_tls_keys(files: dict[str, str]) -> None:
    assert PDConfig.from_extra_config(files).engine_config().tls == want(files)
    store = StoreConnectorConfig.from_extra_config(files)
    assert store.client_config(5.0).tls == want(files)
    lm = {f"remote_storage_plugin.mc.{k}": v for k, v in files.items()}
    lm["remote_storage_plugin.mc.master"] = "127.0.0.1:50051"
    assert lmcache_config("mc", lm, env={}).client_config().tls == want(files)
    sg = sglang_config({"master": "127.0.0.1:50051", **files}, env={})
    assert sg.client_config().tls == want(files)


def test_the_environment_fills_what_the_configuration_leaves_out(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "MOONCAKE_CONNECTORS_TLS_CERT": files["tls_cert"],
        "MOONCAKE_CONNECTORS_TLS_KEY": files["tls_key"],
        "MOONCAKE_CONNECTORS_TLS_CA": files["tls_ca"],
    }
    assert engine_config_from_env(env).tls == want(files)
    assert tls_from_env(env=env) == want(files)
    assert tls_from_env(env={}) is None
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert StoreConnectorConfig().client_config(5.0).tls == want(files)


def test_half_a_pair_or_a_missing_file_is_a_clear_error(files: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="go together"):
        TlsConfig(cert=files["tls_cert"])
    with pytest.raises(ConfigError, match="no such file"):
        PDConfig.from_extra_config({**files, "tls_ca": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError, match="must be a string"):
        PDConfig.from_extra_config({"tls_cert": 3})
