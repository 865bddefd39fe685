"""DQN engine: action mapping, ε schedule, Bellman target, soft update, checkpoints."""

import numpy as np
import pytest
import torch

from capes.common.replay_db import ReplayReader
from drl_engine.dqn import DQN, DQNConfig, epsilon, pick_device
from drl_engine.experience import Batch
from drl_engine.engine import Engine, action_name, apply_action
from drl_engine.config import RewardConfig
from conftest import two_params


def test_actions_are_two_per_parameter_plus_null():
    specs = two_params()
    assert apply_action(0, [10, 4], specs) == [10, 4]          # NULL
    assert apply_action(1, [10, 4], specs) == [11, 4]          # a + step
    assert apply_action(2, [10, 4], specs) == [9, 4]           # a - step
    assert apply_action(3, [10, 4], specs) == [10, 6]          # b + 2
    assert apply_action(4, [10, 4], specs) == [10, 2]
    assert apply_action(2, [1, 4], specs) == [1, 4]            # clamped at min
    assert apply_action(3, [10, 10], specs) == [10, 10]        # clamped at max
    assert [action_name(a, ["a", "b"]) for a in range(5)] == ["null", "a+", "a-", "b+", "b-"]
    # above 2P: the same moves by two steps (engine.action_steps = 2, capes.common.actions)
    assert apply_action(5, [10, 4], specs) == [12, 4]          # a + 2 steps
    assert apply_action(8, [10, 4], specs) == [10, 0]          # b − 2 steps of 2
    assert action_name(5, ["a", "b"]) == "a+2"


def test_epsilon_anneals_linearly_and_bumps_on_workload_change():
    cfg = DQNConfig(exploration_ticks=100, workload_ticks=50)
    assert epsilon(0, cfg) == 1.0
    assert epsilon(50, cfg) == pytest.approx(0.525)
    assert epsilon(100, cfg) == pytest.approx(0.05)
    assert epsilon(10_000, cfg) == pytest.approx(0.05)
    assert epsilon(200, cfg, bumped_at=200) == pytest.approx(0.2)
    assert epsilon(225, cfg, bumped_at=200) == pytest.approx(0.125)
    assert epsilon(400, cfg, bumped_at=200) == pytest.approx(0.05)
    assert epsilon(10, cfg, bumped_at=5) == pytest.approx(epsilon(10, cfg))  # never lowers


def tiny_dqn(**kw):
    cfg = DQNConfig(**{"hidden_layers": 1, "hidden_width": 3, "gamma": 0.5, **kw})
    return DQN(obs_dim=2, n_actions=3, cfg=cfg, seed=0)


def set_linear(net, w, b):
    with torch.no_grad():
        layers = [m for m in net.net if isinstance(m, torch.nn.Linear)]
        for layer in layers[:-1]:               # make the hidden layer pass x through
            layer.weight.zero_()
            layer.bias.zero_()
            layer.weight[:2, :2] = torch.eye(2) * 1e-3
        layers[-1].weight.copy_(torch.tensor(w))
        layers[-1].bias.copy_(torch.tensor(b))


def test_bellman_target_matches_a_hand_computation():
    dqn = tiny_dqn()
    # target network: Q⁻(s') = bias only -> [1, 5, 3]; online: bias [9, 0, 2]
    set_linear(dqn.target, [[0, 0, 0]] * 3, [1.0, 5.0, 3.0])
    set_linear(dqn.q, [[0, 0, 0]] * 3, [9.0, 0.0, 2.0])
    r = torch.tensor([2.0, -1.0])
    s1 = torch.zeros(2, 2)
    # plain DQN: y = r + γ max_a Q⁻(s', a) = r + 0.5 * 5
    np.testing.assert_allclose(dqn.td_target(r, torch.full((2,), 0.5), s1).numpy(), [4.5, 1.5])
    # Double DQN: a* = argmax Q(s') = 0, y = r + γ Q⁻(s', 0) = r + 0.5 * 1
    double = tiny_dqn(double_dqn=True)
    set_linear(double.target, [[0, 0, 0]] * 3, [1.0, 5.0, 3.0])
    set_linear(double.q, [[0, 0, 0]] * 3, [9.0, 0.0, 2.0])
    np.testing.assert_allclose(double.td_target(r, torch.full((2,), 0.5), s1).numpy(), [2.5, -0.5])


def test_train_step_minimises_the_squared_td_error():
    dqn = tiny_dqn(loss="mse", target_update_rate=0.0, hidden_width=64)
    obs = torch.randn(32, 2)
    actions = torch.randint(0, 3, (32,))
    rewards = torch.ones(32)
    nxt = torch.randn(32, 2)
    disc = torch.full((32,), 0.5)
    y = dqn.td_target(rewards, disc, nxt)
    q = dqn.q(obs).gather(1, actions[:, None]).squeeze(1)
    expected = ((y - q) ** 2).mean().detach()
    batch = Batch(obs=obs, actions=actions, rewards=rewards, discounts=disc, next_obs=nxt)
    loss = dqn.train_step(batch)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    losses = [float(dqn.train_step(batch)) for _ in range(200)]
    assert losses[-1] < 0.1 * losses[0]


def test_soft_update_moves_the_target_by_alpha():
    dqn = tiny_dqn(target_update_rate=0.01)
    before = [p.clone() for p in dqn.target.parameters()]
    online = [p.clone() for p in dqn.q.parameters()]
    with torch.no_grad():
        for p in dqn.q.parameters():
            p.add_(1.0)
    dqn.soft_update()
    for t0, q0, t1 in zip(before, online, dqn.target.parameters()):
        torch.testing.assert_close(t1, 0.99 * t0 + 0.01 * (q0 + 1.0))


def test_network_shape_follows_the_paper():
    dqn = DQN(obs_dim=1760, n_actions=9, cfg=DQNConfig(), seed=0)
    linears = [m for m in dqn.q.net if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(1760, 1760), (1760, 1760), (1760, 9)]
    assert sum(isinstance(m, torch.nn.Tanh) for m in dqn.q.net) == 2
    assert dqn.optimizer.alpha == 0.9 and dqn.optimizer.lr == 0.001


def test_the_optimiser_and_clipping_are_torch_rmsprop_and_clip_grad_norm_exactly():
    """The engine's RMSprop and gradient clipping (no torch.optim import: no
    torch._dynamo at start) give bit-identical weights to torch's, and their state
    dicts load into each other."""
    import copy

    from drl_engine.qnet import RMSprop, clip_grad_norm
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(20, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5))
    b = copy.deepcopy(a)
    ta, ours = torch.optim.RMSprop(a.parameters(), lr=1e-3, alpha=0.9), \
        RMSprop(b.parameters(), lr=1e-3, alpha=0.9)
    for _ in range(30):
        x = torch.randn(32, 20) * 10
        for m, opt, clip in ((a, ta, torch.nn.utils.clip_grad_norm_), (b, ours, clip_grad_norm)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            clip(list(m.parameters()), 1.0)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    again = RMSprop(b.parameters(), lr=1e-3, alpha=0.9)
    again.load_state_dict(ta.state_dict())
    assert all(torch.equal(v, ta.state[p]["square_avg"])
               for v, p in zip(again.square_avg, a.parameters()))
    torch.optim.RMSprop(a.parameters(), lr=1e-3, alpha=0.9).load_state_dict(ours.state_dict())


def test_device_choice():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA"):
            pick_device("cuda")


def make_engine(path, seed=0, **kw):
    cfg = DQNConfig(stack=4, exploration_ticks=100, **kw)
    return Engine(cfg, RewardConfig(pis=["tp"]), ReplayReader(path), device="cpu", seed=seed)


def test_engine_observation_includes_parameter_values(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=10)
    eng = make_engine(path)
    tick, obs = eng.experience.latest(1)
    assert tick == 9 and obs.shape == (4 * 2 * 2 + 2,)
    # parameter a in effect at tick 9 = value after action at tick 8 = 10 + 8 % 3 = 12
    assert obs[-2] == pytest.approx((12 - 1) / 99)
    assert obs[-1] == pytest.approx(4 / 10)


def test_global_fraction_zero_means_no_global_probe_even_on_the_first_tick(
        tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=10)
    assert make_engine(path, guided=True).global_share == 1.0     # the default: global first
    eng = make_engine(path, guided=True, global_fraction=0.0)
    assert eng.global_share == 0.0
    eng.workload_changed()
    assert eng.global_share == 0.0


def test_checkpoint_resume_restores_networks_counters_and_epsilon(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=60)
    eng = make_engine(path, seed=3)
    for _ in range(30):
        eng.act(1)
    eng.train(20)
    eng.workload_changed()
    ckpt = eng.save(tmp_path / "ckpt" / "engine.pt")
    resumed = make_engine(path, seed=99)
    resumed.load(ckpt)
    assert (resumed.action_ticks, resumed.train_steps,
            resumed.exploration.bumped_at) == (30, 20, 30)
    assert resumed.epsilon == eng.epsilon
    obs = eng.experience.latest(1)[1][None]
    np.testing.assert_allclose(resumed.dqn.q_values(obs), eng.dqn.q_values(obs))
    # the same continuation after resume: identical decisions and training
    assert [resumed.act(1).action for _ in range(10)] == [eng.act(1).action for _ in range(10)]
    # weights only: the networks, fresh counters
    fresh = make_engine(path)
    fresh.load(ckpt, weights_only=True)
    assert fresh.action_ticks == 0
    np.testing.assert_allclose(fresh.dqn.q_values(obs), eng.dqn.q_values(obs))


def test_checkpoint_for_another_layout_is_refused(tmp_path, make_session):
    make_session(tmp_path / "a.db", ticks=20)
    make_session(tmp_path / "b.db", ticks=20, nodes=("n0",))
    ckpt = make_engine(tmp_path / "a.db").save(tmp_path / "a.pt")
    with pytest.raises(ValueError, match="another layout"):
        make_engine(tmp_path / "b.db").load(ckpt)


def test_td_target_discounts_the_bootstrap_by_the_batch_discount():
    dqn = tiny_dqn(n_step=2)
    set_linear(dqn.target, [[0, 0, 0]] * 3, [1.0, 5.0, 3.0])
    y = dqn.td_target(torch.tensor([1.0]), torch.tensor([0.5 ** 2]), torch.zeros(1, 2))
    assert float(y) == pytest.approx(1.0 + 0.5 ** 2 * 5.0)


def test_checkpoint_carries_normalisation_statistics(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=60)
    eng = make_engine(path, normalise_inputs=True)
    ckpt = eng.save(tmp_path / "n.pt")
    make_session(tmp_path / "new.db", ticks=12)          # a new, short session
    fresh = make_engine(tmp_path / "new.db", normalise_inputs=True)
    fresh.load(ckpt, weights_only=True)
    np.testing.assert_allclose(fresh.experience.normaliser.mean, eng.experience.normaliser.mean)
    fresh.update()                                       # its own few ticks do not replace them
    np.testing.assert_allclose(fresh.experience.normaliser.std, eng.experience.normaliser.std)


def test_a_pretrained_model_explores_less_at_first(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=30)
    ckpt = make_engine(path).save(tmp_path / "m.pt")
    fresh, pretrained = make_engine(path), make_engine(path)
    pretrained.load(ckpt, weights_only=True)
    assert fresh.epsilon == 1.0
    assert pretrained.epsilon == pytest.approx(0.3)
    resumed = make_engine(path)
    resumed.load(pretrained.save(tmp_path / "p.pt"))
    assert resumed.exploration.pretrained and resumed.epsilon == pytest.approx(0.3)


def test_a_checkpoint_of_another_layout_found_before_data_starts_afresh(tmp_path, make_session):
    """A restarted engine that resumes before the DB has data (the daemon restarted and
    began a session with another layout) must not crash-loop: it trains afresh and says
    why, instead of raising on every start."""
    make_session(tmp_path / "a.db", ticks=20)
    ckpt = make_engine(tmp_path / "a.db").save(tmp_path / "a.pt")
    from capes.common.replay_db import ReplayReader
    from drl_engine.config import DQNConfig, RewardConfig
    from drl_engine.engine import Engine
    empty = tmp_path / "b.db"
    make_session(empty, ticks=20, nodes=("n0",))
    eng = Engine(DQNConfig(stack=4, exploration_ticks=10), RewardConfig(pis=["tp"]),
                 ReplayReader(empty), device="cpu")
    eng.dqn = None
    eng._pending_state = None
    eng.load(ckpt)                     # pending: checked when the network is built
    eng.update()
    assert eng.dqn is not None and "another layout" in (eng.restore_error or "")


def test_a_layout_wider_than_max_inputs_is_refused_before_any_allocation(tmp_path, make_session):
    make_session(tmp_path / "a.db", ticks=20)
    with pytest.raises(ValueError, match="more than engine.max_inputs = 8"):
        make_engine(tmp_path / "a.db", max_inputs=8)


def test_the_guide_probes_before_the_first_full_observation(tmp_path, make_session):
    """The network needs ``stack`` ticks, the guide's probes none: the default preset
    starts searching at the session's first tick, the paper's waits for a full stack."""
    path = tmp_path / "r.db"
    make_session(path, ticks=2)                          # stack is 4
    guided = make_engine(path, guided=True, probe_model=True)
    decision = guided.act(1)
    assert decision is not None and decision.tick == 1 and decision.explored
    assert decision.action != 0                          # walking to a probe's target
    assert make_engine(path).act(1) is None


def test_train_every_trains_every_kth_tick_on_a_k_times_larger_minibatch(
        tmp_path, make_session):
    """engine.train_every = k (the default preset's speed setting): a training step on
    every k-th call only, sampling k × batch_size transitions, so a run sees as many
    samples per tick as with a step every tick."""
    path = tmp_path / "r.db"
    make_session(path, ticks=60)
    eng = make_engine(path, train_every=3, batch_size=4)
    sizes = []
    sample = eng.experience.sample
    eng.experience.sample = lambda n, rng: sizes.append(n) or sample(n, rng)
    losses = [eng.train() for _ in range(7)]
    assert [loss is not None for loss in losses] == [False, False, True] * 2 + [False]
    assert eng.train_steps == 2 and sizes == [12, 12]
    one = make_engine(path, batch_size=4)          # 1, the paper's: a step every call
    assert all(one.train() is not None for _ in range(3)) and one.train_steps == 3
    sizes.clear()                   # an explicit count (offline training): exactly that
    assert eng.train(2) is not None and eng.train_steps == 4 and sizes == [4, 4]
