#!/usr/bin/env python3
"""The tables of docs/results.md, regenerated from small JSON files in docs/results/.

Each table in docs/results.md sits between two markers,

    <!-- results:NAME -->
    ...generated table...
    <!-- /results:NAME -->

and is rendered from ``docs/results/NAME.json``: ``{"title", "command", "commit",
"date", "seeds", "columns": [...], "rows": [[...], ...], "notes"}``. The text around
the tables (what a table shows and does not) is written by hand.

    python tools/results.py                  # rewrite every table of docs/results.md
    python tools/results.py --check          # exit 1 when a table is out of date
    python tools/results.py --from-converge REPORT.json --name NAME --commit C
                                             # a `capes converge-test --json` (or
                                             # bench_converge_grid/bench_tuners) report
                                             # -> docs/results/NAME.json, then rewrite

A new measurement: run its command with ``--json``, import it with
``--from-converge``, and commit the small JSON with the doc.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "results.md"
DATA = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
                   re.S)


def render(table: dict) -> str:
    """A markdown table, then one line with the command, commit and seeds it came from."""
    cols = table["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    src = [f"`{table['command']}`" if table.get("command") else "",
           f"commit {table['commit']}" if table.get("commit") else "",
           table.get("date", ""), f"seeds {table['seeds']}" if table.get("seeds") else ""]
    src = ", ".join(s for s in src if s)
    if src:
        lines += ["", f"<sub>Source: {src} (`docs/results/{table['name']}.json`).</sub>"]
    return "\n".join(lines) + "\n"


def load(name: str) -> dict:
    table = json.loads((DATA / f"{name}.json").read_text())
    table["name"] = name
    return table


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(load(m.group("name"))) + m.group(4), text)


def from_converge(report: dict) -> dict:
    """The summary table of a converge-test report: one row per cell (tuner × noise ×
    reward), the columns `capes converge-test` prints."""
    reports = report.get("reports") if isinstance(report.get("reports"), list) else [report]
    rows = []
    for rep in reports:
        for c in rep["cells"]:
            ci = c.get("median_ci95")
            first = "-" if c.get("median_converge_s") is None else f"{c['median_converge_s']:g}"
            rows.append([f"{c['noise'] * 100:g} %", rep.get("tuner", "capes"), c["reward"],
                         f"{c['wins']}/{c['runs']}",
                         first + (f" [{ci[0]:g}, {ci[1]:g}]" if ci else ""),
                         _f(c.get("median_in_band_late")), _f(c.get("median_tp_frac_hour"), 3),
                         _f(c.get("median_tp_frac_late"), 3),
                         _f(c.get("median_min_tp_frac_after_300"))])
    return {"columns": ["noise", "tuner", "reward", "won", "1st win, median s [95 % CI]",
                        "in-band late", "tp hour", "tp late", "min tp"], "rows": rows}


def _f(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is stale")
    ap.add_argument("--from-converge", metavar="REPORT.json",
                    help="import a converge-test/benchmark JSON report as docs/results/NAME.json")
    ap.add_argument("--name", help="with --from-converge: the table's name")
    ap.add_argument("--title", default="")
    ap.add_argument("--command", default="", help="the command that produced the report")
    ap.add_argument("--commit", default="")
    ap.add_argument("--date", default="")
    args = ap.parse_args(argv)
    if args.from_converge:
        if not args.name:
            ap.error("--from-converge needs --name")
        table = from_converge(json.loads(Path(args.from_converge).read_text()))
        table = {"title": args.title, "command": args.command, "commit": args.commit,
                 "date": args.date, **table}
        (DATA / f"{args.name}.json").write_text(json.dumps(table, indent=1, ensure_ascii=False)
                                                + "\n")
        print(f"wrote docs/results/{args.name}.json; add <!-- results:{args.name} --> "
              f"<!-- /results:{args.name} --> to docs/results.md to show it")
    text = DOC.read_text()
    new = regenerate(text)
    if args.check:
        if new != text:
            print("docs/results.md is out of date: python tools/results.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
        print("rewrote docs/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
