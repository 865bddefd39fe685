"""The control-plane clients: ``capes status``, ``capes tuning on|off``,
``capes training on|off``, ``capes workload-changed`` and ``capes nodes``.
One module, since they share everything but the call they make."""
from __future__ import annotations

import argparse
import json
import sys

from capes.cli import common_config_args


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """``capes status`` and ``capes nodes``."""
    common_config_args(p)
    p.add_argument("--grpc", metavar="ADDR",
                   help="the daemon's control plane, host:port (default: the config's "
                        "daemon.grpc)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_switch_arguments(p: argparse.ArgumentParser) -> None:
    """``capes tuning on|off`` and ``capes training on|off``."""
    add_status_arguments(p)
    p.add_argument("state", choices=["on", "off"])


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """``capes workload-changed [--note TEXT]``."""
    add_status_arguments(p)
    p.add_argument("--note", default="", help="logged by the daemon")


def run(args) -> int:
    from capes.common.control_client import ControlClient, ControlError
    from capes.settings import load_settings
    cfg = load_settings(args.config, args.overrides)
    client = ControlClient.from_config(cfg, args.grpc, args.timeout)
    try:
        if args.command == "nodes":
            result = client.nodes()
        elif args.command == "tuning":
            result = client.set_tuning(args.state == "on")
        elif args.command == "training":
            result = client.set_training(args.state == "on")
        elif args.command == "workload-changed":
            result = client.workload_changed(args.note)
        else:
            result = client.status()
    except ControlError as exc:
        print(f"capes {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.command == "nodes":
        print(format_nodes(result))
    else:
        print(format_status(result))
    return 0


def format_status(s: dict) -> str:
    drops = ", ".join(f"{k} {v}" for k, v in sorted(s["drops"].items())) or "none"
    acts = ", ".join(f"{k} {v}" for k, v in sorted(s["actions"].items())) or "none"
    params = ", ".join(f"{k}={v:g}" for k, v in sorted(s["parameters"].items())) or "none"
    return "\n".join([
        f"tuning {'on' if s['tuning'] else 'off'}, training {'on' if s['training'] else 'off'}, "
        f"workload epoch {s['workload_epoch']}, up {s['uptime_s']:.0f} s",
        f"session {s['session_id']} ({s['session_uuid'] or 'not started'}) in {s['db_path']}",
        f"nodes {s['nodes']}, PIs {s['pis']}, latest tick {s['latest_tick']}",
        f"messages {s['messages']} ({s['bytes']} B), rows written {s['rows_written']}, "
        f"ticks written {s['ticks_written']}, commits {s['commits']}",
        f"drops: {drops}; full requests {s['full_requests']}; CURVE refused {s['auth_denied']}",
        f"actions: {acts}",
        f"parameters: {params}",
    ])


def format_nodes(nodes: list[dict]) -> str:
    if not nodes:
        return "no nodes yet"
    rows = [f"{'node':<20} {'monitor':>7} {'control':>7} {'PIs':>5} {'last tick':>12} "
            f"{'idle s':>7} {'key':<12} applied"]
    for n in nodes:
        applied = ", ".join(f"{k}={v:g}" for k, v in sorted(n["applied"].items()))
        rows.append(f"{n['name']:<20} {'yes' if n['monitor'] else '-':>7} "
                    f"{'yes' if n['control'] else '-':>7} {n['pis']:>5} {n['last_tick']:>12} "
                    f"{n['idle_s']:>7.1f} {n['key']:<12} {applied}")
    return "\n".join(rows)
