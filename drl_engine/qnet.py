"""The torch machinery every Q-learner here shares (:mod:`drl_engine.dqn` is the flat
algorithm, :mod:`drl_engine.node_model` the per-node one): the flat Q-network, the
learner base (networks, optimiser step with clipping, soft target update, typed batches
to tensors), the CUDA-graph replay and compiled parts of a step, and an RMSprop that
does not import ``torch._dynamo``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import torch
from torch import nn


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden_layers: int = 2,
                 hidden_width: int = 0, numpy_tanh: bool = False):
        super().__init__()
        self.numpy_tanh = numpy_tanh
        width = hidden_width or obs_dim
        layers, d = [], obs_dim
        for _ in range(hidden_layers):
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        layers.append(nn.Linear(d, n_actions))
        self.net = nn.Sequential(*layers)
        self.affine = [m for m in layers if isinstance(m, nn.Linear)]   # tanh between

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.forward_inputs(obs)[0]

    def forward_inputs(self, obs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The Q-values and each linear layer's input (a backward by hand needs them).
        A batch (2-D) runs ``torch.addmm`` and ``torch.tanh`` directly, the kernels that
        ``nn.Linear`` (``F.linear`` of a matrix is ``addmm(bias, x, weight.t())``) and
        ``nn.Tanh`` run, without their modules' Python calls, which cost more than these
        small layers' arithmetic; any other shape runs each layer's own forward.
        ``numpy_tanh`` (``engine.numpy_tanh``): where no gradient is recorded, on a CPU
        float32 batch, numpy's tanh in place of torch's (~5x faster here, within one ulp)."""
        if obs.dim() != 2:
            x = obs
            for layer in self.net:
                x = layer.forward(x)
            return x, []
        inputs, x, last = [], obs, len(self.affine) - 1
        numpy_tanh = self.numpy_tanh and obs.device.type == "cpu" and \
            obs.dtype == torch.float32
        for i, m in enumerate(self.affine):
            inputs.append(x)
            x = torch.addmm(m.bias, x, m.weight.t())
            if i < last:
                if numpy_tanh and not x.requires_grad:
                    a = x.numpy()          # the fresh layer output, overwritten
                    np.tanh(a, out=a)
                else:
                    x = torch.tanh(x)
        return x, inputs


class TargetNetworkLearner:
    """What every Q-learner here shares: its networks and optimiser, built by
    :meth:`_build_networks`, and after computing its loss one optimiser step on the
    online network θ (gradient norm clipped to ``cfg.grad_clip`` when set), then the soft
    target update. Needs ``cfg`` and ``device``."""

    fields: tuple[str, ...] = ()      # the typed batch's arrays a training step reads

    def _build_networks(self, make_net, seed: int) -> None:
        """The online network ``make_net()`` (on ``device``), its target copy and its
        RMSprop. ``torch.manual_seed(seed)`` runs first, so a seed gives the same weights
        in every learner and in every build of one (the flat engine builds late)."""
        torch.manual_seed(seed)
        self.q = make_net().to(self.device)
        self.target = copy.deepcopy(self.q)
        self.target.requires_grad_(False)
        self.optimizer = RMSprop(self.q.parameters(), lr=self.cfg.learning_rate,
                                 alpha=self.cfg.rmsprop_decay)
        self._q_params = list(self.q.parameters())
        self._t_params = list(self.target.parameters())
        self._graphs = CUDAGraphStep(self) if self.device.type == "cuda" and \
            self.cfg.cuda_graph else None
        self._pending_loss = None          # mean_loss on CUDA: (host copy, its event)
        self.loss_late = True              # ... read a call late (offline: False)

    @property
    def graphed(self) -> bool:
        """The step is replayed as a CUDA graph (a CUDA device and ``cfg.cuda_graph``)."""
        return self._graphs is not None

    def run_plain(self) -> None:
        """From here on the step runs as it is written, never as a CUDA graph (offline
        training's plain path; the config, and so a checkpoint's, is left as it is)."""
        self._graphs = None

    def learn(self, batch) -> torch.Tensor:
        """One minibatch, the replay's typed batch (numpy; :attr:`fields` are what the
        step reads): on a CUDA device replayed as a CUDA graph (``cfg.cuda_graph``), else
        converted and run as it is written. Returns the loss."""
        batch = self.step_batch(batch)
        if self._graphs is not None:
            return self._graphs(batch)
        return self.train_step(self.to_tensors(batch))

    def step_batch(self, batch):
        """``batch`` as the step takes it (a mode may drop what it need not compute)."""
        return batch

    def learn_sampled(self, sample, key) -> torch.Tensor:
        """One minibatch drawn on the device by ``sample()`` (a typed batch of tensors;
        drl_engine/device_replay.py): on a CUDA device the draw and the step replayed as
        one CUDA graph per ``key`` (``cfg.cuda_graph``), else run as written."""
        if self._graphs is not None:
            return self._graphs.sampled(key, lambda: self.train_step(sample()))
        return self.train_step(sample())

    def to_tensors(self, batch):
        """``batch`` with its :attr:`fields` as tensors on the device (None stays None)."""
        return self.with_fields(batch, [
            None if a is None else torch.as_tensor(np.ascontiguousarray(a), device=self.device)
            for a in (getattr(batch, f) for f in self.fields)])

    def with_fields(self, batch, values):
        """``batch`` with :attr:`fields` set to ``values``, in their order."""
        return dataclasses.replace(batch, **dict(zip(self.fields, values)))

    def _networks_state(self) -> dict:
        """The networks' and optimiser's part of a checkpoint (both learners' layout)."""
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def _load_networks(self, state: dict, shape: tuple[str, str], have: tuple[int, int],
                       what: str, optimizer: bool = True) -> None:
        """Load :meth:`_networks_state`'s part after checking that the checkpoint's
        ``shape`` entries (inputs, actions) are this learner's ``have``."""
        saved = (state[shape[0]], state[shape[1]])
        if saved != have:
            raise ValueError(f"checkpoint is for {saved[0]} {what} and {saved[1]} "
                             f"actions, this engine has {have[0]} and {have[1]}")
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])

    def descend(self, loss: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():          # one context for the three updates, not one each
            self._update()
        return loss.detach()

    def _update(self) -> None:
        """From the online network's gradients: clip, the optimiser step, the soft
        target update (the caller holds ``no_grad``)."""
        self._update_tensors()
        self.optimizer.steps += 1      # after a backward every parameter has a gradient

    def _update_tensors(self) -> None:
        """:meth:`_update`'s tensor work, without the step count (compiled with
        ``compile_step``: a Python int it changed would be compiled in as a constant)."""
        if self.cfg.grad_clip:
            _clip_grad_norm(self._q_params, self.cfg.grad_clip)
        self.optimizer.apply()
        self._soft_update()

    def _update_with(self, grads: list[torch.Tensor]) -> None:
        """:meth:`_update` given every parameter's gradient in order (the same ops,
        without looking for the parameters that have one)."""
        if self.cfg.grad_clip:
            _clip_grads(grads, self.cfg.grad_clip)
        self.optimizer.update_with(grads)
        self._soft_update()

    def _soft_update(self) -> None:
        torch._foreach_lerp_(self._t_params, self._q_params, self.cfg.target_update_rate)

    @torch.no_grad()
    def soft_update(self) -> None:
        """θ⁻ ← (1 − α) · θ⁻ + α · θ."""
        self._soft_update()

    def mean_loss(self, losses) -> float | None:
        """The mean of a tick's training losses, as a float (both modes' learners); one
        loss (a step a tick) is its own mean, exactly, without a stack and a mean. On a
        CUDA device, the previous call's mean (None at the first): reading this call's
        would wait for the GPU to finish the step; read a call late, the step runs while
        the CPU goes on with the tick. ``loss_late`` False (offline training, whose every
        chunk's loss is a point of its curve and whose first must not read as none):
        this call's, waited for."""
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if self.device.type != "cuda" or not self.loss_late:
            return float(loss)
        # copied out now, in stream order before the next step; read at the next call
        # (``float`` of a device tensor would queue behind that step and wait for it)
        done = torch.cuda.Event()
        host = loss.to("cpu", non_blocking=True)
        done.record()
        previous, self._pending_loss = self._pending_loss, (host, done)
        if previous is None:
            return None
        previous[1].synchronize()
        return float(previous[0])


class CUDAGraphStep:
    """A learner's ``train_step`` replayed as CUDA graphs, one per input shape.

    Why: the networks are small, so on a GPU a step is ~150 kernels of a few microseconds
    each and the time goes to launching them from Python; captured once, one graph launch
    replays them all. A replay runs the captured kernels on the same buffers (inputs,
    weights, gradients, optimiser state), so it computes what the eager step computes.
    The inputs, numpy arrays, are packed into one pinned host buffer and reach the device
    in one copy. The first ``warmup`` calls of a shape run eagerly on a side stream
    (PyTorch's recipe: lazy initialisation must not happen inside a capture); every call,
    warm-up, capture or replay, is exactly one update. Beyond ``max_shapes`` shapes a
    call runs eagerly."""

    def __init__(self, learner: "TargetNetworkLearner", warmup: int = 2, max_shapes: int = 4):
        self.learner, self.warmup, self.max_shapes = learner, warmup, max_shapes
        self.shapes: dict[tuple, _GraphedShape] = {}
        self.replays = 0

    def __call__(self, batch) -> torch.Tensor:
        learner = self.learner
        arrays = [getattr(batch, f) for f in learner.fields]
        key = tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays)
        g = self.shapes.get(key)
        if g is None:
            if len(self.shapes) >= self.max_shapes:
                return learner.train_step(learner.to_tensors(batch))
            g = self.shapes[key] = _GraphedShape(arrays, learner.device)
        g.load(arrays)
        return self._run(g, lambda: learner.train_step(learner.with_fields(batch, g.inputs)))

    def sampled(self, key, step) -> torch.Tensor:
        """``step()``, a training step that draws its own minibatch on the device
        (``cluster_engine.device_sampling``), replayed as one graph per ``key``: the
        draw's random numbers come from the default CUDA generator, which a capture
        registers (each replay draws fresh ones). ``key`` ends with the sampler's
        generation (its ring's tensors, its span's size): a newer one drops the graphs
        of the older ones, which read stale tensors or too short a span."""
        g = self.shapes.get(key)
        if g is None:
            for old in [k for k in self.shapes if k[0] == key[0] and k[-1] != key[-1]]:
                del self.shapes[old]
            if len(self.shapes) >= self.max_shapes:
                return step()
            g = self.shapes[key] = _Captured()
        return self._run(g, step)

    def _run(self, g: "_Captured", step) -> torch.Tensor:
        """One update by ``step()``: warm-up calls eagerly on a side stream, then the
        capture (which records, it does not run) and a replay."""
        if g.calls < self.warmup:              # eager, on a side stream
            g.calls += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = step()
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if g.graph is None:                    # capture records, it does not run
            opt = self.learner.optimizer
            steps = opt.steps
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, capture_error_mode="thread_local"):
                g.loss = step()
            opt.steps = steps
        g.graph.replay()
        self.learner.optimizer.steps += 1
        self.replays += 1
        return g.loss.clone()                  # the next replay overwrites g.loss


class CompiledOrEager:
    """``fn`` through ``torch.compile`` (``engine.compile_step``), falling back to ``fn``
    itself, with a warning, if compiling fails.

    Why: a captured step replays every kernel it launched, 292 small ones on an H100
    (docs/journal.md, "On a GPU"); Inductor fuses the elementwise ones (103 left), so the
    replay is shorter. Static shapes (a new shape compiles anew, as it is captured anew);
    random ops through aten's (``fallback_random``), whose generator a CUDA-graph capture
    registers, so that each replay draws new numbers. The first call of a shape
    compiles (seconds): CUDAGraphStep's eager warm-up calls do, never a capture.

    Every new shape recompiles (the device sampler's span doubles as the ring fills), and
    past dynamo's recompile limit (8) a function would run eagerly without a word: the
    limit is raised to 64 for the process, and a function past it fails here, visibly."""

    def __init__(self, fn, what: str, backend="inductor"):
        from torch._dynamo import config as dynamo, exc
        # the names changed across torch 2.x (older: cache_size_limit, fail_on_cache_...)
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit, max(getattr(dynamo, limit), 64))
        for flag in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
            if hasattr(dynamo, flag):
                setattr(dynamo, flag, True)
                break
        self._errors = tuple(getattr(exc, name) for name in (
            "TorchDynamoException", "FailOnRecompileLimitHit", "FailOnCacheLimitHit")
            if hasattr(exc, name))
        self.fn, self.what, self.failed = fn, what, None
        options = {"fallback_random": True} if backend == "inductor" else None
        self.compiled = torch.compile(fn, dynamic=False, backend=backend, options=options)

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except self._errors as e:            # compiling failed: nothing ran yet
                self._give_up(e)
        return self.fn(*args, **kwargs)

    def guarded(self, step):
        """``step()``, which calls this part and a backward through its output: the
        backward compiles lazily, at its first call, so its failure shows there. Then
        this part stays eager and ``step()`` runs again (nothing was applied: the
        gradients come before any update). An error eager code raises too propagates."""
        try:
            return step()
        except Exception as e:                 # the backward's compile, or a real error
            if self.failed is not None:
                raise                          # eager already: the error is real
            self._give_up(e)
            return step()

    def _give_up(self, e: Exception) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise e                            # a capture cannot run the eager ops now
        self.failed = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        warnings.warn(f"engine.compile_step: {self.what} stays eager ({self.failed})",
                      RuntimeWarning, stacklevel=3)


class _Captured:
    """One graph of :class:`CUDAGraphStep`: its calls so far, the graph once captured,
    and the loss tensor a replay writes."""

    def __init__(self):
        self.calls, self.graph, self.loss = 0, None, None


class _GraphedShape(_Captured):
    """One input shape's static buffers (a pinned host buffer and its device twin, one
    view per input, 64-byte aligned) and its graph."""

    def __init__(self, arrays, device: torch.device):
        super().__init__()
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += 0 if a is None else -(-a.nbytes // 64) * 64
        self.host = torch.empty(max(total, 64), dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty_like(self.host, device=device)
        raw = self.host.numpy()
        self.host_views, self.inputs = [], []
        for a, off in zip(arrays, offsets):
            if a is None:
                self.host_views.append(None), self.inputs.append(None)
                continue
            dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype
            self.host_views.append(raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape))
            self.inputs.append(self.dev[off:off + a.nbytes].view(dtype).view(a.shape))
        self.copied = torch.cuda.Event()       # the last copy out of ``host`` is done

    def load(self, arrays) -> None:
        self.copied.synchronize()              # never overwrite a copy still in flight
        for view, a in zip(self.host_views, arrays):
            if view is not None:
                np.copyto(view, a)
        self.dev.copy_(self.host, non_blocking=True)
        self.copied.record()


def linear_grads(lin: nn.Linear, x: torch.Tensor, g: torch.Tensor, need_input: bool):
    """AddmmBackward0 of ``addmm(lin.bias, x, lin.weight.t())`` (``F.linear`` on the rows
    ``x``) for the output gradient ``g``: (the input's gradient, or None; the weight's;
    the bias's), the kernels autograd calls, so the same bits (the steps by hand: here
    and drl_engine/node_backward.py)."""
    return (g.mm(lin.weight) if need_input else None), g.t().mm(x), g.sum(0)


def _clip_grad_norm(params, max_norm: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        _clip_grads(grads, max_norm)


def _clip_grads(grads: list[torch.Tensor], max_norm: float) -> None:
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> None:
    """``nn.utils.clip_grad_norm_`` (2-norm over every gradient, scaled down to
    ``max_norm``), the same arithmetic without its per-call Python overhead (~5 % of a
    converge run's wall time)."""
    _clip_grad_norm(params, max_norm)


class RMSprop:
    """``torch.optim.RMSprop``'s default update (no momentum, not centred, no weight
    decay): v ← α·v + (1 − α)·g², θ ← θ − lr·g / (√v + ε), the same arithmetic.
    Why not torch.optim: an optimiser's first construction imports ``torch._dynamo``
    (``Optimizer.add_param_group`` is wrapped to disable it), ~2.4 s of every process
    start, as long as a short converge run. The state dict reads torch's own too."""

    def __init__(self, params, lr: float, alpha: float = 0.99, eps: float = 1e-8):
        self.params = list(params)
        self.lr, self.alpha, self.eps = lr, alpha, eps
        self.square_avg = [torch.zeros_like(p, memory_format=torch.preserve_format)
                           for p in self.params]
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.update()

    def update(self) -> None:
        """:meth:`step` without its own ``no_grad`` (the caller holds one)."""
        if self.apply():
            self.steps += 1

    def apply(self) -> bool:
        """:meth:`update`'s arithmetic on the parameters that have a gradient, without
        counting the step; whether any had one."""
        have = [(p, v) for p, v in zip(self.params, self.square_avg) if p.grad is not None]
        if not have:
            return False
        params, avgs = [p for p, _ in have], [v for _, v in have]
        self._step(params, avgs, [p.grad for p in params])
        return True

    def update_with(self, grads: list[torch.Tensor]) -> None:
        """:meth:`update` with every parameter's gradient given, in order."""
        self._step(self.params, self.square_avg, grads)
        self.steps += 1

    def _step(self, params, avgs, grads) -> None:
        torch._foreach_mul_(avgs, self.alpha)
        torch._foreach_addcmul_(avgs, grads, grads, value=1.0 - self.alpha)
        denom = torch._foreach_sqrt(avgs)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, grads, denom, value=-self.lr)

    def state_dict(self) -> dict:
        """In torch.optim's layout, so checkpoints stay readable both ways."""
        return {"state": {i: {"step": torch.tensor(float(self.steps)), "square_avg": v}
                          for i, v in enumerate(self.square_avg)},
                "param_groups": [{"lr": self.lr, "alpha": self.alpha, "eps": self.eps,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("state", {})
        if len(state["param_groups"][0]["params"]) != len(self.params):
            raise ValueError("the optimiser state is for another network")
        for i, v in enumerate(self.square_avg):
            s = saved.get(i)
            if s is not None:
                v.copy_(s["square_avg"])
                self.steps = int(s["step"])
