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
