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
make the agent write elsewhere. The check cannot be raced: the resolved path is opened
one component at a time from ``/``, each relative to the directory opened before it and
never following a symlink (``openat`` with ``O_NOFOLLOW``), so a symlink swapped in
after the check makes the open fail (the write is refused with an ApplyError) instead
of landing outside; the opened file must be a regular file, and its path as the kernel
sees it (``/proc/self/fd``) must still lie inside a root. Option ``root`` (a directory or a list) sets the roots.
Without it, a pattern under ``/sys`` or ``/proc`` may reach ``/sys``, ``/proc/sys`` and
``/proc/fs`` (sysfs, sysctls, Lustre's and nfsd's tunables; nothing else under /proc,
such as ``/proc/sysrq-trigger``), and any other pattern (the simulator's directory)
only the directory its leading non-glob part names.

Options: ``path`` (one pattern, for an applier serving one parameter) and/or ``paths``
(a table parameter name -> pattern); ``root``.
"""
from __future__ import annotations

import fnmatch
import glob
import logging
import os
import stat

from control_agent.appliers.base import (CATEGORICAL, NUMERIC, Applier, ApplyError,
                                         format_value, register)

log = logging.getLogger(__name__)

KERNEL_TREES = ("/sys", "/proc")                 # patterns here get KERNEL_ROOTS
KERNEL_ROOTS = ("/sys", "/proc/sys", "/proc/fs")


def _parse(text: str) -> float | None:
    parts = text.split()
    try:
        value = float(parts[0]) if parts else None
    except ValueError:
        return None
    return None if value is None or value != value or value in (INF, -INF) else value


INF = float("inf")


def parse_choice(text: str) -> tuple[str | None, list[str]]:
    """(active name, names offered) of a text knob: ``[mq-deadline] none kyber`` ->
    (``mq-deadline``, all three); a file holding one word (``on``) -> (that word, [])."""
    tokens = text.split()
    active = next((t[1:-1] for t in tokens if t.startswith("[") and t.endswith("]")), None)
    if active is not None:
        return active, [t.strip("[]") for t in tokens]
    return (tokens[0] if len(tokens) == 1 else None), []


MAX_GLOB_ENTRIES = 100_000   # directory entries one pattern may look at
MAX_GLOB_MATCHES = 4096      # files one knob may be set in


def bounded_glob(pattern: str, max_entries: int = MAX_GLOB_ENTRIES,
                 max_matches: int = MAX_GLOB_MATCHES) -> list[str]:
    """``glob.glob(pattern)``, sorted, that gives up (ApplyError) after looking at
    ``max_entries`` directory entries or finding more than ``max_matches`` paths at any
    level: ``/sys/*/*/*/*/*/*/*/*/*/*/nope`` walked sysfs for minutes (its symlinks
    loop), at every read and apply of the knob and in ``capes config check``. Same
    rules as glob: ``*``, ``?``, ``[...]`` within one component, hidden names only for
    a pattern that starts with a dot, symlinks to directories followed."""
    parts = [p for p in pattern.split(os.sep) if p]
    level = [os.sep if pattern.startswith(os.sep) else ""]
    scanned = 0
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        found = []
        for d in level:
            if not glob.has_magic(part):
                path = os.path.join(d, part)
                if os.path.lexists(path) if last else os.path.isdir(path):
                    found.append(path)
                continue
            try:
                entries = os.scandir(d or os.curdir)
            except OSError:
                continue
            with entries:
                for entry in entries:
                    scanned += 1
                    if scanned > max_entries:
                        raise ApplyError(f"{pattern} makes CAPES look at more than "
                                         f"{max_entries} files; give a narrower pattern")
                    if entry.name.startswith(".") and not part.startswith("."):
                        continue
                    if fnmatch.fnmatchcase(entry.name, part) and (last or _is_dir(entry)):
                        found.append(os.path.join(d, entry.name))
        if len(found) > max_matches:
            raise ApplyError(f"{pattern} matches more than {max_matches} paths; give a "
                             f"narrower pattern")
        level = found
    return sorted(level) if parts else []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


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
    kinds = (NUMERIC, CATEGORICAL)        # a text knob is written by name
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
        """Every file the knob ``param`` is set in (sorted); ApplyError when none, when
        one resolves outside the allowed roots, or cannot be resolved."""
        return [path for path, _ in self.resolve(param)[0]]

    def resolve(self, param: str) -> tuple[list[tuple[str, str]], list[str]]:
        """([(file, its resolved path)], the allowed roots resolved): see ``files``."""
        pattern = self.pattern(param)
        try:
            matches = bounded_glob(pattern) if glob.has_magic(pattern) else [pattern]
            roots = [os.path.realpath(r) for r in self.allowed_roots(pattern)]
            resolved = [(path, os.path.realpath(path)) for path in matches]
        except (OSError, ValueError, RuntimeError) as exc:
            raise ApplyError(f"{param}: cannot resolve {pattern}: {exc}") from None
        if not matches:
            raise ApplyError(f"{param}: no file matches {pattern}")
        for path, real in resolved:
            if not any(_within(real, r) for r in roots):
                raise ApplyError(f"{param}: {path} resolves to {real}, outside the allowed "
                                 f"roots {', '.join(roots)}; refused")
        return resolved, roots

    @staticmethod
    def open_resolved(real: str, flags: int, roots: list[str]) -> int:
        """Open the resolved path ``real`` without following any symlink on the way
        (OSError when one was swapped in since it was resolved), as a regular file
        that still lies inside one of ``roots``."""
        parts = [p for p in real.split(os.sep) if p]
        if not parts:
            raise OSError(f"{real}: not a file")
        fd = os.open(os.sep, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW |
                              os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
            out = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          0o644, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise OSError(f"{real} is not a regular file")
            try:
                where = os.readlink(f"/proc/self/fd/{out}")
            except OSError:
                where = real                     # no /proc: the walk above is the check
            if not any(_within(where, r) for r in roots):
                raise OSError(f"{real} was moved to {where}, outside the allowed roots")
        except OSError:
            os.close(out)
            raise
        return out

    def _read_path(self, real: str, roots: list[str], limit: int = 4096) -> str:
        fd = self.open_resolved(real, os.O_RDONLY, roots)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(limit).decode()

    def _write_path(self, real: str, roots: list[str], text: str) -> None:
        fd = self.open_resolved(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, roots)
        with os.fdopen(fd, "wb", buffering=0) as fh:
            fh.write(text.encode())

    def apply(self, param: str, value: float | str) -> None:
        files, roots = self.resolve(param)
        if isinstance(value, str):
            text = value
            if not value or any(c.isspace() for c in value) or not value.isprintable():
                raise ApplyError(f"{param}: refusing to write {value!r}")
            for path, real in files:
                _, offered = parse_choice(self._read_text(real, roots) or "")
                if offered and value not in offered:
                    raise ApplyError(f"{param}: {path} does not offer {value!r} "
                                     f"(it offers {', '.join(offered)})")
        else:
            text = format_value(value)
        done: list[tuple[str, str]] = []
        for path, real in files:
            try:
                old = self._read_path(real, roots, 1 << 16)
                self._write_path(real, roots, text + "\n")
            except (OSError, UnicodeDecodeError) as exc:
                self._roll_back(param, done, roots)
                raise ApplyError(f"{param}: cannot write {text} to {path}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
            done.append((real, old))
        for real, _ in done:
            if isinstance(value, str):
                got = parse_choice(self._read_text(real, roots) or "")[0]
                ok = got == value
            else:
                got = self._read_file(real, roots)
                ok = got == float(text)
            if not ok:
                log.warning("%s: wrote %s to %s, reads back %s", param, text, real, got)

    def _roll_back(self, param: str, done: list[tuple[str, str]], roots: list[str]) -> None:
        for real, old in reversed(done):
            active, offered = parse_choice(old)
            text = active if offered else old      # "[bfq] none" cannot be written back
            try:
                self._write_path(real, roots, text)
            except OSError as exc:
                log.error("%s: could not restore %s: %s", param, real, exc)

    def _read_text(self, real: str, roots: list[str]) -> str | None:
        try:
            return self._read_path(real, roots)
        except (OSError, UnicodeDecodeError):
            return None

    def _read_file(self, real: str, roots: list[str]) -> float | None:
        text = self._read_text(real, roots)
        return None if text is None else _parse(text)

    def check(self, param: str) -> str | None:
        """Read-only: the pattern matches inside the allowed roots, and a file under
        /sys or /proc (which cannot be created) exists and can be opened for reading.
        Elsewhere (the simulator's directory) a missing file is fine: it is created."""
        try:
            files, roots = self.resolve(param)
        except ApplyError as exc:
            return str(exc)
        kernel = any(_within(r, t) for r in roots for t in KERNEL_TREES)
        for path, real in files:
            if not kernel and not os.path.lexists(real):
                continue
            try:
                os.close(self.open_resolved(real, os.O_RDONLY, roots))
            except FileNotFoundError:
                return f"{param}: {path} does not exist"
            except PermissionError:
                if os.geteuid() == 0:
                    return f"{param}: cannot open {path}: permission denied"
                # a check as a user of a file only root reads: the agent runs as root
            except OSError as exc:
                return f"{param}: cannot open {path}: {exc.strerror or exc}"
        return None

    def read(self, param: str) -> float | None:
        """The knob's value if every matching file agrees on it, else None."""
        try:
            files, roots = self.resolve(param)
        except ApplyError:
            return None
        values = {self._read_file(real, roots) for _, real in files}
        return values.pop() if len(values) == 1 else None

    def read_text(self, param: str) -> str | None:
        """A text knob's value (the bracketed choice, or the file's one word) if every
        matching file agrees on it, else None."""
        try:
            files, roots = self.resolve(param)
        except ApplyError:
            return None
        values = {parse_choice(self._read_text(real, roots) or "")[0] for _, real in files}
        return values.pop() if len(values) == 1 else None
