"""The user docs hold together: the README stays a short guide whose links resolve and
whose figures each link to the doc that reproduces them, and the tables of
docs/results.md are the ones their JSON renders (``tools/results.py``)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_short_guide_whose_links_resolve():
    assert len(README.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" in target or target == "docs/results-real.md":   # the real results land later
            continue
        assert (ROOT / target).exists(), f"README links to a missing {target}"


def test_every_figure_in_the_readme_names_its_source():
    expect = README.split("## What to expect", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in expect.splitlines() if r.startswith("| ") and not r.startswith("| measurement")]
    assert rows
    for row in rows:
        assert "](docs/" in row, f"no source linked: {row}"


def test_results_tables_match_their_json():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_converge_report_becomes_a_results_table(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import results
    finally:
        sys.path.pop(0)
    cell = {"noise": 0.1, "reward": "diff", "wins": 2, "runs": 3, "median_converge_s": 80.0,
            "median_ci95": None, "median_in_band_late": 1.0, "median_tp_frac_hour": 0.98,
            "median_tp_frac_late": 0.999, "median_min_tp_frac_after_300": 0.9}
    table = results.from_converge({"tuner": "capes", "cells": [cell]})
    table["name"] = "x"
    text = results.render(table)
    assert "| 10 % | capes | diff | 2/3 | 80 | 1.00 | 0.980 | 0.999 | 0.90 |" in text
    json.dumps(table)
