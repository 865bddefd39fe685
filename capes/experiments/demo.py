"""``capes demo``: the whole stack on one machine against the simulator node.

Starts, as separate processes on loopback with fresh CURVE keys in a temporary
directory: the simulator node, the interface daemon, a monitoring agent and a control
agent for it, and the DRL engine. Shows live progress, stops at the win or a limit,
prints a summary, writes a PNG of throughput and parameters over time, and stops every
process it started — on the win, on an error and on Ctrl-C alike.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from capes.experiments.process_group import ProcessGroup

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "simulator.toml"


@dataclass
class DemoOptions:
    config: Path = DEFAULT_CONFIG
    overrides: list[str] = field(default_factory=list)
    seed: int = 0
    timeout_s: float = 180.0         # wall-clock limit
    workdir: str | None = None       # default: a fresh temp dir, removed at the end
    keep: bool = False               # keep the work dir (logs, replay DB, keys)
    plot: str | None = "capes-demo.png"
    json_out: str | None = None
    hold_s: float = 0.0              # keep tuning this long after the win (shows the hold)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_number(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
        return float(text) if text else None
    except (OSError, ValueError):
        return None


def run(opts: DemoOptions, out=sys.stderr) -> dict:
    from capes.common.curve import generate
    from capes.settings import load_settings

    deploy = load_settings(opts.config, opts.overrides)      # the whole file, before any process
    tick_s = deploy.tick_seconds
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="capes-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("ingest", "control", "grpc")}
    sets = [f"daemon.ingest=tcp://127.0.0.1:{ports['ingest']}",
            f"daemon.control=tcp://127.0.0.1:{ports['control']}",
            f"daemon.grpc=127.0.0.1:{ports['grpc']}",
            f"monitor.daemon=tcp://127.0.0.1:{ports['ingest']}",
            f"control.daemon=tcp://127.0.0.1:{ports['control']}", *opts.overrides]
    cfg_args = ["--config", str(Path(opts.config).resolve())]
    for s in sets:
        cfg_args += ["--set", s]
    game_sets = [a for s in opts.overrides if s.startswith("game.") for a in ("--set", s)]
    keys_dir = workdir / deploy.keys.dir
    if deploy.keys.enabled:
        generate(keys_dir, ["monitor", "control", "engine"])
    sim_dir = workdir / "sim"
    stack = ProcessGroup(workdir)
    series = {k: [] for k in ("tick", "throughput", "true_throughput", "window",
                              "rate_limit", "epsilon")}
    result = {"won": False, "workdir": str(workdir)}
    t0 = time.monotonic()
    try:
        print(f"capes demo: work dir {workdir}, {1 / tick_s:g} ticks per second, "
              f"CURVE {'on' if deploy.keys.enabled else 'off'}", file=out, flush=True)
        stack.start("sim-node", "sim-node", "--dir", "sim", "--tick-seconds", str(tick_s),
                    "--seed", str(opts.seed), "--keep-running",
                    "--config", str(Path(opts.config).resolve()), *game_sets)
        stack.start("interface-daemon", "interface-daemon", *cfg_args,
                    "--ready-file", "daemon.ready")
        stack.start("monitor-agent", "monitor-agent", *cfg_args, "--set", "keys.client=monitor")
        stack.start("control-agent", "control-agent", *cfg_args, "--set", "keys.client=control")
        stack.start("drl-engine", "drl-engine", *cfg_args, "--seed", str(opts.seed),
                    "--checkpoint-dir", "checkpoints", "--status-file", "engine.json",
                    "--log-every", "2")
        won_at = None
        last_print = 0.0
        while True:
            time.sleep(0.1)
            stack.check_alive()
            sim = {k: read_number(sim_dir / k) for k in ("ticks", "throughput",
                   "true_throughput", "window", "rate_limit", "won")}
            engine = _read_json(workdir / "engine.json")
            if sim["ticks"] is not None and (not series["tick"] or
                                             sim["ticks"] > series["tick"][-1]):
                series["tick"].append(sim["ticks"])
                for k in ("throughput", "true_throughput", "window", "rate_limit"):
                    series[k].append(sim[k])
                series["epsilon"].append(engine.get("epsilon"))
            now = time.monotonic()
            if now - last_print >= 1.0 and sim["ticks"] is not None:
                last_print = now
                eps = engine.get("epsilon")
                print(f"[{now - t0:5.1f} s] tick {sim['ticks']:.0f}  "
                      f"throughput {sim['throughput'] or 0:6.1f} (ideal 100)  "
                      f"window {sim['window'] or 0:3.0f}  rate limit {sim['rate_limit'] or 0:3.0f}"
                      f"  ε {eps if eps is not None else float('nan'):.2f}  "
                      f"training steps {engine.get('train_steps', 0)}", file=out, flush=True)
            if sim["won"] and won_at is None:
                won_at = now
                result.update(won=True, won_tick=sim["ticks"], won_wall_s=now - t0)
                print(f"won: throughput held within ±10 % of ideal for more than 20 s "
                      f"(simulated second {sim['ticks']:.0f}, {now - t0:.1f} s wall)",
                      file=out, flush=True)
            if won_at is not None and now - won_at >= opts.hold_s:
                break
            if now - t0 > opts.timeout_s:
                print(f"limit: not won within {opts.timeout_s:g} s of wall time", file=out)
                break
        result["daemon"] = _daemon_status(deploy, keys_dir, ports["grpc"])
    finally:
        codes = stack.stop()
        result["exit_codes"] = codes
        result["wall_s"] = time.monotonic() - t0
    result["final"] = {k: (series[k][-1] if series[k] else None)
                       for k in ("tick", "true_throughput", "window", "rate_limit")}
    _summary(result, out)
    if opts.plot and series["tick"]:
        plot_demo(series, opts.plot, result)
        print(f"wrote {opts.plot}", file=out)
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps({**result, "series": series}, indent=1))
    if not opts.keep and not opts.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif opts.keep:
        print(f"kept {workdir} (logs/, replay.db, checkpoints/, keys/)", file=out)
    return result


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _daemon_status(deploy, keys_dir: Path, grpc_port: int) -> dict | None:
    from capes.common.control_client import ControlClient, ControlError
    from capes.common.curve import load_token
    keys = dataclasses.replace(deploy.keys, dir=str(keys_dir))
    try:
        with ControlClient(f"127.0.0.1:{grpc_port}", load_token(keys)) as client:
            return client.status()
    except ControlError:
        return None


def _summary(result: dict, out) -> None:
    final = result["final"]
    print("\n== summary", file=out)
    print(f"won: {result['won']}" + (f" at simulated second {result['won_tick']:.0f} "
                                      f"({result['won_wall_s']:.1f} s wall)"
                                      if result["won"] else ""), file=out)
    if final["tick"] is not None:
        print(f"final: tick {final['tick']:.0f}, noise-free throughput "
              f"{final['true_throughput']:.1f}, window {final['window']:.0f}, "
              f"rate limit {final['rate_limit']:.0f}", file=out)
    d = result.get("daemon")
    if d:
        print(f"daemon: {d['messages']} messages, {d['bytes']} bytes "
              f"({d['bytes'] / max(1, d['messages']):.1f} B/message), "
              f"{d['ticks_written']} ticks written, drops {d['drops'] or 'none'}, "
              f"actions {d['actions']}", file=out)
    bad = {n: c for n, c in result["exit_codes"].items() if c not in (0, None)}
    print(f"processes stopped: {len(result['exit_codes'])}"
          + (f" (non-zero exits: {bad})" if bad else ", all cleanly"), file=out)
    print(f"wall time: {result['wall_s']:.1f} s", file=out)


def plot_demo(series: dict, path: str, result: dict) -> None:
    from capes.experiments.plots import _pyplot
    plt = _pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    t = series["tick"]
    ax1.plot(t, series["throughput"], lw=0.6, alpha=0.6, label="measured")
    ax1.plot(t, series["true_throughput"], lw=1.2, label="noise-free")
    ax1.axhspan(90, 110, color="green", alpha=0.1, label="win band (±10 % of ideal)")
    ax1.set_ylabel("throughput")
    ax1.legend(fontsize=8)
    ax2.plot(t, series["window"], label="window m")
    ax2.plot(t, series["rate_limit"], label="rate limit τ")
    ax2.axhline(50, color="grey", ls=":", lw=0.8)
    ax2.set_ylabel("parameter value")
    ax2.legend(fontsize=8)
    eps = [e if e is not None else float("nan") for e in series["epsilon"]]
    ax3.plot(t, eps, color="purple")
    ax3.set_ylabel("ε")
    ax3.set_xlabel("simulated second")
    title = "capes demo: " + (f"won at simulated second {result['won_tick']:.0f}"
                              if result["won"] else "not won")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
