"""The compiled extensions are optional: an install on a machine without a C compiler or without
libibverbs-dev goes on with the pure-Python loops instead of failing.

``cythonize`` returns new Extension objects that lose ``optional``; a fresh machine without
``infiniband/verbs.h`` once failed ``pip install -e .`` on the rdma extension for that reason.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


def test_every_extension_setup_py_declares_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("Cython")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    exts = seen["ext_modules"]
    assert {e.name.rsplit(".", 1)[-1] for e in exts} == {"_tcp_fast", "_rdma_fast"}
    assert all(e.optional for e in exts), [e.name for e in exts if not e.optional]
