"""Plug-in registries: collectors, appliers, objectives and reward types by name.

A ``Registry`` is a dict of name -> factory with a ``register(name)`` decorator. When a
name is not found it imports every module of its package once, so built-in plug-ins
(one per file) register themselves without a hand-kept list; a plug-in from outside
the package registers the same way, by importing its module first.

A plug-in may declare its options as a dataclass in an ``Options`` attribute; then
``build(name, options)`` checks the options table against it (types, unknown keys,
``validate()``) and calls ``factory(Options(...))``. Without ``Options`` the table is
passed as keyword arguments. Either way a bad option is one ``ValueError`` of the form
``"<key>: <problem>"``, so the config loader can name the file and the dotted key.
Imports nothing heavy: the agents use it.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable


class PluginError(ValueError):
    """An unknown plug-in name or a bad option; ``str()`` is ``"<key>: <problem>"``."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")

    def config_error(self, source: str, prefix: str):
        """The same error as a ``ConfigError`` under the plug-in's table ``prefix``."""
        from capes.common.config import ConfigError
        return ConfigError(source, f"{prefix}.{self.key}" if prefix else self.key, self.problem)


class Registry(dict):
    def __init__(self, kind: str, package: str | None = None):
        super().__init__()
        self.kind = kind
        self.package = package
        self._loaded = package is None

    def register(self, name: str) -> Callable:
        def deco(obj):
            if isinstance(obj, type):
                obj.name = name
            self[name] = obj
            return obj
        return deco

    def names(self) -> list[str]:
        """Every registered name, built-ins included."""
        if not self._loaded:
            self.load_builtin()
        return sorted(self)

    def get_plugin(self, name: str) -> Callable:
        if name not in self and not self._loaded:
            self.load_builtin()
        if name not in self:
            raise PluginError("", f"unknown {self.kind} {name!r} "
                                  f"(known: {', '.join(self.names()) or 'none'})")
        return self[name]

    def build(self, name: str, options: dict[str, Any] | None = None, key: str = "options",
              name_key: str = "name"):
        """The plug-in ``name`` built from its options table; ``key`` and ``name_key`` are
        where the table and the name sit in the config, for the error message."""
        from capes.common.config import ConfigError, build
        try:
            factory = self.get_plugin(name)
        except PluginError as exc:
            raise PluginError(name_key, exc.problem) from None
        options = dict(options or {})
        opts_cls = getattr(factory, "Options", None)
        try:
            if opts_cls is not None and dataclasses.is_dataclass(opts_cls):
                return factory(build(opts_cls, options, "", key))
            return factory(**options)
        except ConfigError as exc:
            raise PluginError(exc.key or key, f"{name}: {exc.problem}") from None
        except TypeError as exc:       # an option the factory does not take
            raise PluginError(key, f"{name}: {exc}") from None

    def load_builtin(self) -> None:
        """Import every module of the package (``base`` excepted) so they register."""
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if mod.name != "base":
                importlib.import_module(f"{self.package}.{mod.name}")
