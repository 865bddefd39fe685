"""Which torch device the networks run on: CUDA when present, else the CPU."""
from __future__ import annotations


class DeviceUnavailable(RuntimeError):
    """The device asked for is not there (CUDA without a GPU) or is not a device name;
    the CLIs print it as one line, never a traceback."""


def device_name(requested: str = "auto") -> str:
    """:func:`pick_device` as a string, without importing torch for ``cpu``."""
    return "cpu" if requested == "cpu" else str(pick_device(requested))


def pick_device(requested: str = "auto"):
    """``auto``: CUDA when present, else CPU. ``cuda`` without a GPU, or a name torch
    does not know, is a :class:`DeviceUnavailable`. Returns a ``torch.device``."""
    import torch
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnavailable(f"--device {requested} requested but no CUDA device is "
                                f"available ({cuda_absence()})")
    try:
        return torch.device(requested)
    except RuntimeError:
        raise DeviceUnavailable(f"--device {requested!r}: not a device (auto, cpu, cuda "
                                f"or cuda:N)") from None


def cuda_absence() -> str:
    """Why torch sees no CUDA device, in words an operator can act on."""
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return (f"torch {torch.__version__} with CUDA {torch.version.cuda} sees no device: "
            f"no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it")


__all__ = ["DeviceUnavailable", "cuda_absence", "device_name", "pick_device"]
