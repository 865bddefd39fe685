"""Plug-in registries: collectors, appliers, objectives and reward types by name.

A ``Registry`` is a dict of name -> factory with a ``register(name)`` decorator. When a
name is not found it imports every module of its package once, so built-in plug-ins
(one per file) register themselves without a hand-kept list. Imports nothing heavy:
the agents use it.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable


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

    def get_plugin(self, name: str) -> Callable:
        if name not in self and not self._loaded:
            self.load_builtin()
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r} "
                             f"(known: {', '.join(sorted(self)) or 'none'})")
        return self[name]

    def build(self, name: str, options: dict[str, Any] | None = None):
        return self.get_plugin(name)(**(options or {}))

    def load_builtin(self) -> None:
        """Import every module of the package (``base`` excepted) so they register."""
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if mod.name != "base":
                importlib.import_module(f"{self.package}.{mod.name}")
