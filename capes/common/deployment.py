"""The deployment config: one TOML file describes a whole CAPES installation.

Each process reads the sections it needs: the interface daemon ``[daemon]`` and
``[parameters]``, a monitoring agent ``[monitor]``, a control agent ``[control]`` and
``[parameters]``, the DRL engine ``[engine]`` and ``[reward]`` (kept as raw tables
here and validated by the engine, so that agents and daemon never import torch).
See ``configs/*.toml`` for one example per supported target.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capes.common import config as cfgmod
from capes.common.params import ParameterSpec


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a node or a parameter (None: it can): it is sent on the
    wire, stored in the replay DB and printed in logs."""
    if not name:
        return "must not be empty"
    if len(name.encode()) > 255:
        return "must have at most 255 bytes"
    if not name.isprintable() or any(c.isspace() for c in name):
        return "must be printable, without spaces"
    return None


@dataclass
class KeysConfig:
    dir: str = "keys"            # CURVE keys made by `capes keys generate`
    enabled: bool = True         # false only for experiments on a trusted loopback
    client: str = "agent"        # this process's client key: DIR/secret/<client>.key_secret


@dataclass
class DaemonConfig:
    ingest: str = "tcp://127.0.0.1:5560"     # monitoring agents connect here
    control: str = "tcp://127.0.0.1:5561"    # control agents connect here
    grpc: str = "127.0.0.1:50051"            # control plane (capes status, the engine)
    metrics: str = "127.0.0.1:9464"          # Prometheus /metrics (docs/metrics.md); "" off
    db: str = "capes-replay.db"
    commit_every_s: float = 1.0              # batch of the replay DB's WAL transactions
    ack_timeout_s: float = 2.0               # resend an unacknowledged action after this
    high_water_mark: int = 10_000
    max_message_bytes: int = 65_536
    forbidden: dict[str, list[float]] = field(default_factory=dict)
    max_nodes: int = 1024                    # nodes (streams) the daemon keeps state for
    full_request_every_s: float = 1.0        # at most one FullRequest per node this often
    max_clock_skew_s: float = 300.0          # refuse frames and actions whose tick is this far from now
    label: str = ""                          # label of the replay DB sessions it starts
    tuning: bool = True                      # start with tuning on (`capes tuning on|off`)
    training: bool = True                    # start with training on (`capes training on|off`)
    max_buffered_rows: int = 100_000         # rows kept while the DB cannot be written (oldest dropped)
    max_pis_per_node: int = 4096             # distinct PI names one node may announce
    max_pi_name_bytes: int = 128             # longest PI name (UTF-8 bytes)
    max_session_pis: int = 65_535            # PI names of all nodes together
    nodes: list[str] = field(default_factory=list)   # node names allowed to speak; empty: any
    liveness_s: float = 15.0                 # a node heard from this recently is live: a second connection claiming it is refused
    # a non-loopback grpc address speaks TLS (keys.dir/tls); without a certificate the
    # daemon refuses to start unless this is true (the token then crosses in clear text)
    allow_insecure_grpc: bool = False
    grpc_reflection: bool = False            # gRPC server reflection (for grpcurl), behind the token

    # upper bounds: beyond them a value is a typo, not a deployment
    LIMITS = {"high_water_mark": 1_000_000, "max_message_bytes": 16 << 20,
              "max_nodes": 1 << 20, "max_buffered_rows": 10_000_000, "max_pis_per_node": 4096,
              "max_pi_name_bytes": 255, "max_session_pis": 65_535}

    # longest sensible durations, seconds: beyond them a value is a typo (and a timer of
    # 1e300 s overflows the poll loop)
    SECONDS = {"commit_every_s": 3600.0, "ack_timeout_s": 3600.0,
               "full_request_every_s": 3600.0, "max_clock_skew_s": 1e11,
               "liveness_s": 3600.0}

    def validate(self) -> None:
        import math
        # 0 skew would be "any tick": refuse it
        for key, most in self.SECONDS.items():
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{key}: must be a finite number > 0 (got {value})")
            if value > most:
                raise ValueError(f"{key}: must be at most {most:g} s (got {value:g})")
        for key, most in self.LIMITS.items():
            if not 1 <= getattr(self, key) <= most:
                raise ValueError(f"{key}: must lie in [1, {most}] (got {getattr(self, key)})")
        for i, n in enumerate(self.nodes):
            if problem := name_problem(n):
                raise ValueError(f"nodes[{i}]: node name {problem}")
        if not self.db.strip():
            raise ValueError("db: must name the replay DB file (got an empty path)")
        if Path(self.db).expanduser().is_dir():
            raise ValueError(f"db: cannot open as a replay DB: {self.db!r} is a directory; "
                             f"name the DB file (e.g. "
                             f"{str(Path(self.db) / 'capes-replay.db')!r})")
        for key in ("ingest", "control", "grpc"):
            if not getattr(self, key).strip():
                raise ValueError(f"{key}: must be an address (got an empty string)")
        from capes.common.metrics import parse_address
        try:
            parse_address(self.metrics)
        except ValueError as exc:
            raise ValueError(f"metrics: {exc}") from None


@dataclass
class PluginConfig:
    """A collector or applier: its registered name and its constructor's options."""
    name: str
    options: dict[str, Any] = field(default_factory=dict)


CollectorConfig = ApplierConfig = PluginConfig


@dataclass
class MonitorConfig:
    node: str = field(default_factory=socket.gethostname)
    daemon: str = "tcp://127.0.0.1:5560"
    full_frame_every: int = 60               # ticks between full frames
    # float32 mantissa bits kept on the wire: 23 is lossless; 15 (relative error
    # <= 1.5e-5, 3 bytes a value) is plenty for performance indicators
    mantissa_bits: int = 15
    # frames of the last resend_s seconds are kept and sent again (as a fresh full frame
    # and deltas) after every reconnect: a daemon killed before committing them, or
    # away meanwhile, still gets them (it drops ticks it already stored); 0: none kept
    resend_s: float = 10.0
    collectors: list[CollectorConfig] = field(
        default_factory=lambda: [CollectorConfig("host"), CollectorConfig("timeofday")])

    def validate(self) -> None:
        if problem := name_problem(self.node):
            raise ValueError(f"node: {problem}")
        if not 1 <= self.mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits: must lie in [1, 23] (got {self.mantissa_bits})")
        if not 1 <= self.full_frame_every <= 1_000_000:
            raise ValueError(f"full_frame_every: must lie in [1, 1000000] "
                             f"(got {self.full_frame_every})")
        if not 0 <= self.resend_s <= 3600:       # also refuses NaN
            raise ValueError(f"resend_s: must be a number of seconds in [0, 3600] "
                             f"(got {self.resend_s})")


@dataclass
class ControlConfig:
    node: str = field(default_factory=socket.gethostname)
    daemon: str = "tcp://127.0.0.1:5561"
    dry_run: bool = False                    # log what would be applied, apply nothing
    restore_after_s: float = 0.0             # restore defaults after this much silence; 0: never
    appliers: dict[str, ApplierConfig] = field(default_factory=dict)   # parameter -> applier
    # the host's original knob values, recorded before the first change and kept across
    # restarts (control_agent.agent.OriginalValues): "auto" = /var/lib/capes-agent/
    # control-<node>.json as root, else $XDG_STATE_HOME/capes/...; "{node}" is replaced; "" keeps
    # them in memory only (a killed agent then forgets them)
    state_file: str = "auto"
    # every this many seconds the agent reads its knobs to notice a value changed behind
    # its back (by hand): logged, counted, told to the daemon, and left as it is; a knob
    # is also read just before each change. 0: only before a change
    drift_check_s: float = 30.0

    MAX_RESTORE_AFTER_S = 7 * 86400.0

    def validate(self) -> None:
        if problem := name_problem(self.node):
            raise ValueError(f"node: {problem}")
        # NaN and inf never get here (config._coerce refuses them); direct construction may
        if not 0 <= self.restore_after_s <= self.MAX_RESTORE_AFTER_S:
            raise ValueError(f"restore_after_s: must lie in [0, {self.MAX_RESTORE_AFTER_S:g}] "
                             f"seconds, 0 meaning never (got {self.restore_after_s})")
        if not 0 <= self.drift_check_s <= self.MAX_RESTORE_AFTER_S:
            raise ValueError(f"drift_check_s: must lie in [0, {self.MAX_RESTORE_AFTER_S:g}] "
                             f"seconds, 0 meaning only before a change (got "
                             f"{self.drift_check_s})")
        if self.state_file.endswith(("/", "\\")):
            raise ValueError(f"state_file: must name a file, not a directory "
                             f"(got {self.state_file!r})")


@dataclass
class DeploymentConfig:
    tick_seconds: float = 1.0                # sampling and action tick
    keys: KeysConfig = field(default_factory=KeysConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    parameters: dict[str, ParameterSpec] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, Any] = field(default_factory=dict)
    game: dict[str, Any] = field(default_factory=dict)      # read by `capes sim-node`

    TICK_SECONDS = (0.001, 3600.0)

    def validate(self) -> None:
        lo, hi = self.TICK_SECONDS
        if not lo <= self.tick_seconds <= hi:
            raise ValueError(f"tick_seconds: must lie in [{lo:g}, {hi:g}] (got "
                             f"{self.tick_seconds})")
        for name, spec in self.parameters.items():
            if problem := name_problem(name):
                raise ValueError(f"parameters: parameter name {name!r} {problem}")
            spec.name = name
        for name in self.daemon.forbidden:
            if name not in self.parameters:
                known = ", ".join(sorted(self.parameters)) or "none"
                raise ValueError(f"daemon.forbidden.{name}: unknown parameter {name!r} "
                                 f"(parameters: {known})")

    def param_specs(self) -> list[ParameterSpec]:
        """Parameters in action order (sorted by name)."""
        return [self.parameters[n] for n in sorted(self.parameters)]


def load_deployment(path: str | Path | None, overrides=()) -> DeploymentConfig:
    return cfgmod.load(DeploymentConfig, path, overrides)


# Paths of a deployment file that mean a place on disk, as (table, key): relative ones
# are taken relative to the file's directory (see resolve_config_paths).
CONFIG_RELATIVE_PATHS = (("keys", "dir"), ("daemon", "db"), ("control", "state_file"))


def resolve_config_paths(table: dict, config_path: str | Path) -> dict:
    """A copy of a deployment file's raw table whose relative paths (``keys.dir``,
    ``daemon.db``, ``control.state_file`` unless "auto" or "") are made absolute against
    the file's directory, so that a config means the same files whichever directory a
    command runs in (systemd's, a shell's). Apply it to the file's table *before*
    ``--set`` overrides, whose paths stay relative to the current directory."""
    base = Path(config_path).resolve().parent
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for section, key in CONFIG_RELATIVE_PATHS:
        sec = out.get(section)
        value = sec.get(key) if isinstance(sec, dict) else None
        if not isinstance(value, str) or not value.strip() or value == "auto":
            continue
        path = Path(value).expanduser()
        if not path.is_absolute():
            sec[key] = str(base / path)
    return out
