"""The CUDA-graph training step (``engine.cuda_graph``, drl_engine/qnet.py) computes
what the eager step computes. Needs a CUDA device; skipped without one (CI has none:
the lead engineer runs it on a lent GPU, see docs/results.md)."""
import numpy as np
import pytest
import torch

from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, with_preset
from drl_engine.node_model import NodeDQN
from drl_engine.dqn import DQN
from drl_engine.experience import Batch
from drl_engine.node_replay import NodeBatch
from test_device_replay import feed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _node_batch(rng, B=32, M=16, D=60, A=3, mean_field=True):
    return NodeBatch(
        obs=rng.normal(size=(B, M, D)).astype(np.float32), mask=rng.random((B, M)) < 0.9,
        actions=rng.integers(0, A, (B, M)), returns=rng.normal(size=B).astype(np.float32),
        discounts=np.full(B, 0.95, np.float32),
        next_obs=rng.normal(size=(B, M, D)).astype(np.float32),
        next_mask=rng.random((B, M)) < 0.9, valid=rng.random((B, M)) < 0.8,
        abar=rng.random((B, M, A)).astype(np.float32) if mean_field else None,
        next_abar=rng.random((B, M, A)).astype(np.float32) if mean_field else None)


def _cfg(**kw) -> DQNConfig:
    return DQNConfig(**with_preset({"preset": "default", **kw}))


def _params(learner):
    return torch.cat([p.detach().flatten().cpu() for p in
                      [*learner.q.parameters(), *learner.target.parameters(),
                       *learner.optimizer.square_avg]])


@pytest.mark.parametrize("mean_field", [True, False])
def test_node_graph_steps_match_eager_steps(mean_field):
    cfg = _cfg()
    model = NodeModelConfig(mean_field=mean_field)
    graphed = NodeDQN(60, 3, cfg, model, device="cuda", seed=3)
    eager = NodeDQN(60, 3, _cfg(cuda_graph=False), model, device="cuda",
                    seed=3)
    assert graphed.graphed and not eager.graphed
    rng = np.random.default_rng(0)
    # two shapes (a short batch too), past warm-up and capture into replays
    batches = [_node_batch(rng, B=32 if i % 4 else 20, mean_field=mean_field)
               for i in range(10)]
    for b in batches:
        lg, le = graphed.learn(b), eager.learn(b)
        assert torch.isfinite(lg) and abs(float(lg) - float(le)) <= 1e-4 * (1 + abs(float(le)))
    assert graphed._graphs.replays > 0
    assert graphed.optimizer.steps == eager.optimizer.steps == len(batches)
    torch.testing.assert_close(_params(graphed), _params(eager), rtol=1e-4, atol=1e-6)


def test_flat_graph_steps_match_eager_steps_with_demonstrations():
    cfg = _cfg(demo_margin=0.5)
    graphed = DQN(40, 5, cfg, device="cuda", seed=1)
    eager = DQN(40, 5, _cfg(demo_margin=0.5, cuda_graph=False), device="cuda", seed=1)
    rng = np.random.default_rng(1)
    for i in range(8):
        demo = np.where(rng.random(32) < 0.3, rng.integers(0, 5, 32), -1)
        if i == 5:
            demo[:] = -1                   # no demonstration at all in this batch
        b = Batch(obs=rng.normal(size=(32, 40)).astype(np.float32),
                  actions=rng.integers(0, 5, 32), rewards=rng.normal(size=32).astype(np.float32),
                  discounts=np.full(32, 0.99, np.float32),
                  next_obs=rng.normal(size=(32, 40)).astype(np.float32), demo=demo)
        lg, le = graphed.learn(b), eager.learn(b)
        assert abs(float(lg) - float(le)) <= 1e-4 * (1 + abs(float(le)))
    torch.testing.assert_close(_params(graphed), _params(eager), rtol=1e-4, atol=1e-6)


def test_loss_is_reported_one_call_late_without_waiting():
    learner = NodeDQN(60, 3, _cfg(), NodeModelConfig(), device="cuda", seed=0)
    rng = np.random.default_rng(2)
    first = learner.learn(_node_batch(rng))
    assert learner.mean_loss([first]) is None           # nothing read yet
    second = learner.learn(_node_batch(rng))
    assert learner.mean_loss([second]) == pytest.approx(float(first))


def _sampling_engine(cuda_graph: bool, nodes: int = 64, ticks: int = 150,
                     compile_step: bool = False, sampling=True):
    """A per-node engine on CUDA with ``cluster_engine.device_sampling``, its ring filled
    with the ragged ticks of tests/test_device_replay.py (gaps, a node absent, unknown
    actions)."""
    from drl_engine.config import RewardConfig
    from drl_engine.engine import Engine
    from storagegamesim.cluster import PI_NAMES, ClusterConfig
    model = NodeModelConfig(stats_ticks=40, learn_start=16, replay_mb=8,
                            cold_start="per_node", device_sampling=sampling)
    eng = Engine.over_rows(_cfg(cuda_graph=cuda_graph, compile_step=compile_step),
                           RewardConfig(), list(PI_NAMES),
                           list(ClusterConfig().param_specs().values()), nodes,
                           model=model, device="cuda", seed=0)
    feed(eng, 0, ticks, seed=0)
    return eng


@pytest.mark.parametrize("compiled", [False, True])
def test_device_sampled_graph_steps_change_the_weights_and_match_eager_steps(compiled):
    """``cluster_engine.device_sampling``: the draw, gather and step captured in one
    graph (CUDAGraphStep.sampled) run, and from the same CUDA generator state leave the
    weights of eager steps on the same draws (a replay's random numbers are the eager
    ones: the generator's offset advances alike), with new ticks ingested between steps
    (the mirror's staged copies). ``compiled``: the step's parts through torch.compile
    first (``engine.compile_step``), fused kernels in the graph, every part compiled."""
    graphed, eager = _sampling_engine(True, compile_step=compiled), _sampling_engine(False)
    assert graphed.dqn.graphed and not eager.dqn.graphed
    assert graphed.dqn.compiles == compiled and not eager.dqn.compiles
    before = _params(graphed.dqn)
    for eng in (graphed, eager):
        torch.cuda.manual_seed(11)
        for _ in range(6):
            eng.train(1)
        for t in range(150, 156):                # a tick, then a step, as the engine runs
            feed(eng, t, t + 1, seed=t)
            eng.train(1)
        torch.cuda.synchronize()
    assert graphed.train_steps == eager.train_steps == 12
    assert graphed.dqn._graphs.replays == 12 - graphed.dqn._graphs.warmup
    assert graphed.dqn.optimizer.steps == eager.dqn.optimizer.steps == 12
    after = _params(graphed.dqn)
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    # compiled: fused kernels round differently (H100: 7e-7 at most, the weights moved 0.03)
    torch.testing.assert_close(after, _params(eager.dqn), rtol=1e-4,
                               atol=1e-5 if compiled else 1e-6)
    if compiled:
        assert [p.failed for p in graphed.compiled_parts] == [None] * 4


def test_device_sampling_auto_draws_on_cuda():
    """``device_sampling = "auto"`` on a CUDA device: the device sampler, and its step
    trains (on the CPU "auto" is numpy: tests/test_device_replay.py)."""
    eng = _sampling_engine(True, sampling="auto")
    assert eng._sampler is not None
    for _ in range(4):
        eng.train(1)
    assert eng.train_steps == 4 and eng.dqn._graphs.replays > 0


def test_replays_draw_new_minibatches():
    """Each replay of a captured sampled step draws anew (its random numbers are not
    frozen into the graph), compiled or not: the draw's ticks differ between replays."""
    for compiled in (False, True):
        eng = _sampling_engine(True, compile_step=compiled)
        s, seen = eng._sampler, []
        s.draw = _Recording(s.draw, seen)
        for _ in range(3):
            eng.train(1)                          # warm-up, warm-up, capture + replay
        ticks = seen[-1]                          # the captured draw's output tensor
        drawn = []
        for _ in range(4):
            eng.train(1)
            torch.cuda.synchronize()
            drawn.append(ticks.clone())
        assert len({tuple(t.tolist()) for t in drawn}) == 4, compiled


class _Recording:
    """A draw that keeps each call's ticks tensor (a replay rewrites the captured one)."""

    def __init__(self, fn, seen):
        self.fn, self.seen = fn, seen

    def __call__(self, batch):
        out = self.fn(batch)
        self.seen.append(out[0])
        return out


def test_the_device_batch_on_cuda_is_the_numpy_batch():
    """The sampler's torch ops on CUDA give :meth:`RowData.batch_at`'s numbers for the
    ticks and nodes it drew."""
    eng = _sampling_engine(False, nodes=40)
    s = eng._sampler
    assert s.prepare(eng.data, 64)
    t, nodes, any_valid = s.draw(64)
    got = s.gather(t, nodes, any_valid)
    want = eng.data.batch_at(t.cpu().numpy(), nodes.cpu().numpy())
    names = ("obs", "mask", "actions", "returns", "discounts", "next_obs", "next_mask",
             "valid", "abar", "next_abar")
    for name, a in zip(names, got):
        np.testing.assert_allclose(a.cpu().numpy(), getattr(want, name), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
