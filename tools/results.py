#!/usr/bin/env python3
"""The tables of docs/results.md and docs/costs.md, regenerated from small JSON files in
docs/results/.

Each table in those pages sits between two markers,

    <!-- results:NAME -->
    ...generated table...
    <!-- /results:NAME -->

and is rendered from ``docs/results/NAME.json``: ``{"title", "command", "commit",
"date", "seeds", "columns": [...], "rows": [[...], ...]}``, followed by the command that
reproduces it, its seeds and date. The commit stays in the JSON (the code measured) and
out of the page, which shows current figures; how they were reached is docs/journal.md.
The text around the tables (what a table shows and does not) is written by hand.

    python tools/results.py                  # rewrite every table of both pages
    python tools/results.py --check          # exit 1 when a table is out of date
    python tools/results.py --from-converge REPORT.json --name NAME --commit C
                                             # a `capes converge-test --json` (or
                                             # bench_converge_grid/bench_tuners) report
                                             # -> docs/results/NAME.json, then rewrite
    python tools/results.py --from-costs COSTS.json --name costs
                                             # a benchmarks/bench_costs.py report ->
                                             # NAME-processes.json and NAME-io.json

A new measurement: run its command with ``--json``, import it, and commit the small
JSON with the page.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "results.md", ROOT / "docs" / "costs.md"]
DATA = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
                   re.S)


def render(table: dict) -> str:
    """A markdown table, then one line with the command that reproduces it, its seeds
    and date (the commit measured stays in the JSON)."""
    cols = table["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
    src = [f"`{table['command']}`" if table.get("command") else "",
           f"seeds {table['seeds']}" if table.get("seeds") else "", table.get("date", "")]
    src = "; ".join(s for s in src if s)
    if src:
        lines += ["", f"<sub>Reproduce: {src} (`docs/results/{table['name']}.json`).</sub>"]
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


ROLE_NAMES = {"interface-daemon": "interface daemon", "drl-engine": "DRL engine",
              "monitor-agent": "monitoring agent", "control-agent": "control agent",
              "sim-node": "(the simulated target)"}


def from_costs(report: dict) -> tuple[dict, dict]:
    """Two tables of a ``benchmarks/bench_costs.py`` report: each process's CPU and RSS by
    node count, and the wire and replay DB per node."""
    procs, io = [], []
    for run in report["runs"]:
        n, load = run["nodes"], f"{run['load_start'][0]:.1f} → {run['load_end'][0]:.1f}"
        for role, name in ROLE_NAMES.items():
            r = run["roles"].get(role)
            if r:
                procs.append([str(n), name, str(r["processes"]),
                              f"{r['cpu_pct_median']:.2f} / {r['cpu_pct_max']:.2f}",
                              f"{r['rss_mb_median']:.0f} / {r['rss_mb_max']:.0f}",
                              f"{r['cpu_pct_total']:.2f} % / {r['rss_mb_total']:,.0f} MB", load])
        net, disk = run["network"], run["disk"]
        per_row = disk.get("bytes_per_row")
        io.append([str(n), f"{net['messages_per_s_per_agent']:.2f}",
                   f"{net['payload_bytes_per_s_per_agent']:.1f}",
                   f"~{net['wire_bytes_per_s_per_agent_est']:.0f}",
                   "-" if per_row is None else f"{per_row:.0f}",
                   f"{disk['bytes_per_node_hour'] / 1e6:.2f}", f"{run['seconds']:.0f}", load])
    seeds = ", ".join(sorted({str(r["seed"]) for r in report["runs"]}))
    base = {"command": "python benchmarks/bench_costs.py --nodes "
                       + ",".join(str(r["nodes"]) for r in report["runs"])
                       + f" --seconds {report['runs'][0]['seconds']:.0f} --json costs.json",
            "seeds": seeds}
    return ({**base, "columns": ["nodes", "process", "count",
                                 "CPU, % of one core (median / max)", "RSS, MB (median / max)",
                                 "all of that role (CPU / RSS)", "load average"],
             "rows": procs},
            {**base, "columns": ["nodes", "messages/s per agent", "payload B/s per agent",
                                 "on the wire B/s per agent (est.)", "replay DB bytes per row",
                                 "replay DB MB per node-hour", "window s", "load average"],
             "rows": io})


def _f(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is stale")
    ap.add_argument("--from-converge", metavar="REPORT.json",
                    help="import a converge-test/benchmark JSON report as docs/results/NAME.json")
    ap.add_argument("--from-costs", metavar="COSTS.json",
                    help="import a benchmarks/bench_costs.py report as NAME-processes/-io")
    ap.add_argument("--name", help="with --from-converge/--from-costs: the table's name")
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
    if args.from_costs:
        if not args.name:
            ap.error("--from-costs needs --name")
        for suffix, table in zip(("processes", "io"),
                                 from_costs(json.loads(Path(args.from_costs).read_text()))):
            table = {"title": args.title, "commit": args.commit, "date": args.date, **table}
            (DATA / f"{args.name}-{suffix}.json").write_text(
                json.dumps(table, indent=1, ensure_ascii=False) + "\n")
            print(f"wrote docs/results/{args.name}-{suffix}.json")
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = regenerate(text)
        if new == text:
            continue
        if args.check:
            stale.append(doc.relative_to(ROOT))
        else:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}: python tools/results.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
