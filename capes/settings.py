"""One typed configuration for the whole installation, validated before anything
starts.

A deployment TOML describes every process of a CAPES installation: the daemon, the
agents, the parameters (``capes.common.deployment``), the engine and its reward
(``drl_engine.config``) and, for the simulator, the game (``storagegamesim.game``).
``load_settings`` turns the whole file into one ``Settings`` object and checks every
section, whichever command reads it: a typo under ``[engine]`` stops
``capes interface-daemon`` too, before any socket opens. Nothing here imports torch.

Relative paths in the file (``keys.dir``, ``daemon.db``, ``control.state_file``) are
relative to the file, not to the current directory; those given with ``--set`` are
relative to the current directory.

``Settings`` *is a* ``DeploymentConfig`` (the components take it as one), with the
engine, reward and game sections typed instead of raw tables; ``[cluster]`` poses the
cluster game and ``[cluster_engine]`` holds the cluster engine's model and behaviour
(``drl_engine.cluster_config.NodeModelConfig``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from capes.common import config as cfgmod
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig, resolve_config_paths
from capes.common.metrics import DEFAULT_ENGINE_METRICS, parse_address
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from storagegamesim.cluster import ClusterConfig
from storagegamesim.game import GameConfig


def is_cluster_config(path: str | Path | None) -> bool:
    """Whether a config file poses the cluster game (has a ``[cluster]`` table); here,
    not beside the cluster test, so that ``converge-test`` asks it without importing
    the cluster engine."""
    if not path or not Path(path).is_file():
        return False
    try:
        return isinstance(cfgmod.read_toml(path).get("cluster"), dict)
    except Exception:                                 # noqa: BLE001 -- the loader reports it
        return False


@dataclass
class Settings(DeploymentConfig):
    engine: DQNConfig = field(default_factory=DQNConfig)
    # ``engine.metrics`` in the file: where the engine process serves Prometheus metrics
    # (as ``daemon.metrics`` is the daemon's). A process setting, not a hyperparameter,
    # so it is kept here rather than in DQNConfig (and never in a checkpoint).
    engine_metrics: str = field(default=DEFAULT_ENGINE_METRICS, init=False)
    # the live engine's PyTorch threads on CPU (engine.cpu_threads; 0: PyTorch's default)
    engine_cpu_threads: int = field(default=1, init=False)
    reward: RewardConfig = field(default_factory=RewardConfig)
    game: GameConfig = field(default_factory=GameConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    cluster_engine: NodeModelConfig = field(default_factory=NodeModelConfig)


def load_settings(path: str | Path | None, overrides: Iterable[str] = (),
                  preset: str | None = None, without: Iterable[str] = ()) -> Settings:
    """The whole file (or the defaults when None) with ``--set`` overrides and the
    engine preset applied. A bad value is one ``ConfigError`` naming the file and the
    dotted key, or the ``--set`` that caused it. ``without``: dotted keys taken out
    first (``config check`` drops each bad key in turn to find the next problem)."""
    table = resolve_config_paths(cfgmod.read_toml(path), path) if path else {}
    return settings_from_table(table, path, overrides, preset, without)


def settings_from_table(table: dict, path: str | Path | None, overrides: Iterable[str] = (),
                        preset: str | None = None, without: Iterable[str] = ()) -> Settings:
    """``load_settings`` of a table already read from ``path`` (which it changes)."""
    overrides = list(overrides) + ([f'engine.preset="{preset}"'] if preset else [])
    source = str(path) if path else "<defaults>"
    if overrides:          # paths given with --set stay relative to the current directory
        table = cfgmod.apply_overrides(table, overrides)
        source = f"{source} (with --set)"
    table = cfgmod.expand_vars(table, source)
    for key in without:
        cfgmod.drop_key(table, key)
    try:
        engine = dict(table.get("engine") or {}) if isinstance(table.get("engine"), dict) \
            else table.get("engine", {})
        metrics = engine.pop("metrics", DEFAULT_ENGINE_METRICS) if isinstance(engine, dict) \
            else DEFAULT_ENGINE_METRICS
        try:
            parse_address(metrics if isinstance(metrics, str) else None)
            if not isinstance(metrics, str):
                raise ValueError(f"expected a string HOST:PORT, got {metrics!r}")
        except ValueError as exc:
            raise ConfigError(source, "engine.metrics", str(exc)) from None
        threads = engine.pop("cpu_threads", 1) if isinstance(engine, dict) else 1
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ConfigError(source, "engine.cpu_threads",
                              f"expected an integer >= 0 (0: PyTorch's default, one "
                              f"thread per core), got {threads!r}")
        table["engine"] = with_preset(engine, source)
        settings = cfgmod.build(Settings, table, source)
        settings.engine_metrics = metrics
        settings.engine_cpu_threads = threads
        return settings
    except ConfigError as exc:
        culprit = _override_of(exc.key, overrides)
        if culprit is not None:
            raise ConfigError(f"--set {culprit}", exc.key, exc.problem) from None
        raise


def _override_of(key: str, overrides: list[str]) -> str | None:
    """The ``--set`` whose key is ``key``, lies above it or below it."""
    for text in reversed(overrides):
        set_key = text.split("=", 1)[0].strip()
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
            return text
    return None
