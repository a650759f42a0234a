"""Shared helpers of the MoE router tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch", reason="the MoE router needs torch (the 'torch' extra)")

_REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "eplb_reference.py"


@pytest.fixture(scope="session")
def reference() -> ModuleType:
    """Our re-implementation of DeepSeek's published EPLB (the comparison baseline)."""
    spec = importlib.util.spec_from_file_location("eplb_reference", _REFERENCE)
    assert spec is not None and spec.loader is not None, _REFERENCE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DictStore:
    """In-memory implementation of the MetadataStore protocol: the seam to the metadata layer
    (owned by another component), not the thing under test."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def list(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self.data.items() if k.startswith(prefix)}

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class FakeClock:
    """A wall clock the test advances by hand: no sleeping."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def store() -> DictStore:
    return DictStore()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
