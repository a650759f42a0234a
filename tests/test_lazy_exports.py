"""Packages that re-export lazily: importing them loads none of the modules behind the names,
a name loads its own module on first access, and an unknown name is an AttributeError."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = {
    "mooncake_connectors.store": ("ClientConfig", "config", "client"),
    "mooncake_connectors.adapters.sglang": ("HiCacheStoreConfig", "config", "storage"),
    "mooncake_connectors.adapters.lmcache": ("PluginConfig", "config", "connector"),
}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_name_loads_only_its_own_module(package: str) -> None:
    name, home, other = PACKAGES[package]
    script = (
        "import sys\n"
        f"import {package} as p\n"
        f"assert '{package}.{home}' not in sys.modules, 'loaded on import'\n"
        f"assert p.{name}.__module__ == '{package}.{home}'\n"
        f"assert '{package}.{other}' not in sys.modules, 'loaded with a neighbour'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_an_unknown_name_is_an_attribute_error(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=rf"module '{package}' has no attribute 'nope'"):
        module.nope  # noqa: B018
    assert not hasattr(module, "_lazy_nope")
