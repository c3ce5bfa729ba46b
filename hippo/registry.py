"""The plugin manager and the name -> class registries built from its hooks."""

from __future__ import annotations

import functools
import os
from importlib import metadata
from typing import Any

import pluggy

from hippo import hookspecs
from hippo.errors import PluginError

#: Set to 1 to stop third-party plugins from loading through entry points (built-ins still load).
AUTOLOAD_ENV = "HIPPO_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_DIST = "hippo"
KINDS = ("scorers", "selectors", "drafters", "verifiers", "schedulers", "adapters")


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    """The project's PluginManager: built-ins, then entry-point plugins, then `check_pending()`."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    eps = metadata.entry_points(group=hookspecs.PROJECT)
    builtin = [ep for ep in eps if _dist_name(ep) == BUILTIN_DIST]
    if not builtin:
        raise PluginError(
            "hippo's built-in plugins are not installed (no 'hippo' entry points found); "
            "install the package with `pip install -e .` (or `pip install hippo`)"
        )
    for ep in builtin:
        pm.register(ep.load(), name=ep.name)
    if os.environ.get(AUTOLOAD_ENV, "").strip() not in ("1", "true", "yes"):
        try:
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        except Exception as exc:  # a broken third-party package must say who it is
            raise PluginError(f"loading a hippo plugin from an entry point failed: {exc!r}") from exc
    check(pm)
    return pm


def check(pm: pluggy.PluginManager) -> None:
    """Reject hook implementations that match no hook spec (e.g. a misspelled hook name)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc}; hippo hooks are: {', '.join(_hook_names())}") from exc


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("hippo_"))


def source_of(pm: pluggy.PluginManager, plugin: object) -> str:
    name = pm.get_name(plugin) or repr(plugin)
    for p, dist in pm.list_plugin_distinfo():
        if p is plugin:
            return f"{dist.project_name} {dist.version} ({name})"
    if name.startswith("builtin-"):
        return f"hippo built-in ({name})"
    return f"registered at runtime ({name})"


def registry(kind: str, pm: pluggy.PluginManager | None = None) -> dict[str, tuple[type, str]]:
    """Flatten `hippo_register_<kind>` results into {name: (class, source)}, rejecting duplicates."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
    pm = pm or plugin_manager()
    caller = getattr(pm.hook, f"hippo_register_{kind}")
    out: dict[str, tuple[type, str]] = {}
    for impl in caller.get_hookimpls():
        source = source_of(pm, impl.plugin)
        for name, cls in (impl.function() or {}).items():
            if name in out:
                raise PluginError(
                    f"{kind[:-1]} name {name!r} is registered twice: by {out[name][1]} and by {source}; "
                    "rename one of them or uninstall the duplicate plugin"
                )
            out[name] = (cls, source)
    return out


def lookup(kind: str, name: str, pm: pluggy.PluginManager | None = None) -> type:
    reg = registry(kind, pm)
    if name not in reg:
        known = ", ".join(sorted(reg)) or "none"
        raise PluginError(f"unknown {kind[:-1]} {name!r}; registered {kind}: {known}")
    return reg[name][0]


def resolve_adapter(config: Any, pm: pluggy.PluginManager | None = None) -> type:
    """Find the adapter for a model config through the firstresult hook."""
    pm = pm or plugin_manager()
    cls = pm.hook.hippo_resolve_adapter(config=config)
    if cls is None:
        model_type = getattr(config, "model_type", None)
        known = ", ".join(sorted(registry("adapters", pm))) or "none"
        raise PluginError(
            f"no hippo adapter handles model_type {model_type!r}; installed adapters: {known}. "
            "Pass the backbone explicitly or install an adapter plugin for it"
        )
    return cls


def describe(pm: pluggy.PluginManager | None = None) -> dict[str, dict[str, str]]:
    """{kind: {name: source}} for `hippo plugins`."""
    return {kind: {n: src for n, (_, src) in sorted(registry(kind, pm).items())} for kind in KINDS}
