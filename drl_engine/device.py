"""Which torch device the networks run on: CUDA when present, else the CPU."""
from __future__ import annotations


def device_name(requested: str = "auto") -> str:
    """:func:`pick_device` as a string, without importing torch for ``cpu``."""
    return "cpu" if requested == "cpu" else str(pick_device(requested))


def pick_device(requested: str = "auto"):
    """``auto``: CUDA when present, else CPU. ``cuda`` without a GPU is an error.
    Returns a ``torch.device``."""
    import torch
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but no CUDA device is available")
    return torch.device(requested)


__all__ = ["device_name", "pick_device"]
