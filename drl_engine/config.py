"""The engine's settings, torch-free: the DQN hyperparameters, the presets, and the
reward. Validating a deployment file imports this module, never torch.

``DQNConfig``'s defaults are the paper's values (thesis §5.1.4–5.1.7, Table 5.2); a
preset names the changes from them. ``paper`` is exactly the paper; ``default`` is what
the converge test justified (README, "Converge test").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from capes.common.actions import MAX_STEPS
from capes.common.config import ConfigError

# engine.q_scope: where the Q-network's greedy action may act (round 5 of docs/journal.md)
# (round 7: "first_visits", the walk and a later workload's first visit)
Q_SCOPES = ("everywhere", "new_contexts", "first_visits")


@dataclass
class DQNConfig:
    preset: Literal["default", "paper"] = "default"
    stack: int = 10                    # S: sampling ticks per observation
    hidden_layers: int = 2
    hidden_width: int = 0              # 0: as wide as the input
    gamma: float = 0.99
    learning_rate: float = 0.001
    rmsprop_decay: float = 0.9
    batch_size: int = 32
    target_update_rate: float = 0.01   # α of the soft target update
    epsilon_start: float = 1.0
    epsilon_final: float = 0.05
    pretrained_epsilon_start: float = 0.3   # ε start for a model given by --init-model
    exploration_ticks: int = 72_000    # 20 h of 1 s action ticks
    workload_epsilon: float = 0.2
    workload_ticks: int = 3_600        # ticks to anneal back after a workload change
    missing_tolerance: float = 0.2
    train_steps_per_tick: int = 1
    train_every: int = 1               # one-row mode: train on every k-th tick only, each
                                       # minibatch k times as large (the same samples per
                                       # tick, 1/k of the per-step cost; 1: the paper's)
    n_step: int = 1                    # TD target over n rewards: r_t + … + γ^n max Q⁻(s_{t+n})
    return_shift: int = 0              # ... those rewards start this many ticks after the
                                       # action (its effect shows up late; 0: the paper's)
    double_dqn: bool = False
    loss: Literal["mse", "huber"] = "mse"
    normalise_inputs: bool = False
    scale_rewards: bool = False
    grad_clip: float = 0.0             # max gradient norm; 0: no clipping
    action_steps: int = 1              # probe walks move up to this many steps per tick
                                       # (the Q-network keeps one-step actions)
    numpy_tanh: bool = False           # on CPU, numpy's tanh where no gradient is recorded
                                       # (within one ulp of torch's, ~5x faster; drl_engine/qnet.py)
    cuda_graph: bool = True            # on a CUDA device, replay the training step as a
                                       # CUDA graph (drl_engine/qnet.py; no effect on CPU)
    compile_step: bool = False         # ... and before its capture, pass the per-node
                                       # step's parts (loss, forward and backward; update;
                                       # the device sampler's draw and gather) through
                                       # torch.compile: fused kernels, a shorter replay;
                                       # each shape compiles first (seconds; CUDA only)
    max_inputs: int = 20_000           # refuse a wider observation (a PI-name flood, a
                                       # layout error) instead of allocating its network
    # The guide (drl_engine/guide.py): probes to target settings instead of uniform
    # random actions, and a trust region around the best-known setting.
    guided: bool = False
    settle_ticks: int = 3              # credit p_t to the setting in effect this long before
    learn_lags: bool = False           # ... or, per knob, as long as its moves take to show
    lag_fit_ticks: int = 1             # ... that fit solved once this many ticks have joined
                                       # its sums (1: every tick; its solve was ~5 % of a
                                       # simulated hour's CPU, its answer changes rarely)
    kernel_steps: float = 1.5          # smoothing of the per-setting means, in steps
    lcb_kappa: float = 0.5             # best = highest mean − κ standard errors
    lcb_pooled_noise: bool = False     # ... each setting's variance at least the variance
                                       # pooled within settings (round 10: measured a tie,
                                       # off in both presets; docs/recall.md)
    best_min_samples: int = 3          # (kernel-weighted) samples before a setting counts
    best_refresh_ticks: int = 3        # recompute the best-known setting this often
    probe_local_steps: float = 3.0     # spread of local probe targets around the best, steps
    probe_dwell: int = 3               # ticks a probe holds its target
    global_fraction: float = 0.5       # global probes during this share of exploration
    probe_model: bool = False          # probe targets from a GP's upper bound, not at random
    model_length: float = 0.25         # the GP's length scale, as a share of each range
    model_beta: float = 0.5            # UCB = mean + β·sd (standardised objective) ...
    model_travel: float = 0.005        # ... − this per tick of walking to the target
    guard_steps: int = 3               # local probes stay this close to the best-known setting
    probe_unit: int = 0                # guard_steps, probe_local_steps and alarm_guard_steps
                                       # count 1/probe_unit of each knob's range (10: tenths,
                                       # a rung of an 11-value ladder); 0: each knob's own steps
    first_probe: Literal["local", "global"] = "global"   # before any setting is known:
                                       # "local" holds where tuning starts until its level is
                                       # known (the trust region's anchor); "global" probes
                                       # anywhere at once
    probe_floor: float = 0.0           # a probe whose newest objective falls below this share
                                       # of the best-known level walks back at once (0: off)
    probe_floor_noise: float = 0.0     # ... a value below the floor counts only when also
                                       # this many of the best's own standard deviations
                                       # below its level (0: any value below the floor)
    probe_avoid_bad: bool = False      # local probes and greedy moves skip a setting whose
                                       # level is known below probe_floor x the best's
    probe_move: bool = False           # a local probe never targets the best-known setting
                                       # itself (a probe that stays measures nothing new)
    alarm_guard_steps: int = 0         # after a change alarm, the first ``alarm_probes`` local
    alarm_probes: int = 0              # probes may go this far (0: guard_steps): a far optimum
                                       # on a ladder is reached in a few probes, not one rung each
    probe_safe: float = 0.0            # this share of the local probes (not the wide ones)
                                       # goes anywhere in the range where the GP's lower
                                       # bound stays above probe_floor x the best-known
                                       # level, to the best upper bound there (safe
                                       # Bayesian optimisation; needs probe_model and a
                                       # probe_floor; 0: local probes stay local)
    probe_walk_unit: bool = False      # probe walks move a knob up to one probe_unit of its
                                       # range a tick (at least action_steps, at most
                                       # MAX_STEPS): as fast over 100 steps as over 10 rungs
    wide_replan: bool = False          # the wide probes (alarm_probes) are re-aimed by the
                                       # model as their walk's ticks come in
    sweep_points: int = 0              # on a new workload (a new context, or one the engine
                                       # is told of; not an alarm): probe this many settings
                                       # spread evenly over each knob's range first, the
                                       # nearer side first (0: alarm_probes' wide draws)
    greedy_guard_steps: int = 1        # ... and the greedy (Q-network) actions this close
    detect_changes: bool = True        # CUSUM on per-setting residuals raises ε locally
    detect_fresh_only: bool = False    # ... hearing a tick only when its objective differs
                                       # from the tick before (a collector re-reading a
                                       # figure the application has not renewed is no new
                                       # evidence; counted twice, its noise alarmed)
    tick_poll_s: float = 0.0           # live: look for a newly committed tick this often and
                                       # act on it at once, at most tick_seconds apart (0:
                                       # tick every tick_seconds, whenever data lands: a bad
                                       # probe's walk back waits up to a tick longer)
    # [context hook] Workload contexts (drl_engine/context.py, issue 25): tell workloads
    # apart by their PI signature, keep each one's best-known setting, recall it on return.
    use_q_network: bool = True         # False: greedy holds the best-known setting (ablation)
    q_scope: str = "everywhere"        # "new_contexts": the Q-network acts only in a new
                                       # workload's inference walk (context_infer); greedy
                                       # elsewhere holds the best-known setting, as with
                                       # use_q_network = false (docs/journal.md, round 5;
                                       # the guided engine's: the paper preset ignores it);
                                       # "first_visits": also its guarded greedy moves on
                                       # the first visit of every workload but the first
                                       # (round 7), never on a return
    use_context: bool = False          # per-workload memory (the default preset turns it on)
    context_pis: list[str] = field(default_factory=list)   # [] : every PI that is neither
                                       # the objective's nor a parameter's
    context_window: int = 3            # ticks in the signature's running median
    context_threshold: float = 5.0     # a context fits while every PI is this many spreads near
    context_floor: float = 0.1         # least spread of a signature PI (log scale: ~10 %)
    context_floor_strict: bool = False # ... a hard least (False: a prior of 5 samples, which
                                       # a tight context outgrows: then a ±30 % wobble of
                                       # its signature made a second context)
    context_confirm: int = 1           # ticks a misfit must last before a switch
    context_recall_steps: int = 8      # steps per tick of the walk to a recalled setting
    context_hold_ticks: int = 30       # ... then this many ticks without probes
    context_lead: bool = False         # the Q-network moves first on a signature change
                                       # (measured a loss online: docs/recall.md)
    context_infer: bool = False        # a new context first walks to the setting the
                                       # Q-network infers from its signature
    context_infer_fresh: bool = True   # ... on fresh observations (the newest tick over
                                       # the stack); false: its stack, after `stack` ticks
    context_infer_known: int = 2       # ... once this many other contexts have a best setting
    context_replan: bool = False       # a new context's first global probes, drawn uniformly
                                       # before the model has 3 settings, are re-aimed by
                                       # the model as their walk's ticks come in (round 8)
    context_infer_local: bool = False  # the setting the network's walk reached is searched
                                       # around: the new context's probes stay local (round 9)
    demo_margin: float = 0.0           # DQfD's large-margin loss towards each context's
                                       # best-known setting (drl_engine/demonstrations.py)

    def validate(self) -> None:
        positive = ("stack", "hidden_layers", "batch_size", "exploration_ticks",
                    "train_steps_per_tick", "train_every", "learning_rate", "n_step",
                    "lag_fit_ticks")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        for name in ("gamma", "rmsprop_decay", "target_update_rate", "epsilon_start",
                     "epsilon_final", "pretrained_epsilon_start", "workload_epsilon",
                     "missing_tolerance"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name}: must lie in [0, 1] (got {v})")
        if not self.tick_poll_s >= 0:
            raise ValueError(f"tick_poll_s: must be >= 0 (got {self.tick_poll_s})")
        for name in ("settle_ticks", "probe_dwell", "guard_steps", "greedy_guard_steps",
                     "best_min_samples", "alarm_guard_steps", "alarm_probes", "sweep_points",
                     "return_shift", "probe_unit"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if not 1 <= self.action_steps <= MAX_STEPS:
            raise ValueError(f"action_steps: must lie in [1, {MAX_STEPS}] "
                             f"(got {self.action_steps})")
        if self.q_scope not in Q_SCOPES:
            raise ValueError(f"q_scope: must be one of {', '.join(Q_SCOPES)} "
                             f"(got {self.q_scope!r})")
        if self.first_probe not in ("local", "global"):
            raise ValueError(f"first_probe: must be local or global (got {self.first_probe!r})")
        if not 0 <= self.probe_floor < 1:
            raise ValueError(f"probe_floor: must lie in [0, 1) (got {self.probe_floor})")
        if not 0 <= self.probe_safe <= 1:
            raise ValueError(f"probe_safe: must lie in [0, 1] (got {self.probe_safe})")
        if not 0 <= self.global_fraction <= 1:
            raise ValueError(f"global_fraction: must lie in [0, 1] (got {self.global_fraction})")
        for name in ("kernel_steps", "best_refresh_ticks", "probe_local_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        for name in ("lcb_kappa", "model_beta", "model_travel", "probe_floor_noise"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if not 0 < self.model_length <= 10:
            raise ValueError(f"model_length: must lie in (0, 10] (got {self.model_length})")
        for name in ("context_window", "context_confirm", "context_infer_known"):
            if not 1 <= getattr(self, name) <= 10_000:
                raise ValueError(f"{name}: must lie in [1, 10000] (got {getattr(self, name)})")
        if not 1 <= self.context_recall_steps <= MAX_STEPS:
            raise ValueError(f"context_recall_steps: must lie in [1, {MAX_STEPS}] "
                             f"(got {self.context_recall_steps})")
        for name in ("context_threshold", "context_floor"):
            if not 0 < getattr(self, name) <= 1e6:
                raise ValueError(f"{name}: must lie in (0, 1e6] (got {getattr(self, name)})")
        for name in ("hidden_width", "workload_ticks", "grad_clip", "context_hold_ticks",
                     "demo_margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        for name, most in self.MOST.items():      # beyond these a value is a typo
            if getattr(self, name) > most:
                raise ValueError(f"{name}: must be at most {most:g} (got {getattr(self, name)})")

    # upper bounds (the lower ones are above): a network or a history this large would
    # exhaust memory at start instead of failing here with the key's name
    MOST = {"stack": 10_000, "hidden_layers": 64, "hidden_width": 1 << 20,
            "batch_size": 1 << 20, "exploration_ticks": 10**12, "workload_ticks": 10**12,
            "train_steps_per_tick": 10_000, "train_every": 10_000, "n_step": 10_000,
            "learning_rate": 10.0,
            "settle_ticks": 10**6, "lag_fit_ticks": 10**6, "return_shift": 10**6, "probe_dwell": 10**6,
            "guard_steps": 10**6, "greedy_guard_steps": 10**6, "alarm_guard_steps": 10**6,
            "alarm_probes": 10**6, "context_hold_ticks": 10**6, "probe_unit": 10**6,
            "best_min_samples": 10**9, "best_refresh_ticks": 10**9, "kernel_steps": 1e6,
            "probe_local_steps": 1e6, "lcb_kappa": 1e6, "model_beta": 1e6, "model_travel": 1e6,
            "probe_floor_noise": 1e6,
            "grad_clip": 1e12, "demo_margin": 1e6, "tick_poll_s": 3600.0}


# What each preset changes from the dataclass defaults (which are the paper's values).
PRESETS: dict[str, dict] = {
    "paper": {},
    "default": {"double_dqn": True, "loss": "huber", "normalise_inputs": True,
                "scale_rewards": True, "grad_clip": 10.0, "n_step": 5, "guided": True,
                "probe_model": True, "learn_lags": True, "lag_fit_ticks": 10,
                "action_steps": 2,
                "use_context": True, "train_every": 3, "numpy_tanh": True,
                # what the real devices taught (issue 39; docs/engine.md, "Safety"):
                # explore near where tuning starts and near the best-known setting, a
                # tenth of each knob's range at a time, never the whole range at random;
                # walk back at once from a probe below 3/4 of the best-known level and
                # never probe there again; sweep a new workload's ladder knobs coarsely
                "probe_unit": 10, "guard_steps": 1, "probe_local_steps": 1.0,
                "alarm_guard_steps": 10, "alarm_probes": 3, "sweep_points": 4,
                "global_fraction": 0.0, "first_probe": "local", "probe_floor": 0.75,
                "probe_avoid_bad": True,
                # ... but where the floor fires on the best's own noise (the game at 50 %:
                # half the probes walked back, better settings among them; never on the
                # recorded real traces) only a value 2 of its sd below it ends a probe
                "probe_floor_noise": 2.0,
                # ... and, where a knob's range is long and the model knows where it is
                # safe (issue 39: the recurring game's slow first visits), half the local
                # probes go to the model's best bound inside the safe set, probe walks
                # cross a tenth of a knob's range a tick, and the wide probes after a
                # change are re-aimed as they walk
                "probe_safe": 0.5, "probe_walk_unit": True, "wide_replan": True,
                # live: act on a committed tick within 0.1 s; hear each objective
                # figure once; a signature's spread never below its floor
                "tick_poll_s": 0.1, "detect_fresh_only": True, "context_floor_strict": True},
}

# The default preset's exploration came from the one-row engine on real devices (issue
# 39). The per-node engine's own search (the shared cold start's guide, per-row probes,
# per-node contexts) reads these names too and has not met the new values on a cluster:
# it keeps the values its figures were measured with (docs/results.md, "cluster") until a
# cluster bench measures the others. A value the config's [engine] sets is taken as given.
PER_NODE_KEEPS = {"probe_unit": 0, "guard_steps": 3, "probe_local_steps": 3.0,
                  "alarm_guard_steps": 0, "alarm_probes": 0,
                  "global_fraction": 0.5, "first_probe": "global", "probe_floor": 0.0,
                  "probe_floor_noise": 0.0, "probe_safe": 0.0, "probe_walk_unit": False,
                  "wide_replan": False, "probe_avoid_bad": False, "detect_fresh_only": False,
                  "context_floor_strict": False, "context_infer": True,
                  "context_infer_known": 3, "demo_margin": 0.5, "q_scope": "new_contexts",
                  "context_replan": True}


def per_node_settings(dqn: DQNConfig) -> DQNConfig:
    """``dqn`` for the per-node engine: each of ``PER_NODE_KEEPS``' keys that holds the
    default preset's value back at the value the per-node engine was measured with."""
    if dqn.preset != "default":
        return dqn
    preset = PRESETS["default"]
    keep = {k: v for k, v in PER_NODE_KEEPS.items()
            if getattr(dqn, k) == preset.get(k, getattr(DQNConfig, k))}
    return dataclasses.replace(dqn, **keep) if keep else dqn


def with_preset(table: Any, source: str = "<config>", key: str = "engine") -> Any:
    """An ``[engine]`` table with its preset's values filled in under explicit keys."""
    if not isinstance(table, dict):
        return table                      # build() reports the type error
    preset = table.get("preset", DQNConfig.preset)
    if not isinstance(preset, str):
        raise ConfigError(source, f"{key}.preset", f"expected a preset name (one of "
                          f"{', '.join(PRESETS)}), got {type(preset).__name__}")
    if preset not in PRESETS:
        raise ConfigError(source, f"{key}.preset", f"unknown preset {preset!r} "
                          f"(known: {', '.join(PRESETS)})")
    return {**PRESETS[preset], **table}


@dataclass
class RewardConfig:
    """What to maximise and how its change becomes a reward (``drl_engine.rewards``).
    ``objective`` and ``type`` name registered plug-ins; ``objective_options`` and
    ``options`` are their typed option tables, checked when the config is loaded."""
    objective: str = "throughput"
    pis: list[str] = field(default_factory=lambda: ["throughput"])
    objective_options: dict[str, Any] = field(default_factory=dict)
    type: str = "diff"
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from drl_engine.rewards import OBJECTIVES, REWARD_TYPES   # numpy only
        if not self.pis:
            raise ValueError("pis: name at least one PI")
        OBJECTIVES.build(self.objective, self.objective_options, "objective_options",
                         "objective")
        REWARD_TYPES.build(self.type, self.options, "options", "type")
