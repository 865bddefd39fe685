"""The control agent's state file: what it must remember across a restart or a kill -9.

Two things per knob, each keyed by parameter *and* applier fingerprint (its applier's
name and options, so an original recorded for ``sda`` is never written to ``sdb``):

* ``originals``: the host's own value, recorded before CAPES first changes the knob;
  restoring puts it back (``{param, applier, value, recorded_at}``; ``value`` is a
  number, or a categorical knob's name);
* ``changes``: the wall-clock time of the knob's last change, for knobs with a
  ``min_dwell_s``, so that a restarted agent (or ``capes restore-defaults`` then a new
  agent) still holds the knob to its dwell (``{param, applier, changed_at}``; kept only
  while the dwell runs).

Entries of other knobs (another fingerprint: a second deployment sharing the file) are
left as they are. The file is JSON, rewritten atomically, and removed once it holds
nothing.

**The file is not trusted.** It is opened without following a symlink and without
blocking (a FIFO cannot hang the agent), must be a regular file of at most
``MAX_BYTES``, and every entry is checked field by field (types, finite numbers within
float range, printable names of bounded length). A file that fails is moved aside to
``<file>.corrupt`` with one warning line and nothing of it is used; a bad entry is
dropped: the whole file is then copied aside for the operator and the good entries are
kept, so a restore still puts back every good value.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import tempfile
import time
from pathlib import Path

from capes.common.atomic import remove_stale_temps, write_json
from capes.common.deployment import DeploymentConfig

log = logging.getLogger("capes.control_agent")

# root's state directory: the unit's StateDirectory=capes-agent, never the daemon's
# /var/lib/capes (owned by User=capes; see deploy/systemd)
AGENT_STATE_DIR = "/var/lib/capes-agent"
MAX_BYTES = 1 << 20             # a state file holds a few entries per knob: 1 MiB is plenty
MAX_ENTRIES = 10_000
MAX_TEXT = 255                  # a parameter or categorical value name, as on the wire
LATEST_TIME = 1e11              # seconds since 1970 (year 5138): beyond it, not a time


class StateFileError(ValueError):
    """The state file as a whole cannot be used."""


def state_path(cfg: DeploymentConfig) -> Path | None:
    """Where this node's original values are kept (None: in memory only)."""
    node = re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.control.node) or "node"
    spec = cfg.control.state_file
    if not spec:
        return None
    if spec == "auto":
        if os.geteuid() == 0:
            base = Path(AGENT_STATE_DIR)
        else:
            try:
                home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state")
            except (RuntimeError, KeyError):          # no home directory at all
                home = Path(tempfile.gettempdir()) / f"capes-{os.geteuid()}"
            base = home / "capes"
        return base / f"control-{node}.json"
    return Path(spec.replace("{node}", node)).expanduser()


def applier_fingerprint(cfg: DeploymentConfig, param: str) -> dict:
    """What identifies a knob: its applier's name and options, as plain JSON. An original
    recorded under another fingerprint (the config now points elsewhere, e.g. sda ->
    sdb) is never written to this knob."""
    ac = cfg.control.appliers.get(param)
    raw = {"name": ac.name, "options": ac.options} if ac is not None else {"name": "?"}
    return json.loads(json.dumps(raw, sort_keys=True, default=str))


# -- reading, bounded and checked -----------------------------------------------------------

def _parse_int(text: str) -> int | float:
    """A JSON integer; one beyond any float (10**400) reads as infinite (then refused)
    rather than costing the quadratic conversion of thousands of digits."""
    return int(text) if len(text) <= 320 else math.inf


def read_bounded(path: Path) -> bytes | None:
    """The file's bytes (None: there is none). StateFileError for a symlink, anything
    but a regular file, or a file over MAX_BYTES; never blocks, never reads more."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise StateFileError("a symbolic link, not a regular file") from None
        raise StateFileError(exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError("not a regular file")
        if st.st_size > MAX_BYTES:
            raise StateFileError(f"{st.st_size} bytes, more than a state file's "
                                 f"{MAX_BYTES}")
        data = os.read(fd, MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise StateFileError(f"more than a state file's {MAX_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _text(x) -> str | None:
    return x if isinstance(x, str) and 0 < len(x) <= MAX_TEXT and x.isprintable() and \
        not any(c.isspace() for c in x) else None


def _finite(x) -> float | None:
    """``x`` as a finite float (None: not a number, NaN, infinite, beyond float range)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        f = float(x)
    except OverflowError:                    # an int such as 10**400
        return None
    return f if math.isfinite(f) else None


def _time(x) -> float | None:
    t = _finite(x)
    return t if t is not None and 0 <= t <= LATEST_TIME else None


def check_original(e) -> tuple[dict | None, str | None]:
    """(the entry cleaned, or None when it is unusable; what was wrong, or None)."""
    if not isinstance(e, dict) or _text(e.get("param")) is None or \
            not isinstance(e.get("applier"), dict):
        return None, "an entry without a parameter name and applier"
    value = e.get("value")
    v = _text(value) if isinstance(value, str) else _finite(value)
    if v is None:
        return None, f"{e['param']}: value {str(value)[:40]!r} is not a finite number or a name"
    out = {"param": e["param"], "applier": e["applier"], "value": v,
           "recorded_at": _time(e.get("recorded_at", 0.0))}
    if out["recorded_at"] is None:          # the value is good: keep it, time unknown
        out["recorded_at"] = 0.0
        return out, f"{e['param']}: recorded_at {str(e.get('recorded_at'))[:40]!r} is not a time"
    return out, None


def check_change(e) -> tuple[dict | None, str | None]:
    if not isinstance(e, dict) or _text(e.get("param")) is None or \
            not isinstance(e.get("applier"), dict):
        return None, "a change without a parameter name and applier"
    t = _time(e.get("changed_at"))
    if t is None:
        return None, f"{e['param']}: changed_at {str(e.get('changed_at'))[:40]!r} is not a time"
    return {"param": e["param"], "applier": e["applier"], "changed_at": t}, None


def parse_state(data: bytes) -> tuple[list[dict], list[dict], list[str]]:
    """(originals, changes, problems) of a state file's bytes; StateFileError when the
    file as a whole is unusable."""
    try:
        doc = json.loads(data, parse_int=_parse_int)
    except (ValueError, RecursionError) as exc:        # JSONDecodeError, bad UTF-8, nesting
        raise StateFileError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise StateFileError("not a JSON object")
    sections = []
    for key, check in (("originals", check_original), ("changes", check_change)):
        entries = doc.get(key, [])
        if not isinstance(entries, list):
            raise StateFileError(f"'{key}' is not a list")
        if len(entries) > MAX_ENTRIES:
            raise StateFileError(f"{len(entries)} entries in '{key}', more than {MAX_ENTRIES}")
        sections.append([check(e) for e in entries])
    if "originals" not in doc and "changes" not in doc:
        raise StateFileError("no 'originals'")
    problems = [why for section in sections for _, why in section if why]
    originals, changes = ([e for e, _ in section if e is not None] for section in sections)
    return originals, changes, problems


class OriginalValues:
    """The host's own value of each knob and the time of its last change (see the
    module docstring). ``values``/``recorded_at`` hold this deployment's originals,
    ``changed_at`` the wall-clock times of its knobs' last changes still inside their
    dwell (``dwell``: parameter -> min_dwell_s, for the knobs that have one)."""

    VERSION = 2

    def __init__(self, path: Path | None, node: str, fingerprints: dict[str, dict],
                 dwell: dict[str, float] | None = None):
        self.path, self.node, self.fingerprints = path, node, fingerprints
        self.dwell = {p: d for p, d in (dwell or {}).items() if d > 0}
        self.values: dict[str, float | str] = {}
        self.recorded_at: dict[str, float] = {}
        self.changed_at: dict[str, float] = {}
        originals, changes = self._load(report=True)
        for e in originals:
            param = e["param"]
            if param not in fingerprints:
                continue
            if self._mine(e):
                self.values[param] = e["value"]
                self.recorded_at[param] = e["recorded_at"]
            else:
                log.warning("%s: the state file %s holds an original value %r recorded "
                            "for another applier (%s); it is not restored here", param,
                            path, e["value"], json.dumps(e["applier"]))
        for e in changes:
            if self._mine(e) and e["param"] in self.dwell:
                self.changed_at[e["param"]] = e["changed_at"]

    def _aside(self) -> Path:
        return self.path.with_name(self.path.name + ".corrupt")

    def _load(self, report: bool = False) -> tuple[list[dict], list[dict]]:
        """The file's good entries (originals, changes). With ``report``: a bad file is
        moved aside, a bad entry copied aside with the file and dropped from it, each
        with one warning line."""
        if self.path is None:
            return [], []
        try:
            data = read_bounded(self.path)
            if data is None:
                return [], []
            originals, changes, problems = parse_state(data)
        except StateFileError as exc:
            if report:
                self._move_aside(str(exc))
            return [], []
        if problems and report:
            aside = self._aside()
            try:
                with open(aside, "wb") as fh:
                    fh.write(data)
                kept = f"copied to {aside}"
            except OSError as exc:
                kept = f"not copied aside: {exc.strerror or exc}"
            log.warning("state file %s: %s%s; those entries are ignored (the file was %s)",
                        self.path, "; ".join(problems[:3]),
                        f" and {len(problems) - 3} more" if len(problems) > 3 else "", kept)
            try:
                self._write(originals, changes)
            except OSError:
                pass
        return originals, changes

    def _move_aside(self, why: str) -> None:
        aside = self._aside()
        try:
            os.replace(self.path, aside)
            where = f"moved it to {aside}"
        except OSError as exc:
            where = f"could not move it aside: {exc.strerror or exc}"
        log.error("cannot use the state file %s (%s); %s", self.path, why, where)

    def _mine(self, e: dict) -> bool:
        return self.fingerprints.get(e["param"]) == e["applier"]

    def _write(self, originals: list[dict], changes: list[dict]) -> None:
        if originals or changes:
            write_json(self.path, {"version": self.VERSION, "node": self.node,
                                   "originals": originals, "changes": changes})
        else:
            self.path.unlink(missing_ok=True)
            remove_stale_temps(self.path.parent, self.path.name)

    def _save(self) -> None:
        if self.path is None:
            return
        originals, changes = self._load()
        now = time.time()
        for p, t in list(self.changed_at.items()):    # a dwell that ran out: forget it
            if now - t >= self.dwell[p]:
                del self.changed_at[p]
        originals = [e for e in originals if not self._mine(e)]
        originals += [{"param": p, "applier": self.fingerprints[p], "value": v,
                       "recorded_at": self.recorded_at.get(p, 0.0)}
                      for p, v in sorted(self.values.items())]
        changes = [e for e in changes if not self._mine(e)]
        changes += [{"param": p, "applier": self.fingerprints[p], "changed_at": t}
                    for p, t in sorted(self.changed_at.items())]
        self._write(originals, changes)

    def check_writable(self) -> str | None:
        """Why the state file cannot be written (None: it can)."""
        if self.path is None:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot create {self.path.parent}: {exc.strerror or exc}"
        if not os.access(self.path.parent, os.W_OK):
            return f"cannot write in {self.path.parent}"
        return None

    def record(self, param: str, value: float | str) -> None:
        """Remember ``value`` as ``param``'s original unless one is known (OSError: not
        saved, and not remembered either)."""
        if param in self.values:
            return
        self.values[param] = value
        self.recorded_at[param] = time.time()
        try:
            self._save()
        except OSError:
            del self.values[param]
            raise

    def changed(self, params, at: float | None = None) -> None:
        """Note that ``params`` changed now (only those with a dwell are kept); saved
        with the next write, or now (OSError: not saved)."""
        params = [p for p in params if p in self.dwell]
        for p in params:
            self.changed_at[p] = time.time() if at is None else at
        if params:
            self._save()

    def dwell_left(self, param: str, now: float | None = None) -> float:
        """Seconds before ``param`` may change again by the recorded time (0: now). A
        time in the future (the clock went back) counts as a change just now."""
        t = self.changed_at.get(param)
        if t is None:
            return 0.0
        now = time.time() if now is None else now
        return max(0.0, self.dwell[param] - max(0.0, now - t))

    def forget(self, params) -> None:
        """Forget the originals of ``params`` (restored); their change times stay."""
        params = [p for p in params if p in self.values]
        for p in params:
            del self.values[p]
            self.recorded_at.pop(p, None)
        if params:
            self._save()
