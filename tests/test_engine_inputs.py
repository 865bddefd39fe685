"""An engine that survives its inputs (issue 38): a node whose clock runs ahead of the
others, a checkpoint from another config or damaged, PIs that are not finite. Each as a
user meets it: ``capes drl-engine`` against a real interface daemon, or on a real DB."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from daemon_harness import PARAMS, ROOT, Agent, DaemonProcess, wait_for, write_config

from capes.common import curve
from capes.common.control_client import ControlClient
from capes.common.deployment import KeysConfig

NODES = ("n1", "n2", "n3", "n4")
TICK_S = 0.05


def per_node_params(nodes=NODES) -> str:
    return "".join(f"""
[parameters."{n}/window"]
min = 1
max = 100
step = 1
default = 10
nodes = ["{n}"]
""" for n in nodes)


GLOBAL_WINDOW = """
[parameters.window]
min = 1
max = 100
step = 1
default = 10
"""


def read_status(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class LiveCluster:
    """An interface daemon with per-node knobs ``<node>/window``, one synthetic monitoring
    agent per node (throughput peaks at window 50; the knob's value reported as a PI),
    and ``capes drl-engine`` started on it. ``ahead``: ticks each node's clock runs ahead
    of the wall clock's tick (an agent stamps frames with its own clock)."""

    def __init__(self, tmp, ahead: dict[str, int], engine_args=(), nodes=NODES,
                 bad: dict[str, float] | None = None, flat: bool = False):
        curve.generate(tmp / "keys", ["mon", "engine"])
        self.cfg = write_config(tmp, max_clock_skew_s=300)       # the shipped default
        self.cfg.write_text(self.cfg.read_text().replace(
            PARAMS, GLOBAL_WINDOW if flat else per_node_params(nodes)))
        self.knob = (lambda node: "window") if flat else (lambda node: f"{node}/window")
        self.tmp, self.nodes, self.ahead = tmp, nodes, ahead
        self.daemon = DaemonProcess(self.cfg, tmp / "ready.json")
        self.ctx = zmq.Context()
        self.engine = None
        keys = KeysConfig(dir=str(tmp / "keys"), client="mon")
        self.agents = [Agent(self.ctx, self.daemon.info["ingest"], keys, "mon", n,
                             ["throughput", "window"]) for n in nodes]
        self.control = ControlClient(self.daemon.info["grpc"], curve.load_token(keys))
        self.tick = int(time.time() / TICK_S)
        self.status_file = tmp / "engine.json"
        self.engine_args = list(engine_args)
        self.bad, self.fed = bad or {}, 0     # node -> its throughput in the first ticks

    def throughput(self, node: str, w: float) -> float:
        if node in self.bad and self.fed < 15:
            return self.bad[node]
        return 100.0 - abs(w - 50.0)

    def feed(self, n: int = 1) -> None:
        """``n`` ticks of every node, one every TICK_S (as agents on wall-clock ticks)."""
        params = self.control.status()["parameters"]
        for _ in range(n):
            for a, node in zip(self.agents, self.nodes):
                w = params[self.knob(node)]
                a.send(self.tick + self.ahead.get(node, 0), [self.throughput(node, w), w])
            self.tick += 1
            self.fed += 1
            time.sleep(TICK_S)

    def start_engine(self) -> None:
        self.status_file.unlink(missing_ok=True)        # an earlier run's
        self.engine = subprocess.Popen(
            [sys.executable, "-m", "capes", "drl-engine", "--config", str(self.cfg),
             "--set", f"daemon.grpc={self.daemon.info['grpc']}", "--set", "engine.stack=2",
             "--set", "keys.client=engine", "--device", "cpu",
             "--checkpoint-dir", str(self.tmp / "ckpt"), "--status-file",
             str(self.status_file), "--metrics", "", *self.engine_args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def feed_until(self, pred, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.engine.poll() is None, self.engine.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, read_status(self.status_file)
            self.feed()

    def close(self) -> None:
        if self.engine is not None and self.engine.poll() is None:
            self.engine.kill()
            self.engine.wait()
        for a in self.agents:
            a.close()
        self.control.close()
        self.ctx.destroy(linger=0)
        self.daemon.stop()


def seen(status: dict) -> tuple[int, dict[str, int]]:
    s = status.get("nodes_seen") or {}
    return s.get("ticks", 0), s.get("nodes", {})


@pytest.mark.slow
@pytest.mark.parametrize("flat", [False, True], ids=["per_node", "one_row"])
@pytest.mark.parametrize("skew_s", [0.0, 3.0])
def test_a_node_whose_clock_runs_ahead_does_not_blind_the_engine_to_the_others(
        tmp_path, skew_s, flat):
    """One node's clock 3 s ahead (60 ticks; well inside max_clock_skew_s = 300): its
    rows are stored 60 ticks ahead of the others'. The per-node engine took every tick
    up to the newest row (that node's) and never went back, so the on-time nodes were
    seen in a few % of its ticks; the one-row engine decided on the newest tick, where
    only that node had a row. Each node must be seen in >= 95 % of the ticks (per node:
    ingested; one row: decided on) once it sends, and every frame stored."""
    lead = round(skew_s / TICK_S)
    c = LiveCluster(tmp_path, {"n4": lead}, flat=flat)
    try:
        c.feed(20)
        wait_for(lambda: c.control.status()["rows_written"] >= 60, timeout=15)
        c.start_engine()
        c.feed_until(lambda: seen(read_status(c.status_file))[0] >= 120 + lead)
        ticks, nodes = seen(read_status(c.status_file))
        print(f"skew {skew_s} s, {'one row' if flat else 'per node'}: {ticks} ticks, "
              f"seen per node {nodes}")
        for n in ("n1", "n2", "n3"):              # on time: there from the first tick
            assert nodes[n] >= 0.95 * ticks, (n, nodes, ticks)
        # the fast node: from its first row, lead ticks after the others' first
        assert nodes["n4"] >= 0.95 * (ticks - lead), (nodes, ticks)
        st = c.control.status()
        assert not st["drops"], st["drops"]        # no frame refused: no row lost
    finally:
        c.close()


def frames(ticks: int, rows: dict[int, range]):
    """(ticks, nodes, 1) PIs: node j has a row at the ticks ``rows[j]``."""
    pis = np.full((ticks, len(rows), 1), np.nan, np.float32)
    for j, have in rows.items():
        pis[[t for t in have if t < ticks], j] = 1.0
    return pis


def test_the_frontier_waits_for_live_nodes_but_not_for_stopped_or_far_behind_ones():
    from drl_engine.tick_frontier import TickFrontier
    f = TickFrontier(stall_ticks=5, lag_ticks=10)
    # n0, n1 on time up to tick 49; n2 sixty ticks ahead (up to 109): wait for n0, n1
    pis = frames(110, {0: range(50), 1: range(50), 2: range(60, 110)})
    assert f.end(pis, 1000, 110, 0) == 50
    # they catch up: taken as far as the slower of the two; n1 one tick late
    pis = frames(120, {0: range(70), 1: range(69), 2: range(60, 120)})
    assert f.end(pis, 1000, 120, 50) == 69
    # n1 stops: waited for while the newest tick moves 5 more ticks, not after
    pis = frames(124, {0: range(74), 1: range(69), 2: range(60, 124)})
    assert f.end(pis, 1000, 124, 69) == 69
    pis = frames(126, {0: range(76), 1: range(69), 2: range(60, 126)})
    assert f.end(pis, 1000, 126, 69) == 76
    # a node 3 ticks behind the others is waited for; one 30 behind is not
    g = TickFrontier(stall_ticks=5, lag_ticks=10)
    pis = frames(100, {0: range(100), 1: range(100), 2: range(97), 3: range(70)})
    assert g.end(pis, 0, 100, 0) == 97
    # a node that joins is waited for from its first row on
    pis = frames(100, {0: range(100), 1: range(100), 2: range(100), 3: range(70)})
    pis = np.concatenate([pis, np.full((100, 1, 1), np.nan, np.float32)], axis=1)
    pis[98, 4] = 1.0
    assert g.end(pis, 0, 100, 97) == 99


def run_engine_until_it_saves(c: LiveCluster, *args: str) -> None:
    """One engine run of 40 ticks (``args``: its settings), leaving its checkpoint."""
    c.engine_args = ["--max-ticks", "40", *args]
    c.start_engine()
    deadline = time.monotonic() + 90
    while c.engine.poll() is None:
        assert time.monotonic() < deadline, "the engine did not stop after --max-ticks"
        c.feed()
    assert c.engine.returncode == 0, c.engine.stderr.read().decode()[-3000:]
    assert (c.tmp / "ckpt" / "engine-latest.pt").exists()


def damage(path, how: str) -> None:
    import torch
    state = torch.load(path, weights_only=True)
    if how == "counter":
        state["action_ticks"] = "many"
    elif how == "rng":
        state["rng"] = {"bit_generator": "PCG64", "state": {"state": "x", "inc": 1}}
    elif how == "nan_weights":
        for t in state["dqn"]["q"].values():
            t.fill_(float("nan"))
    elif how == "scale":
        state["controller"]["p_scale"] = float("inf")
    torch.save(state, path)


def restart_engine(c: LiveCluster, action_ticks: int) -> str:
    """The engine started again (no extra arguments), fed until its status shows
    ``action_ticks`` decisions, then stopped cleanly; its log."""
    c.engine_args = []
    c.start_engine()
    c.feed_until(lambda: (read_status(c.status_file).get("action_ticks") or 0)
                 >= action_ticks)
    c.engine.terminate()
    assert c.engine.wait(20) == 0
    return c.engine.stderr.read().decode()


def assert_trains_afresh(c: LiveCluster, why: str) -> None:
    """The engine runs on (decides, trains), says why in its log, and keeps the
    checkpoint it could not use aside."""
    log = restart_engine(c, 5)
    assert "the checkpoint could not be used" in log and why in log, log[-3000:]
    assert (c.tmp / "ckpt" / "engine-latest.pt.incompatible").exists()
    # the checkpoint it saves at exit is a fresh one, and resumable
    import torch
    state = torch.load(c.tmp / "ckpt" / "engine-latest.pt", weights_only=True)
    assert 5 <= state["action_ticks"] < 40


@pytest.mark.slow
@pytest.mark.parametrize("how, why", [
    ("config", "shape"), ("counter", "counter action_ticks"), ("rng", "RNG state"),
    ("nan_weights", "not finite"), ("scale", "reward scale")])
def test_a_checkpoint_of_another_config_or_damaged_is_set_aside_not_a_crash_loop(
        tmp_path, how, why):
    """A checkpoint of another cluster_engine.hidden made load_state_dict raise at every
    start (``capes drl-engine`` crash-looped); damaged ones that load cleanly (a counter
    that is not a number, an RNG state that is not one) failed at start or at the first
    decision, and NaN weights or an infinite reward scale were trained on and saved."""
    c = LiveCluster(tmp_path, {})
    try:
        c.feed(20)
        wait_for(lambda: c.control.status()["rows_written"] >= 60, timeout=15)
        # cold_start_ticks = 5: the controller's state (p_scale) is in the checkpoint
        run_engine_until_it_saves(c, *(["--set", "cluster_engine.hidden=32"]
                                       if how == "config" else []))
        if how != "config":
            damage(tmp_path / "ckpt" / "engine-latest.pt", how)
        assert_trains_afresh(c, why)
    finally:
        c.close()


@pytest.mark.slow
def test_a_flat_engine_checkpoint_of_another_hidden_width_is_set_aside(tmp_path):
    """The one-row engine: a checkpoint of another engine.hidden_width on a DB with
    data (restored at start) crash-looped the same way."""
    c = flat_cluster(tmp_path)
    try:
        c.feed(30)
        wait_for(lambda: c.control.status()["rows_written"] >= 25, timeout=15)
        run_engine_until_it_saves(c, "--set", "engine.hidden_width=16")
        assert_trains_afresh(c, "shape")
    finally:
        c.close()


def flat_cluster(tmp_path, bad=None) -> LiveCluster:
    """A LiveCluster of one node with a global knob ``window`` (the one-row engine)."""
    return LiveCluster(tmp_path, {}, nodes=("n1",), bad=bad, flat=True)


def saved_state(c: LiveCluster) -> dict:
    import torch
    return torch.load(c.tmp / "ckpt" / "engine-latest.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_pi_that_is_not_finite_in_the_first_ticks_reaches_no_scale_or_statistic(
        tmp_path, value):
    """One node reports an infinite throughput for its first 15 ticks: the per-node
    reward scale became inf (every return 0 or NaN; saved in checkpoints) and the input
    statistics held 3.4e38 (inf through nan_to_num). Both must come from the finite
    values only; the checkpoint the engine leaves is one it resumes from."""
    c = LiveCluster(tmp_path, {}, bad={"n1": value})
    try:
        c.feed(20)
        wait_for(lambda: c.control.status()["rows_written"] >= 60, timeout=15)
        run_engine_until_it_saves(c, "--set", "cluster_engine.stats_ticks=30",
                                  "--set", "cluster_engine.learn_start=20")
        state = saved_state(c)
        scale = state["controller"]["p_scale"]
        # the objective (sum of the 4 throughputs, 40 each at window 10) is ~160: 1 %
        assert scale is not None and 0.5 < scale < 5, scale
        mean, std = (np.asarray(state["stats"][k]) for k in ("mean", "std"))
        assert np.isfinite(mean).all() and np.isfinite(std).all(), state["stats"]
        assert np.abs(mean).max() < 100, mean             # log1p of PIs of ~100
        assert_resumes(c)
    finally:
        c.close()


def assert_resumes(c: LiveCluster) -> None:
    log = restart_engine(c, 45)
    assert "resumed from" in log and "could not be used" not in log, log[-3000:]


@pytest.mark.slow
def test_a_pi_that_is_not_finite_reaches_no_statistic_of_the_flat_engine(tmp_path):
    """The one-row engine: an infinite throughput in the first ticks made the input
    statistics' mean 3.4e38 (nan_to_num of inf) and the objective's spread fell back to
    1 (NaN from inf - inf) instead of the finite values' spread."""
    c = flat_cluster(tmp_path, bad={"n1": float("inf")})
    try:
        c.feed(60)
        wait_for(lambda: c.control.status()["rows_written"] >= 55, timeout=15)
        run_engine_until_it_saves(c)
        stats = saved_state(c)["stats"]
        mean = np.asarray(stats["mean"])
        assert np.isfinite(mean).all() and np.abs(mean).max() < 1e3, stats
        assert np.isfinite(stats["objective_std"]) and stats["objective_std"] != 1.0, stats
        assert_resumes(c)
    finally:
        c.close()


def test_the_replay_reader_reads_an_infinite_pi_as_missing(tmp_path, make_session):
    """The engines' one source of PIs: ±inf stored in the DB (an older daemon, a merged
    DB) is no measurement, read as NaN like a PI not sent; the finite ones stay."""
    from capes.common.replay_db import ReplayReader
    w, _ = make_session(tmp_path / "r.db", ticks=5)
    w.add_pis(5, 0, np.array([np.inf, 3.0], np.float32))
    w.add_pis(5, 1, np.array([-np.inf, np.nan], np.float32))
    w.commit()
    with ReplayReader(tmp_path / "r.db") as r:
        pis = r.sessions[max(r.sessions)].pis
        assert np.isnan(pis[5, 0, 0]) and pis[5, 0, 1] == 3.0
        assert np.isnan(pis[5, 1]).all()
        assert np.isfinite(pis[:5]).all()


@pytest.mark.parametrize("damage_how", ["truncated", "a_list", "no_networks", "bad_stats"])
def test_start_engine_survives_any_checkpoint_file(tmp_path, make_session, damage_how):
    """Own pass: a checkpoint cut short (a full disk), one that holds a list, one without
    its networks, one whose statistics are strings: each said (``restore_error``) and a
    fresh engine, never an exception out of the start."""
    import torch
    from capes.common.replay_db import ReplayReader
    from drl_engine.config import DQNConfig, RewardConfig
    from drl_engine.daemon import EngineDaemonOptions, _start_engine
    from drl_engine.engine import Engine
    cfg, reward = DQNConfig(stack=4, exploration_ticks=10), RewardConfig(pis=["tp"])
    make_session(tmp_path / "a.db", ticks=20)
    ckpt = Engine(cfg, reward, ReplayReader(tmp_path / "a.db"), device="cpu").save(
        tmp_path / "engine-latest.pt")
    if damage_how == "truncated":
        ckpt.write_bytes(ckpt.read_bytes()[:300])
    else:
        state = torch.load(ckpt, weights_only=True)
        if damage_how == "a_list":
            state = [1, 2, 3]
        elif damage_how == "no_networks":
            del state["dqn"]["q"]
        else:
            state["stats"] = {"mean": [["x", "y"]] * 2, "std": [[1.0, 1.0]] * 2,
                              "objective_std": 1.0}
        torch.save(state, ckpt)
    eng = _start_engine(tmp_path / "a.db", cfg, reward, EngineDaemonOptions(device="cpu"), ckpt)
    assert eng is not None and eng.dqn is not None and eng.restore_error, eng.restore_error
    assert eng.action_ticks == 0 and eng.act(max(eng.experience.reader.sessions)) is not None
    eng.close()
