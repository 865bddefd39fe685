"""The house rule, read from the imports: the floor (``capes.common``) imports no
component and nothing above it; components import the floor and each other's public
modules, never ``capes.experiments``, ``capes.commands`` or ``capes.cli``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("monitor_agent", "control_agent", "interface_daemon", "drl_engine",
              "storagegamesim")
ROOF = ("capes.experiments", "capes.commands", "capes.cli")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def _under(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _files(package: str):
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def test_the_packages_exist():
    assert _files("capes.common") and all(_files(c) for c in COMPONENTS)


@pytest.mark.parametrize("path", _files("capes.common"), ids=lambda p: p.name)
def test_the_floor_imports_no_component_and_nothing_above_it(path):
    bad = {m for m in imported_modules(path)
           if _under(m, COMPONENTS + ROOF)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", [p for c in COMPONENTS for p in _files(c)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_components_import_only_the_floor_of_capes(path):
    bad = {m for m in imported_modules(path)
           if _under(m, ("capes",)) and not _under(m, ("capes.common",))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_rule_catches_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from capes.experiments.demo import run\n")
    assert "capes.experiments.demo" in imported_modules(f)
