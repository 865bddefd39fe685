"""The control-plane clients: ``capes status``, ``capes tuning on|off``,
``capes training on|off``, ``capes workload-changed`` and ``capes nodes``.
One module, since they share everything but the call they make.

``capes status`` shows the interface daemon (over its gRPC control plane) and the DRL
engine (its status file, else its Prometheus metrics). ``--workdir DIR`` talks to a
running ``capes demo`` there: its addresses and token are in ``DIR/capes-demo.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from capes.cli import common_config_args

DEMO_FILE = "capes-demo.json"


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """``capes status`` and ``capes nodes``."""
    common_config_args(p)
    p.add_argument("--grpc", metavar="ADDR",
                   help="the daemon's control plane, host:port (default: the config's "
                        "daemon.grpc)")
    p.add_argument("--workdir", metavar="DIR",
                   help=f"a running `capes demo`'s work dir: its addresses and token are "
                        f"read from DIR/{DEMO_FILE}")
    p.add_argument("--tls-cert", metavar="PATH",
                   help="the daemon's TLS certificate, for an address beyond loopback "
                        "(default: the config's keys.dir/tls/server.crt)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="give up on the daemon after this many seconds (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    if p.prog.split()[-1] == "status":
        from capes.common.metrics import DEFAULT_ENGINE_METRICS
        p.add_argument("--engine-metrics", default=None,
                       metavar="HOST:PORT", help="the engine's metrics endpoint (`capes "
                       "drl-engine --metrics`; default: the config's engine.metrics, else "
                       f"{DEFAULT_ENGINE_METRICS}; \"\": don't ask)")
        p.add_argument("--engine-status", metavar="PATH",
                       help="the engine's status file (`capes drl-engine --status-file`); "
                            "read instead of its metrics")


def add_switch_arguments(p: argparse.ArgumentParser) -> None:
    """``capes tuning on|off`` and ``capes training on|off``."""
    add_status_arguments(p)
    p.add_argument("state", choices=["on", "off"], help="on or off")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """``capes workload-changed [--note TEXT]``."""
    add_status_arguments(p)
    p.add_argument("--note", default="", help="logged by the daemon")


def read_demo_file(workdir: str | Path) -> dict:
    """A demo's ``capes-demo.json`` (ValueError with one line when there is none)."""
    path = Path(workdir) / DEMO_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found; is a `capes demo --workdir {workdir}` "
                         "running?") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
    if not isinstance(info, dict) or "grpc" not in info:
        raise ValueError(f"{path}: not a capes demo file")
    return info


def _client(args):
    """The control-plane client and, for --workdir, the demo's file."""
    from capes.common.control_client import ControlClient, tls_certificate
    if args.workdir:
        demo = read_demo_file(args.workdir)
        token = None
        if demo.get("token_file"):
            try:
                token = Path(demo["token_file"]).read_text().strip() or None
            except OSError as exc:
                raise ValueError(f"{demo['token_file']}: {exc.strerror}") from None
        address = args.grpc or demo["grpc"]
        keys = Path(demo["token_file"]).parent if demo.get("token_file") else None
        cert = tls_certificate(address, keys, args.tls_cert, demo["grpc"])
        return ControlClient(address, token, args.timeout, cert), demo
    from capes.settings import load_settings
    cfg = load_settings(args.config, args.overrides)
    if getattr(args, "engine_metrics", "") is None:
        args.engine_metrics = cfg.engine_metrics
    return ControlClient.from_config(cfg, args.grpc, args.timeout, args.tls_cert), None


def run(args) -> int:
    from capes.common.config import ConfigError
    from capes.common.control_client import ControlError
    try:
        client, demo = _client(args)
    except ConfigError:
        raise
    except ValueError as exc:
        print(f"capes {args.command}: {exc}", file=sys.stderr)
        return 1
    error = None
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
        error, result = str(exc), None
        if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            error = (f"no interface daemon answers at {client.address} (is one running? "
                     + ("is the demo still running?)" if demo else
                        "for a running demo: --workdir DIR; for a deployment: --config "
                        "FILE or --grpc HOST:PORT)"))
    finally:
        client.close()
    if args.command != "status":
        if error:
            print(f"capes {args.command}: {error}", file=sys.stderr)
            return 1
        print(json.dumps(result, indent=2, sort_keys=True) if args.json else
              format_nodes(result) if args.command == "nodes" else format_status(result))
        return 0
    start = session_start_tick(result["db_path"], result["session_id"]) if result else \
        session_start_tick(demo.get("db")) if demo else None    # a demo that has stopped
    if result:
        result["session_start_tick"] = start
    engine = engine_status(args, demo)
    if error and engine.get("error") and not args.json:     # nothing to show but the hint
        print(f"capes status: {error}", file=sys.stderr)
        return 1
    if args.json:
        out = dict(result or {"error": error})
        out["engine"] = engine
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"daemon {client.address}")
        print(_indent(format_status(result)) if result else f"  not reachable: {error}")
        print(f"engine {engine.get('source', '')}".rstrip())
        print(_indent(format_engine(engine, start)))
    return 1 if error else 0


def session_start_tick(db: str | None, session: int | None = None) -> int | None:
    """The tick session ``session`` (None: the newest) of replay DB ``db`` started at
    (read-only; None where the DB is not on this host): ticks are counted from the Unix
    epoch, and a session's own count (the demo's "tick 35") is the difference."""
    import sqlite3
    if not db or session == 0 or not Path(db).is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            row = conn.execute("SELECT started_at, tick_seconds FROM sessions WHERE id = ?",
                               (session,)).fetchone() if session else conn.execute(
                "SELECT started_at, tick_seconds FROM sessions ORDER BY id DESC").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return None if row is None else int(row[0] // row[1])


def session_tick(tick: int | None, start: int | None) -> str:
    """``tick 35 of the session`` where the session's start is known, else the tick."""
    if tick is None or tick < 0:
        return "-"
    return f"{tick - start} of the session" if start is not None and tick >= start \
        else str(tick)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------------------- engine

def engine_status(args, demo: dict | None) -> dict:
    """The engine's state from its status file (``--engine-status`` or the demo's), else
    from its metrics; ``{"error": ...}`` when neither can be read."""
    path = getattr(args, "engine_status", None) or (demo or {}).get("engine_status")
    metrics = (demo or {}).get("engine_metrics") if demo else getattr(args, "engine_metrics", "")
    errors = []
    if path:
        try:
            out = json.loads(Path(path).read_text())
            out["source"] = f"(status file {path})"
            if out.get("checkpoint_at") is not None:
                import time
                out["checkpoint_age_s"] = time.time() - out["checkpoint_at"]
            return out
        except FileNotFoundError:
            errors.append(f"{path}: no status file yet")
        except (OSError, ValueError) as exc:
            errors.append(f"{path}: {exc}")
    if metrics:
        try:
            return engine_from_metrics(metrics, args.timeout)
        except OSError as exc:
            errors.append(f"metrics {metrics}: {getattr(exc, 'reason', None) or exc}")
    return {"error": "; ".join(errors) or "no engine status file or metrics address given"}


def engine_from_metrics(address: str, timeout: float = 2.0) -> dict:
    """The engine's state, read from its ``/metrics`` (the status file's keys)."""
    from capes.common.metrics import by_label, iso, one, scrape
    s = scrape(address, timeout)
    if one(s, "capes_engine_up") is None:
        raise OSError(f"no capes_engine_* metrics at {address}")
    info = dict(next(iter(s.get("capes_engine_info", {})), ()))
    tick = one(s, "capes_engine_last_tick")
    ts = one(s, "capes_engine_last_tick_timestamp_seconds")
    flag = lambda n: None if one(s, n) is None else bool(one(s, n))   # noqa: E731
    ints = {k: (None if one(s, n) is None else int(one(s, n))) for k, n in (
        ("train_steps", "capes_engine_train_steps_total"),
        ("action_ticks", "capes_engine_action_ticks_total"),
        ("ticks", "capes_engine_ticks_total"),
        ("workload_epoch", "capes_engine_workload_epoch"))}
    return {
        "source": f"(metrics http://{address}/metrics)", **info, **ints,
        "tick": None if tick is None else int(tick), "tick_time": iso(ts),
        "epsilon": one(s, "capes_engine_epsilon"), "loss": one(s, "capes_engine_loss"),
        "q_max": one(s, "capes_engine_q_max"), "q_spread": one(s, "capes_engine_q_spread"),
        "reward": one(s, "capes_engine_reward"),
        "objective": one(s, "capes_engine_objective"),
        "values": by_label(s, "capes_engine_parameter_value", "parameter"),
        "best": by_label(s, "capes_engine_best_value", "parameter") or None,
        "tuning": flag("capes_engine_tuning"), "training": flag("capes_engine_training"),
        "checkpoint_age_s": one(s, "capes_engine_checkpoint_age_seconds"),
        "checkpoint_time": iso(one(s, "capes_engine_checkpoint_timestamp_seconds")),
    }


def format_engine(e: dict, start: int | None = None) -> str:
    from capes.common.metrics import fmt
    if e.get("error"):
        return f"not reachable: {e['error']}"
    vals = lambda d: ", ".join(f"{k}={fmt(v, '.6g')}" for k, v in sorted((d or {}).items())) or "-"  # noqa: E731
    tick = (f"tick {session_tick(e['tick'], start)} ({e.get('tick_time')})"
            if e.get("tick") is not None else "no decision yet")
    age = e.get("checkpoint_age_s")
    ckpt = (f"checkpoint {age:.0f} s ago" if age is not None else "no checkpoint yet") + (
        f" ({e['checkpoint']})" if e.get("checkpoint") else "")
    lines = [
        f"{tick}, ε {fmt(e.get('epsilon'), '.3f')}, training steps {e.get('train_steps')}, "
        f"loss {fmt(e.get('loss'))}, decisions {e.get('action_ticks')}",
        f"Q max {fmt(e.get('q_max'))}, Q spread {fmt(e.get('q_spread'))}, reward "
        f"{fmt(e.get('reward'))}, objective {fmt(e.get('objective'))}"
        + (f", last action {e['last_action']}"
           + (" (exploring)" if e.get("explored") else "") if e.get("last_action") else ""),
        f"values: {vals(e.get('values'))}; best known: {vals(e.get('best'))}",
        f"{ckpt}; device {e.get('device', '-')}, preset {e.get('preset', '-')}, "
        f"reward {e.get('reward_type', '-')}, workload epoch {e.get('workload_epoch')}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- daemon

def format_status(s: dict) -> str:
    from capes.common.metrics import fmt, iso, tick_text
    drops = ", ".join(f"{k} {v}" for k, v in sorted(s["drops"].items())) or "none"
    acts = ", ".join(f"{k} {v}" for k, v in sorted(s["actions"].items())) or "none"
    params = ", ".join(f"{k}={fmt(v, '.6g')}" for k, v in sorted(s["parameters"].items())) or "none"
    return "\n".join([
        f"tuning {'on' if s['tuning'] else 'off'}, training {'on' if s['training'] else 'off'}, "
        f"workload epoch {s['workload_epoch']}, up {s['uptime_s']:.0f} s",
        f"session {s['session_id']} ({s['session_uuid'] or 'not started'}) in {s['db_path']}",
        f"nodes {s['nodes']}, PIs {s['pis']}, latest tick "
        + (f"{session_tick(s['latest_tick'], s['session_start_tick'])} "
           f"({iso(s['latest_tick'] * (s.get('tick_seconds') or 1.0))})"
           if s.get("session_start_tick") is not None and s["latest_tick"] >= 0 else
           tick_text(s['latest_tick'], s.get('tick_seconds') or 1.0)),
        f"messages {s['messages']} ({s['bytes']} B), rows written {s['rows_written']}, "
        f"ticks written {s['ticks_written']}, commits {s['commits']}",
        f"drops: {drops}; full requests {s['full_requests']}; CURVE refused {s['auth_denied']}",
        f"actions: {acts}",
        f"parameters: {params}",
    ])


def format_nodes(nodes: list[dict]) -> str:
    from capes.common.metrics import fmt
    if not nodes:
        return "no nodes yet"
    rows = [f"{'node':<20} {'monitor':>7} {'control':>7} {'PIs':>5} {'last tick':>12} "
            f"{'idle s':>7} {'key':<12} applied"]
    for n in nodes:
        applied = ", ".join(f"{k}={fmt(v, '.6g')}" for k, v in sorted(n["applied"].items()))
        rows.append(f"{n['name']:<20} {'yes' if n['monitor'] else '-':>7} "
                    f"{'yes' if n['control'] else '-':>7} {n['pis']:>5} {n['last_tick']:>12} "
                    f"{n['idle_s']:>7.1f} {n['key']:<12} {applied}")
    return "\n".join(rows)
