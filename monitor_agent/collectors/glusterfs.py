"""GlusterFS volume PIs: per-second I/O, fop rates and latencies, FUSE client memory.

Three sources, chosen by ``source``:

* ``"bricks"`` (default): the JSON that each brick's io-stats translator writes every
  second when the volume has ``diagnostics.stats-dump-interval 1``, to
  ``<stats_dir>/glusterfsd_<brick path, / as _>.dump`` (stats_dir is
  /var/lib/glusterd/stats whatever glusterd's working directory), summed over this
  node's bricks of the volume. The server's view (all clients together); a file read, no
  command, no cluster lock; unaffected by option changes (bricks reconfigure in place).
  The bricks are ``bricks`` (their directories) or, when not given, those ``gluster
  volume info VOL`` lists at start (bricks of other nodes have no dump here and are
  skipped), or, when that fails too, every fresh brick dump in stats_dir.
* ``"client"``: the dump of this node's FUSE client, ``<stats_dir>/glusterfs_<volume>.dump``
  (what the application here sees). Unreliable once the client has switched graphs
  (any translator switched on or off): the old graphs keep writing the same file, and
  here it read zeros for minutes under a steady 150 MB/s writer.
* ``"profile"``: ``gluster volume profile VOL info incremental`` (needs ``volume profile
  VOL start``): the bricks' counters since the previous call, summed over bricks, made
  rates with this collector's own clock. Answers in 0.1-0.6 s and takes the volume
  lock, so a concurrent ``volume set`` may be refused (the gluster applier retries).
  It excludes the dumps: io-stats keeps ONE interval counter, which the dump and
  ``info incremental`` both reset, so with both on each sees only part of the traffic.

Dumps are rewritten in place each second: an empty or half-written read is retried once,
then gives NaN; a dump older than ``max_age_s`` gives NaN. Their latencies, labelled
"usec", are nanoseconds in GlusterFS >= 7 (``dump_latency_unit = "ns"``, the default;
``"us"`` for older versions). Fop counts and latencies are
zero unless the volume has ``diagnostics.count-fop-hits on`` and
``diagnostics.latency-measurement on`` (``volume profile VOL start`` sets both); bytes
are always counted.

PIs per tick (names ``glusterfs.<volume>.<field>``):

* ``read_bytes_s``, ``write_bytes_s``; ``fops_s`` (all fops) and ``latency_us`` (their
  call-weighted mean latency; 0 when no call);
* per fop in ``fops`` (default FOPS): ``<fop>_s`` and ``<fop>_lat_us`` (0 when no call);
* ``client_rss_bytes``: resident memory of the volume's FUSE client on this node (the
  ``glusterfs`` process with ``--volfile-id=<volume>``, on ``mount`` when given; NaN
  when there is none). Switching translators on and off leaks client memory: watch it;
* optionally the current values of tuned options (``knobs``: PI field -> gluster key,
  or ``{ key = ..., unit = ... }`` with unit ``bool`` -> 1/0, ``B``/``KB``/``MB``/``GB``
  -> a number of that unit, ``""`` -> the number), read with ``gluster volume get VOL
  all`` every ``knobs_every`` ticks, so that the engine sees the values it tunes.

A command that fails or times out, or a file that cannot be read or parsed, gives NaN
for its fields this tick; ``collect`` never raises. ``gluster``, ``glusterd_sock`` and
``remote_host`` say how to reach glusterd (the test volume of
``tools/gluster-test-volume`` has its own socket). ``enable = true`` turns the chosen
source on when the collector starts (``volume set`` of the three diagnostics options
above that are not already so, or ``volume profile … start``); a failure there is a
warning. Building the collector runs nothing; ``check()`` (``capes config check``) only
queries (``volume info``, ``volume get``); ``monitor-agent --test`` puts back what it
turned on (``undo``), while a running agent leaves it on (the options are the volume's,
shared with the other nodes' agents).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from typing import Callable

from capes.common.bounded_run import run_bounded
from monitor_agent.collectors.base import Collector, register

log = logging.getLogger(__name__)
NAN = float("nan")
DEFAULT_STATS_DIR = "/var/lib/glusterd/stats"
FOPS = ("lookup", "create", "open", "read", "write", "flush", "fsync", "readdirp", "stat",
        "unlink")
TOTALS = ("read_bytes_s", "write_bytes_s", "fops_s", "latency_us")
SOURCES = ("bricks", "client", "profile")
# GlusterFS >= 7 measures fop latency in nanoseconds; the JSON dump still labels it
# "usec" (10.3 here: a brick's FLUSH dumps as 22773 "usec" while `volume profile` shows
# the same fop at 18257 ns). Set dump_latency_unit = "us" for older versions.
DUMP_LATENCY_SCALE = 1e-3
SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40,
              "PB": 1 << 50}
BOOL_WORDS = {"on": 1.0, "off": 0.0, "true": 1.0, "false": 0.0, "yes": 1.0, "no": 0.0,
              "enable": 1.0, "disable": 0.0, "enabled": 1.0, "disabled": 0.0}


# ---------------------------------------------------------------- pure parsers

def split_json_objects(text: str) -> list[dict]:
    """The JSON objects written one after another in ``text`` (the stats dump holds two);
    stops at the first one that does not parse (a half-written file)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return out
        if isinstance(obj, dict):
            out.append(obj)


def parse_stats_dump(text: str, fops=FOPS, latency_scale: float = DUMP_LATENCY_SCALE
                     ) -> dict[str, float] | None:
    """The per-second fields of one io-stats JSON dump (its "inter" object); None when the
    text has no complete interval object (empty or half-written file). The dump's
    ``latency_*_usec`` are multiplied by ``latency_scale`` to give microseconds."""
    inter = None
    for obj in split_json_objects(text):
        if any(".inter." in k for k in obj):
            inter = obj
    if inter is None:
        return None
    vals: dict[str, float] = {}
    for key, value in inter.items():
        if ".inter." in key and isinstance(value, (int, float)):
            vals[key.split(".inter.", 1)[1]] = float(value)
    interval = vals.get("sample_interval_sec") or 1.0
    out = {"read_bytes_s": vals.get("bytes_read_per_sec", 0.0),
           "write_bytes_s": vals.get("bytes_written_per_sec", 0.0),
           "fops_s": vals.get("fop.weighted_fop_count", 0.0) / interval,
           "latency_us": vals.get("fop.weighted_latency_ave_usec", 0.0) * latency_scale}
    for fop in fops:
        rate = vals.get(f"fop.{fop}.per_sec", 0.0)
        out[f"{fop}_s"] = rate
        out[f"{fop}_lat_us"] = (vals.get(f"fop.{fop}.latency_ave_usec", 0.0) * latency_scale
                                if rate else 0.0)
    return out


_FOP_ROW = re.compile(r"^\s*([\d.]+)\s+([\d.]+)\s*(ns|us)\s+([\d.]+)\s*(?:ns|us)\s+"
                      r"([\d.]+)\s*(?:ns|us)\s+(\d+)\s+([A-Z_]+)\s*$")
_DATA = re.compile(r"^\s*Data (Read|Written):\s*(\d+)\s*bytes", re.I)


def parse_profile(text: str) -> dict | None:
    """``gluster volume profile VOL info [incremental]`` summed over bricks:
    ``{"bricks": n, "read_bytes": .., "write_bytes": .., "fops": {fop: [calls,
    latency_sum_us]}}``. Only "Interval" sections count (a plain ``info`` also prints
    the cumulative ones). None when the text names no brick."""
    bricks, section = 0, None
    total = {"read_bytes": 0.0, "write_bytes": 0.0, "fops": {}}
    for line in text.splitlines():
        if line.startswith("Brick:"):
            bricks += 1
            section = None
            continue
        if re.match(r"^\s*Interval \d+ Stats:", line):
            section = "interval"
            continue
        if re.match(r"^\s*Cumulative Stats:", line):
            section = "cumulative"
            continue
        if section != "interval":
            continue
        m = _DATA.match(line)
        if m:
            total["read_bytes" if m.group(1).lower() == "read" else "write_bytes"] += \
                float(m.group(2))
            continue
        m = _FOP_ROW.match(line)
        if m:
            avg = float(m.group(2)) / (1000.0 if m.group(3) == "ns" else 1.0)
            calls, fop = int(m.group(6)), m.group(7).lower()
            acc = total["fops"].setdefault(fop, [0, 0.0])
            acc[0] += calls
            acc[1] += avg * calls
    if not bricks:
        return None
    total["bricks"] = bricks
    return total


def profile_rates(sample: dict | None, dt: float, fops=FOPS) -> dict[str, float] | None:
    """Per-second fields from a ``parse_profile`` result covering ``dt`` seconds."""
    if sample is None or not dt > 0:
        return None
    counted = {f: v for f, v in sample["fops"].items()}
    # fops with no latency of their own (RELEASE, FORGET) count as calls, not in the mean
    timed = [(c, s) for c, s in counted.values() if s > 0]
    calls = sum(c for c, _ in counted.values())
    timed_calls = sum(c for c, _ in timed)
    out = {"read_bytes_s": sample["read_bytes"] / dt, "write_bytes_s": sample["write_bytes"] / dt,
           "fops_s": calls / dt,
           "latency_us": sum(s for _, s in timed) / timed_calls if timed_calls else 0.0}
    for fop in fops:
        c, s = counted.get(fop, (0, 0.0))
        out[f"{fop}_s"] = c / dt
        out[f"{fop}_lat_us"] = s / c if c else 0.0
    return out


def parse_option_value(text: str, unit: str = "") -> float:
    """A gluster option value as a number: ``on``/``off`` -> 1/0 (unit ``bool``), sizes
    (``4MB``, ``131072``, ``1.5GB``) in ``unit``; NaN when it is neither."""
    word = text.strip().split()[0] if text.strip() else ""
    low = word.lower()
    if low in BOOL_WORDS:
        return BOOL_WORDS[low]
    m = re.fullmatch(r"([\d.]+)\s*([kmgtp]?b?)", low)
    if not m:
        return NAN
    try:
        number = float(m.group(1))
    except ValueError:
        return NAN
    suffix = m.group(2).upper()
    if suffix and not suffix.endswith("B"):
        suffix += "B"
    if unit.upper() in ("", "BOOL") and not suffix:
        return number
    scale = SIZE_UNITS.get(suffix, 1) / SIZE_UNITS.get(unit.upper(), 1)
    return number * scale


def parse_volume_get(text: str) -> dict[str, list[str]]:
    """``gluster volume get VOL KEY|all`` -> key -> its values (a key may be listed
    twice, e.g. performance.cache-size for io-cache and quick-read); "(DEFAULT)" and
    similar markers dropped."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] in ("Option", "------") or "." not in parts[0]:
            continue
        out.setdefault(parts[0], []).append(parts[1])
    return out


def combine(samples: list[dict[str, float]], fops=FOPS) -> dict[str, float]:
    """Several bricks' fields as one: rates summed, latencies weighted by call rates."""
    out = {f: sum(s[f] for s in samples) for f in ("read_bytes_s", "write_bytes_s", "fops_s")}
    out["latency_us"] = _weighted(samples, "fops_s", "latency_us")
    for fop in fops:
        out[f"{fop}_s"] = sum(s[f"{fop}_s"] for s in samples)
        out[f"{fop}_lat_us"] = _weighted(samples, f"{fop}_s", f"{fop}_lat_us")
    return out


def _weighted(samples, weight: str, value: str) -> float:
    total = sum(s[weight] for s in samples)
    return sum(s[weight] * s[value] for s in samples) / total if total else 0.0


def parse_volume_info_bricks(text: str) -> list[str]:
    """Brick directories from ``gluster volume info VOL`` (``Brick1: host:/path``)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*Brick\d+:\s*\S+?:(/\S*)", line)
        if m:
            out.append(m.group(1))
    return out


def brick_dump_name(brick: str) -> str:
    """``/srv/gl/b1`` -> ``glusterfsd__srv_gl_b1.dump``, as io-stats names it."""
    return "glusterfsd_" + brick.replace("/", "_") + ".dump"


def rss_bytes(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return NAN


def find_client(volume: str, mount: str | None = None, proc: str = "/proc") -> int | None:
    """The PID of the FUSE client of ``volume`` (on ``mount`` when given)."""
    mount = os.path.realpath(mount) if mount else None
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "cmdline"), "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) != "glusterfs":
            continue
        ids = [a.split("=", 1)[1] for a in argv if a.startswith("--volfile-id=")]
        ids += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--volfile-id"]
        if volume not in [i.lstrip("/") for i in ids]:
            continue
        if mount is None or os.path.realpath(argv[-1]) == mount:
            return int(entry)
    return None


# ---------------------------------------------------------------- the collector

def _knob_option(name: str, spec) -> tuple[str, str]:
    if isinstance(spec, str):
        return spec, ""
    if isinstance(spec, dict) and isinstance(spec.get("key"), str) \
            and set(spec) <= {"key", "unit"}:
        unit = spec.get("unit", "")
        if unit.upper() not in SIZE_UNITS and unit.lower() != "bool":
            raise ValueError(f"knobs.{name}.unit: {unit!r} is not one of bool, "
                             f"{', '.join(u for u in SIZE_UNITS if u)}")
        return spec["key"], unit
    raise ValueError(f"knobs.{name}: a gluster option key or {{ key = ..., unit = ... }}")


@register("glusterfs")
class GlusterFSCollector(Collector):
    def __init__(self, volume: str, source: str = "bricks", bricks: list[str] | None = None,
                 stats_dir: str = DEFAULT_STATS_DIR, max_age_s: float = 5.0,
                 mount: str | None = None, fops: list[str] | None = None,
                 knobs: dict | None = None, knobs_every: int = 1,
                 gluster: str = "gluster", glusterd_sock: str | None = None,
                 remote_host: str | None = None, timeout_s: float = 2.0,
                 dump_latency_unit: str = "ns",
                 enable: bool = False, clock: Callable[[], float] = time.monotonic):
        if not isinstance(volume, str) or not re.fullmatch(r"[\w.-]+", volume):
            raise ValueError(f"volume: must be a volume name (got {volume!r})")
        if source not in SOURCES:
            raise ValueError(f"source: must be one of {', '.join(SOURCES)} (got {source!r})")
        if bricks is not None and (not isinstance(bricks, list) or not all(
                isinstance(b, str) and b.startswith("/") for b in bricks)):
            raise ValueError("bricks: must be a list of brick directories, e.g. "
                             "[\"/data/brick1\"]")
        if not timeout_s > 0 or not max_age_s > 0:
            raise ValueError("timeout_s, max_age_s: must be > 0")
        if not isinstance(knobs_every, int) or knobs_every < 1:
            raise ValueError(f"knobs_every: must be an integer >= 1 (got {knobs_every!r})")
        fops = list(FOPS if fops is None else fops)
        if not all(isinstance(f, str) and re.fullmatch(r"[a-z_]+", f) for f in fops):
            raise ValueError("fops: must be a list of lower-case fop names, e.g. "
                             "[\"read\", \"write\", \"lookup\"]")
        if dump_latency_unit not in ("ns", "us"):
            raise ValueError(f"dump_latency_unit: must be ns or us (got {dump_latency_unit!r})")
        self.latency_scale = 1e-3 if dump_latency_unit == "ns" else 1.0
        self.volume, self.source, self.fops = volume, source, fops
        self.stats_dir = stats_dir
        self.client_file = os.path.join(stats_dir, f"glusterfs_{volume}.dump")
        self.max_age_s, self.mount, self.timeout_s = float(max_age_s), mount, float(timeout_s)
        self.knobs = {n: _knob_option(n, s) for n, s in (knobs or {}).items()}
        self.knobs_every = knobs_every
        self._cli = [gluster]
        if glusterd_sock:
            self._cli.append(f"--glusterd-sock={glusterd_sock}")
        if remote_host:
            self._cli.append(f"--remote-host={remote_host}")
        self._clock = clock
        self.fields = [*TOTALS, *(f"{f}{s}" for f in fops for s in ("_s", "_lat_us")),
                       "client_rss_bytes", *self.knobs]
        self._names = [f"glusterfs.{volume}.{f}" for f in self.fields]
        self.failures = 0
        self.last_error = ""
        self._client_pid: int | None = None
        self._ticks = 0
        self._knob_values: dict[str, float] = {}
        self.enable = bool(enable)
        self.bricks = bricks
        self._started = False
        self._undo: list[list[str]] = []    # gluster commands that put back what start did
        self._prev_t = clock()

    # -------------------------------------------------------------- lifecycle

    def effects(self) -> list[str]:
        out = [f"runs {self._cli[0]} volume get every {self.knobs_every} ticks"] \
            if self.knobs else []
        if self.source == "profile":
            out.append(f"runs {self._cli[0]} volume profile info every tick")
        if self.enable:
            out.append(f"turns on the {self.source} source of volume {self.volume} at "
                       f"start ({'volume profile start' if self.source == 'profile' else 'volume set diagnostics.*'})")
        return out

    def check(self) -> list[str]:
        """Read-only: glusterd answers for the volume (``volume info``), and every knob
        it reads is an option of the volume (``volume get VOL all``)."""
        if self._run(["volume", "info", self.volume], quiet=True) is None:
            return [f"volume {self.volume}: {self._cli[0]} volume info failed: "
                    f"{self.last_error} (is glusterd running and reachable?)"]
        if not self.knobs:
            return []
        text = self._run(["volume", "get", self.volume, "all"], quiet=True)
        if text is None:
            return [f"volume {self.volume}: {self._cli[0]} volume get failed: "
                    f"{self.last_error}"]
        known = parse_volume_get(text)
        return [f"knobs.{name}: {key!r} is not an option of volume {self.volume}"
                for name, (key, _) in self.knobs.items() if key not in known]

    def start(self) -> None:
        """Turn the source on (``enable``), find the bricks, start a profile interval:
        once, before the first collection."""
        if self._started:
            return
        self._started = True
        if self.enable:
            self._enable()
        if self.source == "bricks" and self.bricks is None:
            out = self._run(["volume", "info", self.volume])
            found = parse_volume_info_bricks(out) if out is not None else []
            self.bricks = found or None     # None: every fresh brick dump in stats_dir
        self._prev_t = self._clock()
        if self.source == "profile":
            self._run(self._profile_args())          # starts a fresh interval

    def undo(self) -> None:
        """Put back the options ``start`` changed (``monitor-agent --test``). The
        agent itself leaves them on: several agents share one volume's options."""
        for args in reversed(self._undo):
            if self._run(args) is None:
                log.warning("glusterfs collector: could not put back %s of volume %s",
                            " ".join(args[3:]) or args[2], self.volume)
        self._undo = []

    def _enable(self) -> None:
        if self.source == "profile":
            if self._run(["volume", "profile", self.volume, "start"], quiet=True) is not None:
                self._undo.append(["volume", "profile", self.volume, "stop"])
            return                 # failed: most often already started, which is fine
        text = self._run(["volume", "get", self.volume, "all"]) or ""
        before = parse_volume_get(text)
        for key, value in (("diagnostics.count-fop-hits", "on"),
                           ("diagnostics.latency-measurement", "on"),
                           ("diagnostics.stats-dump-interval", "1")):
            old = before.get(key, [None])[0]
            if old == value:
                continue
            if self._run(["volume", "set", self.volume, key, value]) is None:
                log.warning("glusterfs collector: could not enable the %s source of "
                            "volume %s", self.source, self.volume)
                return
            self._undo.append(["volume", "set", self.volume, key, old] if old is not None
                              else ["volume", "reset", self.volume, key])

    # -------------------------------------------------------------- commands

    def _profile_args(self) -> list[str]:
        return ["volume", "profile", self.volume, "info", "incremental"]

    def _run(self, args: list[str], quiet: bool = False) -> str | None:
        """The command's stdout; None (logged sparingly, unless ``quiet``; the reason in
        ``last_error``) when it fails or times out."""
        argv = [*self._cli, "--mode=script", *args]
        try:
            done = run_bounded(argv, self.timeout_s)
        except OSError as exc:
            reason = str(exc)
        else:
            if done.ok:
                return done.stdout
            reason = done.why(self.timeout_s)
        self.last_error = reason
        if quiet:
            return None
        self.failures += 1
        if self.failures == 1 or math.log2(self.failures).is_integer():
            log.warning("glusterfs collector: %s %s: %s (%d failures)", self._cli[0],
                        " ".join(args[:3]), reason, self.failures)
        return None

    # -------------------------------------------------------------- sources

    def _dump(self, path: str) -> dict[str, float] | None:
        """One dump's fields; None when stale, unreadable or half-written (one retry)."""
        for attempt in range(2):
            try:
                if time.time() - os.stat(path).st_mtime > self.max_age_s:
                    return None
                with open(path, "rb") as fh:
                    text = fh.read(1 << 20).decode("utf-8", "replace")
            except OSError:
                return None
            sample = parse_stats_dump(text, self.fops, self.latency_scale)
            if sample is not None:
                return sample
            if attempt == 0:
                time.sleep(0.02)
        return None

    def _from_bricks(self) -> dict[str, float] | None:
        if self.bricks is None:
            try:
                paths = sorted(os.path.join(self.stats_dir, f)
                               for f in os.listdir(self.stats_dir)
                               if f.startswith("glusterfsd_") and f.endswith(".dump"))
            except OSError:
                return None
            samples = [s for s in map(self._dump, paths) if s is not None]
        else:
            paths = [os.path.join(self.stats_dir, brick_dump_name(b)) for b in self.bricks]
            paths = [p for p in paths if os.path.exists(p)]    # others: remote bricks
            samples = [self._dump(p) for p in paths]
            if any(s is None for s in samples):
                return None
        return combine(samples, self.fops) if samples else None

    def _from_profile(self, dt: float) -> dict[str, float] | None:
        out = self._run(self._profile_args())
        return None if out is None else profile_rates(parse_profile(out), dt, self.fops)

    def _client_rss(self) -> float:
        pid = self._client_pid
        if pid is None or not os.path.exists(f"/proc/{pid}"):
            pid = self._client_pid = find_client(self.volume, self.mount)
        return NAN if pid is None else rss_bytes(pid)

    def _knobs(self) -> dict[str, float]:
        if not self.knobs:
            return {}
        if self._ticks % self.knobs_every == 0 or not self._knob_values:
            text = self._run(["volume", "get", self.volume, "all"])
            got = parse_volume_get(text) if text is not None else {}
            self._knob_values = {}
            for name, (key, unit) in self.knobs.items():
                values = {parse_option_value(v, unit) for v in got.get(key, [])}
                self._knob_values[name] = values.pop() if len(values) == 1 else NAN
        return self._knob_values

    # -------------------------------------------------------------- interface

    def names(self) -> list[str]:
        return list(self._names)

    def collect(self) -> dict[str, float]:
        self.start()
        now = self._clock()
        dt, self._prev_t = now - self._prev_t, now
        try:
            if self.source == "bricks":
                values = self._from_bricks()
            elif self.source == "client":
                values = self._dump(self.client_file)
            else:
                values = self._from_profile(dt)
            values = dict(values or {})
            values["client_rss_bytes"] = self._client_rss()
            values.update(self._knobs())
        except Exception:                   # never let a surprise kill the agent
            log.exception("glusterfs collector: unexpected error")
            values = {}
        self._ticks += 1
        return {n: float(values.get(f, NAN)) for n, f in zip(self._names, self.fields)}
