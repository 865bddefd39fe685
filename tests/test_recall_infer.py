"""A new workload's first setting (``engine.context_infer``, issue 25): the Q-network's
inferred setting from the signature seen now, or without the network the nearest known
context's best-known setting; and its first probe (``engine.context_replan``)."""
from types import SimpleNamespace

import numpy as np
import pytest

from capes.common import actions
from capes.common.step_grid import StepGrid
from drl_engine.config import DQNConfig
from drl_engine.context import WorkloadContexts, fresh_observations
from drl_engine.exploration import Exploration
from drl_engine.normaliser import Normaliser

PIS = ["throughput", "window", "rate_limit", "request_kb"]
PARAMS = ["rate_limit", "window"]
STACK = 4


def experience(newest: list[float]) -> SimpleNamespace:
    """A session whose newest tick shows ``newest`` (older ticks: another workload)."""
    pis = np.array([[[1.0, 10.0, 50.0, 16.0]]] * 5 + [[newest]], np.float64)
    return SimpleNamespace(
        reader=SimpleNamespace(sessions={7: SimpleNamespace(pis=pis)}),
        derived={7: SimpleNamespace(n=len(pis))}, stack=STACK, normalise=False,
        normaliser=Normaliser(), layout=SimpleNamespace(pi_names=PIS, param_names=PARAMS),
        _param_lo=np.array([10.0, 1.0]), _param_span=np.array([190.0, 99.0]))


def test_fresh_observations_show_the_newest_tick_over_the_whole_stack_at_each_setting():
    exp = experience([80.0, 40.0, 200.0, 1024.0])
    obs = fresh_observations(exp, 7, np.array([[100.0, 1.0], [100.0, 60.0]]))
    assert obs.shape == (2, STACK * len(PIS) + len(PARAMS))
    ticks = obs[:, :-2].reshape(2, STACK, len(PIS))
    assert (ticks[:, :, 3] == 1024.0).all() and (ticks[:, :, 0] == 80.0).all()  # no old tick
    assert (ticks[0, :, 1] == 1.0).all() and (ticks[1, :, 1] == 60.0).all()      # the setting
    assert (ticks[:, :, 2] == 100.0).all()
    assert np.allclose(obs[1, -2:], [90 / 190, 59 / 99])


class PointingNetwork:
    """Q-values whose greedy move points the window at a value that grows with the
    signature's request size (up below it, down above it)."""

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        last = obs[:, (STACK - 1) * len(PIS):STACK * len(PIS)]
        peak = 20 + 10 * np.log2(last[:, 3] / 16)           # 16 KiB: 20, 1024 KiB: 80
        q = np.zeros((len(obs), actions.count(2)))
        q[:, actions.encode(1, 1, 2)] = np.sign(peak - last[:, 1])
        q[:, actions.encode(1, -1, 2)] = -np.sign(peak - last[:, 1])
        q[:, actions.encode(0, 1, 2)] = 0.5                 # the rate limit: second best
        return q


def network_walk(request_kb: float, start: int, frozen=(False, False), known: int = 2,
                 **cfg):
    """(moves made, setting the walk ends at) of a new context's network walk; ``cfg``:
    more engine settings (the engine stub is kept in ``network_walk.engine``)."""
    grid = StepGrid.of([SimpleNamespace(min=10, max=200, step=10),
                        SimpleNamespace(min=1, max=100, step=1)])
    guide = SimpleNamespace(step_grid=grid, n_steps=grid.n_steps, frozen=np.array(frozen))
    engine = SimpleNamespace(experience=experience([80.0, 1.0, 50.0, request_kb]),
                             dqn=PointingNetwork(), action_ticks=0,
                             exploration=Exploration(DQNConfig()))
    network_walk.engine = engine
    ctx = WorkloadContexts(DQNConfig(use_context=True, context_infer=True, **cfg), [3])
    ctx.memory = [SimpleNamespace()] * (known + 1)
    for k in range(known):
        ctx.remember(0, k, np.array([0, 0]))
    ctx.infer, current, moves = True, np.array([4, start]), 0
    while ctx.inferring:
        action = ctx.infer_action(engine, 7, current, guide)
        if action:
            k, steps = actions.decode(action, 2)
            current[k] += steps
            moves += 1
        engine.action_ticks += 1
        assert engine.action_ticks < 100
    return moves, ctx.target


def test_the_network_walk_follows_its_greedy_move_and_stops_half_a_move_past_its_turn():
    for request_kb, peak, start, turn in ((1024.0, 80, 32, 7), (16.0, 20, 49, 5),
                                          (128.0, 50, 40, 3)):
        moves, target = network_walk(request_kb, start)
        assert moves == turn - 1          # 8 steps a move; the turn is asked, not made
        assert abs(target[1] + 1 - peak) <= 4 and target[0] == 4   # the rate limit stays


def test_no_walk_before_the_network_has_seen_two_other_workloads():
    moves, target = network_walk(1024.0, 32, known=1)
    assert moves == 0 and target is None


def test_the_network_walk_never_moves_a_frozen_knob():
    moves, target = network_walk(1024.0, 32, frozen=(False, True))
    assert moves == 0 and list(target) == [4, 32]


def test_context_infer_local_keeps_the_probes_local_after_the_networks_walk_only():
    # round 9: with engine.context_infer_local the setting the walk reached is searched
    # around (the engine's global share goes to 0, as after an alarm); off, or with no
    # walk (fewer known workloads), the new context's probes start global as before
    for local, known, bumped in ((True, 2, True), (False, 2, False), (True, 1, False)):
        network_walk(1024.0, 32, known=known, context_infer_local=local)
        assert network_walk.engine.exploration.local is bumped


def test_without_the_network_a_new_context_starts_at_the_nearest_contexts_best():
    ctx = WorkloadContexts(DQNConfig(use_context=True), [0, 1])
    for sig in ([0.9, 1024.0], [0.2, 16.0], [0.6, 128.0], [0.5, 60.0]):
        for _ in range(10):
            ctx.clusters.update(np.array(sig))
    assert ctx.clusters.count == 4 and ctx.current == 3      # the last is new ...
    ctx.memory = [SimpleNamespace() for _ in range(4)]
    for k, b in enumerate((49, 24, 74)):
        ctx.remember(0, k, np.array([9, b]))
    assert list(ctx.nearest_best()) == [9, 74]                 # ... nearest the third
    ctx.remember(0, 2, None)
    assert list(ctx.nearest_best()) == [9, 24]                 # then the second


@pytest.mark.parametrize("switch", ["engine.context_infer=false",
                                    "engine.demo_margin=0"])      # round 4's too
def test_the_stationary_game_plays_as_before_with_inference_on(switch):
    # the default preset has both on; switching either off changes nothing here
    from pathlib import Path
    from capes.experiments.converge_test import load_config, run_one
    game = Path(__file__).resolve().parents[1] / "configs" / "storagegamesim.toml"
    on = load_config(game, ["game.time_limit_ticks=120"])
    off = load_config(game, ["game.time_limit_ticks=120", switch])
    a, b = run_one(on, 3, keep_trace=True), run_one(off, 3, keep_trace=True)
    assert a.trace["window"] == b.trace["window"]       # no signature PIs: no context
    assert a.trace["loss"] == b.trace["loss"]           # ... no label to learn either


def _trace(game: str, limit: int, extra: list[str], seed: int = 3) -> dict:
    """The trace of one seeded run of a shipped game, on one thread (as a converge-test
    job: threaded BLAS spins on a busy machine), the suite's thread counts restored."""
    from pathlib import Path
    import torch
    from threadpoolctl import threadpool_limits
    from capes.experiments.converge_test import load_config, run_one
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / game, extra)
    cfg.game = cfg.game.until(limit)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            return run_one(cfg, seed, keep_trace=True).trace
    finally:
        torch.set_num_threads(threads)


def _before_39() -> list[str]:
    """The default preset before issue 39 (the values the per-node engine keeps):
    q_scope = new_contexts with the taught walk, global probes, the re-aimed first one."""
    from capes.common.config import as_overrides
    from drl_engine.config import PER_NODE_KEEPS
    return as_overrides("engine", PER_NODE_KEEPS)


def test_with_q_scope_new_contexts_and_no_walk_the_engine_plays_as_without_the_network():
    # the recurring game with q_scope = new_contexts: no walk acts (three workloads;
    # context_infer_known = 3), so the network never acts and every move is
    # use_q_network = false's (where the unscoped network's guarded greedy moves do
    # change the trace)
    game, limit, scope = "recurring-workloads.toml", 400, _before_39()
    scoped = _trace(game, limit, scope)
    no_q = _trace(game, limit, [*scope, "engine.use_q_network=false"])
    everywhere = _trace(game, limit, [*scope, "engine.q_scope=everywhere"])
    assert scoped["window"] == no_q["window"] and scoped["rate_limit"] == no_q["rate_limit"]
    assert everywhere["window"] != no_q["window"]


def test_with_q_scope_new_contexts_the_network_acts_first_at_an_unseen_workloads_walk():
    # the mixes game: the first mix arrives at tick 1600, the fourth workload, where the
    # walk acts (context_infer_known = 3); until then the network arm plays its
    # ablation's moves exactly, then its walk differs from the nearest context's setting
    game, walk = "recurring-workloads-mixes.toml", ["engine.context_infer=true",
                                                   "engine.context_infer_known=3"]
    scoped = _trace(game, 1650, [*walk, "engine.q_scope=new_contexts",
                                 "engine.demo_margin=0.5"], seed=0)
    nearest = _trace(game, 1650, [*walk, "engine.use_q_network=false"], seed=0)
    # either knob: the walk may move the rate limit first (with the safe probes' default
    # the window agreed until tick 1637, the rate limit differed by tick 1604)
    setting = lambda t: list(zip(t["window"], t["rate_limit"]))
    differ = [i for i, (a, b) in enumerate(zip(setting(scoped), setting(nearest)))
              if a != b]
    assert differ and 1600 <= differ[0] <= 1620


def test_q_scope_is_validated():
    from pathlib import Path
    from capes.experiments.converge_test import load_config
    game = Path(__file__).resolve().parents[1] / "configs" / "storagegamesim.toml"
    with pytest.raises(Exception, match="q_scope"):
        load_config(game, ["engine.q_scope=new_workloads"])


def test_fresh_q_reads_the_network_on_fresh_observations_at_the_current_setting():
    # the scoped network's lead and walk (round 7): what it makes of the workload seen
    # now, the newest tick over the whole stack, not the old workload in its stack
    from drl_engine.context import fresh_q
    exp = experience([80.0, 40.0, 200.0, 1024.0])
    grid = StepGrid.of([SimpleNamespace(min=10, max=200, step=10),
                        SimpleNamespace(min=1, max=100, step=1)])
    seen = []
    dqn = SimpleNamespace(q_values=lambda obs: seen.append(obs) or obs[:, :3] * 0 + 7.0)
    q = fresh_q(SimpleNamespace(experience=exp, dqn=dqn), 7, np.array([9, 59]),
                SimpleNamespace(step_grid=grid))
    assert q.shape == (3,) and (q == 7.0).all()
    want = fresh_observations(exp, 7, np.array([[100.0, 60.0]]))
    assert len(seen) == 1 and np.array_equal(seen[0], want)


def test_the_scoped_lead_is_the_networks_and_its_ablation_is_untouched():
    # engine.context_lead with q_scope = new_contexts (the default preset's): the lead
    # acts (the trace leaves use_q_network = false's, which it equals without the lead:
    # the test above) and without the network the lead switch changes nothing
    game, limit = "recurring-workloads.toml", 700
    lead = _trace(game, limit, ["engine.context_lead=true"])
    no_q = _trace(game, limit, ["engine.use_q_network=false"])
    no_q_lead = _trace(game, limit, ["engine.use_q_network=false", "engine.context_lead=true"])
    assert lead["window"] != no_q["window"]
    assert no_q_lead["window"] == no_q["window"]


def test_the_stationary_game_with_q_scope_new_contexts_plays_as_without_the_network():
    # q_scope = new_contexts and no signature PIs (no context, no walk): the network
    # trains but never acts, so that scope and use_q_network = false play one game
    # (the ablation floor's "not worse on the stationary game" is a tie by construction)
    game, scope = "storagegamesim.toml", _before_39()
    default = _trace(game, 300, scope)
    no_q = _trace(game, 300, [*scope, "engine.use_q_network=false"])
    assert default["window"] == no_q["window"] and default["rate_limit"] == no_q["rate_limit"]
    assert default["throughput"] == no_q["throughput"]
    first = _trace(game, 300, [*scope, "engine.q_scope=first_visits"])   # round 7's scope
    assert first["window"] == no_q["window"]
    everywhere = _trace(game, 300, [*scope, "engine.q_scope=everywhere"])
    assert everywhere["window"] != no_q["window"]         # where the network acts, it shows


def test_first_visit_is_a_later_workloads_first_visit_only():
    # q_scope = "first_visits" (round 7): the network's guarded greedy moves act where
    # a workload's best-known setting is least known, never on a return
    ctx = WorkloadContexts(DQNConfig(use_context=True), [0, 1])
    assert not ctx.first_visit                          # nothing seen yet
    ctx.clusters.current = 0
    ctx.memory = [SimpleNamespace(visits=1)]
    assert not ctx.first_visit                          # the first workload: explored all along
    ctx.memory.append(SimpleNamespace(visits=1))
    ctx.clusters.current = 1
    assert ctx.first_visit                              # the second, first seen now
    ctx.memory[1].visits = 2
    assert not ctx.first_visit                          # ... come back: the memory's


def test_q_scope_first_visits_with_the_lead_plays_where_the_network_reads_the_stack():
    # "first_visits" turns the network on at a context switch within a tick; with the
    # lead it read an observation the engine had skipped building (a crash within 700
    # ticks before the fix): it plays, and its network moves show against the ablation
    game, limit = "recurring-workloads.toml", 700
    first = _trace(game, limit, ["engine.q_scope=first_visits", "engine.context_lead=true"])
    no_q = _trace(game, limit, ["engine.use_q_network=false", "engine.context_lead=true"])
    assert len(first["window"]) == len(no_q["window"]) >= limit - 1
    assert first["window"] != no_q["window"]


def test_context_replan_changes_nothing_before_the_first_new_context():
    # engine.context_replan (round 8) re-aims a new workload's first (global) probe; off,
    # the engine plays as before it. With global probes (the default before issue 39)
    # both play the same moves through the first workload (a session's own first probe
    # is not re-aimed) and part only after randwrite, the first new context, arrives at
    # tick 600; the stationary game has no context, so its trace is the same on and off
    on = _before_39()
    off = [*on, "engine.context_replan=false"]
    on_w, before = (_trace("recurring-workloads.toml", 700, s, seed=0)["window"]
                    for s in (on, off))
    differ = [i for i, (a, b) in enumerate(zip(on_w, before)) if a != b]
    assert differ and 600 <= differ[0] <= 620
    assert _trace("storagegamesim.toml", 120, on) == _trace("storagegamesim.toml", 120, off)
