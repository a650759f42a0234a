"""The LMCache plugin's settings from LMCache's extra_config (no lmcache needed)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_connectors.adapters.lmcache.config import (
    Layout,
    PluginConfig,
    find_plugin_name,
    from_extra_config,
)
from mooncake_connectors.errors import ConfigError

P = "remote_storage_plugin.mc."


def test_defaults_without_config_or_environment() -> None:
    cfg = from_extra_config("mc", None, env={})
    assert cfg == PluginConfig()
    assert from_extra_config("mc", {P + "transports": ["tcp", "shm"]}, env={}).transports == (
        "tcp",
        "shm",
    )
    assert cfg.master == "127.0.0.1:50051" and cfg.layout is Layout.AUTO
    client = cfg.client_config()
    assert client.timeout == cfg.timeout and client.rpc_timeout <= cfg.timeout
    assert client.replica_timeout <= cfg.timeout


def test_values_as_lmcache_passes_them_strings_or_typed() -> None:
    extra: dict[str, Any] = {
        P + "module_path": "mooncake_connectors.adapters.lmcache",
        P + "class_name": "StoreConnector",
        P + "master": " 10.0.0.1:7000 ",
        P + "timeout": "1.5",
        P + "transports": "tcp",
        P + "cooldown": 0,
        P + "workers": "8",
        P + "replicas": 2,
        P + "layout": "FRAMED",
        P + "register_buffer": "false",
        P + "local_buffer_size": "8M",
        P + "global_segment_size": "1G",
        P + "key_prefix": "team-a/",
        P + "list_limit": "0",
        "remote_storage_plugin.other.timeout": "not ours",
        "save_chunk_meta": False,
    }
    cfg = from_extra_config("mc", extra, env={})
    assert cfg == PluginConfig(
        master="10.0.0.1:7000",
        transports=("tcp",),
        timeout=1.5,
        cooldown=0.0,
        workers=8,
        replicas=2,
        layout=Layout.FRAMED,
        register_buffer=False,
        local_buffer_size=8 << 20,
        global_segment_size=1 << 30,
        key_prefix="team-a/",
        list_limit=0,
    )


def test_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"\['timout'\]; allowed: \[.*'cooldown'"):
        from_extra_config("mc", {P + "timout": "1"}, env={})
    # another implementation's cool-down names are not ours here: LMCache's key is cooldown
    with pytest.raises(ConfigError, match="retry_interval"):
        from_extra_config("mc", {P + "retry_interval": "1"}, env={})


def test_none_means_the_default() -> None:
    assert from_extra_config("mc", {P + "timeout": None}, env={}).timeout == PluginConfig().timeout


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout", "0"),
        ("timeout", "soon"),
        ("timeout", True),
        ("cooldown", "-1"),
        ("workers", "0"),
        ("workers", "1.5"),
        ("replicas", "9"),
        ("layout", "zip"),
        ("register_buffer", "maybe"),
        ("master", "nohost"),
        ("host", ""),
        ("transports", ""),
        ("transports", "tcp,tcp"),
        ("transports", 5),
        ("key_prefix", "a b"),
        ("local_buffer_size", "1K"),
        ("local_buffer_size", "lots"),
        ("global_segment_size", 1.5),
        ("list_limit", "-1"),
    ],
)
def test_bad_values_raise_config_error(key: str, value: Any) -> None:
    with pytest.raises(ConfigError):
        from_extra_config("mc", {P + key: value}, env={})


def test_environment_fills_what_the_config_leaves_out() -> None:
    env = {"MOONCAKE_MASTER": "10.0.0.2:50051", "MC_TCP_BIND_ADDRESS": "10.0.0.9"}
    cfg = from_extra_config("mc", {}, env=env)
    assert (cfg.master, cfg.host) == ("10.0.0.2:50051", "10.0.0.9")
    env["MOONCAKE_CONNECTORS_MASTER"] = "10.0.0.3:50051"
    assert from_extra_config("mc", {}, env=env).master == "10.0.0.3:50051"
    explicit = from_extra_config("mc", {P + "master": "10.0.0.4:1"}, env=env)
    assert explicit.master == "10.0.0.4:1"
    with pytest.raises(ConfigError):
        from_extra_config("mc", {}, env={"MOONCAKE_MASTER": "garbage"})


def _extra(*names: str, cls: str = "StoreConnector") -> dict[str, str]:
    out = {}
    for n in names:
        out[f"remote_storage_plugin.{n}.module_path"] = "pkg.mod"
        out[f"remote_storage_plugin.{n}.class_name"] = cls
    return out


def loads(module: str, cls: str) -> bool:
    return (module, cls) == ("pkg.mod", "StoreConnector")


def test_plugin_name_is_found_from_module_and_class() -> None:
    extra = {**_extra("mc"), **_extra("fs", cls="FSConnector")}
    assert find_plugin_name(["fs", "mc"], extra, loads) == "mc"
    with pytest.raises(ConfigError, match="no entry"):
        find_plugin_name(["fs"], extra, loads)
    with pytest.raises(ConfigError, match="no entry"):
        find_plugin_name(None, None, loads)
    with pytest.raises(ConfigError, match="only one instance"):
        find_plugin_name(["a", "b"], _extra("a", "b"), loads)
