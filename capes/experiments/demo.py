"""``capes demo``: the whole stack on one machine against the simulator node.

Starts, as separate processes on loopback with fresh CURVE keys in a temporary
directory: the simulator node, the interface daemon, a monitoring agent and a control
agent for it, and the DRL engine. Shows live progress, stops at the win or a limit,
prints a summary, writes a PNG of throughput and parameters over time, and stops every
process it started — on the win, on an error and on Ctrl-C alike, and (on Linux) when
the demo itself is killed, even with SIGKILL (``process_group.die_with_parent``).

``--nodes N`` (N > 1) runs N simulator nodes, each a process with its own monitoring and
control agent, and tunes them with per-node knobs (``sim3/window``…, the deployment of
``docs/deploying-per-node.md``): the demo writes that deployment into the work dir
(``demo-nodes.toml``, from the given config) and the engine daemon runs the per-node
engine on it. The demo is won when every node has won its game.

The work dir holds ``capes-demo.json`` (the daemon's gRPC address, the token file, the
metrics addresses, the engine's status file), so ``capes status --workdir DIR`` finds
a running demo. The live line shows the values the control agent acknowledged as
applied (from the daemon), never a knob file caught mid-write.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from capes.common.shipped_configs import config_path
from capes.experiments.process_group import ProcessGroup

DEFAULT_CONFIG = config_path("simulator")


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
    tensorboard: str | None = None   # the engine's TensorBoard log dir
    nodes: int = 1                   # simulator nodes; > 1: per-node knobs


DEMO_FILE = "capes-demo.json"        # what `capes status --workdir DIR` reads
ENGINE_STATUS = "engine.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_number(path: Path) -> float | None:
    """A number from a file the simulator node replaces atomically (None when absent
    or not a number)."""
    try:
        text = path.read_text().strip()
        return float(text) if text else None
    except (OSError, ValueError):
        return None


NODES_FILE = "demo-nodes.toml"       # the per-node deployment of ``--nodes N``
MOST_NODES = 64                      # 3 processes a node on one machine


def knob_of(name: str) -> str:
    """``sim3/window`` -> ``window`` (a global knob's name is its own)."""
    return name.rsplit("/", 1)[-1]


def per_node_table(table: dict, nodes: list[str], sim_dir: str = "sim") -> dict:
    """The deployment ``table`` (a simulator config's raw TOML) with every parameter
    ``P`` made one per node, ``<node>/P`` held by that node only, and its applier
    writing that node's knob file ``SIM_DIR/<node>/P``. The monitoring agents'
    collectors are set per process (``--set monitor.collectors=...``)."""
    params = table.get("parameters") or {}
    if not params or any("/" in p for p in params):
        raise ValueError("--nodes needs a config of global parameters (it makes them "
                         "per-node)")
    collectors = (table.get("monitor") or {}).get("collectors") or []
    if [c.get("name") for c in collectors] != ["simulator"]:
        raise ValueError("--nodes needs a simulator config (one monitor collector, "
                         "\"simulator\"), such as the default")
    out = {k: v for k, v in table.items() if k != "parameters"}
    out["parameters"] = {f"{n}/{p}": {**spec, "nodes": [n]}
                         for n in nodes for p, spec in params.items()}
    out["control"] = {**table.get("control", {}), "appliers": {
        f"{n}/{p}": {"name": "file", "options": {"path": f"{sim_dir}/{n}/{p}"}}
        for n in nodes for p in params}}
    if (table.get("daemon") or {}).get("nodes"):
        out["daemon"] = {**table["daemon"], "nodes": list(nodes)}
    return out


def run(opts: DemoOptions, out=sys.stderr) -> dict:
    """Run the demo (see the module's doc). A temp work dir holds secret keys and the
    control token: it is removed on every way out, a closed pipe (``capes demo 2>&1 |
    head``) or Ctrl-C at any moment included, unless ``--keep``."""
    temp = None if opts.workdir else tempfile.mkdtemp(prefix="capes-demo-")
    try:
        return _run(opts, out, Path(opts.workdir or temp).resolve())
    finally:
        if temp is not None and not opts.keep:
            shutil.rmtree(temp, ignore_errors=True)


def _run(opts: DemoOptions, out, workdir: Path) -> dict:
    from capes.common.atomic import write_json
    from capes.common.config import dump_toml, read_toml
    from capes.common.control_client import ControlClient
    from capes.common.curve import TOKEN_FILE, bind, generate, load_token
    from capes.common.metrics import iso
    from capes.settings import load_settings

    if not 1 <= opts.nodes <= MOST_NODES:
        raise RuntimeError(f"--nodes: 1 to {MOST_NODES} (got {opts.nodes})")
    deploy = load_settings(opts.config, opts.overrides)      # the whole file, before any process
    if opts.tensorboard:
        from capes.common.metrics import TENSORBOARD_MISSING, tensorboard_available
        if not tensorboard_available():
            raise RuntimeError(TENSORBOARD_MISSING)
        opts.tensorboard = str(Path(opts.tensorboard).resolve())
    tick_s = deploy.tick_seconds
    workdir.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("ingest", "control", "grpc", "daemon_metrics",
                                      "engine_metrics")}
    # everything in the work dir, as absolute paths (the config's own are resolved
    # against the config file's directory, which is not where a demo writes)
    keys_dir = workdir / Path(deploy.keys.dir).name
    db = workdir / Path(deploy.daemon.db).name
    sets = [f"daemon.ingest=tcp://127.0.0.1:{ports['ingest']}",
            f"daemon.control=tcp://127.0.0.1:{ports['control']}",
            f"daemon.grpc=127.0.0.1:{ports['grpc']}",
            f"daemon.metrics=127.0.0.1:{ports['daemon_metrics']}",
            f"monitor.daemon=tcp://127.0.0.1:{ports['ingest']}",
            f"control.daemon=tcp://127.0.0.1:{ports['control']}", *opts.overrides,
            f'keys.dir="{keys_dir}"', f'daemon.db="{db}"',
            # the agents' recorded originals too: never /var/lib/capes-agent (as root) or
            # ~/.local/state, where two demos at once would share them
            f'control.state_file="{workdir / "control-{node}.json"}"']
    config = str(Path(opts.config).resolve())
    if opts.nodes == 1:
        nodes = [deploy.control.node]
    else:                              # the per-node deployment, written into the work dir
        nodes = [f"sim{i}" for i in range(opts.nodes)]
        table = per_node_table(read_toml(config), nodes)
        config = str(workdir / NODES_FILE)
        Path(config).write_text(dump_toml(table))
        load_settings(config, opts.overrides)                # checked before any process
    cfg_args = ["--config", config]
    for s in sets:
        cfg_args += ["--set", s]
    game_sets = [a for s in opts.overrides if s.startswith("game.") for a in ("--set", s)]
    if deploy.keys.enabled:            # each agent's key bound to its node (docs/protocol.md)
        generate(keys_dir, ["monitor", "control", "engine"])
        bind(keys_dir, "monitor", nodes if opts.nodes > 1 else [deploy.monitor.node])
        bind(keys_dir, "control", nodes)
        bind(keys_dir, "engine", ["engine"])         # as `capes keys generate --client`
    sim_dirs = {n: workdir / "sim" / n for n in nodes} if opts.nodes > 1 else \
        {nodes[0]: workdir / "sim"}
    engine_status = workdir / ENGINE_STATUS
    stack = ProcessGroup(workdir)
    series = {k: [] for k in ("tick", "throughput", "true_throughput", "window",
                              "rate_limit", "epsilon")}
    result = {"won": False, "workdir": str(workdir)}
    t0 = time.monotonic()
    info = {
        "pid": os.getpid(), "started": iso(time.time()), "config": config, "overrides": sets,
        "grpc": f"127.0.0.1:{ports['grpc']}",
        "token_file": str(keys_dir / TOKEN_FILE) if deploy.keys.enabled else None,
        "keys_dir": str(keys_dir), "db": str(db),
        "daemon_metrics": f"127.0.0.1:{ports['daemon_metrics']}",
        "engine_metrics": f"127.0.0.1:{ports['engine_metrics']}",
        "engine_status": str(engine_status), "logs": str(stack.logs),
        "tensorboard": opts.tensorboard, "tick_seconds": tick_s, "nodes": nodes,
    }
    client = None
    try:
        print(f"capes demo: work dir {workdir}, {1 / tick_s:g} ticks per second, "
              f"CURVE {'on' if deploy.keys.enabled else 'off'}"
              + (f", {len(nodes)} nodes with per-node knobs ({config})"
                 if opts.nodes > 1 else ""), file=out, flush=True)
        stack.start("interface-daemon", "interface-daemon", *cfg_args,
                    "--ready-file", "daemon.ready")
        for i, (node, d) in enumerate(sim_dirs.items()):
            suffix = "" if opts.nodes == 1 else f"-{node}"     # one node: the plain names
            stack.start(f"sim-node{suffix}", "sim-node", "--dir", str(d.relative_to(workdir)),
                        "--tick-seconds", str(tick_s), "--seed", str(opts.seed + i),
                        "--keep-running", "--config", config, *game_sets)
            per_node = [] if opts.nodes == 1 else [
                "--set", f"monitor.node={node}", "--set", f"control.node={node}",
                "--set", f'monitor.collectors=[{{name = "simulator", options = '
                         f'{{dir = "{d.relative_to(workdir)}"}}}}]']
            stack.start(f"monitor-agent{suffix}", "monitor-agent", *cfg_args, *per_node,
                        "--set", "keys.client=monitor")
            stack.start(f"control-agent{suffix}", "control-agent", *cfg_args, *per_node,
                        "--set", "keys.client=control")
        stack.start("drl-engine", "drl-engine", *cfg_args, "--seed", str(opts.seed),
                    "--checkpoint-dir", str(workdir / "checkpoints"),
                    "--status-file", str(engine_status), "--log-every", "2",
                    "--metrics", info["engine_metrics"],
                    *(["--tensorboard", opts.tensorboard] if opts.tensorboard else []))
        write_json(workdir / DEMO_FILE, {**info, "children": stack.pids()})
        print(f"  capes status --workdir {workdir}      (daemon and engine)\n"
              f"  curl -s http://{info['daemon_metrics']}/metrics   "
              f"curl -s http://{info['engine_metrics']}/metrics", file=out, flush=True)
        client = ControlClient(info["grpc"], load_token(
            dataclasses.replace(deploy.keys, dir=str(keys_dir))), timeout=1.0)
        poller = _AppliedPoller(client, nodes)
        try:
            _watch(opts, stack, poller, sim_dirs, engine_status, series, result, t0, out)
        except KeyboardInterrupt:
            result["interrupted"] = True
            print("interrupted: stopping every process", file=out, flush=True)
        finally:
            poller.stop()
        result["daemon"] = _daemon_status(client)
        result["applied"] = _applied(client, nodes)
    finally:
        if client is not None:
            client.close()
        # the engine first: then the daemon is the DB's last user and folds the WAL in
        codes = stack.stop(first=("drl-engine",))
        result["exit_codes"] = codes
        result["wall_s"] = time.monotonic() - t0
        _tidy_db(db)
        if (workdir / DEMO_FILE).exists():
            write_json(workdir / DEMO_FILE, {**info, "children": stack.pids(),
                                             "stopped": iso(time.time())})
    result["engine"] = _read_json(engine_status)
    result["final"] = {k: (series[k][-1] if series[k] else None)
                       for k in ("tick", "true_throughput", "window", "rate_limit")}
    result["final"].update(knob_means(result.get("applied") or {}))  # what the nodes have
    kept = bool(opts.keep or opts.workdir)
    _summary(result, out, kept)
    plot = opts.plot
    if plot and opts.workdir and not Path(plot).is_absolute():
        plot = str(workdir / plot)             # a kept work dir holds the whole run
    if plot and series["tick"]:
        plot_demo(series, plot, result)
        result["plot"] = plot
        print(f"wrote {plot}", file=out)
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps({**result, "series": series}, indent=1))
    if not opts.keep and not opts.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"kept {workdir} (logs/, {db.name}, checkpoints/, keys/, {ENGINE_STATUS}, "
              f"{DEMO_FILE})", file=out)
    return result


class _AppliedPoller:
    """The values the control agents of ``nodes`` acknowledged, asked of the daemon once
    a second on a thread of its own, so that a slow answer never delays the game's
    sampling."""

    def __init__(self, client, nodes: list[str], every_s: float = 1.0):
        self.client, self.nodes, self.every_s = client, nodes, every_s
        self.values: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capes-demo-applied",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.values = _applied(self.client, self.nodes) or self.values
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(3)


def _watch(opts: DemoOptions, stack: ProcessGroup, poller: _AppliedPoller,
           sim_dirs: dict[str, Path], engine_status: Path, series: dict, result: dict,
           t0: float, out) -> None:
    """Follow the games until every node has won (plus the hold) or the time limit; keep
    the series (means over the nodes) and print a live line every second."""
    won_at = None
    last_print = 0.0
    many = len(sim_dirs) > 1
    while True:
        time.sleep(0.1)
        over = [n for n in stack.dead() if n.startswith("sim-node")
                and stack.procs[n].returncode == 0]
        if over:                      # a node played its whole game: not an error
            if won_at is None:
                print(f"limit: {over[0]} reached the game's time limit without a win",
                      file=out, flush=True)
            break
        stack.check_alive()
        sims = [{k: read_number(d / k) for k in ("ticks", "throughput", "true_throughput",
                                                 "won")} for d in sim_dirs.values()]
        sim = {k: _mean([s[k] for s in sims]) for k in ("throughput", "true_throughput")}
        sim["ticks"] = sims[0]["ticks"]
        won = sum(1 for s in sims if s["won"])
        engine = _read_json(engine_status)
        values = knob_means(engine.get("values") or {})
        applied = knob_means(poller.values)
        if sim["ticks"] is not None and (not series["tick"] or
                                         sim["ticks"] > series["tick"][-1]):
            series["tick"].append(sim["ticks"])
            for k in ("throughput", "true_throughput"):
                series[k].append(sim[k])
            for k in ("window", "rate_limit"):    # in effect, as the daemon accepted them
                series[k].append(values.get(k, applied.get(k)))
            series["epsilon"].append(engine.get("epsilon"))
        now = time.monotonic()
        if now - last_print >= 1.0 and sim["ticks"] is not None:
            last_print = now
            shown = applied or values
            params = "  ".join(f"{k.replace('_', ' ')} {shown[k]:g}"
                               for k in sorted(shown)) or "(no value applied yet)"
            eps = engine.get("epsilon")     # None until the engine's first decision
            print(f"[{now - t0:5.1f} s] tick {sim['ticks']:.0f}  "
                  f"throughput {sim['throughput'] or 0:6.1f} (ideal 100"
                  + (f", mean of {len(sims)} nodes; {won} won)  mean " if many else ")  ")
                  + f"{params}  ε {'-' if eps is None else format(eps, '.2f')}  "
                  f"training steps {engine.get('train_steps', 0)}", file=out, flush=True)
        if won == len(sims) and won_at is None:
            won_at = now
            result.update(won=True, won_tick=sim["ticks"], won_wall_s=now - t0)
            print("won: throughput held within ±10 % of ideal for more than 20 s "
                  + ("on every node " if many else "")
                  + f"(simulated second {sim['ticks']:.0f}, {now - t0:.1f} s wall)",
                  file=out, flush=True)
        if won_at is not None and now - won_at >= opts.hold_s:
            break
        if now - t0 > opts.timeout_s:
            print(f"limit: not won within {opts.timeout_s:g} s of wall time"
                  + (f" ({won} of {len(sims)} nodes won)" if many else ""), file=out)
            break


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _applied(client, nodes: list[str]) -> dict[str, float]:
    """The values the control agents of ``nodes`` acknowledged as applied, by parameter
    ({} when the daemon cannot tell)."""
    from capes.common.control_client import ControlError
    out: dict[str, float] = {}
    try:
        for n in client.nodes():
            if n["name"] in nodes:
                out.update(n.get("applied") or {})
    except ControlError:
        pass
    return out


def knob_means(values: dict[str, float]) -> dict[str, float]:
    """{knob: mean over the nodes} of ``{param: value}`` (one node: the values)."""
    by_knob: dict[str, list[float]] = {}
    for name, v in values.items():
        by_knob.setdefault(knob_of(name), []).append(v)
    return {k: sum(vs) / len(vs) for k, vs in by_knob.items()}


def _tidy_db(db: Path) -> None:
    """After every process stopped: fold a WAL a reader kept alive into the DB."""
    from interface_daemon.daemon import checkpoint_wal
    if Path(str(db) + "-wal").exists() and db.exists():
        checkpoint_wal(db)


def _read_json(path: Path) -> dict:
    """A JSON file written atomically by another process ({} when absent)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _daemon_status(client) -> dict | None:
    from capes.common.control_client import ControlError
    try:
        return client.status()
    except ControlError:
        return None


def _summary(result: dict, out, kept: bool = True) -> None:
    final = result["final"]
    print("\n== summary", file=out)
    print(f"won: {result['won']}" + (f" at simulated second {result['won_tick']:.0f} "
                                      f"({result['won_wall_s']:.1f} s wall)"
                                      if result["won"] else ""), file=out)
    from capes.common.metrics import fmt as num          # no e-notation
    if final["tick"] is not None:
        print(f"final: tick {final['tick']:.0f}, noise-free throughput "
              f"{num(final['true_throughput'], '.1f')}, window {num(final['window'], '.0f')}, "
              f"rate limit {num(final['rate_limit'], '.0f')} (applied)", file=out)
    e = result.get("engine")
    if e:
        ckpt = (e.get("checkpoint") if kept else
                "removed with the temp dir (--keep or --workdir DIR keeps it)")
        print(f"engine: {e.get('action_ticks')} decisions, {e.get('train_steps')} training "
              f"steps, ε {num(e.get('epsilon'), '.3f')}, loss {num(e.get('loss'), '.4g')}, "
              f"checkpoint {ckpt}", file=out)
    d = result.get("daemon")
    if d:
        print(f"daemon: {d['messages']} messages, {d['bytes']} bytes "
              f"({d['bytes'] / max(1, d['messages']):.1f} B/message), "
              f"{d['ticks_written']} ticks written, drops {d['drops'] or 'none'}, "
              f"actions {d['actions']}", file=out)
    print(exit_report(result["exit_codes"]), file=out)
    print(f"wall time: {result['wall_s']:.1f} s", file=out)


def exit_report(codes: dict[str, int | None]) -> str:
    """The children's exits in a line. A child still starting when the demo stopped it
    dies of that SIGTERM before it handles signals: the demo's own stop, not a failure."""
    ours = -signal.SIGTERM
    bad = {n: c for n, c in codes.items() if c not in (0, None, ours)}
    early = sum(c == ours for c in codes.values())
    return (f"processes stopped: {len(codes)}"
            + (f" (non-zero exits: {bad})" if bad else ", all cleanly")
            + (f"; {early} stopped while still starting" if early else ""))


def plot_demo(series: dict, path: str, result: dict) -> None:
    from capes.experiments.plots import _pyplot
    plt = _pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    t = series["tick"]
    ax1.plot(t, series["throughput"], lw=0.6, alpha=0.6, label="measured")
    ax1.plot(t, series["true_throughput"], lw=1.2, label="noise-free")
    ax1.axhspan(90, 110, color="green", alpha=0.1, label="win band (±10 % of ideal)")
    ax1.set_ylabel("throughput (ideal 100)")
    ax1.set_title("throughput of the simulated storage system", fontsize=9, loc="left")
    ax1.legend(fontsize=8)
    nan = lambda xs: [math.nan if x is None else x for x in xs]    # noqa: E731
    ax2.plot(t, nan(series["window"]), label="congestion window m")
    ax2.plot(t, nan(series["rate_limit"]), label="I/O rate limit τ")
    ax2.axhline(50, color="grey", ls=":", lw=0.8)
    ax2.set_ylabel("parameter value")
    ax2.set_title("parameter values in effect (dotted: the window's optimum, 50)", fontsize=9,
                  loc="left")
    ax2.legend(fontsize=8)
    eps = [e if e is not None else float("nan") for e in series["epsilon"]]
    ax3.plot(t, eps, color="purple")
    ax3.set_ylabel("ε")
    ax3.set_title("exploration rate ε of the engine", fontsize=9, loc="left")
    ax3.set_xlabel("simulated second")
    title = "capes demo: " + (f"won at simulated second {result['won_tick']:.0f}"
                              if result["won"] else "not won")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
