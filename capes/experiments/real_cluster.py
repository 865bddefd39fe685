"""Live tuning of a real GlusterFS cluster on one machine (issue 40): the workloads by
phase across clients, the static grid, the tuners through the stack, the score.

The cluster is :class:`~capes.experiments.gluster_volume.GlusterTestVolume` with
``clients=N`` FUSE mounts (nodes ``client1..N``) and bricks on throttled loop devices.
The knob is each client's own FUSE readahead window (``/sys/class/bdi/<0:NN>/
read_ahead_kb`` of its mount), a per-node row (``clientK/read_ahead_kb``); the volume's
options stay at their values (the facts in docs/targets.md: the defaults are near-best
and the per-node engine has no shared row beside per-node rows).

Workloads (``PHASES``): each phase gives every client a fio job or none, as the cluster
simulator's phases do: checkpoint-like 1 MiB writes on all clients; 1 MiB sequential
reads on half of them; a mix (half 70/30 random 4 KiB read/write, half sequential
readers); a small-file storm (many 64 KiB files read in 4 KiB requests on every client).
fio runs in segments (``segment_s``; a new ``read_ahead_kb`` reaches a reader only when
it opens its file); **the objective is fio's own bytes/s (reads + writes) summed over
the clients**, one row per second, with each client's figure kept for fairness (Jain's
index over the active clients).

Scoring is :mod:`capes.experiments.real_readahead`'s: each phase's throughput over its
workload's best static throughput (``relative``), the difference from the best static
setting with a 95 % interval, the worst 10 s against the original.

Root only.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capes.experiments import evaluate as ev
from capes.experiments import real_readahead as rr
from capes.experiments import workload_driver as wd
from capes.experiments.gluster_volume import (BrickDisk, GlusterError, GlusterTestVolume,
                                              bdi_read_ahead_path)
from capes.experiments.process_group import ProcessGroup, kill_session

REPO = Path(__file__).resolve().parents[2]
CLUSTER_CONFIG = REPO / "configs" / "glusterfs-cluster.toml"
KNOB = "read_ahead_kb"
PI = "app_bytes_s"

# fio jobs (one per client); {file}/{dir}, {seconds} filled in per segment
JOBS = {
    "seqwrite": "rw=write\nbs=1M\nfilename={dir}/ckpt\nsize=256M\n",
    # sequential 4 KiB reads: what each FUSE request carries is the readahead window
    "seqread": "rw=read\nbs=4k\nfilename={dir}/data\nsize={data_mib}M\n",
    "randwrite": ("rw=randwrite\nbs=4k\nfilename={dir}/data\nsize={data_mib}M\n"
                  "randrepeat=0\n"),
    # random 4 KiB page faults through mmap (no fadvise): each fault reads around it by
    # the client's readahead window
    "mmaprand": ("ioengine=mmap\nrw=randread\nbs=4k\nfadvise_hint=0\nrandrepeat=0\n"
                 "filename={dir}/data\nsize={data_mib}M\n"),
    "smallfiles": ("rw=read\nbs=4k\ndirectory={dir}/small\nnrfiles={nfiles}\n"
                   "filesize=64k\nfilename_format=f.$filenum\nopenfiles=8\n"
                   "file_service_type=sequential\n"),
}
JOB_HEAD = ("[global]\nioengine=psync\ntime_based=1\nruntime={seconds}\n"
            "invalidate=1\nallow_file_create={create}\n[job]\n")

# phase name -> what each class of clients runs ("all", "half": the first half of the
# clients, "rest": the others; None: idle)
PHASES = {
    "checkpoint": {"all": "seqwrite"},
    "analysis": {"half": "seqread", "rest": None},
    "mixed": {"half": "mmaprand", "rest": "randwrite"},
    "smallfiles": {"all": "smallfiles"},
}
# the four phases twice: every workload returns once. A schedule in which only analysis
# and mixed returned gave the per-phase best a gap of 0.071-0.133 over the best static
# setting (4 KiB loses only the small-file storm, 0.58-0.61 of its best); with every phase
# returning the same grids give 0.106-0.165 (docs/targets.md, item 7), and a tuner that
# remembers is judged on as many returns as first visits.
DEFAULT_SCHEDULE = ["checkpoint", "analysis", "mixed", "smallfiles"] * 2
BRICK_GIB = 2.0                   # each brick's loop device
LADDER = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# arms that run the stack with no tuner, every client held: at the best static setting,
# or where it was (the untuned cluster under the same stack and load)
HELD = ("static", "original")


def assignment(phase: str, nodes: list[str]) -> dict[str, str | None]:
    """Which job each node runs in ``phase``."""
    spec = PHASES[phase]
    half = max(1, len(nodes) // 2)
    out = {}
    for i, n in enumerate(nodes):
        key = "all" if "all" in spec else ("half" if i < half else "rest")
        out[n] = spec.get(key)
    return out


@dataclass
class ClusterRow:
    t: float
    bytes_s: float             # summed over the clients
    per_client: dict           # node -> bytes/s (active clients only)
    read_ahead_kb: int         # client1's, for the record
    phase: int
    workload: str
    label: str


def _terse(line: str) -> tuple[float, float, float, float] | None:
    """(read KiB, read ms, write KiB, write ms) so far, from one terse v3 status line."""
    p = line.split(";")
    if len(p) < 50 or p[0] != "3":
        return None
    try:
        return float(p[5]), float(p[8]), float(p[46]), float(p[49])
    except ValueError:
        return None


class ClusterRunner:
    """Plays phases on the cluster's mounts: fio per active client, in segments."""

    def __init__(self, vol: GlusterTestVolume, workdir: Path, segment_s: float = 3.0,
                 data_mib: int = 256, nfiles: int = 192, client_memory_mib: int = 0):
        self.vol, self.workdir, self.segment_s = vol, Path(workdir), segment_s
        self.data_mib, self.nfiles = data_mib, nfiles
        self.nodes = vol.client_names
        # each client's applications in a memory cgroup of their own: a client's page
        # cache is a fraction of its data, as on a real client (0: unbounded)
        self.cgroups: dict[str, rr.MemoryCgroup] = {}
        for n in self.nodes if client_memory_mib else []:
            self.cgroups[n] = rr.MemoryCgroup(client_memory_mib << 20,
                                              f"capes-cluster-{os.getpid()}-{n}")
        self.mounts = dict(zip(self.nodes, vol.mounts))
        self.ra_paths = {n: bdi_read_ahead_path(m) for n, m in self.mounts.items()}
        self.rows: list[ClusterRow] = []
        self.latest: dict[str, tuple[float, float]] = {}     # node -> (time, bytes/s)
        self.n = 0

    def read_ahead(self, node: str) -> int:
        return int(Path(self.ra_paths[node]).read_text().split()[0])

    def set_read_ahead(self, value: int, nodes=None) -> None:
        for n in nodes or self.nodes:
            Path(self.ra_paths[n]).write_text(f"{int(value)}\n")

    def node_dir(self, node: str) -> Path:
        return self.mounts[node] / node

    def lay_out(self) -> float:
        """Each client's data file and small files, written through its own mount."""
        t0 = time.monotonic()
        procs = []
        for n in self.nodes:
            d = self.node_dir(n)
            (d / "small").mkdir(parents=True, exist_ok=True)
            job = (f"[global]\nioengine=psync\nbs=1M\n[data]\nrw=write\nfilename={d}/data\n"
                   f"size={self.data_mib}M\n[small]\nrw=write\nbs=64k\ndirectory={d}/small\n"
                   f"nrfiles={self.nfiles}\nfilesize=64k\nfilename_format=f.$filenum\n")
            f = self.workdir / f"layout-{n}.fio"
            self.workdir.mkdir(parents=True, exist_ok=True)
            f.write_text(job)
            procs.append(subprocess.Popen([wd.fio_binary() or "fio", str(f)],
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise wd.WorkloadError(f"lay-out fio failed: {err.decode()[-300:]}")
        return time.monotonic() - t0

    def segment(self, phase_name: str, seconds: float, stop=None, phase: int = -1,
                label: str = "") -> list[float]:
        """One fio run per active client, together; the summed bytes/s per second."""
        self.n += 1
        seg = self.workdir / f"seg{self.n}"
        seg.mkdir(parents=True, exist_ok=True)
        jobs = {n: j for n, j in assignment(phase_name, self.nodes).items() if j}
        procs, outs = {}, {}
        for n, j in jobs.items():
            text = JOB_HEAD.format(seconds=max(1, int(round(seconds))), create=0) + \
                JOBS[j].format(dir=self.node_dir(n), data_mib=self.data_mib,
                               nfiles=self.nfiles)
            if j == "seqwrite":
                text = text.replace("allow_file_create=0", "allow_file_create=1")
            jf = seg / f"{n}.fio"
            jf.write_text(text)
            outs[n] = seg / f"{n}.terse"
            cg = self.cgroups.get(n)

            def enter(path=cg.path if cg else None) -> None:
                if path:
                    with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                        fh.write(str(os.getpid()))
            procs[n] = subprocess.Popen(
                [wd.fio_binary() or "fio", "--output-format=terse", "--status-interval=1",
                 f"--output={outs[n]}", str(jf)], stdout=subprocess.DEVNULL,
                stderr=open(seg / f"{n}.err", "w"), start_new_session=True,
                preexec_fn=enter if cg else None)
        per: dict[str, list[float]] = {n: [] for n in jobs}
        last = {n: (0.0, 0.0, 0.0, 0.0) for n in jobs}
        seen = {n: 0 for n in jobs}
        emitted = 0
        ra = self.read_ahead(self.nodes[0])
        deadline = time.monotonic() + seconds + 30
        totals: list[float] = []
        try:
            while True:
                done = all(p.poll() is not None for p in procs.values())
                if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                    break
                for n in jobs:
                    try:
                        text = outs[n].read_text()
                    except OSError:
                        text = ""
                    lines = text.splitlines()
                    fin = procs[n].poll() is not None
                    complete = lines if fin or text.endswith("\n") else lines[:-1]
                    for line in complete[seen[n]:]:
                        s = _terse(line)
                        if s is None:
                            continue
                        ms = max(s[1], s[3])
                        lms = max(last[n][1], last[n][3])
                        if ms - lms >= 500:                # the closing summary repeats
                            rate = ((s[0] - last[n][0]) + (s[2] - last[n][2])) * 1024 / (
                                (ms - lms) / 1000)
                            per[n].append(rate)
                            self.latest[n] = (time.time(), rate)
                            last[n] = s
                    seen[n] = len(complete)
                # a second is complete once every active client has reported it
                ready = min((len(v) for v in per.values()), default=0)
                while emitted < ready:
                    pc = {n: per[n][emitted] for n in jobs}
                    total = float(sum(pc.values()))
                    totals.append(total)
                    self.rows.append(ClusterRow(time.time(), total, pc, ra, phase,
                                                phase_name, label))
                    emitted += 1
                if done:
                    break
                time.sleep(0.2)
        finally:
            for p in procs.values():
                kill_session(p)
            shutil.rmtree(seg, ignore_errors=True)
        if not jobs:                       # every client idle: seconds of zero
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (stop is not None and stop.is_set()):
                time.sleep(1)
                totals.append(0.0)
                self.rows.append(ClusterRow(time.time(), 0.0, {}, ra, phase, phase_name,
                                            label))
        bad = [n for n, p in procs.items() if p.returncode not in (0, -9) and not per[n]]
        if bad and not (stop is not None and stop.is_set()):
            raise wd.WorkloadError(f"fio failed on {bad} in {phase_name}")
        return totals

    def close(self) -> None:
        for cg in self.cgroups.values():
            cg.remove()
        self.cgroups = {}

    play = rr.SessionRunner.play          # every phase in turn, in segments

    def fairness(self, label: str) -> dict[str, float]:
        """Per phase, Jain's index of the mean throughput of the clients that run the same
        job (1: all alike), the lowest over the phase's jobs (readers and writers move
        different amounts by nature: they are not compared with each other)."""
        out = {}
        for ph in sorted({r.phase for r in self.rows if r.label == label}):
            rows = [r for r in self.rows if r.label == label and r.phase == ph and r.per_client]
            if not rows:
                continue
            jobs = assignment(rows[0].workload, self.nodes)
            worst = 1.0
            for job in {j for j in jobs.values() if j}:
                nodes = [n for n, j in jobs.items() if j == job]
                x = np.array([np.mean([r.per_client.get(n, 0.0) for r in rows])
                              for n in nodes])
                if x.any():
                    worst = min(worst, float(x.sum() ** 2 / (len(x) * (x ** 2).sum())))
            out[str(ph)] = worst
        return out


# -- the static grid ----------------------------------------------------------------------

def _knobs(runner: ClusterRunner) -> ev.Knobs:
    """Every client's ``read_ahead_kb`` as ``clientK/read_ahead_kb`` (file appliers)."""
    from capes.common.deployment import load_deployment
    lines = ["tick_seconds = 1.0"]
    for n in runner.nodes:
        lines += [f'[control.appliers."{n}/{KNOB}"]', 'name = "file"',
                  f'options = {{ path = "{runner.ra_paths[n]}" }}',
                  f'[parameters."{n}/{KNOB}"]', "min = 0", "max = 16384", "step = 1",
                  f"default = {runner.read_ahead(n)}", f'nodes = ["{n}"]']
    toml = runner.workdir / "static.toml"
    runner.workdir.mkdir(parents=True, exist_ok=True)
    toml.write_text("\n".join(lines) + "\n")
    return ev.Knobs(load_deployment(toml), [f"{n}/{KNOB}" for n in runner.nodes])


def static_grid(runner: ClusterRunner, phases: list[str], values: list[int], reps: int,
                duration: float, seed: int, stop=None, log=print) -> dict:
    """``capes evaluate`` per phase: the original and every value shared by all the
    clients, ``reps`` randomised interleaved repetitions of ``duration`` s."""
    original = runner.read_ahead(runner.nodes[0])
    configs = [ev.ConfigSet.parse("original")] + [
        ev.ConfigSet.parse(",".join(f"{n}/{KNOB}={v}" for n in runner.nodes))
        for v in values if v != original]
    return rr.grid_per_workload(runner, _knobs(runner), configs, phases, reps, duration,
                                seed, stop, log, label=lambda c: f"{_value(c, original):>6}",
                                digits=2)


def _value(c, original: int) -> int:
    vals = c.values or {}
    return original if not vals else int(round(next(iter(vals.values()))))


def static_summary(grids: dict, original: int, schedule: list[rr.Phase]) -> dict:
    """As :func:`real_readahead.static_summary`, from this module's grid reports."""
    return rr.summarise_means({w: rr.grid_means(rep, original) for w, rep in grids.items()},
                              original, schedule)


def gap_interval(grids: dict, original: int, schedule: list[rr.Phase], n: int = 2000,
                 seed: int = 0) -> list[float]:
    """The gap between the per-phase best and the best static setting, resampled: each
    (phase, value)'s repetitions drawn with replacement ``n`` times; the 5th, 50th and
    95th percentiles. The point figure picks each phase's best from noisy means (it leans
    high with few repetitions); this says how far the repetitions let it move."""
    rng = np.random.default_rng(seed)
    reps = {w: {v: [float(x) for x in c["samples"]]
                for c in rep["configs"] if c.get("samples")
                for v in [original if c["name"] == "original" else
                          int(round(next(iter(c["values"].values()))))]}
            for w, rep in grids.items()}
    gaps = []
    for _ in range(n):
        means = {w: {v: (float(np.mean(rng.choice(x, len(x)))), math.nan)
                     for v, x in m.items()} for w, m in reps.items()}
        gaps.append(1.0 - rr.summarise_means(means, original, schedule)
                    ["best_static"]["relative"])
    return [float(q) for q in np.percentile(gaps, [5, 50, 95])]


# -- tuners through the stack --------------------------------------------------------------

def _phase_terms(series: list, schedule: list, best: dict, batch_s: int) -> tuple[float, float]:
    """A run's ``relative`` (each phase's mean ÷ its workload's best static, weighted by
    its seconds) and its standard error stratified by phase: within each phase the
    variance of its ``batch_s``-second batch means. The schedule is the design, so the
    phases' different levels are not noise (``rr.score``'s pooled error counts them)."""
    x = np.asarray(series, float)
    terms = []
    for i, (workload, _) in enumerate(schedule):
        z = x[x[:, 2] == i, 1] / best[workload]
        if not z.size:
            continue
        nb = z.size // batch_s
        se = (float(np.std(z[:nb * batch_s].reshape(nb, batch_s).mean(1), ddof=1))
              / math.sqrt(nb)) if nb >= 2 else math.nan
        terms.append((z.size, float(z.mean()), se))
    total = sum(n for n, _, _ in terms)
    rel = sum(n * m for n, m, _ in terms) / total
    return rel, math.sqrt(sum((n / total * se) ** 2 for n, _, se in terms))


def against_static_live(result: dict, batch_s: int = 10) -> None:
    """Each tuner against the best static setting held live in the same run (the
    ``static`` arm: the same stack, the same schedule, the host's load then), where one
    ran: ``vs_static_live = {diff, ci95, se}``, both errors stratified by phase
    (:func:`_phase_terms`) and independent (the arms ran one after the other). The
    grid's comparison (``diff_vs_best_static``) carries the grid's own error, which on
    2 repetitions of 9 s is twice a live arm's. Works on a finished run's JSON."""
    tuners, best = result.get("tuners", {}), result.get("static", {}).get("best")
    live = tuners.get("static", {})
    if not best or not live.get("series"):
        return
    schedule = [tuple(p) for p in result["schedule"]]
    rel0, se0 = _phase_terms(live["series"], schedule, best, batch_s)
    for name, sc in tuners.items():
        if name == "static" or not sc.get("series"):
            continue
        rel, se = _phase_terms(sc["series"], schedule, best, batch_s)
        diff, half = rel - rel0, 1.96 * math.sqrt(se ** 2 + se0 ** 2)
        sc["vs_static_live"] = {"diff": diff, "ci95": [diff - half, diff + half],
                                "se": se, "static_se": se0}


def against_original_live(result: dict, width: int = 10) -> None:
    """Each arm's worst ``width`` seconds against the untuned cluster held live in the
    same run (the ``original`` arm), where one ran, two ways, each the lowest over
    phases: ``worst_10s_vs_original_live`` divides the phase's worst ``width``-second
    mean by the original arm's mean in that phase (the original arm's own figure is
    how far the host's noise alone takes that measure below 1: 0.77-0.89 on the
    GlusterFS bench, whose analysis phase reads in bursts);
    ``worst_10s_vs_original_worst`` divides it by the original arm's own worst
    ``width`` seconds in that phase (a tuner's worst stretch against the untuned
    cluster's worst stretch of the same workload: 1 for the original by construction).
    ``worst_10s_vs_original`` divides by the grid's original, measured without the
    stack's processes on the host. Works on a finished run's JSON."""
    tuners = result.get("tuners", {})
    base = tuners.get("original", {}).get("series")
    if not base:
        return
    b = np.asarray(base, float)
    phases = [int(i) for i in np.unique(b[:, 2])]
    means = {i: float(b[b[:, 2] == i, 1].mean()) for i in phases}
    worsts = {i: rr.worst_window(b[b[:, 2] == i, 1], width) for i in phases}
    for sc in tuners.values():
        if not sc.get("series"):
            continue
        x = np.asarray(sc["series"], float)
        mine = {i: rr.worst_window(x[x[:, 2] == i, 1], width) for i in phases
                if (x[:, 2] == i).sum() >= width}
        worst = [w / means[i] for i, w in mine.items() if means[i] > 0]
        if worst:
            sc["worst_10s_vs_original_live"] = float(min(worst))
        worst = [w / worsts[i] for i, w in mine.items() if worsts[i] > 0]
        if worst:
            sc["worst_10s_vs_original_worst"] = float(min(worst))


def stack_table(template: Path, runner: ClusterRunner, pi_dir: Path, values: list[int],
                original: int, one_row: bool = False) -> dict:
    """The shipped cluster config made concrete: one ``clientK/read_ahead_kb`` row per
    node with its own bdi path, the ladder ``values``, the original as the default."""
    from capes.common.config import read_toml
    table = read_toml(template)
    name = (lambda n: f"{n}_{KNOB}") if one_row else (lambda n: f"{n}/{KNOB}")
    params = {name(n): {"values": [str(v) for v in values], "default": str(original),
                        "nodes": [n]} for n in runner.nodes}
    table["parameters"] = params
    table.setdefault("control", {})["appliers"] = {
        name(n): {"name": "file", "options": {"path": runner.ra_paths[n]}}
        for n in runner.nodes}
    table["control"]["state_file"] = str(pi_dir / "control-{node}.json")
    return table


def node_collectors(pi_file: Path, cgroup: str | None = None, mount: Path | None = None) -> str:
    """A node's collectors: the application's figure and the knob's value from its PI
    file, and (``cgroup``) what the application's processes do (the ``processes``
    collector: the signature PIs that tell its workloads apart)."""
    procs = (f', {{name = "processes", options = {{cgroup = "{cgroup}", under = "{mount}"}}}}'
             if cgroup else "")
    return (f'monitor.collectors=[{{name = "command", options = {{argv = ["cat", '
            f'"{pi_file}"], names = ["{PI}", "{KNOB}"]}}}}{procs}]')


@dataclass
class ClusterTunerRun(rr.TunerRun):
    """A live session's record, with every client's value at the end and the replay
    rows lost."""
    restored_values: dict = field(default_factory=dict)
    rows_lost: int | None = None
    cpu_s: dict = field(default_factory=dict)    # CPU seconds per stack process


def rung(values: list[int], kib: int) -> int:
    """The index of a window (KiB) on the ladder ``values``, the nearest on the log scale
    where it is off the ladder: a categorical knob's PI is its value's index, as the
    engine sees the knob (the blockdev collector's ``scheduler`` likewise)."""
    if kib in values:
        return values.index(kib)
    logs = [abs(math.log2(max(kib, 1)) - math.log2(v)) for v in values]
    return logs.index(min(logs))


def run_tuner(name: str, runner: ClusterRunner, schedule: list[rr.Phase], workdir: Path,
              seed: int, stop, exploration_ticks: int | None, values: list[int],
              template: Path = CLUSTER_CONFIG, extra_sets: tuple[str, ...] = (),
              log=print, static_value: int | None = None,
              one_row: bool = False) -> ClusterTunerRun:
    """Play ``schedule`` while ``name`` (capes, hill, bo) tunes every client's
    ``read_ahead_kb`` through the stack: one interface daemon, a monitoring and a control
    agent per client node, the engine (per-node mode) or the baseline tuner. ``static``:
    the same stack without a tuner, every client held at ``static_value`` (the best
    static setting measured with the stack's own load on the host); ``original``: the
    same, every client held where it was (the untuned cluster, live)."""
    from capes.common.config import dump_toml
    from capes.common.curve import bind, generate
    from capes.settings import load_settings
    sub = workdir / f"stack-{name}"
    pis = sub / "pi"
    pis.mkdir(parents=True, exist_ok=True)
    original = {n: runner.read_ahead(n) for n in runner.nodes}
    table = stack_table(template, runner, sub, values, original[runner.nodes[0]],
                        one_row=one_row)
    config = sub / "stack.toml"
    config.write_text(dump_toml(table))
    keys = sub / "keys"
    sets = rr.stack_sets(sub, [*extra_sets] + (
        [f"engine.exploration_ticks={exploration_ticks}"] if exploration_ticks else []))
    deploy = load_settings(config, sets)
    if deploy.keys.enabled:
        generate(keys, ["monitor", "control", "engine"])
        bind(keys, "monitor", runner.nodes)
        bind(keys, "control", runner.nodes)
        bind(keys, "engine", ["engine"])
    cfg = ["--config", str(config)]
    for s in sets:
        cfg += ["--set", s]
    status = sub / "engine.json"
    stack = ProcessGroup(sub)
    result = ClusterTunerRun(name)
    halt = threading.Event()

    def publish() -> None:            # each node's PI file, twice a second
        while not halt.wait(0.5):
            now = time.time()
            for n in runner.nodes:
                t, v = runner.latest.get(n, (0.0, 0.0))
                v = v if now - t < 2.5 else 0.0
                try:
                    ra = runner.read_ahead(n)
                except (OSError, ValueError):
                    continue
                result.applied.append(ra)
                f = pis / n
                tmp = f.with_suffix(".tmp")
                tmp.write_text(f"{PI} {v:.1f}\n{KNOB} {rung(values, ra)}\n")
                os.replace(tmp, f)
    runner.latest.clear()
    for n in runner.nodes:
        (pis / n).write_text(f"{PI} 0\n{KNOB} {rung(values, original[n])}\n")
    thread = threading.Thread(target=publish, daemon=True)
    try:
        stack.start("interface-daemon", "interface-daemon", *cfg, "--ready-file",
                    "daemon.ready")
        for n in runner.nodes:
            cg = runner.cgroups.get(n)
            per = ["--set", f"monitor.node={n}", "--set", f"control.node={n}",
                   "--set", node_collectors(pis / n, cg.path if cg else None,
                                            runner.mounts[n])]
            stack.start(f"monitor-{n}", "monitor-agent", *cfg, *per,
                        "--set", "keys.client=monitor")
            stack.start(f"control-{n}", "control-agent", *cfg, *per,
                        "--set", "keys.client=control")
        if name == "static":
            runner.set_read_ahead(static_value)
        elif name not in HELD:
            rr.start_tuner(stack, name, cfg, seed, sub, status)
        thread.start()
        tick = rr.progress_tick(
            stack, name, status, log,
            lambda: [r.bytes_s for r in runner.rows if r.label == name][-30:],
            lambda: [runner.read_ahead(n) for n in runner.nodes], digits=2)
        runner.play(schedule, name, stop, tick)
        result.status = rr._read_json(status)
    finally:
        halt.set()
        if thread.is_alive():
            thread.join(2)
        result.cpu_s = {n: round(v, 2) for n, v in stack.cpu_seconds().items()}
        result.exit_codes = stack.stop(first=("tuner",) if name not in HELD else ())
        if name == "static":
            runner.set_read_ahead(original[runner.nodes[0]])
        now = {}
        for n in runner.nodes:
            try:
                now[n] = runner.read_ahead(n)
            except (OSError, ValueError):
                now[n] = None
        result.restored_values = now
        result.restored = now == original
        for n, v in original.items():              # never leave a client changed
            if now.get(n) != v:
                runner.set_read_ahead(v, [n])
        result.rows_lost = rows_lost(sub / "replay.db", sub / "logs")
    return result


def rows_lost(db: Path, logs: Path) -> int | None:
    """Replay rows lost, from the interface daemon's log: the rows it stopped with that
    the DB could not take, and those dropped from a full buffer (None: no log)."""
    import re
    files = list(logs.glob("interface-daemon*"))
    if not files:
        return None
    text = "\n".join(p.read_text(errors="replace") for p in files)
    lost = [int(m) for m in re.findall(r"stopping with (\d+) rows the replay DB", text)]
    dropped = [int(m) for m in re.findall(r"\((\d+) rows dropped from the full buffer", text)]
    return sum(lost) + max(dropped, default=0)


# -- the bench ----------------------------------------------------------------------------

@dataclass
class ClusterBenchOptions:
    clients: int = 4
    bricks: int = 4
    # each brick's loop device: 10 MB/s (bandwidth is scarce: what a window reads and
    # nobody uses costs the others), the bricks' page cache capped at 256 MiB
    disk: BrickDisk = field(default_factory=lambda: BrickDisk(
        size_gib=BRICK_GIB, read_mbs=10.0, write_mbs=10.0, memory_mib=256))
    client_memory_mib: int = 64
    schedule: list[rr.Phase] = field(default_factory=list)
    tuners: list[str] = field(default_factory=lambda: ["capes", "hill", "bo"])
    grid: list[int] = field(default_factory=lambda: [4, 16, 64, 512, 8192])
    ladder: list[int] = field(default_factory=lambda: list(LADDER))
    original: int = 128
    grid_reps: int = 2
    grid_duration: float = 9.0
    segment_s: float = 3.0
    data_mib: int = 256
    exploration_ticks: int | None = None
    seed: int = 1
    extra_sets: tuple[str, ...] = ()
    # a CAPES variant's own settings on top of extra_sets: {"capes-nopool": ("…=…",)}
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    facts: bool = False               # volume options and `volume set` costs, no tuners
    # every client's knob one knob of the engine's one row (the thesis' layout: one
    # network over every client's PIs) instead of a per-node row each
    one_row: bool = False
    volume_settings: list[str] = field(default_factory=lambda: list(VOLUME_SETTINGS))


def run_bench(opts: ClusterBenchOptions, stop, log=print) -> dict:
    """Stand the cluster up, lay the data out, the static grid, every tuner, the score;
    the cluster is torn down on every exit path."""
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="capes-cluster-"))
    result: dict = {"clients": opts.clients, "bricks": opts.bricks, "seed": opts.seed,
                    "brick_mbs": opts.disk.read_mbs, "brick_iops": opts.disk.read_iops,
                    "brick_memory_mib": opts.disk.memory_mib,
                    "client_memory_mib": opts.client_memory_mib,
                    "brick_seek_ms": opts.disk.seek_ms, "brick_seek_mbs": opts.disk.seek_mbs,
                    "schedule": [[p.workload, p.seconds] for p in opts.schedule],
                    "segment_s": opts.segment_s, "grid": opts.grid, "ladder": opts.ladder,
                    "grid_reps": opts.grid_reps, "grid_duration_s": opts.grid_duration,
                    "exploration_ticks": opts.exploration_ticks, "tuners": {},
                    "layout": "one-row" if opts.one_row else "per-node",
                    "load_average_start": os.getloadavg()[0]}
    vol = GlusterTestVolume(work / "vol", bricks=opts.bricks, clients=opts.clients,
                            netns=True, disk=opts.disk)
    runner = None
    try:
        vol.up()
        st = vol.status()
        result["cluster"] = {"throttle": st["throttle"], "timings_s": st["timings_s"],
                             "nodes": [c["node"] for c in st["clients"]]}
        log(f"cluster up in {st['timings_s']['up']:.1f} s: {opts.bricks} bricks "
            f"({st['throttle']}, {opts.disk.read_mbs:g} MB/s each), {opts.clients} clients")
        runner = ClusterRunner(vol, work / "fio", opts.segment_s, opts.data_mib,
                               client_memory_mib=opts.client_memory_mib)
        result["kernel_read_ahead_kb"] = runner.read_ahead(runner.nodes[0])
        runner.set_read_ahead(opts.original)
        with vol.throttle_lifted():               # the bricks at full speed meanwhile
            log(f"laid out in {runner.lay_out():.1f} s")
        phases = list(dict.fromkeys(p.workload for p in opts.schedule))
        if opts.facts:
            result["volume_set_costs"] = volume_set_costs(vol)
            log(f"volume set costs: {result['volume_set_costs']}")
            result["volume_options"] = volume_option_grid(
                runner, phases, opts.volume_settings, opts.grid_reps, opts.grid_duration,
                opts.seed, stop=stop, log=log)
            result["volume_options_summary"] = {
                w: {c["name"]: {"mean_mb_s": c["mean"] / 1e6,
                                "vs_original": c["mean"] / rep["configs"][0]["mean"]}
                    for c in rep["configs"]} for w, rep in result["volume_options"].items()}
            return result
        log(f"== static grid: {phases} x read_ahead_kb {opts.grid} (original "
            f"{opts.original}), {opts.grid_reps} x {opts.grid_duration:g} s each")
        grids = static_grid(runner, phases, opts.grid, opts.grid_reps, opts.grid_duration,
                            opts.seed, stop, log)
        result["grid_reports"] = grids
        if stop.is_set():
            return result
        sm = static_summary(grids, opts.original, opts.schedule)
        rr.adopt_static(result, sm, log)
        result["per_phase_best_gap_resampled"] = gap_interval(grids, opts.original,
                                                              opts.schedule, seed=opts.seed)
        log("gap resampled (5th, 50th, 95th percentile): "
            + ", ".join(f"{g:.3f}" for g in result["per_phase_best_gap_resampled"]))
        for name in opts.tuners:
            if stop.is_set():
                break
            log(f"== {name}, {sum(p.seconds for p in opts.schedule):g} s")
            try:
                run = run_tuner(name, runner, opts.schedule, work, opts.seed, stop,
                                opts.exploration_ticks, opts.ladder,
                                extra_sets=(*opts.extra_sets, *opts.variants.get(name, ())),
                                log=log, one_row=opts.one_row,
                                static_value=sm["best_static"]["setting"])
            except (RuntimeError, OSError) as exc:      # one tuner's failure is its result
                log(f"{name}: failed: {exc}")
                result["tuners"][name] = {"error": str(exc)[-2000:]}
                continue
            rows = [r for r in runner.rows if r.label == name]
            sc = rr.score(rows, opts.schedule, sm["best"], sm["best_static"]["relative"],
                          sm["best_static"]["se"], sm["original"]["means"])
            returns = [ph["seconds_to_90"] for ph in sc.get("phases", []) if ph["visit"] > 1]
            sc["recall_30s"] = {"returns": len(returns), "seconds_to_90": returns,
                                "within_30s": sum(t is not None and t <= 30 for t in returns)}
            sc.update(restored=run.restored, restored_values=run.restored_values,
                      exit_codes=run.exit_codes, rows_lost=run.rows_lost,
                      cpu_s=run.cpu_s, fairness=runner.fairness(name),
                      applied_min=min(run.applied, default=None),
                      applied_max=max(run.applied, default=None),
                      series=[[r.t, r.bytes_s, r.phase] for r in rows])
            result["tuners"][name] = sc
            if sc.get("relative") is not None:
                log(rr.score_line(name, sc, run.restored, run.rows_lost))
        against_static_live(result)
        against_original_live(result)
    finally:
        if runner is not None:
            runner.close()
        t_down = time.monotonic()
        problems = vol.down()
        result["teardown"] = {"problems": problems, "seconds": time.monotonic() - t_down}
        rr._keep_stacks(work)                  # CAPES_REAL_KEEP=DIR: DBs and logs kept
        shutil.rmtree(work, ignore_errors=True)
        result["wall_s"] = time.time() - t0
        result["load_average_end"] = os.getloadavg()[0]
    return result


def missing_requirements() -> str | None:
    why = wd.missing_on_host("glusterd, FUSE mounts, loop devices",
                             ("fio", "glusterd", "gluster", "glusterfs", "losetup",
                              "mkfs.xfs"))
    if why:
        return why
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE)"
    from capes.experiments import gluster_volume as gv
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "ip/nsenter not installed (the cluster runs in a network namespace)"
    try:
        gv.throttle_mechanism()
        gv.loopback_host()
    except GlusterError as exc:
        return str(exc)
    return None


# -- facts: volume options on the cluster ----------------------------------------------------

# name -> (gluster option, unit, min, max); the grid's configurations name these
VOLUME_KNOBS = {
    "read_ahead": ("performance.read-ahead", "bool", 0, 1),
    "io_cache": ("performance.io-cache", "bool", 0, 1),
    "stat_prefetch": ("performance.stat-prefetch", "bool", 0, 1),
    "write_behind_window_mb": ("performance.write-behind-window-size", "MB", 1, 64),
    "io_thread_count": ("performance.io-thread-count", "", 1, 64),
    "client_io_threads": ("performance.client-io-threads", "bool", 0, 1),
}
VOLUME_SETTINGS = ["read_ahead=1", "io_cache=1", "stat_prefetch=0",
                   "write_behind_window_mb=8", "io_thread_count=4", "io_thread_count=64",
                   "client_io_threads=0"]


def volume_knobs(vol: GlusterTestVolume, workdir: Path, names) -> ev.Knobs:
    from capes.common.deployment import load_deployment
    lines = ["tick_seconds = 1.0"]
    for n in names:
        key, unit, lo, hi = VOLUME_KNOBS[n]
        lines += [f"[control.appliers.{n}]", 'name = "gluster"',
                  f'options = {{ volume = "{vol.volume}", key = "{key}", unit = "{unit}", '
                  f'glusterd_sock = "{vol.socket_path}" }}',
                  f"[parameters.{n}]", f"min = {lo}", f"max = {hi}", "step = 1",
                  f"default = {lo}"]
    toml = workdir / "volume.toml"
    workdir.mkdir(parents=True, exist_ok=True)
    toml.write_text("\n".join(lines) + "\n")
    return ev.Knobs(load_deployment(toml), list(names))


def volume_option_grid(runner: ClusterRunner, phases: list[str], settings: list[str],
                       reps: int, duration: float, seed: int, settle_s: float = 3.0,
                       stop=None, log=print) -> dict:
    """``capes evaluate`` per phase over volume options (the volume's original values and
    each setting), the clients' readahead as it is; {phase: report}."""
    configs = [ev.ConfigSet.parse("original")] + [ev.ConfigSet.parse(s) for s in settings]
    names = sorted({n for c in configs for n in (c.values or {})})
    out = {}
    for w in phases:
        knobs = volume_knobs(runner.vol, runner.workdir, names)

        measure = rr.in_segments(runner, w, duration, f"volume:{w}")

        def on_rep(r, i, total, w=w):
            x = r.samples
            log(f"  volume {w} {i:>3}/{total} {configs[r.config].label:<28} "
                f"{(np.mean(x) / 1e6 if x else math.nan):8.2f} MB/s")
        try:
            out[w] = ev.evaluate(knobs, configs, measure, reps, seed, stop,
                                 settle_s=settle_s, on_rep=on_rep)
        finally:
            knobs.close()
    return out


def _applied_marks(log_path: Path) -> int:
    """Lines a FUSE client logs when it takes a new volfile: a reconfigured option
    (``xlator_option_reconf``) or a switch to a new graph."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    return text.count("xlator_option_reconf") + text.count("switched to graph")


def volume_set_costs(vol: GlusterTestVolume, n: int = 5, timeout_s: float = 20.0) -> dict:
    """What a ``volume set`` costs and how long it takes to reach the clients: per
    option kind, the CLI's wall time (it holds the cluster-wide volume lock that long)
    and the seconds until every client's log shows it took the change (a reconfigured
    option, or a switch to a new graph, which a FUSE client makes at its next file
    operation: each mount is stat'ed every 0.05 s, as a busy client would touch it;
    None: not within ``timeout_s``)."""
    logs = [vol.dir / "log" / ("client.log" if len(vol.mounts) == 1 else
                               f"client{i + 1}.log") for i in range(len(vol.mounts))]
    cases = {"value (io-thread-count, bricks)": ("performance.io-thread-count", "16", "24"),
             "value (write-behind window, clients)":
                 ("performance.write-behind-window-size", "1MB", "2MB"),
             "translator on/off (read-ahead, clients' graph)":
                 ("performance.read-ahead", "off", "on")}
    out = {}
    for label, (key, a, b) in cases.items():
        set_s, reach = [], []
        for i in range(n):
            value = b if i % 2 == 0 else a
            before = [_applied_marks(p) for p in logs]
            t0 = time.monotonic()
            vol.gluster("volume", "set", vol.volume, key, value)
            set_s.append(time.monotonic() - t0)
            seen: dict[int, float] = {}
            while len(seen) < len(logs) and time.monotonic() - t0 < timeout_s:
                for k, p in enumerate(logs):
                    if k in seen:
                        continue
                    try:
                        os.stat(vol.mounts[k])
                    except OSError:
                        pass
                    if _applied_marks(p) > before[k]:
                        seen[k] = time.monotonic() - t0
                time.sleep(0.05)
            reach.append(max(seen.values()) if len(seen) == len(logs) else None)
        vol.gluster("volume", "reset", vol.volume, key)
        out[label] = {"set_s": [round(x, 3) for x in set_s],
                      "all_clients_took_it_s": [None if x is None else round(x, 3)
                                                for x in reach]}
    return out
