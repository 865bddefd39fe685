"""Knobs that are files: sysfs, procfs, the simulator node's directory.

Each parameter maps to a path pattern; shell-style globs set a knob on every match at
once, e.g. ``/proc/fs/lustre/osc/*/max_rpcs_in_flight`` (every OSC of a Lustre client)
or ``/sys/block/sd*/queue/read_ahead_kb``. A number is written as an integer when it
is integral (the kernel refuses ``32.0``), in one write, as ``echo 32 > FILE`` would,
then read back. If any write fails, the files already written get their old value
back, so a knob is never left half-changed.

Text knobs (categorical parameters) are written by name. A file that lists its choices
with the active one in brackets, as ``/sys/block/<dev>/queue/scheduler`` does
(``[mq-deadline] none kyber bfq``), reads as the bracketed name, and a name it does not
list is refused before anything is written.

**Allowed roots.** Every file a pattern matches must resolve (symlinks followed) inside
an allowed root, checked at every apply and read: a glob or a planted symlink cannot
make the agent write elsewhere. Option ``root`` (a directory or a list) sets the roots.
Without it, a pattern under ``/sys`` or ``/proc`` may reach ``/sys``, ``/proc/sys`` and
``/proc/fs`` (sysfs, sysctls, Lustre's and nfsd's tunables; nothing else under /proc,
such as ``/proc/sysrq-trigger``), and any other pattern (the simulator's directory)
only the directory its leading non-glob part names.

Options: ``path`` (one pattern, for an applier serving one parameter) and/or ``paths``
(a table parameter name -> pattern); ``root``.
"""
from __future__ import annotations

import glob
import logging
import os

from control_agent.appliers.base import Applier, ApplyError, format_value, register

log = logging.getLogger(__name__)

KERNEL_TREES = ("/sys", "/proc")                 # patterns here get KERNEL_ROOTS
KERNEL_ROOTS = ("/sys", "/proc/sys", "/proc/fs")


def _parse(text: str) -> float | None:
    parts = text.split()
    try:
        return float(parts[0]) if parts else None
    except ValueError:
        return None


def parse_choice(text: str) -> tuple[str | None, list[str]]:
    """(active name, names offered) of a text knob: ``[mq-deadline] none kyber`` ->
    (``mq-deadline``, all three); a file holding one word (``on``) -> (that word, [])."""
    tokens = text.split()
    active = next((t[1:-1] for t in tokens if t.startswith("[") and t.endswith("]")), None)
    if active is not None:
        return active, [t.strip("[]") for t in tokens]
    return (tokens[0] if len(tokens) == 1 else None), []


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _literal_dir(pattern: str) -> str:
    """The leading directory of ``pattern`` that holds no glob character."""
    parts = os.path.abspath(pattern).split(os.sep)
    keep = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        keep.append(part)
    return os.sep.join(keep) or os.sep


@register("file")
class FileApplier(Applier):
    def __init__(self, path: str | None = None, paths: dict[str, str] | None = None,
                 root: str | list[str] | None = None):
        if path is None and not paths:
            raise ValueError("path: give 'path' or a 'paths' table (parameter -> pattern)")
        for name, pattern in [("path", path)] + [(f"paths.{k}", v) for k, v in
                                                 (paths or {}).items()]:
            if pattern is not None and (not isinstance(pattern, str) or not pattern):
                raise ValueError(f"{name}: must be a non-empty path pattern")
        if root is not None:
            roots = [root] if isinstance(root, str) else root
            if not isinstance(roots, list) or not roots or \
                    not all(isinstance(r, str) and r for r in roots):
                raise ValueError("root: must be a directory or a list of directories")
            self.roots: list[str] | None = [os.path.abspath(r) for r in roots]
        else:
            self.roots = None
        self.path = path
        self.paths = dict(paths or {})
        for name, pattern in [("path", path)] + [(f"paths.{k}", v) for k, v in
                                                 self.paths.items()]:
            if pattern is None:
                continue
            allowed = self.allowed_roots(pattern)
            where = os.path.normpath(os.path.abspath(pattern))
            if not any(_within(where, r) for r in allowed):
                raise ValueError(f"{name}: {pattern} lies outside the allowed roots "
                                 f"{', '.join(allowed)}; set 'root' to allow it")

    def allowed_roots(self, pattern: str) -> list[str]:
        """The directories the files of ``pattern`` must resolve into."""
        if self.roots is not None:
            return list(self.roots)
        where = os.path.normpath(os.path.abspath(pattern))
        if any(_within(where, t) for t in KERNEL_TREES):
            return list(KERNEL_ROOTS)
        return [_literal_dir(where)]

    def pattern(self, param: str) -> str:
        pattern = self.paths.get(param, self.path)
        if pattern is None:
            raise ApplyError(f"{param}: no path configured for this parameter")
        return pattern

    def files(self, param: str) -> list[str]:
        """Every file the knob ``param`` is set in (sorted); ApplyError when none, or
        when one resolves outside the allowed roots."""
        pattern = self.pattern(param)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ApplyError(f"{param}: no file matches {pattern}")
        roots = [os.path.realpath(r) for r in self.allowed_roots(pattern)]
        for path in matches:
            real = os.path.realpath(path)
            if not any(_within(real, r) for r in roots):
                raise ApplyError(f"{param}: {path} resolves to {real}, outside the allowed "
                                 f"roots {', '.join(roots)}; refused")
        return matches

    def apply(self, param: str, value: float | str) -> None:
        files = self.files(param)
        if isinstance(value, str):
            text = value
            if not value or any(c.isspace() for c in value) or not value.isprintable():
                raise ApplyError(f"{param}: refusing to write {value!r}")
            for path in files:
                _, offered = parse_choice(self._read_text(path) or "")
                if offered and value not in offered:
                    raise ApplyError(f"{param}: {path} does not offer {value!r} "
                                     f"(it offers {', '.join(offered)})")
        else:
            text = format_value(value)
        done: list[tuple[str, str]] = []
        for path in files:
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
            if isinstance(value, str):
                got = parse_choice(self._read_text(path) or "")[0]
                ok = got == value
            else:
                got = self._read_file(path)
                ok = got == float(text)
            if not ok:
                log.warning("%s: wrote %s to %s, reads back %s", param, text, path, got)

    def _roll_back(self, param: str, done: list[tuple[str, str]]) -> None:
        for path, old in reversed(done):
            active, offered = parse_choice(old)
            text = active if offered else old      # "[bfq] none" cannot be written back
            try:
                with open(path, "w") as fh:
                    fh.write(text)
            except OSError as exc:
                log.error("%s: could not restore %s: %s", param, path, exc)

    @staticmethod
    def _read_text(path: str) -> str | None:
        try:
            with open(path) as fh:
                return fh.read(4096)
        except (OSError, UnicodeDecodeError):
            return None

    @classmethod
    def _read_file(cls, path: str) -> float | None:
        text = cls._read_text(path)
        return None if text is None else _parse(text)

    def read(self, param: str) -> float | None:
        """The knob's value if every matching file agrees on it, else None."""
        try:
            values = {self._read_file(p) for p in self.files(param)}
        except ApplyError:
            return None
        return values.pop() if len(values) == 1 else None

    def read_text(self, param: str) -> str | None:
        """A text knob's value (the bracketed choice, or the file's one word) if every
        matching file agrees on it, else None."""
        try:
            values = {parse_choice(self._read_text(p) or "")[0] for p in self.files(param)}
        except ApplyError:
            return None
        return values.pop() if len(values) == 1 else None
