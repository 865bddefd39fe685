"""The CPU training step's gradients by hand (drl_engine/dqn.py, ``DQN._cpu_step``)
must leave the networks and the optimiser bit-for-bit where autograd's step leaves them:
the converge runs and every saved model depend on it."""
import warnings

import numpy as np
import pytest
import torch

from drl_engine.config import PRESETS, DQNConfig
from drl_engine.dqn import DQN
from drl_engine.experience import Batch


def batches(dim, n_actions, batch, steps, demo, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        b = Batch(obs=rng.normal(size=(batch, dim)).astype(np.float32) * 3,
                  actions=rng.integers(0, n_actions, batch).astype(np.int64),
                  rewards=rng.normal(size=batch).astype(np.float32) * 5,
                  discounts=np.full(batch, 0.99 ** 5, np.float32),
                  next_obs=rng.normal(size=(batch, dim)).astype(np.float32) * 3)
        if demo == "none":            # the engine's array when no row is demonstrated
            b.demo = np.full(batch, -1, np.int64)
        elif demo == "some":
            b.demo = np.where(rng.random(batch) < 0.2,
                              rng.integers(0, n_actions, batch), -1).astype(np.int64)
        yield b


def train(preset, by_hand, dim, n_actions, batch, steps, demo, layers=2, width=0,
          numpy_tanh=False):
    cfg = DQNConfig(**{**PRESETS[preset], "preset": preset, "hidden_layers": layers,
                       "hidden_width": width, "numpy_tanh": numpy_tanh})
    learner = DQN(dim, n_actions, cfg, seed=3)
    learner._by_hand = by_hand
    calls = []
    step = learner._cpu_step
    learner._cpu_step = lambda *a: calls.append(1) or step(*a)
    losses = [learner.learn(b).item() for b in batches(dim, n_actions, batch, steps, demo)]
    state = ([p.detach().clone() for p in learner.q.parameters()]
             + [p.detach().clone() for p in learner.target.parameters()]
             + [v.clone() for v in learner.optimizer.square_avg])
    return losses, state, len(calls)


@pytest.mark.parametrize("preset, dim, n_actions, batch, demo, layers, width", [
    ("default", 57, 9, 96, "none", 2, 0),     # the converge test's shape
    ("paper", 57, 9, 32, None, 2, 0),         # MSE, no double DQN, no clipping
    ("default", 20, 5, 1, None, 3, 0),        # one row; three hidden layers
    ("paper", 33, 7, 7, None, 1, 16),         # one hidden layer of another width
    ("default", 40, 9, 64, "some", 2, 0),     # demonstrations: autograd's step
])
def test_step_by_hand_is_bit_identical(preset, dim, n_actions, batch, demo, layers, width):
    torch.set_num_threads(1)
    args = (dim, n_actions, batch, 60, demo, layers, width)
    losses_a, state_a, calls_a = train(preset, False, *args)
    losses_h, state_h, calls_h = train(preset, True, *args)
    assert calls_a == 0
    assert calls_h == (0 if demo == "some" else 60)      # the path under test ran
    assert losses_h == losses_a
    for a, h in zip(state_a, state_h):
        assert a.dtype == h.dtype and torch.equal(a, h)
        assert torch.equal(torch.signbit(a), torch.signbit(h))


def test_numpy_tanh_changes_only_the_rounding():
    # engine.numpy_tanh (on in the default preset): numpy's tanh where no gradient is
    # recorded; the Q-values and 60 training steps stay within float32 rounding
    torch.set_num_threads(1)
    args = (57, 9, 96, 60, "none")
    losses_t, state_t, _ = train("default", True, *args)
    losses_n, state_n, calls = train("default", True, *args, numpy_tanh=True)
    assert calls == 60
    assert losses_n == pytest.approx(losses_t, rel=1e-4)
    for t, n in zip(state_t, state_n):
        torch.testing.assert_close(n, t, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(t, n) for t, n in zip(state_t, state_n))   # it ran


def test_a_part_that_fails_to_compile_runs_eagerly_and_says_so():
    """``engine.compile_step``: a part whose compile fails (here a backend that raises)
    warns once and computes what the plain function computes, at every later call too."""
    from drl_engine.qnet import CompiledOrEager

    def refuse(gm, example_inputs):
        raise RuntimeError("no compiler here")

    def f(x):
        return torch.tanh(x) * 2 + 1

    part = CompiledOrEager(f, "the test part", backend=refuse)
    x = torch.arange(6.0)
    with pytest.warns(RuntimeWarning, match="the test part stays eager"):
        assert torch.equal(part(x), f(x))
    assert "no compiler here" in part.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # no second try, no second warning
        assert torch.equal(part(x + 1), f(x + 1))


def test_a_backward_that_fails_to_compile_runs_eagerly():
    """The loss's backward compiles at its first call, after the forward ran: a failure
    there leaves the loss eager and the step runs again, once, with the same gradient."""
    from torch._dynamo.backends.common import aot_autograd

    from drl_engine.qnet import CompiledOrEager

    def refuse(gm, example_inputs):
        raise RuntimeError("no backward compiler here")

    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)

    def loss(x):
        return (torch.tanh(x * w) ** 2).sum()

    part = CompiledOrEager(loss, "the test loss",
                           backend=aot_autograd(fw_compiler=lambda gm, ex: gm,
                                                bw_compiler=refuse))
    x = torch.arange(3.0)
    runs = []

    def step():
        runs.append(1)
        w.grad = None
        part(x).backward()
        return w.grad.clone()

    with pytest.warns(RuntimeWarning, match="the test loss stays eager"):
        grad = part.guarded(step)
    assert "no backward compiler here" in part.failed and len(runs) == 2
    w.grad = None
    loss(x).backward()
    assert torch.equal(grad, w.grad)


def test_a_part_past_the_recompile_limit_says_so():
    """Each new shape recompiles; past the limit (64) a part would silently run eagerly
    in dynamo: here it is marked and warned, and still computes the same values."""
    from drl_engine.qnet import CompiledOrEager

    def f(x):
        return x * 3 + 1

    part = CompiledOrEager(f, "the growing part", backend="eager")
    with pytest.warns(RuntimeWarning, match="the growing part stays eager"):
        for n in range(1, 70):
            assert torch.equal(part(torch.ones(n)), f(torch.ones(n)))
    assert part.failed is not None and "limit" in part.failed.lower()


def test_compile_step_leaves_a_cpu_learner_as_written():
    """On the CPU ``compile_step`` changes nothing (the step by hand is faster there, and
    torch.compile's first call would cost seconds): no part is wrapped."""
    from drl_engine.node_model import NodeDQN
    cfg = DQNConfig(**{**PRESETS["default"], "preset": "default", "compile_step": True})
    learner = NodeDQN(8, 3, cfg, device="cpu", seed=0)
    assert not learner.compiles
    assert not hasattr(learner._update_tensors, "compiled")
    assert not hasattr(learner.loss, "compiled")
