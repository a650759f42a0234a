"""The error tree's structured fields: declared per class, read as attributes, never guessed."""

from __future__ import annotations

import pytest

from mooncake_connectors.errors import (
    ConfigError,
    MasterUnavailable,
    MetadataError,
    MooncakeConnectorsError,
    ObjectExists,
    PluginError,
    ProtocolError,
    SegmentNotFound,
    StoreError,
    TransferTimeout,
    TransportBroken,
)


def test_a_misspelt_field_raises_attribute_error() -> None:
    err = TransportBroken("connection reset", peer="127.0.0.1:5000", path="tcp")
    assert err.peer == "127.0.0.1:5000"
    with pytest.raises(AttributeError):
        _ = err.pear  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        _ = StoreError("no room", key="k").kee  # type: ignore[attr-defined]


def test_a_field_another_class_declares_is_not_an_attribute() -> None:
    # A store error carries no peer: reading one is a bug, not None.
    with pytest.raises(AttributeError):
        _ = StoreError("x", key="k").peer  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        _ = MooncakeConnectorsError("x").key  # type: ignore[attr-defined]


def test_a_field_the_class_does_not_declare_is_refused_at_construction() -> None:
    with pytest.raises(TypeError):
        TransportBroken("x", pear="p")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ObjectExists("x", segment="s")  # type: ignore[call-arg]


def test_declared_fields_default_to_none_and_are_shown_when_set() -> None:
    err = TransferTimeout("request still pending", peer="seg", index=3)
    assert (err.peer, err.path, err.index) == ("seg", None, 3)
    assert str(err) == "request still pending (peer='seg', index=3)"
    assert str(ProtocolError("bad frame")) == "bad frame"
    exists = ObjectExists("exists", key="k", code=-706)
    assert (exists.key, exists.code) == ("k", -706)
    master = MasterUnavailable("no master", master="127.0.0.1:1")
    assert (master.master, master.key, master.code) == ("127.0.0.1:1", None, None)
    missing = SegmentNotFound("gone", segment="s")
    assert isinstance(missing, MetadataError)
    assert (missing.segment, missing.url, missing.source) == ("s", None, None)
    plugin = PluginError("clash", group="g", first="a:b", second="c:d")
    assert (plugin.group, plugin.first, plugin.second) == ("g", "a:b", "c:d")


def test_config_error_keeps_the_offending_option_in_its_context() -> None:
    err = ConfigError("block_tokens must be > 0", block_tokens=0)
    assert isinstance(err, ValueError)
    assert err.context == {"block_tokens": 0}
    assert (err.key, err.code, err.path) == (None, None, None)
    assert str(err) == "block_tokens must be > 0 (block_tokens=0)"
    with pytest.raises(AttributeError):
        _ = err.block_tokens  # type: ignore[attr-defined]
    refused = ConfigError("buffer too small", key="k", code=-600)
    assert (refused.key, refused.code, refused.context) == ("k", -600, {})
