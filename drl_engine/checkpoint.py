"""Checkpoints: one module for writing, reading and cleaning up every engine's files
(:class:`Checkpoints`: the flat engine's and the cluster engine's alike), and for
turning the controller's state (the guide: best-known setting, per-setting statistics,
learned lags, change detector, running probe) into something
``torch.load(weights_only=True)`` reads back.

Why not pickle: a checkpoint is read with ``weights_only=True`` so that a file from
elsewhere cannot run code. That loader takes tensors, numbers, strings, lists and
dicts; :func:`encode` turns numpy arrays into tensors and tags the other containers
(tuples, deques, dicts with non-string keys, plain objects), and :func:`restore_into`
puts such a state back into a freshly built object of the same class.
"""
from __future__ import annotations

import pickle
from collections import deque
from pathlib import Path

import numpy as np

from capes.common.atomic import atomic_write, remove_stale_temps

# temp names of a killed save: atomic_write's, and those of the code before it
CHECKPOINT_TEMPS = (".{name}.*.tmp", "{name}*.tmp")


def remove_stale_checkpoint_temps(path: str | Path) -> list[Path]:
    """Delete the temp files that saves of ``path`` killed mid-write left beside it."""
    path = Path(path)
    return remove_stale_temps(path.parent, path.name, CHECKPOINT_TEMPS)


def write(state: dict, path: str | Path) -> Path:
    """Write ``state`` atomically and durably (``capes.common.atomic``): a temp file
    beside it, fsynced, renamed into place, the directory fsynced. A crash or a power
    cut leaves the old checkpoint or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch             # here, not at the top: importing the engine needs no torch
    with atomic_write(path, "wb") as fh:
        torch.save(state, fh)
    return path


class Checkpoints:
    """One engine's checkpoint files: each state is tagged with the engine's ``kind``
    and format ``version`` and written atomically (:func:`write`); a load reads it
    ``weights_only`` (:func:`read`) and refuses another engine's or version's file with
    one clear error. The temp files of saves killed mid-write are removed before the
    first save of each path, and before resuming from it (not when a run only takes
    the weights of another's checkpoint, which may still be saving)."""

    def __init__(self, kind: str, version: int, label: str):
        self.kind, self.version, self.label = kind, version, label
        self._cleaned: set[Path] = set()       # paths whose stale temps are gone

    def _clean(self, path: Path) -> None:
        if path not in self._cleaned:
            remove_stale_checkpoint_temps(path)
            self._cleaned.add(path)

    def header(self) -> dict:
        """What an engine's ``state_dict`` starts with: its kind and format version."""
        return {"kind": self.kind, "version": self.version}

    def save(self, state: dict, path: str | Path) -> Path:
        """Write ``state`` (an engine's ``state_dict``, :meth:`header` included)."""
        path = Path(path)
        self._clean(path)
        return write({**self.header(), **state}, path)

    def load(self, path: str | Path, device="cpu", resume: bool = True) -> dict:
        """The state kept at ``path``; ValueError when it is not this engine's
        checkpoint of this version (files without a kind are the flat engine's)."""
        path = Path(path)
        if resume:
            self._clean(path)
        state = read(path, device)
        if state.get("kind", "flat") != self.kind or state.get("version") != self.version:
            raise ValueError(f"{path}: not {self.label} checkpoint of version "
                             f"{self.version} (found {state.get('kind', 'flat')} version "
                             f"{state.get('version')})")
        return state


def read(path: str | Path, device="cpu") -> dict:
    """A checkpoint's state (``weights_only``: never runs code); ValueError when the
    file is not a readable checkpoint."""
    import torch
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path}: not a readable checkpoint ({exc})") from None


# -- validation -------------------------------------------------------------------------
# the parts of an engine's state_dict a resume applies, checked against the engine's own
# state_dict before any is applied: a checkpoint of another config (engine.hidden_width,
# cluster_engine.hidden) made load_state_dict raise a RuntimeError at every start (a crash
# loop), and damaged ones that load cleanly (a counter that is not a number, an RNG
# state that is not one, NaN weights) failed later or were trained on and saved again
COUNTERS = {"action_ticks": int, "train_steps": int, "bumped_at": (int, type(None)),
            "pretrained": bool, "local_bump": bool, "change_alarms": int,
            "stale_bests": int, "unconfirmed_rollbacks": int,
            "handed_over_at": (int, type(None)), "guide_session": (int, type(None)),
            "nodes_trained": int}
SETTINGS = ("cfg", "model")          # a network's settings: values differ, never state


def validate(state: dict, template: dict, path, weights_only: bool = False) -> None:
    """ValueError naming the first part of ``state`` (a checkpoint) that does not fit
    ``template`` (the engine's own ``state_dict``, of the same build): the networks and
    optimiser (every tensor's shape and dtype, finite values), the input statistics
    (finite, as many as the engine's, a positive std), the counters (numbers of their
    type), the RNG state (one numpy accepts) and the reward scale (finite, positive)."""
    try:
        if "dqn" in state or template.get("dqn") is not None:
            _like(state.get("dqn"), template.get("dqn"), "dqn")
        _stats(state.get("stats"), template.get("stats"))
        if weights_only:
            return
        for key, kind in COUNTERS.items():
            if key in state and not _number_of(state[key], kind):
                raise _Unfit(f"counter {key} is {state[key]!r}, not a number")
        if "rng" in state:
            _rng_state(state["rng"])
        scale = (state.get("controller") or {}).get("p_scale") \
            if isinstance(state.get("controller"), dict) else None
        if scale is not None and not (_finite(scale) and scale > 0):
            raise _Unfit(f"reward scale is {scale!r}")
    except _Unfit as exc:
        raise ValueError(f"{path}: {exc}") from None


class _Unfit(Exception):
    pass


# what resuming from a checkpoint raises when the file cannot be used: ValueError from
# validate and the loaders; the others from a state that passed validation but not its
# part's own load_state (a damaged controller entry): never a crash loop
UNUSABLE = (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError)


def why(exc: BaseException) -> str:
    """The reason to log for ``exc``, one of :data:`UNUSABLE`."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


def _number_of(x, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if x is None:
        return type(None) in kinds
    if bool in kinds:
        return isinstance(x, bool)
    return isinstance(x, int) and not isinstance(x, bool) and int in kinds


def _like(saved, tmpl, where: str) -> None:
    """``saved`` has ``tmpl``'s structure: the same keys, list lengths, tensor shapes
    and dtypes, value types; floating tensors finite."""
    import torch
    if tmpl is None:
        return
    if isinstance(tmpl, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise _Unfit(f"{where} is a {type(saved).__name__}, not a tensor")
        if saved.shape != tmpl.shape or saved.dtype != tmpl.dtype:
            raise _Unfit(f"{where} is {saved.dtype} of shape {tuple(saved.shape)}, this "
                         f"engine's is {tmpl.dtype} of shape {tuple(tmpl.shape)} (another "
                         f"network: another engine.hidden_width or cluster_engine shape?)")
        if saved.is_floating_point() and not bool(torch.isfinite(saved).all()):
            raise _Unfit(f"{where} holds values that are not finite")
    elif isinstance(tmpl, dict):
        if not isinstance(saved, dict):
            raise _Unfit(f"{where} is a {type(saved).__name__}, not a dict")
        if set(saved) != set(tmpl):
            raise _Unfit(f"{where} has the entries {sorted(map(str, saved))}, this "
                         f"engine's {sorted(map(str, tmpl))}")
        for key, value in tmpl.items():
            if key not in SETTINGS:
                _like(saved[key], value, f"{where}.{key}")
    elif isinstance(tmpl, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(tmpl):
            raise _Unfit(f"{where} is {type(saved).__name__} of another length")
        for i, (a, b) in enumerate(zip(saved, tmpl)):
            _like(a, b, f"{where}[{i}]")
    elif isinstance(tmpl, bool):
        if not isinstance(saved, bool):
            raise _Unfit(f"{where} is {saved!r}, not a bool")
    elif isinstance(tmpl, (int, float)):
        if not _finite(saved):
            raise _Unfit(f"{where} is {saved!r}, not a finite number")
        if isinstance(tmpl, int) and not isinstance(saved, int):
            raise _Unfit(f"{where} is {saved!r}, not an integer")
    elif isinstance(tmpl, str) and not isinstance(saved, str):
        raise _Unfit(f"{where} is {saved!r}, not a string")


def _stats(saved, tmpl) -> None:
    """Input statistics: finite means, finite positive stds, as many as the engine's."""
    if saved is None:
        return
    if not isinstance(saved, dict) or not {"mean", "std"} <= set(saved):
        raise _Unfit("input statistics are not a dict of mean and std")
    try:
        mean, std = (np.asarray(saved[k], np.float64) for k in ("mean", "std"))
    except (TypeError, ValueError):
        raise _Unfit("input statistics are not numbers") from None
    if std.shape != mean.shape:
        raise _Unfit(f"input statistics of shapes {mean.shape} and {std.shape}")
    if isinstance(tmpl, dict) and "mean" in tmpl and np.shape(tmpl["mean"]) != mean.shape:
        raise _Unfit(f"input statistics of shape {mean.shape}, this engine's are "
                     f"{np.shape(tmpl['mean'])}")
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        raise _Unfit("input statistics hold values that are not finite (or a std <= 0)")
    if "objective_std" in saved and not (_finite(saved["objective_std"])
                                         and saved["objective_std"] > 0):
        raise _Unfit(f"objective_std is {saved['objective_std']!r}")


def _rng_state(state) -> None:
    """A state numpy's generator accepts (tried on a scratch generator)."""
    try:
        np.random.default_rng().bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise _Unfit(f"the RNG state is not one ({type(exc).__name__}: "
                     f"{str(exc)[:80]})") from None


# -- plain state of python objects ---------------------------------------------------------
def encode(x):
    """``x`` as tensors, numbers, strings, lists and dicts (see the module docstring)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        import torch
        return {"__nd__": torch.from_numpy(np.ascontiguousarray(x).copy()),
                "dtype": str(x.dtype)}
    if isinstance(x, deque):
        return {"__deque__": [encode(v) for v in x], "maxlen": x.maxlen}
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: encode(v) for k, v in x.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in x.items()]}
    if hasattr(x, "__dict__"):
        return {"__obj__": state_of(x)}
    raise TypeError(f"cannot keep a {type(x).__name__} in a checkpoint")


def decode(x):
    """The inverse of :func:`encode` (plain objects come back as dicts of attributes)."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__nd__" in x:
        return x["__nd__"].numpy().astype(x["dtype"], copy=True)
    if "__deque__" in x:
        return deque((decode(v) for v in x["__deque__"]), maxlen=x["maxlen"])
    if "__tuple__" in x:
        return tuple(decode(v) for v in x["__tuple__"])
    if "__items__" in x:
        return {decode(k): decode(v) for k, v in x["__items__"]}
    if "__obj__" in x:
        return {k: decode(v) for k, v in x["__obj__"].items()}
    return {k: decode(v) for k, v in x.items()}


# attributes that are settings or shared with the owner, never state: a restored
# object keeps the ones it was built with (a retuned threshold applies after a restart)
NOT_STATE = ("config", "cfg", "rng")


def state_of(obj, skip: tuple[str, ...] = ()) -> dict:
    """The encoded attributes of ``obj`` but settings (``NOT_STATE``) and ``skip``."""
    return {k: encode(v) for k, v in vars(obj).items()
            if k not in skip and k not in NOT_STATE}


def restore_into(obj, state: dict) -> None:
    """Put :func:`state_of`'s ``state`` back into ``obj``, a freshly built object of the
    same class: attributes that hold objects are restored in place (so a nested
    detector keeps its class), the others replaced."""
    for key, value in state.items():
        current = getattr(obj, key, None)
        if (isinstance(value, dict) and "__obj__" in value and current is not None
                and hasattr(current, "__dict__")):
            restore_into(current, value["__obj__"])
        elif (isinstance(value, dict) and "__obj__" in value and current is None):
            continue                       # an object this build does not have
        else:
            setattr(obj, key, decode(value))
