"""Knobs that are files: sysfs, procfs, the simulator node's directory.

Each parameter maps to a path pattern; shell-style globs set a knob on every match at
once, e.g. ``/proc/fs/lustre/osc/*/max_rpcs_in_flight`` (every OSC of a Lustre client)
or ``/sys/block/sd*/queue/read_ahead_kb``. The value is written as an integer when it
is integral (the kernel refuses ``32.0``), in one write, as ``echo 32 > FILE`` would,
then read back. If any write fails, the files already written get their old contents
back, so a knob is never left half-changed.

Options: ``path`` (one pattern, for an applier serving one parameter) and/or ``paths``
(a table parameter name -> pattern).
"""
from __future__ import annotations

import glob
import logging

from control_agent.appliers.base import Applier, ApplyError, format_value, register

log = logging.getLogger(__name__)


def _parse(text: str) -> float | None:
    parts = text.split()
    try:
        return float(parts[0]) if parts else None
    except ValueError:
        return None


@register("file")
class FileApplier(Applier):
    def __init__(self, path: str | None = None, paths: dict[str, str] | None = None):
        if path is None and not paths:
            raise ValueError("path: give 'path' or a 'paths' table (parameter -> pattern)")
        for name, pattern in [("path", path)] + [(f"paths.{k}", v) for k, v in
                                                 (paths or {}).items()]:
            if pattern is not None and (not isinstance(pattern, str) or not pattern):
                raise ValueError(f"{name}: must be a non-empty path pattern")
        self.path = path
        self.paths = dict(paths or {})

    def pattern(self, param: str) -> str:
        pattern = self.paths.get(param, self.path)
        if pattern is None:
            raise ApplyError(f"{param}: no path configured for this parameter")
        return pattern

    def files(self, param: str) -> list[str]:
        """Every file the knob ``param`` is set in (sorted); ApplyError when none."""
        pattern = self.pattern(param)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ApplyError(f"{param}: no file matches {pattern}")
        return matches

    def apply(self, param: str, value: float) -> None:
        text = format_value(value)
        done: list[tuple[str, str]] = []
        for path in self.files(param):
            try:
                with open(path) as fh:
                    old = fh.read()
                with open(path, "w") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                self._roll_back(param, done)
                raise ApplyError(f"{param}: cannot write {text} to {path}: "
                                 f"{exc.strerror or exc}") from None
            done.append((path, old))
        for path, _ in done:
            got = self._read_file(path)
            if got != float(text):
                log.warning("%s: wrote %s to %s, reads back %s", param, text, path, got)

    def _roll_back(self, param: str, done: list[tuple[str, str]]) -> None:
        for path, old in reversed(done):
            try:
                with open(path, "w") as fh:
                    fh.write(old)
            except OSError as exc:
                log.error("%s: could not restore %s: %s", param, path, exc)

    @staticmethod
    def _read_file(path: str) -> float | None:
        try:
            with open(path) as fh:
                return _parse(fh.read(256))
        except OSError:
            return None

    def read(self, param: str) -> float | None:
        """The knob's value if every matching file agrees on it, else None."""
        try:
            values = {self._read_file(p) for p in self.files(param)}
        except ApplyError:
            return None
        return values.pop() if len(values) == 1 else None
