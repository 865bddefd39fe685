"""GlusterFS volume options, set live with ``gluster volume set VOL KEY VALUE``.

Each parameter maps to one volume option (``key``, or a ``keys`` table parameter ->
option for an applier serving several) and a ``unit`` (or ``units`` table) that says how
the engine's number is written:

* ``""`` (default): the number as it is (``performance.io-thread-count 16``,
  ``client.event-threads 4``);
* ``"bool"``: 0 -> ``off``, anything else -> ``on`` (``performance.read-ahead``,
  ``performance.write-behind``, ...);
* ``"B"``, ``"KB"``, ``"MB"``, ``"GB"``: a size in that unit, written with the suffix
  gluster understands (4 with unit ``MB`` -> ``4MB``; a fractional value is written in
  bytes: 1.5 MB -> ``1572864``). Gluster's units are powers of 1024.

A categorical parameter (``values = ["on", "off"]``, ``cluster.read-hash-mode``'s
numbers, ``performance.cache-size``'s sizes...) is set by its value's name, written as
it is; such a parameter takes no ``unit``.

``read`` runs ``gluster volume get VOL KEY`` and converts the value back to the same
unit; None when it cannot be read, or when the key is listed twice with different values
(``performance.cache-size`` belongs to io-cache and quick-read, whose defaults differ
until it is set).

A non-zero exit or a timeout is an ApplyError. ``volume set`` takes the volume lock;
while another transaction holds it (a profile query, another agent) gluster answers
"Another transaction is in progress", and the set is retried ``retries`` times, 0.2 s
apart. Switching a translator on or off rebuilds every client's graph: the FUSE client
leaks memory each time, and its stats read zero for tens of seconds, so such knobs need
a long dwell (see docs/targets.md). ``gluster``, ``glusterd_sock`` and ``remote_host``
say how to reach glusterd.
"""
from __future__ import annotations

import math
import re
import time

from capes.common.bounded_run import run_bounded
from control_agent.appliers.base import (CATEGORICAL, NUMERIC, Applier, ApplyError,
                                         format_value, register)

UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
BOOL_WORDS = {"on": 1.0, "off": 0.0, "true": 1.0, "false": 0.0, "yes": 1.0, "no": 0.0,
              "enable": 1.0, "disable": 0.0, "1": 1.0, "0": 0.0}
BUSY = ("another transaction", "locking failed", "is in progress")
KEY_RE = re.compile(r"[a-z][\w.-]*\.[\w.-]+", re.I)


def _unit(name: str, unit) -> str:
    if not isinstance(unit, str) or (unit.upper() not in UNITS and unit.lower() != "bool"):
        raise ValueError(f"{name}: unit must be one of \"\", bool, B, KB, MB, GB "
                         f"(got {unit!r})")
    return unit.lower() if unit.lower() == "bool" else unit.upper()


def to_option(value: float, unit: str) -> str:
    """The engine's number in the option's syntax."""
    value = float(value)
    if unit == "bool":
        return "off" if value == 0 else "on"
    if unit in ("", "B") or not value.is_integer():
        return format_value(value * UNITS[unit]) if unit else format_value(value)
    return f"{int(value)}{unit}"


def from_option(text: str, unit: str) -> float | None:
    """An option's value (``4MB``, ``on``, ``16``, ``131072``) as a number in ``unit``."""
    word = text.strip().split()[0].lower() if text.strip() else ""
    if word in BOOL_WORDS and (unit == "bool" or word not in ("0", "1")):
        return BOOL_WORDS[word]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", word)
    if not m:
        return None
    number = float(m.group(1))
    if unit in ("", "bool"):
        return number if not m.group(2) else number * UNITS[m.group(2).upper() + "B"]
    suffix = (m.group(2).upper() + "B") if m.group(2) else "B"
    return number * UNITS[suffix] / UNITS[unit]


def parse_volume_get(text: str, key: str) -> list[str]:
    """The values ``gluster volume get VOL KEY`` prints for ``key`` (may be several)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == key:
            out.append(parts[1])
    return out


@register("gluster")
class GlusterApplier(Applier):
    kinds = (NUMERIC, CATEGORICAL)
    def __init__(self, volume: str, key: str | None = None,
                 keys: dict[str, str] | None = None, unit: str = "",
                 units: dict[str, str] | None = None, gluster: str = "gluster",
                 glusterd_sock: str | None = None, remote_host: str | None = None,
                 timeout_s: float = 20.0, retries: int = 5):
        if not isinstance(volume, str) or not re.fullmatch(r"[\w.-]+", volume):
            raise ValueError(f"volume: must be a volume name (got {volume!r})")
        if key is None and not keys:
            raise ValueError("key: give 'key' or a 'keys' table (parameter -> option)")
        for name, k in [("key", key)] + [(f"keys.{p}", v) for p, v in (keys or {}).items()]:
            if k is not None and (not isinstance(k, str) or not KEY_RE.fullmatch(k)):
                raise ValueError(f"{name}: must be a volume option such as "
                                 f"performance.io-thread-count (got {k!r})")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries: must be an integer >= 0 (got {retries!r})")
        self.volume, self.key, self.keys = volume, key, dict(keys or {})
        self.unit = _unit("unit", unit)
        self.units = {p: _unit(f"units.{p}", u) for p, u in (units or {}).items()}
        self.cli = [gluster]
        if glusterd_sock:
            self.cli.append(f"--glusterd-sock={glusterd_sock}")
        if remote_host:
            self.cli.append(f"--remote-host={remote_host}")
        self.timeout_s, self.retries = float(timeout_s), retries
        self.last_latency_s = math.nan

    def option(self, param: str) -> tuple[str, str]:
        """(gluster option key, unit) of ``param``."""
        key = self.keys.get(param, self.key)
        if key is None:
            raise ApplyError(f"{param}: no gluster option configured for this parameter")
        return key, self.units.get(param, self.unit)

    def _run(self, args: list[str], param: str) -> str:
        argv = [*self.cli, "--mode=script", *args]
        try:
            done = run_bounded(argv, self.timeout_s)
        except OSError as exc:
            raise ApplyError(f"{param}: cannot run {argv[0]}: {exc}") from None
        if done.timed_out or done.overflow:
            raise ApplyError(f"{param}: {' '.join(args[:3])} {done.why(self.timeout_s)}")
        if done.returncode != 0:
            msg = (done.stderr.strip() or done.stdout.strip())[-300:]
            raise ApplyError(f"{param}: {' '.join(args[:2])} {args[3] if len(args) > 3 else ''}"
                             f" exited with status {done.returncode}: {msg}")
        return done.stdout

    def check(self, param: str) -> str | None:
        """Read-only (``volume get VOL KEY``): glusterd answers and the option exists."""
        try:
            done = run_bounded([*self.cli, "--mode=script", "volume", "info", self.volume],
                               self.timeout_s)
            why = None if done.ok else done.why(self.timeout_s)
        except OSError as exc:
            why = str(exc)
        if why is not None:                # worded as the glusterfs collector's check
            return (f"volume {self.volume}: {self.cli[0]} volume info failed: {why} (is "
                    f"glusterd running and reachable?)")
        try:
            key, _ = self.option(param)
            out = self._run(["volume", "get", self.volume, key], param)
        except ApplyError as exc:
            return str(exc)
        if not parse_volume_get(out, key):
            return f"{key!r} is not an option of volume {self.volume}"
        return None

    def supports(self, param: str, categorical: bool) -> str | None:
        if categorical and self.units.get(param, self.unit):
            return (f"a categorical parameter is set by its value's name: give it no unit "
                    f"(got {self.units.get(param, self.unit)!r})")
        return super().supports(param, categorical)

    def apply(self, param: str, value: float | str) -> None:
        key, unit = self.option(param)
        if isinstance(value, str):          # a categorical value, by name
            if not value or not value.isprintable() or any(c.isspace() for c in value):
                raise ApplyError(f"{param}: refusing to set {value!r}")
            text = value
        else:
            text = to_option(value, unit)
        t0 = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                self._run(["volume", "set", self.volume, key, text], param)
                break
            except ApplyError as exc:
                busy = any(b in str(exc).lower() for b in BUSY)
                if not busy or attempt == self.retries:
                    raise
                time.sleep(0.2)
        self.last_latency_s = time.monotonic() - t0

    def read(self, param: str) -> float | None:
        try:
            key, unit = self.option(param)
            out = self._run(["volume", "get", self.volume, key], param)
        except ApplyError:
            return None
        values = {from_option(v, unit) for v in parse_volume_get(out, key)}
        if len(values) != 1:
            return None
        return values.pop()

    def read_text(self, param: str) -> str | None:
        """A categorical option's value as gluster prints it (None: unreadable, or
        listed twice with different values)."""
        try:
            key, _ = self.option(param)
            out = self._run(["volume", "get", self.volume, key], param)
        except ApplyError:
            return None
        values = set(parse_volume_get(out, key))
        return values.pop() if len(values) == 1 else None
