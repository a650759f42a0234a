"""The extra-config parser every engine adapter uses: names, types, aliases, unknown keys."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mooncake_connectors.errors import ConfigError
from mooncake_connectors.extra_config import Key, Kind, Schema, client_config, engine_config

KEYS = {
    "name": Key(Kind.TEXT, "a name"),
    "tag": Key(Kind.TEXT, "may be empty", empty=True),
    "flag": Key(Kind.BOOL, "a flag"),
    "count": Key(Kind.INT, "a count"),
    "seconds": Key(Kind.FLOAT, "a duration"),
    "size": Key(Kind.SIZE, "bytes"),
    "names": Key(Kind.NAMES, "names"),
    "maybe": Key(Kind.INT, "an int or None", nullable=True),
}


def schema(**kw: Any) -> Schema:
    return Schema("test", KEYS, **kw)


def test_values_of_every_kind() -> None:
    got = schema().parse(
        {
            "name": "x",
            "tag": "",
            "flag": False,
            "count": 3,
            "seconds": 2,
            "size": "4M",
            "names": "a, b",
            "maybe": None,
        }
    )
    assert got == {
        "name": "x",
        "tag": "",
        "flag": False,
        "count": 3,
        "seconds": 2.0,
        "size": 4 << 20,
        "names": ("a", "b"),
        "maybe": None,
    }
    assert isinstance(got["seconds"], float)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("name", "", "non-empty string"),
        ("name", 5, "a string"),
        ("flag", "true", "true or false"),
        ("count", 1.5, "an integer"),
        ("count", True, "a number"),
        ("seconds", "2", "a number"),
        ("size", 1.5, "a size"),
        ("names", 3, "list of names"),
        ("count", None, "a number"),
    ],
)
def test_strict_types_name_the_key(key: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"test\['{key}'\] must be .*{match}"):
        schema().parse({key: value})


def test_lenient_reads_text_and_none_is_the_default() -> None:
    got = schema(lenient=True).parse(
        {"name": " x ", "flag": "yes", "count": "7", "seconds": "0.5", "tag": None}
    )
    assert got == {"name": "x", "flag": True, "count": 7, "seconds": 0.5}
    with pytest.raises(ConfigError, match="an integer"):
        schema(lenient=True).parse({"count": "1.5"})


def test_unknown_foreign_ignored_aliases_and_deprecated_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = schema(
        aliases={"label": "name"},
        deprecated={"old_seconds": "seconds"},
        ignored=frozenset({"theirs"}),
        foreign=frozenset({"engine_key"}),
    )
    with pytest.raises(ConfigError, match=r"unknown extra-config key\(s\) \['nmae'\]; allowed: "):
        s.parse({"nmae": "x"})
    with caplog.at_level(logging.WARNING):
        assert s.parse({"label": "x", "theirs": 1, "engine_key": 2}) == {"name": "x"}
    assert "theirs" in caplog.text and "engine_key" not in caplog.text
    with pytest.warns(DeprecationWarning, match=r"'old_seconds'\] is deprecated; use .*'seconds'"):
        assert s.parse({"old_seconds": 3}) == {"seconds": 3.0}
    with pytest.raises(ConfigError, match="'name' twice"):
        s.parse({"name": "x", "label": "y"})
    assert "old_seconds" in s.allowed() and "label" in s.allowed()


def test_environment_fills_or_overrides() -> None:
    s = schema()
    values: dict[str, Any] = {"name": "given"}
    s.from_env(values, {"A": "from-env", "B": "42"}, "name", "A")
    s.from_env(values, {"A": "from-env", "B": "42"}, "count", "MISSING", "B")
    assert values == {"name": "given", "count": 42}
    s.from_env(values, {"A": "from-env"}, "name", "A", override=True)
    assert values["name"] == "from-env"
    with pytest.raises(ConfigError, match="environment variable B"):
        s.from_env({}, {"B": "many"}, "count", "B")


def test_client_and_engine_configs_follow_one_rule() -> None:
    c = client_config(
        master="127.0.0.1:1",
        host="127.0.0.1",
        transports=("tcp",),
        timeout=0.8,
        local_buffer_size=1 << 20,
    )
    assert c.timeout == 0.8 and c.rpc_timeout == 0.8 and c.replica_timeout == 0.4
    e = engine_config(
        host="127.0.0.1",
        metadata="p2p",
        transports=("tcp",),
        timeout=3.0,
        connect_timeout=1.0,
        tcp_lanes=2,
        auth_token=None,
    )
    assert (e.timeout, e.connect_timeout, e.tcp_lanes) == (3.0, 1.0, 2)
    assert e.auth_token is None  # left out: the environment's or the default


def test_each_store_adapter_passes_the_store_token_to_its_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A store started with --auth-token refuses a client without it (control and data plane);
    # every adapter must be able to carry it, from its own config or the store's variable.
    from mooncake_connectors.adapters.lmcache import config as lmcache_config
    from mooncake_connectors.adapters.sglang import config as sglang_config
    from mooncake_connectors.adapters.vllm.store_config import StoreConnectorConfig
    from mooncake_connectors.config import STORE_TOKEN_ENV

    monkeypatch.delenv(STORE_TOKEN_ENV, raising=False)
    token = "s3cret-token"
    vllm = StoreConnectorConfig.from_extra_config({"auth_token": token})
    assert vllm.client_config(1.0).auth_token == token
    assert token not in repr(vllm)
    lm = lmcache_config.from_extra_config(
        "mc",
        {
            "remote_storage_plugin.mc.master": "127.0.0.1:1",
            "remote_storage_plugin.mc.auth_token": token,
        },
        env={},
    )
    assert lm.client_config().auth_token == token
    sg = sglang_config.from_extra_config({"master": "127.0.0.1:1", "auth_token": token}, env={})
    assert sg.client_config().auth_token == token
    # Without a configured token the store's environment variable is the client's token.
    monkeypatch.setenv(STORE_TOKEN_ENV, "from-the-env-1")
    assert StoreConnectorConfig().client_config(1.0).auth_token == "from-the-env-1"
    assert (
        sglang_config.from_extra_config({"master": "127.0.0.1:1"}, env={})
        .client_config()
        .auth_token
        == "from-the-env-1"
    )
    monkeypatch.delenv(STORE_TOKEN_ENV)
    assert StoreConnectorConfig().client_config(1.0).auth_token is None
    with pytest.raises(ConfigError, match="auth_token"):
        StoreConnectorConfig.from_extra_config({"auth_token": 7})
