"""Demonstrations for the Q-network (``engine.demo_margin``, issue 25 round 4): each
replayed tick is labelled with the move towards its workload's best-known setting, and
DQfD's large-margin loss teaches the network to make it."""
from types import SimpleNamespace

import numpy as np
import torch

from capes.common import actions
from capes.common.step_grid import StepGrid
from drl_engine.config import DQNConfig
from drl_engine.context import Switch, WorkloadContexts
from drl_engine.demonstrations import NONE, demo_actions, labels, margin_loss
from drl_engine.qnet import QNetwork, RMSprop

UP, DOWN = actions.encode(1, 1, 2), actions.encode(1, -1, 2)      # the window (knob 1)


def test_the_demonstration_moves_the_farthest_knob_one_step_towards_the_best():
    n_steps, free = np.array([19, 99]), np.array([False, False])
    cur = np.array([[4, 10], [4, 90], [4, 50], [18, 50], [18, 50]])
    best = np.array([[4, 50], [4, 50], [4, 50], [4, 52], [4, 52]])
    got = demo_actions(cur, best, n_steps, free)
    assert list(got[:3]) == [UP, DOWN, 0]                      # NULL: at the best
    assert got[3] == actions.encode(0, -1, 2)                  # 14/19 of the range > 2/99
    frozen = demo_actions(cur[3:], best[3:], n_steps, np.array([True, False]))
    assert list(frozen) == [UP, UP]                            # a frozen knob never moves


def contexts_with(switches, current_best):
    ctx = WorkloadContexts(DQNConfig(use_context=True), [0])
    ctx.switches = [Switch(i, k, True) for i, k in switches]
    ctx.memory = [SimpleNamespace()] * 3
    ctx.remember(0, 0, np.array([4, 50]))
    ctx.remember(0, 2, np.array([4, 20]))
    ctx.clusters.current = 2
    grid = StepGrid.of([SimpleNamespace(min=10, max=200, step=10),
                        SimpleNamespace(min=1, max=100, step=1)])
    guide = SimpleNamespace(grid=grid.index, n_steps=grid.n_steps,
                            frozen=np.array([False, False]),
                            known=SimpleNamespace(best_idx=current_best))
    return ctx, guide


def test_each_tick_is_labelled_by_the_context_it_ran_in():
    ctx, guide = contexts_with([(5, 0), (100, 1), (200, 2)], current_best=np.array([4, 80]))
    index = np.array([3, 50, 150, 250, 250])
    values = np.array([[50.0, 30.0]] * 5)                      # rate limit 50, window 30
    got = labels(ctx, guide, values, np.array([7, 7, 7, 7, 8]), index, session=7)
    # before the first context: none; context 0: its best (window 51 > 30); context 1:
    # no best known; context 2, the current one: the guide's best (81), not the stored
    # one; another session's tick: none
    assert list(got) == [NONE, UP, NONE, UP, NONE]
    ctx.new_session()                       # a new session's indices start again
    assert (labels(ctx, guide, values, np.full(5, 7), index, session=7) == NONE).all()


def test_the_margin_loss_is_zero_once_the_demonstrated_action_leads_by_the_margin():
    q = torch.tensor([[0.0, 1.0, 0.2], [0.0, 1.0, 0.5], [3.0, 0.0, 0.0]])
    demo = torch.tensor([1, 1, NONE])
    assert abs(float(margin_loss(q, demo, 0.8)) - 0.5 * 0.3) < 1e-6   # only row 2 short
    assert float(margin_loss(q, torch.tensor([NONE] * 3), 0.8)) == 0.0


def test_a_network_taught_by_demonstrations_points_between_two_known_workloads():
    """The map the contexts' table cannot make: trained on two signatures whose best
    windows are 25 and 75 (of 100), the greedy window move for the signature halfway
    between turns between them."""
    torch.manual_seed(0)
    net = QNetwork(2, 5, 2, 16)
    opt = RMSprop(net.parameters(), lr=0.01, alpha=0.9)
    rng = np.random.default_rng(0)
    for _ in range(400):
        sig = rng.integers(0, 2, 64).astype(np.float32)
        x = rng.random(64).astype(np.float32)
        best = np.where(sig == 1, 0.75, 0.25)
        demo = np.where(x < best, UP, DOWN)
        loss = margin_loss(net.forward(torch.tensor(np.stack([sig, x], 1))),
                           torch.tensor(demo), 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def turn(sig: float) -> float:
        x = np.linspace(0, 1, 101, dtype=np.float32)
        with torch.no_grad():
            q = net.forward(torch.tensor(np.stack([np.full_like(x, sig), x], 1))).numpy()
        return float(x[np.argmax(q[:, DOWN] > q[:, UP])])

    assert abs(turn(0.0) - 0.25) <= 0.05 and abs(turn(1.0) - 0.75) <= 0.05
    assert 0.3 <= turn(0.5) <= 0.7



def test_where_workloads_are_told_apart_the_demonstrations_reach_the_network():
    from pathlib import Path
    from capes.experiments.converge_test import load_config, run_one
    game = Path(__file__).resolve().parents[1] / "configs" / "recurring-workloads.toml"
    runs = []
    for extra in (["engine.demo_margin=0"], ["engine.demo_margin=0.5"]):
        cfg = load_config(game, extra)
        cfg.game = cfg.game.until(150)
        runs.append(run_one(cfg, 3, keep_trace=True).trace["loss"])
    assert any(x is not None for x in runs[0]) and runs[0] != runs[1]
