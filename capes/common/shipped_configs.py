"""The example configs and fio workloads that ship inside the package.

They live in the repository at ``configs/`` (``configs/*.toml``,
``configs/workloads/*.fio``); ``capes/configs`` is a symbolic link to that folder, so
the wheel carries them as package data (``setup.cfg``'s ``package_data``) and an
installed CAPES finds them here through ``importlib.resources``, from any directory.
``capes config list`` and ``capes config show NAME`` print them.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def config_dir() -> Path:
    """The folder of the shipped configs (a real folder: pip installs wheels unzipped;
    resolved, so that in a checkout it is ``configs/`` itself)."""
    return Path(str(resources.files("capes") / "configs")).resolve()


def workload_dir() -> Path:
    """The folder of the shipped fio job files."""
    return config_dir() / "workloads"


def config_names() -> list[str]:
    """Names of the shipped configs, without ``.toml``."""
    return sorted(p.stem for p in config_dir().glob("*.toml"))


def config_path(name: str) -> Path:
    """The shipped config ``name`` (``lustre`` or ``lustre.toml``); the path is returned
    even when absent, so that loading it gives the usual "file not found"."""
    return config_dir() / (name if name.endswith(".toml") else f"{name}.toml")


def find_config(name_or_path: str) -> Path | None:
    """An existing file at ``name_or_path``, else the shipped config of that name, else
    None."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if is_name(name_or_path) and config_path(name_or_path).is_file():
        return config_path(name_or_path)
    if path.exists():          # a FIFO, a device, a directory: the loader says which
        return path
    return None


def is_name(text: str) -> bool:
    """Whether ``text`` can name a shipped config: no folder in it, no ``..``, no
    leading dot (``config show /etc/shadow`` or ``../x`` names nothing shipped)."""
    return bool(text) and "/" not in text and "\\" not in text and not text.startswith(".") \
        and "\0" not in text
