"""The cluster engine's settings (``[cluster_engine]`` in a config file), torch-free.

:class:`NodeModelConfig` is the shape of the per-node model
(:mod:`drl_engine.node_model`) and what the engine's per-node mode (:mod:`drl_engine.row_controller`)
does around it: exploration, the trust region, change detection and rollback. It lives
here, not beside the network, so that validating a config file (``capes.settings``)
never imports torch. Every field is optional in the file; a bad key or value is one
``ConfigError`` line naming ``cluster_engine.<key>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal


@dataclass
class NodeModelConfig:
    """Shape of the per-node model and what the cluster engine does around it."""
    embed: int = 64                   # width of a node's embedding e_i
    hidden: int = 64                  # width of the hidden layers of φ and ψ
    encoder_layers: int = 2           # layers of φ (the last one outputs e_i)
    head_layers: int = 2              # layers of ψ (the last one outputs the Q-values)
    pool: Literal["mean_std", "mean_max"] = "mean_std"
    dueling: bool = True
    mean_field: bool = True           # the head also reads the others' action distribution
    # the head's first layer applied to the cluster summary c once per tick and broadcast
    # to its nodes (c is the same for every node of a tick: 128 of the head's 197 inputs);
    # False: c copied to every node's input row first (the same sums up to float rounding)
    summary_once: bool = True
    # tanh by numpy on the CPU (7x faster than torch's on the benchmark machine; within
    # one float32 ulp of it); False: torch.tanh
    numpy_tanh: bool = True
    loss_nodes: int = 16              # nodes per sampled tick in a minibatch (0: all)
    # how those nodes are drawn (each tick a uniform random subset either way):
    # "partition": argpartition of N uniforms per tick (B × N draws, ~0.3 ms a minibatch
    # at 1,000 nodes); "redraw": M integers per tick, duplicates drawn again (~0.03 ms)
    node_pick: Literal["partition", "redraw"] = "partition"
    # train on every k-th tick only, each minibatch k times as many ticks (the one-row
    # mode's engine.train_every): one larger pass costs less than k small ones
    train_every: int = 1
    # the minibatch drawn on the engine's torch device from a mirror of the ring, in one
    # CUDA graph with the step (drl_engine/device_replay.py); False: numpy on the host;
    # "auto": on a CUDA device only (numpy is faster on the CPU). Off by default: on an
    # H100 the step with sampling took 0.89 ms against numpy's 1.74, and its hours tied
    # numpy's (64 nodes, seeds 0-7: cuda -0.005 [-0.030, +0.019], CPU -0.000
    # [-0.013, +0.013]; docs/journal.md)
    device_sampling: bool | Literal["auto"] = False
    gamma: float = 0.0                # 0: the engine's [engine] gamma
    # replay ring and input statistics
    replay_mb: int = 256              # memory of the ring of PIs, in MiB
    stats_ticks: int = 200            # ticks of data that fix the input statistics
    std_floor: float = 0.25           # lowest std of a log1p feature (z-scores)
    learn_start: int = 64             # ticks of transitions before training starts
    recent_fraction: float = 0.5      # share of a minibatch's ticks drawn from ...
    recent_ticks: int = 300           # ... the newest ticks (the rest: the whole ring)
    act_margin: float = 0.1           # greedy moves only when Q beats NULL's by this ...
    # ... on up to margin_nodes nodes, and by act_margin · margin_nodes / N on N > that
    # (0: never scaled): the reward is the cluster's, so one node's own move, and its Q
    # advantage, shrinks like 1/N; at 1,000 nodes an unscaled 0.1 held every greedy node
    # at NULL (phase 0 at 80 % of the best static for 1,200 s; 0.02 or 0: recovered in
    # 270-290 s)
    margin_nodes: int = 64
    idle_hold: bool = True            # a node that moved no data keeps its knobs
    best_window: int = 10             # ticks of the objective's moving average (best-known)
    best_decay: float = 0.0001        # the best level's decay per tick
    best_margin: float = 0.0          # a new best must beat the old by this share
    epsilon_start: float = 0.0        # 0: the engine's epsilon_start
    # cold start (drl_engine/cold_start.py): "shared" moves every node together, the
    # guide's GP probes searching one shared setting for cold_start_ticks ticks, then
    # hands its best over to the per-node engine; "per_node": per node from the start
    cold_start: Literal["shared", "per_node"] = "shared"
    cold_start_ticks: int = 150         # ticks of the shared search (0: none)
    # exploration: probes (local, temporally extended) or one random action
    explore: Literal["probe", "random"] = "probe"
    probe_steps: float = 4.0          # spread of a probe's target, in steps of the knob
    probe_dwell: int = 4              # ticks a probe holds its target
    # then walks back to where it started (True), or to the row's knob in the best-known
    # setting ("best": a probe that named a new best stays; the origin when none is
    # known), or stays where it is (False)
    probe_return: bool | Literal["best"] = True
    # rows entering new contexts within a few ticks with alike signatures share one sweep
    # of their ladder knobs, its points dealt round them (drl_engine/row_sweep.py): m
    # alike clients sweep in 1/m of the time; False: each row sweeps alone
    sweep_pool: bool = True
    # a sweep skips the points beyond one that scored under this share of the knob's
    # best (0: every point is visited)
    sweep_cut: float = 0.25
    # a sweep point whose row's own objective, once settled, lies below this share of the
    # knob's best so far (none yet: the row's level before its sweep) for 2 ticks in a row,
    # with the median of its ticks there, is measured at once as that median and left: the
    # point that starves a client is held ~settle + 2 ticks, not settle + probe_dwell
    # (0: every point held its full dwell)
    sweep_abort: float = 0.5
    # once a sweep's points are measured, each of its rows measures its first point again:
    # the two measures give the drift of the row's level (a warming page cache makes the
    # later points look better) and each point's median is corrected for it; False: the
    # medians as measured
    sweep_recheck: bool = True
    # ... except a row whose first point scored under this share of the knob's best (as
    # measured): no drift a second measure could show would lift it to the top, and the
    # point starves the row's client once more (0: every row re-checks)
    sweep_recheck_floor: float = 0.25
    # the order a row entering a new context visits its sweep's points in: from the side
    # of the setting the row had when its first sweep began, the original ("original"), or
    # from the window it brings from its last context ("current"): a window fitted to
    # another workload is no better a first guess, and can be one that starves this one
    sweep_from: Literal["original", "current"] = "original"
    # a row entering a new context alike a cohort it is too late to join (one still
    # sweeping, or one that finished within a sweep's length) sweeps nothing: it takes
    # the cohort's point, waiting at its best so far; False: it sweeps alone
    sweep_adopt: bool = True
    # a row that reached what its sweep found holds it engine.context_hold_ticks (no probe
    # nor greedy move), as a recalled setting is held: both are measured settings
    sweep_hold: bool = True
    # a row off its best-known knobs whose own objective, settled, lies below this share
    # of its level there (the median of its settled ticks on them) for 2 ticks in a row
    # walks back, and no move of that row reaches the value it fell at again until the
    # best is forgotten (drl_engine/row_floor.py); the cluster's rollback needs most of a
    # minute to see one client of four collapse (0: off)
    row_floor: float = 0.5
    # a fall restarts the change detector, as a context switch does: a client collapsing
    # and coming back moves every client's share of the sum, and the alarm that followed
    # forgot the best-known setting and the bounds the fall had just set (False: kept)
    floor_restarts_detector: bool = True
    # greedy moves (the Q-network's) of a ladder knob stay within engine.greedy_guard_steps
    # rungs of the row's best-known setting, as the one-row mode's do; probes, and knobs
    # given as a range, keep engine.guard_steps. After a recall's hold on the real
    # GlusterFS cluster every client's greedy move went the same way each tick, 3 rungs
    # (8x) off the recalled window (False: guard_steps for every move)
    greedy_guard: bool = True
    # workload-change detection (SettingResidualDetector, per-node streams with a vote)
    detect: bool = True
    detect_vote: float = 0.5          # share of the nodes that must vote (at least 2)
    detect_nodes: int = 128           # streams: a fixed random sample of this many (0: all)
    detect_signal: Literal["throughput", "share"] = "share"   # per-node stream
    detect_threshold: float = 10.0    # CUSUM h, robust standard deviations
    detect_drift: float = 0.5         # CUSUM k, robust standard deviations
    # lowest robust scale of a node's relative residual: with 1 % noise the scale is
    # ~1 %, and the few-% shifts of a node's share that its neighbours' moves cause
    # (contention) hit the ±5 σ winsorising as hard as a workload change that halves
    # or doubles it; at 0.2 a shift must exceed ~k · 0.2 = 10 % of the level to count
    detect_scale_floor: float = 0.2
    bump_ticks: int = 200             # ε anneals back from workload_epsilon this long
    # workload contexts per node (engine.use_context with engine.context_pis;
    # drl_engine/row_context.py): a return to known contexts raises ε too, so that the
    # recalled setting is searched around after the hold (measured: no gain; off)
    return_epsilon: bool = False
    # rows entering new contexts searched a class at a time (drl_engine/context_search.py):
    # the rows of one signature move together, committed moves kept on a measured gain of
    # the cluster objective; the first step is context_search_step of the knob's range, a
    # move is measured over context_search_ticks ticks, the search stops after
    # context_search_max_ticks
    context_search: bool = False
    context_search_step: float = 0.1
    context_search_ticks: int = 8
    context_search_max_ticks: int = 400
    # an action's n-step return starts this many ticks after it (n_step_returns' shift);
    # -1: the engine's settle_ticks, when its effect shows up (the per-node default;
    # the one-row mode's is engine.return_shift, 0)
    return_shift: int = -1
    # rollback: when the cluster objective's best_window-tick average stays below
    # rollback_fraction × the best-known level for rollback_ticks ticks, every node's
    # (dynamic) knobs go back to the best-known setting at once (0: never)
    rollback_fraction: float = 0.9
    rollback_ticks: int = 60
    # ... walked back, one knob of a row by at most actions.MAX_STEPS steps a tick (the
    # interface daemon's per-node step rule, which refuses a jump of two knobs of a row:
    # the hold then measured the bad setting and dropped the good best); false: at once
    # (the ablation; drl_engine/rollback.py); the same for the recall of a known
    # workload and the group search's moves (drl_engine/row_context.py)
    rollback_walk: bool = True
    # reading a live session (drl_engine/tick_frontier.py): a tick is taken once every
    # node still sending has a row at it; a node whose rows did not move while the
    # session's newest tick moved node_stall_ticks is not waited for, nor one more than
    # node_lag_ticks behind the median node (a clock running behind: waiting would
    # make every decision that late). A node ahead of the others is always waited out
    node_stall_ticks: int = 5
    node_lag_ticks: int = 10

    # upper bounds: beyond these a value is a typo (a network or a ring this large would
    # exhaust memory at start instead of failing here with the key's name)
    MOST: ClassVar[dict[str, float]] = {
        "embed": 1 << 16, "hidden": 1 << 16, "encoder_layers": 64, "head_layers": 64,
        "loss_nodes": 1 << 24, "margin_nodes": 1 << 24, "replay_mb": 1 << 20,
        "stats_ticks": 10**9, "learn_start": 10**9, "recent_ticks": 10**9,
        "act_margin": 1e6, "best_window": 10**6, "probe_steps": 1e6, "probe_dwell": 10**6,
        "detect_nodes": 1 << 24, "detect_threshold": 1e6, "detect_scale_floor": 1e6,
        "std_floor": 1e6, "bump_ticks": 10**12, "cold_start_ticks": 10**9,
        "rollback_ticks": 10**9, "best_margin": 1e6, "return_shift": 10**6,
        "train_every": 10_000, "context_search_ticks": 10**6,
        "context_search_max_ticks": 10**9, "node_stall_ticks": 10**6,
        "node_lag_ticks": 10**6}

    def validate(self) -> None:
        for name in ("embed", "hidden", "encoder_layers", "head_layers", "replay_mb",
                     "stats_ticks", "probe_dwell", "bump_ticks", "best_window",
                     "rollback_ticks", "recent_ticks", "train_every",
                     "context_search_ticks", "context_search_max_ticks"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        if self.cold_start not in ("shared", "per_node"):
            raise ValueError(f"cold_start: must be 'shared' or 'per_node' "
                             f"(got {self.cold_start!r})")
        for name in ("loss_nodes", "learn_start", "detect_nodes", "act_margin",
                     "cold_start_ticks", "node_stall_ticks", "node_lag_ticks",
                     "best_margin", "margin_nodes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        for name in ("recent_fraction", "epsilon_start", "best_decay", "context_search_step",
                     "sweep_cut", "sweep_recheck_floor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must lie in [0, 1] (got {getattr(self, name)})")
        if not 0 <= self.sweep_abort < 1:
            raise ValueError(f"sweep_abort: must lie in [0, 1) (0: no abort) "
                             f"(got {self.sweep_abort})")
        if not 0 <= self.row_floor < 1:
            raise ValueError(f"row_floor: must lie in [0, 1) (0: off) "
                             f"(got {self.row_floor})")
        if not self.return_shift >= -1:
            raise ValueError(f"return_shift: must be >= 0, or -1 for settle_ticks "
                             f"(got {self.return_shift})")
        if not 0 <= self.rollback_fraction < 1:
            raise ValueError(f"rollback_fraction: must lie in [0, 1) (0: no rollback) "
                             f"(got {self.rollback_fraction})")
        if self.pool not in ("mean_std", "mean_max"):
            raise ValueError(f"pool: must be 'mean_std' or 'mean_max' (got {self.pool!r})")
        if not (isinstance(self.probe_return, bool) or self.probe_return == "best"):
            raise ValueError(f"probe_return: must be true, false or 'best' "
                             f"(got {self.probe_return!r})")
        if not (isinstance(self.device_sampling, bool) or self.device_sampling == "auto"):
            raise ValueError(f"device_sampling: must be true, false or 'auto' "
                             f"(got {self.device_sampling!r})")
        if self.node_pick not in ("partition", "redraw"):
            raise ValueError(f"node_pick: must be 'partition' or 'redraw' "
                             f"(got {self.node_pick!r})")
        if self.explore not in ("probe", "random"):
            raise ValueError(f"explore: must be 'probe' or 'random' (got {self.explore!r})")
        if not 0 <= self.gamma < 1:
            raise ValueError(f"gamma: must lie in [0, 1) (got {self.gamma})")
        for name in ("std_floor", "probe_steps", "detect_threshold", "detect_scale_floor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        if not 0 <= self.detect_drift < 5:       # the detector winsorises at ±5
            raise ValueError(f"detect_drift: must lie in [0, 5) (got {self.detect_drift})")
        if self.detect_signal not in ("throughput", "share"):
            raise ValueError(f"detect_signal: must be 'throughput' or 'share' "
                             f"(got {self.detect_signal!r})")
        if not 0 < self.detect_vote <= 1:
            raise ValueError(f"detect_vote: must lie in (0, 1] (got {self.detect_vote})")
        for name, most in self.MOST.items():
            if getattr(self, name) > most:
                raise ValueError(f"{name}: must be at most {most:g} "
                                 f"(got {getattr(self, name)})")


__all__ = ["NodeModelConfig"]
