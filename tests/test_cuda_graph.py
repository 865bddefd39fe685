"""The CUDA-graph training step (``engine.cuda_graph``, drl_engine/qnet.py) computes
what the eager step computes. Needs a CUDA device; skipped without one (CI has none:
the lead engineer runs it on a lent GPU, see docs/results.md)."""
import numpy as np
import pytest
import torch

from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, with_preset
from drl_engine.node_model import NodeDQN
from drl_engine.qnet import DQNLearner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _node_batch(rng, B=32, M=16, D=60, A=3, mean_field=True):
    return (rng.normal(size=(B, M, D)).astype(np.float32), rng.random((B, M)) < 0.9,
            rng.integers(0, A, (B, M)), rng.normal(size=B).astype(np.float32),
            np.full(B, 0.95, np.float32), rng.normal(size=(B, M, D)).astype(np.float32),
            rng.random((B, M)) < 0.9, rng.random((B, M)) < 0.8,
            rng.random((B, M, A)).astype(np.float32) if mean_field else None,
            rng.random((B, M, A)).astype(np.float32) if mean_field else None)


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
    assert graphed._graphs is not None and eager._graphs is None
    rng = np.random.default_rng(0)
    # two shapes (a short batch too), past warm-up and capture into replays
    batches = [_node_batch(rng, B=32 if i % 4 else 20, mean_field=mean_field)
               for i in range(10)]
    for b in batches:
        lg, le = graphed.learn(*b), eager.learn(*b)
        assert torch.isfinite(lg) and abs(float(lg) - float(le)) <= 1e-4 * (1 + abs(float(le)))
    assert graphed._graphs.replays > 0
    assert graphed.optimizer.steps == eager.optimizer.steps == len(batches)
    torch.testing.assert_close(_params(graphed), _params(eager), rtol=1e-4, atol=1e-6)


def test_flat_graph_steps_match_eager_steps_with_demonstrations():
    cfg = _cfg(demo_margin=0.5)
    graphed = DQNLearner(40, 5, cfg, device="cuda", seed=1)
    eager = DQNLearner(40, 5, _cfg(demo_margin=0.5, cuda_graph=False),
                       device="cuda", seed=1)
    rng = np.random.default_rng(1)
    for i in range(8):
        demo = np.where(rng.random(32) < 0.3, rng.integers(0, 5, 32), -1)
        if i == 5:
            demo[:] = -1                   # no demonstration at all in this batch
        b = (rng.normal(size=(32, 40)).astype(np.float32), rng.integers(0, 5, 32),
             rng.normal(size=32).astype(np.float32), np.full(32, 0.99, np.float32),
             rng.normal(size=(32, 40)).astype(np.float32), demo)
        lg, le = graphed.learn(*b), eager.learn(*b)
        assert abs(float(lg) - float(le)) <= 1e-4 * (1 + abs(float(le)))
    torch.testing.assert_close(_params(graphed), _params(eager), rtol=1e-4, atol=1e-6)


def test_loss_is_reported_one_call_late_without_waiting():
    learner = NodeDQN(60, 3, _cfg(), NodeModelConfig(), device="cuda", seed=0)
    rng = np.random.default_rng(2)
    first = learner.learn(*_node_batch(rng))
    assert learner.mean_loss([first]) is None           # nothing read yet
    second = learner.learn(*_node_batch(rng))
    assert learner.mean_loss([second]) == pytest.approx(float(first))
