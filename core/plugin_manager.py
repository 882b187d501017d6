"""Plugin discovery (entry points, allow-list) and the name -> class registries they fill.

Loading is idempotent: the first call to :func:`get_plugin_manager` loads every entry point of the
``kvforge`` group (filtered by ``KVFORGE_PLUGINS``), calls the registration hooks and fills one
:class:`Registry` per component kind. Later calls return the same manager. A plugin that fails to
import is logged by name and skipped; if the user then selects a component it would have provided,
the error names the plugin and the cause.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kvforge import hookspecs

logger = logging.getLogger(__name__)

#: Component kinds and the registration hook that fills each one.
KINDS: dict[str, str] = {
    "attention_backend": "register_attention_backends",
    "scheduler": "register_schedulers",
    "sampler": "register_samplers",
    "drafter": "register_drafters",
    "logits_processor": "register_logits_processors",
    "kv_cache_manager": "register_kv_cache_managers",
    "kv_connector": "register_kv_connectors",
    "model": "register_models",
    "executor": "register_executors",
    "quantization_method": "register_quantization_methods",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
}


@dataclass
class PluginInfo:
    """What one loaded plugin is and what it registered (shown by ``kvforge plugins``)."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    registers: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


@dataclass
class _Entry:
    target: Any  # class or "module:Class"
    plugin: str


class Registry:
    """Name -> component class for one kind; lazy "module:Class" targets import on first use."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, _Entry] = {}

    def add(self, name: str, target: Any, plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"plugin {plugin!r} registered a {self.kind} with an invalid name {name!r}")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice: by plugin {self._entries[name].plugin!r} "
                f"and by plugin {plugin!r}")
        self._entries[name] = _Entry(target, plugin)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def plugin_of(self, name: str) -> str:
        return self._entries[name].plugin

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> type:
        """The class registered as ``name``; ``ValueError`` listing valid names if unknown."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none)'}")
        if isinstance(entry.target, str):
            module_name, _, attr = entry.target.partition(":")
            try:
                entry.target = getattr(importlib.import_module(module_name), attr)
            except Exception as exc:  # the selected component must fail loudly with its cause
                raise ImportError(
                    f"{self.kind} {name!r} from plugin {entry.plugin!r} could not be imported "
                    f"({entry.target}): {exc!r}") from exc
        return entry.target


class PluginManager:
    """Owns the pluggy manager, the loaded plugins' metadata and one registry per kind."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failed: dict[str, PluginInfo] = {}
        self.registries = {kind: Registry(kind) for kind in KINDS}

    # -- loading ---------------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        if os.environ.get("KVFORGE_DISABLE_PLUGIN_AUTOLOAD", "").lower() in ("1", "true", "yes"):
            allowed_builtin_only = True
        else:
            allowed_builtin_only = False
        allow = _allow_list()
        for ep in md.entry_points(group=hookspecs.PROJECT_NAME):
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            builtin = dist_name == "kvforge"
            if allowed_builtin_only and not builtin:
                continue
            if allow is not None and ep.name not in allow and not builtin:
                continue
            if ep.name in self.plugins or ep.name in self.failed:
                known = self.plugins.get(ep.name) or self.failed[ep.name]
                if known.module != ep.value:
                    logger.warning("kvforge plugin name %r is taken by %s; skipping %s from %s",
                                   ep.name, known.module, ep.value, dist_name)
                continue
            info = PluginInfo(ep.name, ep.value, dist_name, dist.version if dist is not None else None)
            try:
                module = ep.load()
            except Exception as exc:
                info.error = repr(exc)
                self.failed[ep.name] = info
                logger.warning("kvforge plugin %r (%s) failed to load and is skipped: %r", ep.name, ep.value, exc)
                continue
            try:
                self.register(module, info)
            except Exception as exc:  # a broken registration hook costs only its own plugin
                self.unregister(ep.name)
                info.error = repr(exc)
                self.failed[ep.name] = info
                logger.warning("kvforge plugin %r (%s) failed to register and is skipped: %r", ep.name, ep.value, exc)

    def register(self, plugin: Any, info: PluginInfo | str) -> None:
        """Register a plugin object and run its registration hooks (also used by tests)."""
        if isinstance(info, str):
            info = PluginInfo(info, getattr(plugin, "__name__", repr(plugin)))
        if self.pm.is_registered(plugin) or info.name in self.plugins:
            return
        try:
            self._register(plugin, info)
        except Exception:
            self.unregister(info.name)
            raise

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        self.pm.register(plugin, name=info.name)
        self.plugins[info.name] = info
        for kind, hook_name in KINDS.items():
            # only this plugin's @hookimpl functions, as pluggy validated them against the specs
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin is plugin]
            if not impls:
                continue
            impl = impls[0].function
            names: list[str] = []

            def _register(name: str, target: Any, _kind: str = kind, _names: list = names) -> None:
                self.registries[_kind].add(name, target, info.name)
                _names.append(name)

            info.registers[kind] = names  # before the call, so a failure can be undone
            try:
                impl(register=_register)
            finally:
                if not names:
                    del info.registers[kind]

    def unregister(self, name: str) -> None:
        """Remove a plugin and everything it registered (tests register fakes and remove them)."""
        info = self.plugins.pop(name, None)
        if info is None:
            return
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        for kind, names in info.registers.items():
            for n in names:
                self.registries[kind]._entries.pop(n, None)

    # -- lookups ---------------------------------------------------------------------------------
    def get(self, kind: str, name: str) -> type:
        registry = self.registries[kind]
        if name not in registry:
            hint = ""
            if self.failed:
                hint = " (plugins that failed to load: " + ", ".join(
                    f"{n}: {i.error}" for n, i in self.failed.items()) + ")"
            raise ValueError(
                f"unknown {kind} {name!r}; valid names: {', '.join(registry.names()) or '(none)'}{hint}")
        return registry.get(name)

    def names(self, kind: str) -> list[str]:
        return self.registries[kind].names()

    @property
    def hook(self):
        return self.pm.hook


def _allow_list() -> set[str] | None:
    raw = os.environ.get("KVFORGE_PLUGINS")
    if raw is None or raw.strip() == "":
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


_manager: PluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loading entry points on first use (idempotent)."""
    global _manager
    with _lock:
        if _manager is None:
            manager = PluginManager()
            manager.load_entry_points()
            _manager = manager
        return _manager


def reset_plugin_manager() -> None:
    """Forget the loaded plugins; the next :func:`get_plugin_manager` loads again (for tests)."""
    global _manager
    with _lock:
        _manager = None
