"""The plugin manager and the name -> class registries built from its hooks.

`plugin_manager()` is the process-wide, cached manager; `build_plugin_manager()` makes a fresh one
(for tests, or to add plugin objects without installing a package). Every registered plugin records
its `Origin`: hippo's built-ins, an installed distribution (name + version), or a runtime object.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import attrs
import pluggy

from hippo import hookspecs
from hippo.errors import PluginError

#: Set to 1 to stop third-party plugins from loading through entry points (built-ins still load).
AUTOLOAD_ENV = "HIPPO_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_DIST = "hippo"
KINDS = ("scorers", "selectors", "drafters", "verifiers", "schedulers", "executors", "adapters")


@attrs.frozen
class Origin:
    """Where a plugin came from: hippo itself, an installed distribution, or a runtime registration."""

    plugin: str  # the plugin's name in the manager (entry-point name for packages)
    distribution: str | None = None  # None: registered at runtime with `pm.register`
    version: str | None = None
    builtin: bool = False

    def __str__(self) -> str:
        if self.builtin:
            return f"built-in (hippo {self.version})"
        if self.distribution is None:
            return f"runtime plugin {self.plugin!r}"
        return f"{self.distribution} {self.version}"


class HippoPluginManager(pluggy.PluginManager):
    """A pluggy PluginManager that remembers the `Origin` of every plugin loaded from a package."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, Origin] = {}


def autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() in ("1", "true", "yes")


def _dist(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


def _load(pm: HippoPluginManager, ep: metadata.EntryPoint, builtin: bool) -> None:
    dist, version = _dist(ep)
    # Built-ins keep their entry-point names; third-party plugins are namespaced by distribution so
    # two packages that both call their entry point "plugin" do not shadow each other.
    name = ep.name if builtin else f"{dist}:{ep.name}"
    where = f"entry point {ep.name!r} ({ep.value}) of {dist} {version}"
    try:
        plugin = ep.load()
    except Exception as exc:  # a broken plugin package must say who it is
        raise PluginError(
            f"loading the hippo plugin {where} failed: {exc!r}; fix or uninstall {dist}, or set "
            f"{AUTOLOAD_ENV}=1 to skip third-party plugins"
        ) from exc
    try:
        pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        raise PluginError(f"the hippo plugin {where} cannot be registered: {exc}") from exc
    pm.origins[name] = Origin(name, dist, version, builtin)


def build_plugin_manager(
    *, autoload: bool | None = None, plugins: Iterable[object] = ()
) -> HippoPluginManager:
    """A fresh manager: built-ins, then third-party entry points, then `plugins`, then `check`.

    `autoload=None` follows the HIPPO_DISABLE_PLUGIN_AUTOLOAD environment variable; `plugins` are
    extra plugin objects (modules or classes with `@hippo.hookimpl` functions) registered at runtime.
    """
    pm = HippoPluginManager()
    eps = metadata.entry_points(group=hookspecs.PROJECT)
    builtin = [ep for ep in eps if _dist(ep)[0] == BUILTIN_DIST]
    if not builtin:
        raise PluginError(
            "hippo's built-in plugins are not installed (no 'hippo' entry points found); "
            "install the package with `pip install -e .` (or `pip install hippo`)"
        )
    for ep in builtin:
        _load(pm, ep, builtin=True)
    if autoload is None:
        autoload = not autoload_disabled()
    if autoload:
        for ep in eps:
            if _dist(ep)[0] != BUILTIN_DIST:
                _load(pm, ep, builtin=False)
    for plugin in plugins:
        try:
            pm.register(plugin)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"plugin {plugin!r} cannot be registered: {exc}") from exc
    check(pm)
    return pm


@functools.cache
def plugin_manager() -> HippoPluginManager:
    """The project's PluginManager, built once per process (see `build_plugin_manager`)."""
    return build_plugin_manager()


def check(pm: pluggy.PluginManager) -> None:
    """Reject hook implementations that match no hook spec (e.g. a misspelled hook name)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin = getattr(exc, "plugin", None)
        who = origin_of(pm, plugin) if plugin is not None else "a plugin"
        raise PluginError(
            f"{who}: {exc}; hippo hooks are: {', '.join(hook_names())}. Check the function's spelling"
        ) from exc


def hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("hippo_"))


def origin_of(pm: pluggy.PluginManager, plugin: object) -> Origin:
    name = pm.get_name(plugin) or repr(plugin)
    origin = getattr(pm, "origins", {}).get(name)
    if origin is not None:
        return origin
    for p, dist in pm.list_plugin_distinfo():  # loaded with pluggy's own load_setuptools_entrypoints
        if p is plugin:
            return Origin(name, dist.project_name, dist.version)
    return Origin(name)


def source_of(pm: pluggy.PluginManager, plugin: object) -> str:
    """A plugin's origin in words: 'built-in (hippo 0.1.0)', 'somedist 1.2', 'runtime plugin ...'."""
    return str(origin_of(pm, plugin))


def _entries(kind: str, pm: pluggy.PluginManager) -> list[tuple[str, type, Origin]]:
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
    caller = getattr(pm.hook, f"hippo_register_{kind}")
    out: dict[str, tuple[type, Origin]] = {}
    for impl in caller.get_hookimpls():
        origin = origin_of(pm, impl.plugin)
        found = impl.function() or {}
        if not isinstance(found, dict):
            raise PluginError(
                f"hippo_register_{kind} of {origin} returned {type(found).__name__}; it must return "
                "a dict of {name: class}"
            )
        for name, cls in found.items():
            if name in out:
                raise PluginError(
                    f"{kind[:-1]} name {name!r} is registered twice: by {out[name][1]} and by {origin}; "
                    "rename one of them or uninstall the duplicate plugin"
                )
            out[name] = (cls, origin)
    return [(name, cls, origin) for name, (cls, origin) in out.items()]


def registry(kind: str, pm: pluggy.PluginManager | None = None) -> dict[str, tuple[type, str]]:
    """Flatten `hippo_register_<kind>` results into {name: (class, source)}, rejecting duplicates."""
    pm = pm or plugin_manager()
    return {name: (cls, str(origin)) for name, cls, origin in _entries(kind, pm)}


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


def inventory(pm: pluggy.PluginManager | None = None) -> dict[str, list[dict[str, Any]]]:
    """{kind: [{name, class, source, distribution, version, builtin, plugin}, ...]} sorted by name."""
    pm = pm or plugin_manager()
    out: dict[str, list[dict[str, Any]]] = {}
    for kind in KINDS:
        out[kind] = [
            {
                "name": name,
                "class": f"{cls.__module__}:{cls.__qualname__}",
                "source": str(origin),
                "distribution": origin.distribution,
                "version": origin.version,
                "builtin": origin.builtin,
                "plugin": origin.plugin,
            }
            for name, cls, origin in sorted(_entries(kind, pm), key=lambda e: e[0])
        ]
    return out
