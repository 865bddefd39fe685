"""The per-node minibatch drawn on the torch device (``cluster_engine.device_sampling``).

Why: on a GPU the training step is one CUDA-graph replay (~0.5 ms), and sampling its
minibatch with numpy on the host (:meth:`RowData.sample <drl_engine.node_replay.RowData.
sample>`) took 0.5–1.3 ms more, plus a host → device copy (docs/journal.md, "On a GPU").
Here the ring (:class:`~drl_engine.node_replay.NodeReplay`'s arrays) is mirrored as
tensors on the engine's device, the rows that changed since the last step copied over
in one staged copy, and the minibatch is drawn and gathered by torch ops of static shapes
(B ticks × M nodes), so the draw, the gather, the z-scores and the training step are
captured in one CUDA graph (:meth:`CUDAGraphStep.sampled
<drl_engine.qnet.CUDAGraphStep.sampled>`).

The same transitions as the numpy path: ticks t in lo..hi (:meth:`RowData.sample_span`)
whose n rewards r_{t+d} … r_{t+d+n−1} are all known, t drawn with the numpy path's law
(its mixture of the whole span and the ``recent_ticks``, restricted to the valid ticks:
what its rejection draws converge to), by the inverse of the weights' cumulative sum
(no rejection loop, no ``nonzero``, no host read); each tick's M nodes a uniform random
subset (the smallest M of N uniforms). Given the same ticks and nodes the batch is the
numpy path's (:meth:`RowData.batch_at`; tests/test_device_replay.py). Differences: the
random numbers are torch's (another stream: the engine's numpy generator is not drawn
from, and a checkpoint does not keep this one), a batch always has B ticks (numpy's
gives up after 20 rounds of draws with a shorter one when few ticks are valid), and with
no valid tick at all the step runs on a batch whose transitions all count zero. Per
step it weighs every tick of the span (the weights and their cumulative sum over a
power of two ≥ the span's ticks, up to the ring's capacity: a graph of each size,
~log₂ of the ring's ticks of them over a ring's life).
"""
from __future__ import annotations

import numpy as np
import torch

from drl_engine.node_replay import NodeBatch

# NodeReplay's arrays the sampler reads, one row per ring slot
_FIELDS = ("lp", "present", "actions", "ahist", "r")
_STAGED_SLOTS = 8          # ring rows per staged copy (more: several copies)
_SCALARS = 6               # lo, span, recent − lo, weight of all, weight of recent, p scale


class DeviceSampler:
    """A :class:`~drl_engine.node_replay.RowData`'s ring mirrored on ``device``, and its
    minibatches drawn there. :meth:`prepare` (host, before each step) copies what
    changed; :meth:`batch` (device ops only: capturable) draws one minibatch."""

    def __init__(self, device, seed: int = 0, staged: bool | None = None,
                 compiled: bool = False):
        self.device = torch.device(device)
        if compiled:         # engine.compile_step: the draw and gather as fused kernels
            from drl_engine.qnet import CompiledOrEager
            self.draw = CompiledOrEager(self.draw, "the sampler's draw")
            self.gather = CompiledOrEager(self.gather, "the sampler's gather")
        self.cuda = self.device.type == "cuda"
        # the new rows through one staged buffer (pinned on CUDA; None: on CUDA only)
        self.staged = self.cuda if staged is None else staged
        # CUDA: the default generator (graph capture registers it; train seeds it with
        # the learner's torch.manual_seed); CPU: a generator of the engine's seed
        self.gen = None if self.cuda else torch.Generator().manual_seed(int(seed))
        self.rep = None              # the NodeReplay mirrored
        self.synced: int | None = None   # its newest tick copied
        self.generation = 0          # a new ring (reset, grow): new tensors, new graphs
        self.ring: dict[str, torch.Tensor] = {}
        self._stats_of = None        # the host mean the device one was copied from
        self.mean = self.std = None
        self._stage = None
        self._copied = torch.cuda.Event() if self.cuda else None

    # -- host side ------------------------------------------------------------------------
    def prepare(self, data, batch: int) -> bool:
        """Copy to the device what changed in ``data``'s ring since the last call, with
        this step's span and scale; False when :meth:`RowData.sample` would not sample."""
        span = data.sample_span()
        if span is None:
            return False
        rep = data.replay
        if rep is not self.rep or self.ring["lp"].shape[1] != rep.n:
            self._mirror(data)
        lo, hi, recent = span
        f = data.mcfg.recent_fraction
        total, newer = hi - lo + 1, hi - recent + 1
        scalars = np.array([lo, total, recent - lo, (1.0 - f) / total,
                            f / newer if f > 0 else 0.0, data.p_scale], np.float64)
        if data.mean is not self._stats_of:
            self.mean.copy_(torch.from_numpy(data.mean))
            self.std.copy_(torch.from_numpy(data.std))
            self._stats_of = data.mean
        # tick u's ingest writes slot u, the slot of u − 1 (its action, reward) and
        # clears the slots of a gap between them: the ticks from the last one synced on
        # the draw's static span: a power of two ≥ the span, at most the ring (a new
        # graph each time it doubles, not one op over the whole ring every step)
        self.window = min(rep.capacity, max(64, 1 << (total - 1).bit_length()))
        ticks = np.arange(max(self.synced, rep.last - rep.capacity + 1), rep.last + 1)
        for i in range(0, len(ticks), _STAGED_SLOTS):
            self._copy_rows(rep, rep.slot(ticks[i:i + _STAGED_SLOTS]), scalars)
        self.synced = rep.last
        return True

    def _mirror(self, data) -> None:
        """A new ring (the first, or after a reset or a node joining): every array
        copied whole to freshly allocated tensors (a graph captured on the old ones is
        dropped by its key, :meth:`key`)."""
        rep = self.rep = data.replay
        dev = self.device
        self.ring = {name: torch.from_numpy(getattr(rep, name)).to(dev, copy=True)
                     for name in _FIELDS}
        self.scalars = torch.zeros(_SCALARS, dtype=torch.float64, device=dev)
        P = rep.p
        self.mean = torch.zeros(P, dtype=torch.float32, device=dev)
        self.std = torch.ones(P, dtype=torch.float32, device=dev)
        self._stats_of = None
        self.synced = rep.last
        self.generation += 1
        self._stage = _Stage(rep, self.device, self.cuda) if self.staged else None
        C, n, d = rep.capacity, data.n_step, data.shift
        S, A = data.stack, rep.n_actions
        self.shape = dict(C=C, N=rep.n, P=P, S=S, n=n, d=d, A=A, M=data.batch_nodes(),
                          mean_field=data.mcfg.mean_field, gamma=data.gamma)
        self.offsets = torch.arange(C + d + n, device=dev)              # j: tick lo + j
        self.window = 0
        self.back = torch.arange(S - 1, -n - 1, -1, device=dev)         # the window rows
        self.ahead = d + torch.arange(n, device=dev)                    # the rewards
        self.powers = torch.as_tensor(data.gamma ** np.arange(n), device=dev)
        self.action_ids = torch.arange(A, device=dev)
        self.node_ids = torch.arange(rep.n, device=dev)

    def _copy_rows(self, rep, slots: np.ndarray, scalars: np.ndarray) -> None:
        """Ring rows ``slots`` and the step's scalars to the device: on CUDA one staged
        copy from a pinned buffer, then one ``index_copy_`` a field."""
        k = len(slots)
        if not self.staged:
            idx = torch.from_numpy(slots)
            for name in _FIELDS:
                self.ring[name].index_copy_(0, idx, torch.from_numpy(getattr(rep, name)[slots]))
            self.scalars.copy_(torch.from_numpy(scalars))
            return
        st = self._stage
        if self._copied is not None:
            self._copied.synchronize()           # never overwrite a copy in flight
        st.host["slots"][:k] = slots
        for name in _FIELDS:
            np.take(getattr(rep, name), slots, axis=0, out=st.host[name][:k])
        st.host["scalars"][:] = scalars
        st.dev.copy_(st.buf, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        idx = st.views["slots"][:k]
        for name in _FIELDS:
            self.ring[name].index_copy_(0, idx, st.views[name][:k])
        self.scalars.copy_(st.views["scalars"])

    def key(self, batch: int) -> tuple:
        """The graph key of a step of ``batch`` ticks on this ring's tensors and span
        (its last item: a newer one makes the graphs of the older ones stale)."""
        return ("device_sampling", batch, (self.generation, self.window))

    # -- device side: torch ops of static shapes, no host read ----------------------------
    def draw(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t (B,), nodes (B, M), any): ticks drawn with the numpy path's law among the
        valid ones, each tick's M nodes a uniform subset; ``any`` (0-d bool) false when
        no tick was valid (then t is lo and every transition counts zero)."""
        sh, sc, W = self.shape, self.scalars, self.window
        C, d, n = sh["C"], sh["d"], sh["n"]
        lo = sc[0].long()
        # offset j: tick lo + j, whose rewards are those of ticks lo + j + d … + n − 1
        known = torch.isfinite(self.ring["r"][(lo + self.offsets[:W + d + n]) % C])
        ok = known.unfold(0, n, 1)[d:d + W].all(dim=-1)                 # (W,)
        j = self.offsets[:W]
        w = ok & (j < sc[1])
        w = w * (sc[3] + sc[4] * (j >= sc[2]))                          # float64 (W,)
        cum = w.cumsum(0)
        total = cum[-1:]
        N, M = sh["N"], sh["M"]
        # one draw for the ticks and the node subsets (a compiled draw cannot reorder it)
        r = torch.rand(batch, 1 if M == N else 1 + N, dtype=torch.float64,
                       device=self.device, generator=self.gen)
        u = r[:, 0] * total
        pick = torch.minimum(torch.searchsorted(cum, u, right=True),
                             torch.searchsorted(cum, total))   # the last valid offset
        t = lo + pick
        if M == N:
            nodes = self.node_ids.expand(batch, N)
        else:
            nodes = r[:, 1:].topk(M, dim=1, largest=False, sorted=False).indices
        return t, nodes, total[0] > 0

    def gather(self, t: torch.Tensor, nodes: torch.Tensor, any_valid=None) -> NodeBatch:
        """The minibatch of ticks ``t`` (B,) and ``nodes`` (B, M), tensors:
        :meth:`RowData.batch_at`'s numbers."""
        sh, ring = self.shape, self.ring
        C, N, P, S, n = sh["C"], sh["N"], sh["P"], sh["S"], sh["n"]
        B, M = nodes.shape
        rows = (t[:, None] - self.back[None]) % C                       # (B, S + n)
        flat = (rows[:, :, None] * N + nodes[:, None, :]).reshape(-1)
        x = ring["lp"].view(-1, P).index_select(0, flat).view(B, S + n, M, P)
        z = torch.nan_to_num((x - self.mean) / self.std, nan=0.0)
        obs, next_obs = (z[:, lo:lo + S].permute(0, 2, 1, 3).reshape(B, M, S * P)
                         for lo in (0, n))
        s0, s1 = t % C, (t + n) % C
        mask = ring["present"][s0[:, None], nodes]
        next_mask = ring["present"][s1[:, None], nodes]
        acts = ring["actions"][s0[:, None], nodes].long()
        valid = mask & next_mask & (acts >= 0)
        if any_valid is not None:
            valid = valid & any_valid
        rs = ring["r"][(t[:, None] + self.ahead[None]) % C]              # (B, n) float64
        returns = ((rs @ self.powers) / self.scalars[5]).float()
        discounts = torch.full((B,), sh["gamma"] ** n, dtype=torch.float32,
                               device=self.device)
        abar = next_abar = None
        if sh["mean_field"]:
            abar = self._mean_field(s0, acts)
            next_abar = self._mean_field(s1, ring["actions"][s1[:, None], nodes].long())
        return NodeBatch(obs=obs, mask=mask, actions=acts.clamp_min(0), returns=returns,
                         discounts=discounts, next_obs=next_obs, next_mask=next_mask,
                         valid=valid, abar=abar, next_abar=next_abar)

    def _mean_field(self, s: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """NodeReplay.mean_field at slots ``s`` (B,) for the nodes whose own actions
        there are ``own`` (B, M) (−1: none): the others' action shares, each node's own
        action taken out of the tick's counts."""
        hist = self.ring["ahist"][s][:, None, :]                          # (B, 1, A)
        others = hist - (own[..., None] == self.action_ids).to(hist.dtype)
        return others / others.sum(dim=-1, keepdim=True).clamp_min(1.0)

    def batch(self, batch: int) -> NodeBatch:
        """One minibatch drawn and gathered on the device (what a CUDA graph captures).
        On the CPU a mask of every node is passed as None, as the numpy path does (the
        learner's gradient by hand then applies); on CUDA it stays a tensor (no host
        read inside a graph)."""
        t, nodes, any_valid = self.draw(batch)
        out = self.gather(t, nodes, any_valid)
        return out if self.cuda else out.without_full_masks()

    def learn(self, learner, data, batch: int):
        """One training step of ``learner`` on a minibatch of ``batch`` ticks drawn here
        (None, and no step, when ``data`` would not sample yet)."""
        if not self.prepare(data, batch):
            return None
        return learner.learn_sampled(lambda: self.batch(batch), self.key(batch))


class _Stage:
    """A pinned host buffer and its device twin for :data:`_STAGED_SLOTS` ring rows and
    the step's scalars, one 64-byte-aligned view a field."""

    def __init__(self, rep, device, pinned: bool = True):
        K = _STAGED_SLOTS
        spec = [("slots", np.int64, (K,)), ("scalars", np.float64, (_SCALARS,))] + \
            [(name, getattr(rep, name).dtype, (K,) + getattr(rep, name).shape[1:])
             for name in _FIELDS]
        offsets, total = [], 0
        for _, dtype, shape in spec:
            offsets.append(total)
            total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 64) * 64
        self.buf = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        self.dev = torch.empty_like(self.buf, device=device)
        raw = self.buf.numpy()
        self.host, self.views = {}, {}
        for (name, dtype, shape), off in zip(spec, offsets):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.host[name] = raw[off:off + size].view(dtype).reshape(shape)
            tdtype = torch.from_numpy(np.empty(0, dtype)).dtype
            self.views[name] = self.dev[off:off + size].view(tdtype).view(shape)


__all__ = ["DeviceSampler"]
