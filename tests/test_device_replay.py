"""The per-node minibatch drawn on the torch device (``cluster_engine.device_sampling``,
drl_engine/device_replay.py), here on the CPU: given the same ticks and nodes it is the
numpy path's batch; its ticks are always ones the numpy path would keep, with the numpy
path's law; its mirror of the ring follows the host's through gaps, wraps, resets and
nodes joining; and an engine trains with it. The graph-captured step is in
tests/test_cuda_graph.py (CUDA only)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from capes.experiments.cluster_test import run_one
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.device_replay import DeviceSampler
from drl_engine.node_replay import NodeReplay
from test_cluster_engine import FAST_MODEL, PI_NAMES, cfg_short, engine

@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the engine runs (capes.common.one_core): the draw's ops over
    the whole ring (~50,000 slots here) split over threads that a loaded machine's other
    processes hold took 14x as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FIELDS = ("obs", "mask", "actions", "returns", "discounts", "next_obs", "next_mask",
          "valid", "abar", "next_abar")


def ragged_engine(nodes=8, capacity=None, ticks=220, seed=0, **model):
    """An engine whose ring has what the numpy sampler must skip: a gap of missing ticks,
    a node absent for a while (a membership change: rewards across it are NaN), a PI
    missing on one node, unknown actions (two knobs moved at once); ``capacity``: a
    ring that small (it wraps)."""
    kw = dict(loss_nodes=4, device_sampling=True, learn_start=8)
    eng = engine(nodes, dataclasses.replace(FAST_MODEL, **{**kw, **model}))
    if capacity is not None:
        d = eng.data
        d.replay = NodeReplay(nodes, d.pi_names, d.params, capacity, d.reward_cfg)
    feed(eng, 0, ticks, seed)
    return eng


def feed(eng, start, stop, seed):
    rng = np.random.default_rng(seed)
    for t in range(start, stop):
        if t % 97 in (50, 51):                          # a gap
            continue
        x = rng.uniform(1, 100, (eng.nodes, len(PI_NAMES))).astype(np.float32)
        x[:, 4], x[:, 5] = 8 + rng.integers(0, 2, eng.nodes), 2000
        if t % 11 == 7:
            x[0, 5] = 1950                              # node 0 moved both knobs
        if t % 89 in range(70, 76):
            x[3 % eng.nodes] = np.nan                   # a node absent
        x[1 % eng.nodes, 2] = np.nan                    # a PI missing
        eng.ingest(t, x)


def valid_ticks(data) -> np.ndarray:
    """The ticks the numpy sampler keeps: lo..hi with all n rewards known."""
    lo, hi, _ = data.sample_span()
    rep = data.replay
    t = np.arange(lo, hi + 1)
    r = rep.r[(t[:, None] + data.shift + np.arange(data.n_step)[None]) % rep.capacity]
    return t[np.isfinite(r).all(axis=1)]


@pytest.mark.parametrize("model", [dict(), dict(mean_field=False), dict(loss_nodes=0),
                                   dict(node_pick="redraw", recent_fraction=0.0)])
@pytest.mark.parametrize("capacity", [None, 70])
def test_the_device_batch_is_the_numpy_batch_of_the_same_ticks_and_nodes(model, capacity):
    eng = ragged_engine(capacity=capacity, **model)
    s = DeviceSampler("cpu", seed=1)
    assert s.prepare(eng.data, 64)
    t, nodes, any_valid = s.draw(64)
    got = s.gather(t, nodes, any_valid)
    want = eng.data.batch_at(t.numpy(), nodes.numpy())
    assert not want.valid.all() and want.valid.any()    # the ring's holes are in the batch
    for name in FIELDS:
        a = getattr(got, name)
        b = getattr(want, name)
        if b is None:
            assert a is None and not eng.mcfg.mean_field
            continue
        assert a.shape == b.shape and a.numpy().dtype == b.dtype, name
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-6, atol=0, err_msg=name)


def test_drawn_ticks_are_always_ones_the_numpy_sampler_keeps_with_its_law():
    """Over many draws on a ring that wrapped, with gaps and membership changes: every
    tick drawn is a valid one, every valid one is drawn, and the share drawn from the
    recent ticks is the numpy path's (its mixture of the span and the recent ticks,
    restricted to the valid ones), within 4 binomial standard deviations."""
    eng = ragged_engine(capacity=150, ticks=400, recent_ticks=40)
    data = eng.data
    s = DeviceSampler("cpu", seed=2)
    assert s.prepare(data, 256)
    ok = valid_ticks(data)
    lo, hi, recent = data.sample_span()
    assert data.replay.last >= data.replay.capacity and 0 < len(ok) < hi - lo + 1
    drawn = torch.cat([s.draw(256)[0] for _ in range(200)]).numpy()
    assert np.isin(drawn, ok).all() and set(drawn.tolist()) == set(ok.tolist())
    f = data.mcfg.recent_fraction
    w = (1 - f) / (hi - lo + 1) + f / (hi - recent + 1) * (ok >= recent)
    p = w[ok >= recent].sum() / w.sum()
    share, n = (drawn >= recent).mean(), len(drawn)
    assert abs(share - p) < 4 * np.sqrt(p * (1 - p) / n)
    # the numpy sampler's own ticks (its rejection loop) have that law too
    numpy_ticks = []
    data.batch_at = lambda t, nodes: numpy_ticks.append(t)
    rng = np.random.default_rng(0)
    for _ in range(200):
        data.sample(256, rng)
    mine = np.concatenate(numpy_ticks)
    assert np.isin(mine, ok).all() and len(mine) == n
    assert abs((mine >= recent).mean() - p) < 4 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("staged", [False, True])
def test_the_mirror_follows_the_ring_through_wraps_gaps_resets_and_growth(staged):
    """``staged``: the new rows through the one-copy staging buffer CUDA uses (here not
    pinned), a gap of more rows than it holds included."""
    eng = ragged_engine(capacity=90, ticks=100)
    s = DeviceSampler("cpu", staged=staged)

    def same():
        assert s.prepare(eng.data, 8)
        rep = eng.data.replay
        for name, dev in s.ring.items():
            assert np.array_equal(dev.numpy(), getattr(rep, name), equal_nan=True), name
        assert np.array_equal(s.mean.numpy(), eng.data.mean)

    same()
    for start in (100, 101, 103, 130, 400):     # one tick, a gap, a gap over the ring
        feed(eng, start, start + 1 + start % 7, seed=start)
        same()
    eng.data._fit_stats()                       # refitted statistics reach the device
    eng.data.mean = eng.data.mean + 0.5
    same()
    generation = s.generation
    eng.data.reset()
    feed(eng, 500, 700, seed=5)
    same()
    eng.grow(10)                                # nodes joined: a wider ring
    feed(eng, 700, 760, seed=6)
    same()
    assert s.generation == generation + 2 and s.ring["lp"].shape[1] == 10


def test_with_no_valid_tick_the_batch_counts_nothing():
    """Every tick's membership differs from the next (rewards all NaN): the numpy path
    finds no transition; the device draw (which cannot reject) runs a batch of zero
    weight."""
    eng = engine(4, dataclasses.replace(FAST_MODEL, device_sampling=True, learn_start=8))
    rng = np.random.default_rng(0)
    for t in range(80):
        x = rng.uniform(1, 100, (4, len(PI_NAMES))).astype(np.float32)
        x[t % 4] = np.nan
        eng.ingest(t, x)
    assert eng.data.sample_span() is not None and eng.data.sample(32, rng) is None
    s = DeviceSampler("cpu")
    assert s.prepare(eng.data, 32)
    t, nodes, any_valid = s.draw(32)
    assert not bool(any_valid) and not s.gather(t, nodes, any_valid).valid.any()


def test_an_engine_trains_with_device_sampling():
    """The switch reaches the engine, its steps draw on the device (the engine's numpy
    generator untouched by them), and the TD loss falls on a ring whose returns follow
    the actions."""
    eng = engine(4, dataclasses.replace(FAST_MODEL, device_sampling=True, learn_start=8))
    assert eng._sampler is not None
    w = lambda u: 20.0 + (u % 2)                      # noqa: E731 -- window at tick u
    for u in range(120):
        x = np.full((4, len(PI_NAMES)), 5.0, np.float32)
        x[:, 0] = 10.0 * w(u - 3)                     # throughput follows the window
        x[:, 4], x[:, 5] = w(u), 2000
        eng.ingest(u, x)
    state = eng.rng.bit_generator.state
    before = [p.detach().clone() for p in eng.dqn.q.parameters()]
    losses = [eng.train(1) for _ in range(150)]
    assert eng.train_steps == 150 and eng.rng.bit_generator.state == state
    assert any(not torch.equal(a, b) for a, b in zip(before, eng.dqn.q.parameters()))
    assert np.mean(losses[-30:]) < 0.5 * np.mean(losses[:30])


def test_a_short_cluster_run_with_device_sampling_works_end_to_end(monkeypatch):
    steps = []
    learn = DeviceSampler.learn
    monkeypatch.setattr(DeviceSampler, "learn",
                        lambda self, *a: steps.append(1) or learn(self, *a))
    cfg = cfg_short(["cluster.time_limit_ticks=160", "cluster.phases=[]"])
    cfg.model = dataclasses.replace(cfg.model, device_sampling=True)
    r = run_one(cfg, seed=0)
    assert r["train_steps"] > 50 and len(steps) >= r["train_steps"]
    assert np.isfinite(r["mean_relative"])


def test_device_sampling_auto_draws_on_cuda_only():
    """``device_sampling = "auto"``: the numpy sampler on the CPU, where it is the
    faster one; a bad value is refused when the config is checked."""
    assert NodeModelConfig().device_sampling is False
    eng = engine(4, dataclasses.replace(FAST_MODEL, device_sampling="auto"))
    assert eng._sampler is None
    with pytest.raises(ValueError, match="device_sampling"):
        dataclasses.replace(FAST_MODEL, device_sampling="gpu").validate()
