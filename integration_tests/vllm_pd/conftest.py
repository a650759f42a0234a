"""Fixtures for the vLLM tests: the tiny local model, a log directory, engine cleanup.

Nothing here imports vLLM; each test module calls ``pytest.importorskip("vllm")`` first, so the
suite still runs (and skips these) where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, built once per session (about 10 s)."""
    from mooncake_connectors.bench.tiny_model import build

    return build(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm-logs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can print logs after a failure."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
