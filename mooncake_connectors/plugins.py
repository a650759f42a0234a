"""Plugin discovery on pluggy.

Transports and metadata backends are plugins found through the entry-point groups
``mooncake_connectors.transports`` and ``mooncake_connectors.metadata``. Each entry point names a
module (or object) that implements one hook returning the plugin class. Built-ins are registered
through this package's own entry points, exactly like third-party plugins, and are also known by
module path here: a copy of the source tree that was never installed (no entry points, as on a
machine given only the tracked files) still finds them.

Duplicate names raise :class:`PluginError`; nothing is silently overwritten.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import Any, Generic, TypeVar

import pluggy

from .errors import PluginError

log = logging.getLogger(__name__)

PROJECT = "mooncake_connectors"
TRANSPORT_GROUP = "mooncake_connectors.transports"
METADATA_GROUP = "mooncake_connectors.metadata"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class _Specs:
    @hookspec
    def mooncake_transport(self) -> Any:  # type: ignore[empty-body]
        """Return a Transport subclass (see transfer_core.transport.Transport)."""

    @hookspec
    def mooncake_metadata(self) -> Any:  # type: ignore[empty-body]
        """Return a MetadataBackend subclass (see transfer_core.metadata.base)."""


T = TypeVar("T")

# The same names and modules as pyproject.toml's entry points (test_plugins checks they agree).
BUILTINS: dict[str, dict[str, str]] = {
    TRANSPORT_GROUP: {
        name: f"mooncake_connectors.transfer_core.transports.{name}"
        for name in ("tcp", "shm", "cuda_ipc", "rdma")
    },
    METADATA_GROUP: {
        name: f"mooncake_connectors.transfer_core.metadata.{name}"
        for name in ("memory", "http", "etcd", "p2p")
    },
}


class Registry(Generic[T]):
    """Name → plugin class, loaded lazily from one entry-point group."""

    def __init__(self, group: str, hook: str) -> None:
        self._group = group
        self._hook = hook
        self._lock = threading.Lock()
        self._classes: dict[str, type[T]] | None = None
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(_Specs)

    def _load(self) -> dict[str, type[T]]:
        with self._lock:
            if self._classes is not None:
                return self._classes
            classes: dict[str, type[T]] = {}
            seen: dict[str, str] = {}
            for ep in importlib.metadata.entry_points(group=self._group):
                if ep.name in seen and seen[ep.name] != ep.value:
                    raise PluginError(
                        f"two plugins claim the name {ep.name!r} in {self._group}",
                        first=seen[ep.name],
                        second=ep.value,
                    )
                if ep.name in seen:  # the same distribution seen twice on sys.path
                    continue
                seen[ep.name] = ep.value
                try:
                    obj = ep.load()
                except Exception as exc:
                    raise PluginError(
                        f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}",
                        group=self._group,
                    ) from exc
                self._pm.register(obj, name=f"{self._group}:{ep.name}")
                classes[ep.name] = _call_one(self._pm, self._hook, obj)
            for name, module in BUILTINS.get(self._group, {}).items():
                if name in seen:
                    if seen[name] != module:
                        raise PluginError(
                            f"a plugin claims the built-in name {name!r} in {self._group}",
                            first=module,
                            second=seen[name],
                        )
                    continue
                try:
                    obj = importlib.import_module(module)
                except Exception as exc:
                    raise PluginError(
                        f"built-in plugin {name!r} ({module}) failed to load: {exc}",
                        group=self._group,
                    ) from exc
                self._pm.register(obj, name=f"{self._group}:{name}")
                classes[name] = _call_one(self._pm, self._hook, obj)
            self._classes = classes
            return classes

    def names(self) -> list[str]:
        return sorted(self._load())

    def get(self, name: str) -> type[T]:
        classes = self._load()
        try:
            return classes[name]
        except KeyError:
            raise PluginError(
                f"no plugin named {name!r} in {self._group}; known: {sorted(classes)}"
                + ("" if classes else " (is mooncake-connectors installed? pip install -e .)"),
                group=self._group,
            ) from None

    def register(self, name: str, cls: type[T]) -> None:
        """Register a plugin class at run time (tests, embedding applications)."""
        classes = self._load()
        with self._lock:
            if name in classes and classes[name] is not cls:
                raise PluginError(f"plugin name {name!r} already registered in {self._group}")
            classes[name] = cls


def _call_one(pm: pluggy.PluginManager, hook: str, plugin: object) -> Any:
    """Call ``hook`` on ``plugin`` alone; it must return exactly one class."""
    caller = pm.subset_hook_caller(
        hook, remove_plugins=[p for p in pm.get_plugins() if p is not plugin]
    )
    results = caller()
    if len(results) != 1 or not isinstance(results[0], type):
        raise PluginError(f"plugin {plugin!r} must return exactly one class from {hook}()")
    return results[0]
