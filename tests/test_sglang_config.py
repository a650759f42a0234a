"""The SGLang backend's extra-config and key scheme (no SGLang needed: these modules are pure)."""

from __future__ import annotations

import logging

import pytest

from mooncake_connectors.adapters.sglang.config import HiCacheStoreConfig, from_extra_config
from mooncake_connectors.adapters.sglang.keys import KeyScheme, Shard, page_format
from mooncake_connectors.errors import ConfigError

SGLANG = {
    "backend_name": "mooncake_connectors",
    "module_path": "mooncake_connectors.adapters.sglang",
    "class_name": "HiCacheStore",
    "interface_v1": 1,
}


def test_our_keys_with_types_checked() -> None:
    cfg = from_extra_config(
        {
            **SGLANG,
            "master": "10.0.0.1:50051",
            "timeout": 2,
            "global_segment_size": "4gb",
            "staging_size": 1 << 20,
            "transports": "tcp",
            "allow_clear": False,
        },
        env={},
    )
    assert cfg.master == "10.0.0.1:50051" and cfg.timeout == 2.0
    assert cfg.global_segment_size == 4 << 30 and cfg.staging_size == 1 << 20
    assert cfg.transports == ("tcp",) and cfg.allow_clear is False


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"master": "h:1", "mastr": "h:1"}, r"unknown extra-config key\(s\) \['mastr'\]"),
        ({"master": "h:1", "master_server_address": "h:1"}, "twice"),
        ({"master": "h:1", "timeout": "1"}, "'timeout' must be a number"),
        ({"master": "h:1", "timeout": True}, "'timeout' must be a number"),
        ({"master": "h:1", "cooldown": 1, "retry_interval": 2}, "'cooldown' twice"),
        ({"master": "h:1", "timeout": 0}, "timeout must be > 0"),
        ({"master": "h:1", "replicas": 9}, "replicas must be in"),
        ({"master": "h:1", "allow_clear": "yes"}, "allow_clear"),
        ({"master": "h:1", "namespace": "a/b"}, "namespace must not contain"),
        ({"master": "nohostport"}, "master address must be HOST:PORT"),
        ({"master": "h:1", "staging_size": "1K"}, "staging_size"),
        ({}, "no store master"),
    ],
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_bad_extra_config_is_refused(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_extra_config({**SGLANG, **extra}, env={})


def test_mooncake_names_and_environment(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.2:50051",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
        "MOONCAKE_TENANT_ID": "team-a",
    }
    cfg = from_extra_config(dict(SGLANG), env=env)
    assert (cfg.master, cfg.host, cfg.global_segment_size, cfg.tenant) == (
        "10.0.0.2:50051",
        "10.0.0.9",
        2 << 30,
        "team-a",
    )
    # extra-config beats the environment, except the local host name (as in SGLang's backend).
    with caplog.at_level(logging.WARNING):
        cfg = from_extra_config(
            {
                **SGLANG,
                "master_server_address": "10.0.0.3:1",
                "local_hostname": "10.0.0.4",
                "tenant_id": "team-b",
                "extra_backend_tag": "blue",
                "protocol": "rdma",
                "device_name": "mlx5_0",
            },
            env=env,
        )
    assert (cfg.master, cfg.host, cfg.tenant, cfg.tag) == (
        "10.0.0.3:1",
        "10.0.0.9",
        "team-b",
        "blue",
    )
    assert "ignored here" in caplog.text and "protocol" in caplog.text
    assert from_extra_config({**SGLANG, "master": "h:1"}, env={"LOCAL_HOSTNAME": "n1"}).host == "n1"


def test_retry_interval_is_a_deprecated_name_of_cooldown(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.warns(DeprecationWarning, match="'retry_interval' is deprecated; use .*'cooldown'"):
        cfg = from_extra_config({**SGLANG, "master": "h:1", "retry_interval": 2}, env={})
    assert cfg.cooldown == 2.0
    assert "deprecated" in caplog.text  # also logged: hosts hide DeprecationWarning
    assert from_extra_config({**SGLANG, "master": "h:1", "cooldown": 3}, env={}).cooldown == 3.0


def test_config_dataclass_defaults() -> None:
    cfg = HiCacheStoreConfig(master="127.0.0.1:50051")
    assert cfg.timeout == 5.0 and cfg.global_segment_size == 0 and cfg.allow_clear


def test_keys_keep_models_ranks_formats_and_parts_apart() -> None:
    fmt = page_format("page_first", "torch.bfloat16", 64)
    assert fmt == "tl.bfloat16.p64"
    assert page_format("layer_first", "torch.float8_e4m3fn", 16) == page_format(
        "page_first_direct", "torch.float8_e4m3fn", 16
    )
    assert page_format("page_first", "torch.bfloat16", 64, "mxfp8") == "tl.bfloat16.p64.mxfp8"
    with pytest.raises(ConfigError, match="page_unified"):
        page_format("page_unified", "torch.bfloat16", 64)

    mha = KeyScheme("sglang", "Qwen/Qwen3-8B", Shard(False, 1, 4, 0, 2), fmt)
    assert mha.objects(["h1", "h2"]) == [
        "sglang/Qwen%2FQwen3-8B/tp1-4.pp0-2/tl.bfloat16.p64/h1/k",
        "sglang/Qwen%2FQwen3-8B/tp1-4.pp0-2/tl.bfloat16.p64/h1/v",
        "sglang/Qwen%2FQwen3-8B/tp1-4.pp0-2/tl.bfloat16.p64/h2/k",
        "sglang/Qwen%2FQwen3-8B/tp1-4.pp0-2/tl.bfloat16.p64/h2/v",
    ]
    assert mha.flat(["h1"]) == ["sglang/Qwen%2FQwen3-8B/tp1-4.pp0-2/tl.bfloat16.p64/h1/page"]
    # MLA: no TP rank in the key, so every rank reads the writer's one object per page.
    mla0 = KeyScheme("sglang", "m", Shard(True, 0, 4), fmt, tenant="t", tag="x")
    mla3 = KeyScheme("sglang", "m", Shard(True, 3, 4), fmt, tenant="t", tag="x")
    assert (
        mla0.objects(["h"])
        == mla3.objects(["h"])
        == ["sglang.t.x/m/mla.pp0-1/tl.bfloat16.p64/h/kv"]
    )
    assert Shard(False, 0, 2, cp_rank=1, cp_size=2).tag() == "tp0-2.pp0-1.cp1-2"
    with pytest.raises(ConfigError, match="tp rank 2"):
        Shard(False, 2, 2)
