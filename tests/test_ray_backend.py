"""The optional Ray backend of converge-test sweeps (issue 11, item 6): the same report
as the local backend, from Ray tasks on a local Ray instance. Skipped where ray is not
installed (it is an optional extra: pip install 'capes[ray]')."""
from __future__ import annotations

import pytest

from capes.experiments import ray_backend
from capes.experiments.cluster_test import load_config, run_tuners

TINY = ["cluster.nodes=8", "cluster.time_limit_ticks=60",
        'cluster.phases=[{at_tick=30, active_fraction=0.5}]']


def strip_wall(report: dict) -> dict:
    runs = [{k: v for k, v in r.items() if k not in ("wall_s", "write_s")}
            for r in report["runs"]]
    return {"runs": runs, "tuners": {t: {k: v for k, v in a.items() if k != "wall_s_per_run"}
                                     for t, a in report["tuners"].items()}}


def test_without_ray_the_command_says_so_in_one_line(monkeypatch, capsys):
    from capes.cli import main
    from capes.experiments.cluster_test import DEFAULT_CONFIG
    monkeypatch.setattr(ray_backend, "ray_available", lambda: False)
    rc = main(["converge-test", "--config", str(DEFAULT_CONFIG), "--backend", "ray",
               "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "capes[ray]" in err[0], err


def test_the_single_node_grid_without_ray_says_so_in_one_line(monkeypatch, capsys):
    from capes.cli import main
    monkeypatch.setattr(ray_backend, "ray_available", lambda: False)
    rc = main(["converge-test", "--backend", "ray", "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "capes[ray]" in err[0], err


def test_ray_runs_the_single_node_grid_and_gives_the_local_report():
    ray = pytest.importorskip("ray")
    from capes.experiments.converge_test import load_config as load_game, run_grid
    cfg = load_game(None, ["game.time_limit_ticks=120"], "default")
    local = run_grid(cfg, [0.1], ["diff"], seeds=2, progress=None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_grid(cfg, [0.1], ["diff"], seeds=2, progress=None, backend="ray")
    finally:
        ray.shutdown()
    keep = ("seed", "won", "ticks", "train_steps", "final_window", "final_rate_limit")
    assert [{k: r[k] for k in keep} for r in remote["runs"]] == \
        [{k: r[k] for k in keep} for r in local["runs"]]


def test_ray_runs_the_sweep_and_gives_the_local_report():
    ray = pytest.importorskip("ray")
    cfg = load_config(None, TINY)
    local = run_tuners(cfg, ["hill", "capes"], seeds=2, progress=None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_tuners(cfg, ["hill", "capes"], seeds=2, progress=None, backend="ray")
        assert ray.is_initialized()               # a Ray the caller started is left up
    finally:
        ray.shutdown()
    assert [(r["tuner"], r["seed"]) for r in remote["runs"]] == \
        [("hill", 0), ("hill", 1), ("capes", 0), ("capes", 1)]
    assert strip_wall(remote) == strip_wall(local)
