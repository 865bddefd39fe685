"""The user docs hold together: the README stays a short guide whose links resolve and
whose figures each link to the doc that reproduces them; the README and docs/results.md
read as a user's page of current figures, not a lab notebook (the dated notes live in
docs/journal.md); every link between the docs lands on a file and a heading that exist;
and the tables of docs/results.md and docs/costs.md are the ones their JSON renders
(``tools/results.py``)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_short_guide_whose_links_resolve():
    assert len(README.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to a missing {target}"


# a lab notebook's marks: "round 7", "session 6", a commit hash (7+ hex digits, a letter
# among them, so that 104857600 bytes is not one)
NOTEBOOK = re.compile(r"\b(?:round|session) \d+\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
                      re.I)


@pytest.mark.parametrize("page", ["README.md", "docs/results.md"])
def test_the_pages_a_user_reads_first_are_not_a_lab_notebook(page):
    text = (ROOT / page).read_text()
    assert not NOTEBOOK.findall(text), f"{page}: {sorted(set(NOTEBOOK.findall(text)))}"
    long = [r[:80] for r in text.splitlines() if r.startswith("|") and len(r) > 300]
    assert not long, f"{page}: table rows over 300 characters: {long}"


def _anchors(md: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped,
    spaces to dashes, -1, -2 ... for repeats); headings inside code blocks are none."""
    seen: dict[str, int] = {}
    fence = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").strip().lower())
            slug = slug.replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            yield slug if n == 0 else f"{slug}-{n}"


def test_every_link_between_the_docs_lands_on_a_file_and_heading():
    bad = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, frag = target.partition("#")
            dest = md.parent / path if path else md
            if not dest.exists():
                bad.append(f"{md.name}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in set(_anchors(dest)):
                bad.append(f"{md.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


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


def test_a_costs_report_becomes_two_tables():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import results
    finally:
        sys.path.pop(0)
    role = {"processes": 2, "cpu_pct_median": 0.04, "cpu_pct_max": 0.05, "cpu_pct_total": 0.09,
            "rss_mb_median": 49.2, "rss_mb_max": 49.6, "rss_mb_total": 98.8}
    run = {"nodes": 2, "seconds": 180.0, "seed": 0, "load_start": [1.9, 1, 1],
           "load_end": [6.2, 1, 1], "roles": {"monitor-agent": role},
           "network": {"messages_per_s_per_agent": 1.0, "payload_bytes_per_s_per_agent": 23.6,
                       "wire_bytes_per_s_per_agent_est": 58.6},
           "disk": {"bytes_per_row": 62.6, "bytes_per_node_hour": 225000.0}}
    procs, io = results.from_costs({"runs": [run]})
    assert procs["rows"] == [["2", "monitoring agent", "2", "0.04 / 0.05", "49 / 50",
                              "0.09 % / 99 MB", "1.9 → 6.2"]]
    assert io["rows"] == [["2", "1.00", "23.6", "~59", "63", "0.23", "180", "1.9 → 6.2"]]
    assert "--nodes 2 --seconds 180" in procs["command"]
