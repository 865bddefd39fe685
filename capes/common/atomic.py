"""One way to write a file atomically: a temp file beside it, fsynced, renamed into place
only on success, then the directory fsynced. A crash leaves the old file or the new one,
never half of either, and no temp file behind."""
from __future__ import annotations

import glob
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", **kw) -> Iterator[Any]:
    """``with atomic_write(path, "wb") as fh: ...`` — ``fh`` is the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)       # as open() would have made it
    try:
        with os.fdopen(fd, mode, **kw) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_dir(directory: str | Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    with atomic_write(path) as fh:
        json.dump(obj, fh, indent=indent, default=float)


def remove_stale_temps(directory: str | Path, name: str,
                       patterns: tuple[str, ...] = (".{name}.*.tmp",)) -> list[Path]:
    """Delete temp files a killed ``atomic_write(directory/name)`` left behind (call it
    at start, before this process writes ``name``). ``patterns`` are globs in which
    ``{name}`` stands for ``name`` (escaped), for temp names older code made. A file
    that cannot be removed is left, and not listed."""
    removed = []
    directory = Path(directory)
    for pattern in patterns:
        for p in directory.glob(pattern.replace("{name}", glob.escape(name))):
            try:
                if p.is_file() and not p.is_symlink():
                    p.unlink()
                    removed.append(p)
            except OSError:
                pass
    return removed
