"""A stored replay DB's transitions held on the torch device, minibatches drawn there:
the flat learner's sampling for offline training (``capes train``'s fast path).

Why: offline, the data does not change, so every valid transition of the DB (Algorithm
2's test: an action, its rewards, few missing entries in s_t and s_{t+n}) is known once
at the start. Each tick's PIs (z-scored, missing as 0, flattened) and parameter values
go to the device once; a minibatch is then ``randint`` over the valid transitions and
two gathers of ``stack`` rows, static shapes and device ops only, so on a GPU the draw
and the training step are one CUDA-graph replay (:meth:`CUDAGraphStep.sampled
<drl_engine.qnet.CUDAGraphStep.sampled>`), with no numpy sampling, rejection rounds or
host → device copy per step (:meth:`Experience.sample
<drl_engine.experience.Experience.sample>`, the live path, does those).

The same transitions as the host path: uniform over the valid ones (what the host's
rejection draws converge to), and given the same ticks the batch is the host path's
(tests/test_train_fast_path.py). Differences: torch's random numbers (another stream
than the engine's numpy generator), a batch always has its full size, and it holds
the statistics of the DB it was built from (offline: they do not change). Memory: the
DB's ticks × (nodes × PIs + parameters) floats on the device, once.
"""
from __future__ import annotations

import numpy as np
import torch

from capes.common import actions
from drl_engine.experience import Batch, Experience, n_step_returns


class DeviceTransitions:
    """Every valid transition of ``experience`` (built once), sampled on ``device``."""

    def __init__(self, experience: Experience, device, seed: int = 0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # CUDA: the default generator (a graph capture registers it, so each replay
        # draws fresh numbers); CPU: one of the engine's seed
        self.gen = None if self.cuda else torch.Generator().manual_seed(int(seed))
        e = experience
        self.stack, self.n_step = e.stack, e.n_step
        feats, vals, t_idx, act, rew = [], [], [], [], []
        base = 0
        n_params = len(e.layout.param_names)
        for sid, d in e.derived.items():
            data = e.reader.sessions[sid]
            L = d.n
            if L == 0:
                continue
            x = data.pis[:L]
            if e.normalise:
                x = e.normaliser(x)
            # as Experience.observations: z-scores, then missing as 0, then float32
            feats.append(np.nan_to_num(x.reshape(L, -1), nan=0.0).astype(np.float32))
            v = (d.values[:L] - e._param_lo) / e._param_span
            vals.append(np.nan_to_num(v, nan=0.0).astype(np.float32))
            lost = e.stack + e.n_step + e.shift - 1
            i = np.arange(max(0, L - lost)) + e.stack - 1
            i = i[e._valid(data, d, i)] if len(i) else i
            t_idx.append(base + i)
            act.append(actions.direction(data.actions[i].astype(np.int64), n_params))
            rew.append(n_step_returns(d.r, i, e.n_step, e.gamma, e.shift).astype(np.float32)
                       * e.reward_scale)
            base += L
        self.count = int(sum(len(t) for t in t_idx))
        to = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt,  # noqa: E731
                                           device=self.device)
        cat = lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape)  # noqa: E731
        self.feats = to(cat(feats, (0, 1)), torch.float32)
        self.vals = to(cat(vals, (0, n_params)), torch.float32)
        self.ticks = to(cat(t_idx, (0,)), torch.int64)
        self.actions = to(cat(act, (0,)), torch.int64)
        self.rewards = to(cat(rew, (0,)), torch.float32)
        self.gamma_n = float(np.float32(e.gamma ** e.n_step))
        self._window = torch.arange(-self.stack + 1, 1, device=self.device)

    @property
    def ready(self) -> bool:
        """Whether there is a transition to draw."""
        return self.count > 0

    def observations(self, idx: torch.Tensor) -> torch.Tensor:
        """Stacked observations at global tick indices ``idx`` (device ops only)."""
        x = self.feats[idx[:, None] + self._window].reshape(len(idx), -1)
        return torch.cat([x, self.vals[idx]], dim=1)

    def at(self, k: torch.Tensor) -> Batch:
        """The batch of transitions ``k`` (indices into the valid ones), as tensors."""
        idx = self.ticks[k]
        n = len(k)
        return Batch(obs=self.observations(idx), actions=self.actions[k],
                     rewards=self.rewards[k], next_obs=self.observations(idx + self.n_step),
                     discounts=torch.full((n,), self.gamma_n, device=self.device))

    def batch(self, n: int) -> Batch:
        """A uniform minibatch of ``n`` valid transitions, drawn and gathered on the
        device (capturable: no host read)."""
        k = torch.randint(self.count, (n,), generator=self.gen, device=self.device)
        return self.at(k)


def use_device_sampling(choice: str, device) -> bool:
    """Whether offline training draws its minibatches on the device: ``auto`` where the
    networks are on a CUDA device (there the draw joins the step's CUDA graph; on the
    CPU the host path is the measured default), ``device`` or ``host`` as asked."""
    if choice not in ("auto", "device", "host"):
        raise ValueError(f"--sampling: auto, device or host (got {choice!r})")
    if choice == "auto":
        return torch.device(device).type == "cuda"
    return choice == "device"


__all__ = ["DeviceTransitions", "use_device_sampling"]
