"""Training-step speed for the thesis's Table 5.3 shape: a 1,760-float observation
(10 ticks × 4 nodes × 44 PIs), two hidden layers as wide, minibatch 32 (6.2 M weights).

    .venv/bin/python benchmarks/bench_train_step.py [--device cpu|cuda] [--steps 200]

Measures, in the same run and interleaved: (1) CAPES's DQN.train_step on ready tensors,
(2) a bare PyTorch loop doing the same step (forward, max-target, MSE, RMSProp, soft
target update), and (3) the whole Engine.train(1) including Algorithm-2 sampling from
a replay DB. Prints medians and the ratio CAPES / bare. Paper: 0.1 s CPU, 0.01 s GPU.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from drl_engine.dqn import DQN, DQNConfig, pick_device
from drl_engine.experience import Batch
from drl_engine.engine import Engine
from drl_engine.config import RewardConfig

STACK, NODES, PIS, PARAMS, BATCH = 10, 4, 44, 4, 32
OBS = STACK * NODES * PIS           # 1,760 as in Table 5.3
ACTIONS = 2 * PARAMS + 1


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(device, obs=OBS):
    """The textbook step, written out with no CAPES code."""
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(obs, obs), nn.Tanh(), nn.Linear(obs, obs), nn.Tanh(),
                      nn.Linear(obs, ACTIONS)).to(device)
    target = copy.deepcopy(q)
    opt = torch.optim.RMSprop(q.parameters(), lr=0.001, alpha=0.9)

    def step(obs, act, rew, nxt):
        with torch.no_grad():
            y = rew + 0.99 * target(nxt).max(1).values
        pred = q(obs).gather(1, act[:, None]).squeeze(1)
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for tp, p in zip(target.parameters(), q.parameters()):
                tp.mul_(0.99).add_(p, alpha=0.01)
        return loss
    return step


def make_db(path: Path, ticks: int = 2000) -> None:
    rng = np.random.default_rng(0)
    specs = [ParameterSpec(min=1, max=256, step=1, default=8, name=f"p{i}") for i in range(PARAMS)]
    w = ReplayWriter(path)
    w.begin_session(SessionInfo(pi_names=["throughput"] + [f"pi{i}" for i in range(PIS - 1)],
                                node_names=[f"n{i}" for i in range(NODES)], params=specs))
    for t in range(ticks):
        for n in range(NODES):
            w.add_pis(t, n, rng.random(PIS, dtype=np.float32))
        w.add_action(t, int(rng.integers(ACTIONS)), [8] * PARAMS)
    w.close()


def timed(fn, device, reps):
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="CI: 20 steps")
    args = p.parse_args()
    if args.quick:
        args.steps = 20
    device = pick_device(args.device)
    cfg = DQNConfig(preset="paper")
    dqn = DQN(OBS, ACTIONS, cfg, device, seed=0)
    bare = bare_loop(device)
    g = torch.Generator().manual_seed(0)
    # DQN.train_step's discounts: one-step returns, d = γ (as bare_loop's 0.99)
    gamma = torch.full((BATCH,), cfg.gamma)
    batch = (torch.rand(BATCH, OBS, generator=g), torch.randint(0, ACTIONS, (BATCH,), generator=g),
             torch.rand(BATCH, generator=g), torch.rand(BATCH, OBS, generator=g))
    batch = tuple(t.to(device) for t in batch)
    dqn_batch = Batch(obs=batch[0], actions=batch[1], rewards=batch[2],
                      discounts=gamma.to(device), next_obs=batch[3])
    with tempfile.TemporaryDirectory() as tmp:
        make_db(Path(tmp) / "r.db")
        engine = Engine(cfg, RewardConfig(), ReplayReader(Path(tmp) / "r.db"), device=str(device))
        # the engine's input is the 1,760 PIs plus the 4 parameters' current values
        eobs = engine.experience.obs_dim
        bare_e = bare_loop(device, eobs)
        ebatch = (torch.rand(BATCH, eobs, generator=g).to(device), batch[1], batch[2],
                  torch.rand(BATCH, eobs, generator=g).to(device))
        for _ in range(10):                      # warm-up
            dqn.train_step(dqn_batch); bare(*batch); engine.train(1); bare_e(*ebatch)
        ours, theirs, full, theirs_e = [], [], [], []
        for _ in range(args.steps // 10):        # interleave so load drifts hit all alike
            ours += timed(lambda: dqn.train_step(dqn_batch), device, 10)
            theirs += timed(lambda: bare(*batch), device, 10)
            full += timed(lambda: engine.train(1), device, 10)
            theirs_e += timed(lambda: bare_e(*ebatch), device, 10)
    params = sum(p.numel() for p in dqn.q.parameters())
    med = {k: statistics.median(v) * 1000 for k, v in
           (("capes", ours), ("bare", theirs), ("engine", full), ("bare_e", theirs_e))}
    print(f"device={device} threads={torch.get_num_threads()} obs={OBS} batch={BATCH} "
          f"actions={ACTIONS} weights={params / 1e6:.2f} M steps={len(ours)}")
    print(f"DQN.train_step (ready tensors)      median {med['capes']:8.3f} ms")
    print(f"bare PyTorch loop, same step         median {med['bare']:8.3f} ms")
    print(f"Engine.train(1) incl. Algorithm 2    median {med['engine']:8.3f} ms "
          f"(input {eobs}: PIs + parameter values)")
    print(f"bare PyTorch loop at input {eobs}      median {med['bare_e']:8.3f} ms")
    print(f"ratio DQN.train_step / bare = {med['capes'] / med['bare']:.3f}   "
          f"ratio Engine.train / bare at {eobs} = {med['engine'] / med['bare_e']:.3f}")
    paper = 100.0 if device.type == "cpu" else 10.0
    print(f"paper (Table 5.3, {device.type}): {paper:.0f} ms -> {paper / med['capes']:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
