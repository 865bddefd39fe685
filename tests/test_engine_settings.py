"""The engine's settings are sorted by concern in one place (docs/engine.md, "Settings by
concern", issue 39): every key of ``[engine]`` and ``[cluster_engine]`` stands there
under exactly one concern, and every name the two tables share has its one meaning
written down, so that a key added to either table without a place there fails here."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
CONCERNS = ["exploration", "search", "memory", "safety", "learner", "live input"]


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## Settings by concern\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _keys(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


def _table_rows(section: str, header: str) -> list[list[str]]:
    """The cells of the table whose header row starts with ``header``."""
    lines = section.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {"preset"}


def test_every_engine_setting_stands_under_one_concern():
    rows = _table_rows(_section(), "| concern |")
    assert [r[0] for r in rows] == CONCERNS
    for column, cls in ((1, DQNConfig), (2, NodeModelConfig)):
        keys = [k for r in rows for k in _keys(r[column])]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        assert not twice, f"{cls.__name__}: under more than one concern: {twice}"
        assert set(keys) == _fields(cls), (
            f"{cls.__name__}: not in docs/engine.md's table: "
            f"{sorted(_fields(cls) - set(keys))}; not settings: "
            f"{sorted(set(keys) - _fields(cls))}")


def test_every_name_both_tables_share_has_its_one_meaning_written_down():
    rows = _table_rows(_section(), "| key |")
    shared = _fields(DQNConfig) & _fields(NodeModelConfig)
    assert sorted(_keys(r[0])[0] for r in rows) == sorted(shared)
    assert all(r[1] and r[2] for r in rows)
