"""A local GlusterFS test volume that is stood up and torn down leaving nothing behind.

What the real-target tests, the benchmarks and a curious administrator need: a volume of
three bricks on local directories, FUSE-mounted on this machine, with all traffic on
loopback and every process owned by PID:

* ``glusterd -N`` (foreground, no systemd) is our child, with its own volfile whose
  working directory (the state normally kept in /var/lib/glusterd), run directory and
  CLI socket all lie under DIR; it listens on 127.0.0.1 only;
* the volume ``VOL`` has bricks ``HOST:DIR/bricks/b1..b3`` (distributed, or replica 3),
  created with ``force`` since they sit on the root file system. ``HOST`` is a name that
  resolves to a loopback address (the CLI refuses a literal ``localhost``/``127.0.0.1``);
  the host name usually does, and /etc/hosts is never edited;
* the FUSE client (``glusterfs -N --volfile-server=HOST --volfile-id=VOL DIR/mnt``, what
  ``mount -t glusterfs HOST:/VOL DIR/mnt`` runs, but in the foreground so that we own its
  PID) is our child too.

GlusterFS writes a few things to fixed system paths whatever its volfile says (brick and
client logs and samples under /var/log/glusterfs, brick sockets under /run/gluster, JSON
stats dumps, ``geo-replication`` and ``ss_brick`` under /var/lib/glusterd). ``up`` records
what those trees hold before it starts anything and ``down`` removes whatever appeared
since, so a torn-down volume leaves the host as it found it (files that existed before
and were appended to, e.g. a pre-existing cli.log, keep the new lines).

Refuses to start when a glusterd already runs on this host or port 24007 is taken: one
glusterd per host, and a production one is never touched.

**A cluster on one machine** (issue 40): ``clients=N`` mounts the volume N times, each
mount its own FUSE client process, a node named ``client1..N`` (its own monitoring and
control agent in the real-cluster bench, its own FUSE bdi ``read_ahead_kb``);
``disk=BrickDisk(...)`` puts each brick on its own loop device (a sparse image under DIR,
XFS) throttled like a disk: cgroup v1 blkio throttle rules on the device at the root
cgroup (so that the bricks' writeback is throttled too) or cgroup v2 ``io.max`` in a
cgroup of our own that the brick processes join; the device's bdi gets a small strict
dirty limit so that writers feel the disk instead of the page cache. ``delay_ms`` runs
glusterd, bricks and clients in a network namespace of our own whose loopback has a
``tc netem`` delay (each way: the round trip is twice it); the namespace goes with it.
Every one of these is recorded in DIR/state.json as it is made and undone by ``down``
(original sysfs values written back, rules set to 0, loop devices detached).

Use from Python::

    with GlusterTestVolume() as vol:          # a temp dir; removed on exit
        vol.gluster("volume", "set", vol.volume, "performance.read-ahead", "on")
        open(vol.mount / "f", "wb").write(b"x")

or from the shell (``tools/gluster-test-volume``)::

    tools/gluster-test-volume up --dir /var/tmp/capes-gluster --stats-dump
    tools/gluster-test-volume status --dir /var/tmp/capes-gluster
    tools/gluster-test-volume down --dir /var/tmp/capes-gluster

    # the cluster: 4 bricks on throttled loop devices, 4 client mounts, a command run
    # on it and everything torn down when it ends, fails or is interrupted
    tools/gluster-test-volume run --bricks 4 --clients 4 --brick-mbs 50 -- sh -c 'ls $CAPES_GLUSTER_MOUNTS'

Stdlib only (the shell tool runs with any Python 3.11).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
GLUSTERD_PORT = 24007
SYSTEM_TREES = ("/var/lib/glusterd", "/var/log/glusterfs", "/run/gluster")
STATE_FILE = "state.json"
SEEKDISK = Path(__file__).resolve().parents[2] / "tools" / "seekdisk" / "seekdisk"
PROGRAMS = ("glusterd", "glusterfsd", "glusterfs")
REFUSED_HOSTS = {"localhost", "localhost.localdomain", "127.0.0.1", "::1"}

GLUSTERD_VOL = """\
volume management
    type mgmt/glusterd
    option working-directory {dir}/state
    option run-directory {dir}/run
    option glusterd-sockfile {socket}
    option transport-type socket
    option transport.address-family inet
    option transport.socket.bind-address 127.0.0.1
    option transport.socket.listen-port {port}
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
"""


class GlusterError(RuntimeError):
    """The test volume could not be stood up (or a gluster command failed)."""


# ---------------------------------------------------------------- processes and mounts

def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def glusterd_pids() -> list[int]:
    """The glusterd processes running on this host (ours or anyone's): a volume of ours
    outside a network namespace of its own refuses to start beside one."""
    return sorted(p for p, a in gluster_processes().items()
                  if os.path.basename(a[0]) == "glusterd")


def gluster_processes() -> dict[int, list[str]]:
    """Every running glusterd/glusterfsd/glusterfs process: pid -> argv."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _cmdline(int(entry))
        if argv and os.path.basename(argv[0]) in PROGRAMS and _alive(int(entry)):
            out[int(entry)] = argv
    return out


def descendants(pids) -> set[int]:
    """Every live process below ``pids`` (hook scripts, gsyncd, daemonising children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return {p for p in out if _alive(p)}


def loop_backing(loop: str) -> str | None:
    """The file a loop device is attached to (None: not attached)."""
    try:
        return _read(f"/sys/block/{os.path.basename(loop)}/loop/backing_file")
    except OSError:
        return None


def _ours(argv: list[str], root: str) -> bool:
    return any(root in a for a in argv)


def mounted(path: str | Path) -> bool:
    path = os.path.realpath(path)
    try:
        with open("/proc/mounts") as fh:
            return any(line.split()[1].replace("\\040", " ") == path
                       for line in fh if len(line.split()) > 2)
    except OSError:
        return False


def port_in_use(port: int = GLUSTERD_PORT) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def loopback_host(candidates: list[str] | None = None) -> str:
    """A name the gluster CLI accepts as a brick host that resolves to loopback only."""
    names = candidates or [socket.gethostname(), socket.getfqdn()]
    for name in names:
        if not name or name.lower() in REFUSED_HOSTS:
            continue
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)}
        except OSError:
            continue
        if addrs and all(a.startswith("127.") for a in addrs):
            return name
    raise GlusterError(
        f"no host name resolving to loopback among {names}: give one with --host, e.g. "
        f"after adding '127.0.1.1 capes-gluster' to /etc/hosts (the gluster CLI refuses "
        f"localhost and 127.0.0.1 as a brick host)")


def _signal_all(pids, sig, wait_s: float) -> list[int]:
    """Send ``sig`` to each live pid; wait up to ``wait_s`` for them to go; the ones left."""
    pids = [p for p in pids if _alive(p)]
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if _alive(p)]
    return pids


# ---------------------------------------------------------------- system tree snapshot

def snapshot(trees=SYSTEM_TREES) -> dict[str, list[str] | None]:
    """Every path (relative) in each tree; None for a tree that does not exist."""
    out: dict[str, list[str] | None] = {}
    for tree in trees:
        if not os.path.isdir(tree):
            out[tree] = None
            continue
        paths = []
        for root, dirs, files in os.walk(tree):
            rel = os.path.relpath(root, tree)
            paths.extend(os.path.normpath(os.path.join(rel, n)) for n in dirs + files)
        out[tree] = sorted(paths)
    return out


def remove_new(before: dict[str, list[str] | None], ours=None) -> list[str]:
    """Remove what appeared in the trees since ``before``; return what could not be.
    ``ours(path)``: remove only the new paths it says are ours (another glusterd runs
    beside ours and writes to the same trees)."""
    failed = []
    for tree, old in before.items():
        if not os.path.lexists(tree):
            continue
        if old is None and ours is None:
            try:
                shutil.rmtree(tree)
            except OSError as exc:
                failed.append(f"{tree}: {exc}")
            continue
        keep = set(old or [])
        now = snapshot([tree])[tree] or []
        for rel in sorted(now, key=lambda r: r.count(os.sep), reverse=True):
            path = os.path.join(tree, rel)
            if rel in keep or (ours is not None and not ours(path)):
                continue
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(f"{path}: {exc}")
    return failed



# ---------------------------------------------------------------- disks, throttles, netns

@dataclass
class BrickDisk:
    """Each brick on a loop device of its own, throttled like a disk (0: no cap)."""
    size_gib: float = 2.0
    read_mbs: float = 0.0
    write_mbs: float = 0.0
    read_iops: int = 0
    write_iops: int = 0
    dirty_mib: int = 32          # the device's strict dirty limit (0: the kernel's)
    memory_mib: int = 0          # the brick processes' memory (their page cache) in a
                                 # memory cgroup: reads reach the throttled disk (0: none)
    seek_ms: float = 0.0         # > 0: the image is served by tools/seekdisk (a seek cost
    seek_mbs: float = 100.0      # per non-contiguous request, one request at a time, this
                                 # bandwidth) and the loop device sits on that

    def caps(self) -> dict[str, int]:
        return {k: int(v) for k, v in (("read_bps", self.read_mbs * 1e6),
                                       ("write_bps", self.write_mbs * 1e6),
                                       ("read_iops", self.read_iops),
                                       ("write_iops", self.write_iops)) if v}


BLKIO_V1 = "/sys/fs/cgroup/blkio"
CGROUP_V2 = "/sys/fs/cgroup"
V2_KEYS = {"read_bps": "rbps", "write_bps": "wbps", "read_iops": "riops",
           "write_iops": "wiops"}


def throttle_mechanism() -> str:
    """Which I/O throttle this host has: ``"cgroup v1 blkio"`` or ``"cgroup v2 io.max"``."""
    if os.path.isfile(os.path.join(BLKIO_V1, "blkio.throttle.read_bps_device")):
        return "cgroup v1 blkio"
    try:
        with open(os.path.join(CGROUP_V2, "cgroup.controllers")) as fh:
            if "io" in fh.read().split():
                return "cgroup v2 io.max"
    except OSError:
        pass
    raise GlusterError("no I/O throttle on this host (neither cgroup v1 blkio nor the "
                       "cgroup v2 io controller)")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


def dev_majmin(path: str | Path) -> str:
    """``maj:min`` of a block device, or of the device a mounted path lives on (a FUSE
    mount's is ``0:NN``, the name of its bdi in /sys/class/bdi)."""
    st = os.stat(path)
    dev = st.st_rdev if Path(path).is_block_device() else st.st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


def bdi_read_ahead_path(mount: str | Path) -> str:
    """A mount's bdi ``read_ahead_kb`` (a FUSE client's own readahead window)."""
    return f"/sys/class/bdi/{dev_majmin(mount)}/read_ahead_kb"


def netem_available() -> str | None:
    """Why ``tc netem`` cannot delay here (None: it can): tried on a scratch namespace."""
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return "tc/ip (iproute2) not installed"
    ns = f"capes-netem-probe-{os.getpid()}"
    try:
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
            return "cannot create a network namespace"
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], capture_output=True)
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"], capture_output=True,
                              text=True)
        if done.returncode:
            return f"tc netem refused: {(done.stderr or done.stdout).strip()[:200]} " \
                   f"(the kernel has no sch_netem)"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# ---------------------------------------------------------------- the volume

@dataclass
class VolumeState:
    """What ``up`` started, persisted as DIR/state.json so ``down`` can run elsewhere."""
    dir: str
    volume: str
    host: str
    bricks: list[str]
    mount: str
    socket: str
    replica: bool = False
    glusterd_pid: int | None = None
    client_pid: int | None = None
    brick_pids: list[int] = field(default_factory=list)
    system_before: dict[str, list[str] | None] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)
    # the cluster (issue 40): every client mount, its FUSE process, its bdi
    mounts: list[str] = field(default_factory=list)
    client_pids: list[int] = field(default_factory=list)
    client_bdis: list[str] = field(default_factory=list)      # "0:NN" per mount
    loops: list[str] = field(default_factory=list)            # /dev/loopN per brick
    images: list[str] = field(default_factory=list)
    brick_mounts: list[str] = field(default_factory=list)
    throttle: str = ""                                        # which mechanism was used
    throttle_rules: list[list[str]] = field(default_factory=list)   # [file, "maj:min"]
    throttle_cgroup: str | None = None                        # cgroup v2 only
    memory_cgroup: str | None = None                          # BrickDisk.memory_mib
    own_paths: list[str] = field(default_factory=list)        # our bricks' sockets
    seek_mounts: list[str] = field(default_factory=list)      # BrickDisk.seek_ms
    seek_pids: list[int] = field(default_factory=list)
    sysfs_saved: dict[str, str] = field(default_factory=dict)  # path -> original text
    netns: str | None = None
    qdisc: str | None = None                                  # the netem line we added
    delay_ms: float = 0.0


class GlusterTestVolume:
    def __init__(self, dir: str | Path | None = None, volume: str = "capes", bricks: int = 3,
                 replica: bool = False, host: str | None = None, stats_dump: bool = False,
                 profile: bool = False, options: dict[str, str] | None = None,
                 timeout_s: float = 30.0, clients: int = 1, disk: BrickDisk | None = None,
                 delay_ms: float = 0.0, netns: bool = False):
        if bricks < 1 or (replica and bricks < 2):
            raise ValueError("bricks: need at least 1 (2 for a replica volume)")
        if clients < 1:
            raise ValueError("clients: need at least 1")
        if delay_ms < 0:
            raise ValueError("delay_ms: must be >= 0")
        self.n_clients, self.disk, self.delay_ms = clients, disk, float(delay_ms)
        self.isolated = bool(netns or delay_ms)
        self._own_tmp = dir is None
        self.dir = Path(dir) if dir is not None else None
        self.volume, self.n_bricks, self.replica = volume, bricks, replica
        self.host_arg, self.stats_dump, self.profile = host, stats_dump, profile
        self.options = dict(options or {})
        self.timeout_s = timeout_s
        self.state: VolumeState | None = None
        self._procs: list[subprocess.Popen] = []

    # -------------------------------------------------------------- paths and CLI

    @property
    def mount(self) -> Path:
        return Path(self.state.mount)

    @property
    def mounts(self) -> list[Path]:
        """Every client's mount (``client1..N``), the first being :attr:`mount`."""
        return [Path(m) for m in (self.state.mounts or [self.state.mount])]

    @property
    def client_names(self) -> list[str]:
        return [f"client{i + 1}" for i in range(len(self.mounts))]

    def _netns_prefix(self) -> list[str]:
        ns = self.state.netns if self.state else None
        return ["nsenter", f"--net=/run/netns/{ns}"] if ns else []

    @property
    def socket_path(self) -> str:
        return str(self.dir / "run" / "glusterd.socket")

    def gluster_argv(self) -> list[str]:
        """The CLI with our glusterd's socket: what appliers/collectors are given."""
        return ["gluster", f"--glusterd-sock={self.socket_path}"]

    def gluster(self, *args: str, check: bool = True, timeout: float | None = None
                ) -> subprocess.CompletedProcess:
        argv = [*self.gluster_argv(), "--mode=script",
                f"--log-file={self.dir / 'log' / 'cli.log'}", *args]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace",
                                  timeout=timeout or self.timeout_s)
        except subprocess.TimeoutExpired:
            raise GlusterError(f"gluster {' '.join(args)}: timed out") from None
        if check and done.returncode != 0:
            raise GlusterError(f"gluster {' '.join(args)}: exit {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[-400:]}")
        return done

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        argv = self._netns_prefix() + argv          # nsenter execs: the PID is argv's
        with open(self.dir / "log" / log_name, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=self.dir)
        self._procs.append(proc)
        return proc

    def _wait(self, what: str, ready, proc: subprocess.Popen | None = None,
              poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if proc is not None and proc.poll() is not None:
                raise GlusterError(f"{what}: exited with status {proc.returncode} "
                                   f"(logs under {self.dir / 'log'})")
            if time.monotonic() > deadline:
                raise GlusterError(f"{what}: not ready after {self.timeout_s} s")
            time.sleep(poll_s)

    def _answers(self) -> bool:
        """glusterd answers its CLI socket."""
        if not os.path.exists(self.socket_path):
            return False
        try:
            return self.gluster("volume", "list", check=False, timeout=5).returncode == 0
        except GlusterError:              # timed out: still starting
            return False

    def _save(self) -> None:
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self.state), indent=1))
        os.replace(tmp, self.dir / STATE_FILE)

    # -------------------------------------------------------------- up

    def up(self) -> "GlusterTestVolume":
        for tool in ("glusterd", "glusterfs", "gluster"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                raise GlusterError(f"{tool} not found (apt-get install glusterfs-server "
                                   f"glusterfs-client)")
        if os.geteuid() != 0:
            raise GlusterError("glusterd and FUSE mounts need root")
        if not os.path.exists("/dev/fuse"):
            raise GlusterError("/dev/fuse is missing (modprobe fuse)")
        if self.disk is not None:
            for tool in ("losetup", "mkfs.xfs", "mount", "umount"):
                if shutil.which(tool) is None:
                    raise GlusterError(f"{tool} not found (loop-device bricks need it)")
            throttle_mechanism()
        if self.delay_ms:
            why = netem_available()
            if why:
                raise GlusterError(f"--delay-ms: {why}")
        running = gluster_processes()
        if not self.isolated:     # in a network namespace of our own, port 24007 is ours
            if glusterd_pids():
                raise GlusterError(f"a glusterd is already running (pids "
                                   f"{sorted(running)}); this tool runs only its own "
                                   f"(--netns runs ours in a network namespace beside it)")
            if port_in_use():
                raise GlusterError(f"port {GLUSTERD_PORT} is taken: a glusterd runs here "
                                   f"(--netns runs ours in a network namespace)")
        host = self.host_arg or loopback_host()
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="capes-gluster-"))
        else:
            self.dir = self.dir.absolute()
            if self.dir.exists() and any(self.dir.iterdir()):
                raise GlusterError(f"{self.dir}: exists and is not empty")
            self.dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(os.path.realpath(self.dir))
        d = self.dir
        bricks = [d / "bricks" / f"b{i + 1}" for i in range(self.n_bricks)]
        mounts = ([d / "mnt"] if self.n_clients == 1 else
                  [d / f"mnt{i + 1}" for i in range(self.n_clients)])
        self.state = VolumeState(
            dir=str(d), volume=self.volume, host=host, replica=self.replica,
            bricks=[str(b / "brick" if self.disk else b) for b in bricks],
            mount=str(mounts[0]), mounts=[str(m) for m in mounts],
            socket=self.socket_path, system_before=snapshot(),
            brick_mounts=[str(b) for b in bricks] if self.disk else [],
            delay_ms=self.delay_ms)
        try:
            self._up(d, host)
        except BaseException:
            self.down()
            raise
        return self

    def _up(self, d: Path, host: str) -> None:
        t0 = time.monotonic()
        for sub in ("state", "run", "log", *self.state.mounts, *self.state.brick_mounts):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self._save()                      # from here on, `down --dir` can clean up
        if self.isolated:
            self._make_netns()
        if self.disk is not None:
            self._make_disks(d)
        for b in self.state.bricks:
            Path(b).mkdir(parents=True, exist_ok=True)
        (d / "glusterd.vol").write_text(GLUSTERD_VOL.format(
            dir=d, socket=self.socket_path, port=GLUSTERD_PORT))
        glusterd = self._spawn(["glusterd", "-N", "-f", str(d / "glusterd.vol"),
                                "-l", str(d / "log" / "glusterd.log"),
                                "-p", str(d / "run" / "glusterd.pid")], "glusterd.out")
        self.state.glusterd_pid = glusterd.pid
        self._save()
        self._wait("glusterd", self._answers, glusterd, poll_s=0.2)
        t1 = time.monotonic()
        layout = ["replica", str(self.n_bricks)] if self.replica else []
        self.gluster("volume", "create", self.volume, *layout,
                     *[f"{host}:{b}" for b in self.state.bricks], "force")
        settings = dict(self.options)
        if self.stats_dump:
            settings["diagnostics.stats-dump-interval"] = "1"
        for key, value in settings.items():
            self.gluster("volume", "set", self.volume, key, str(value))
        self.gluster("volume", "start", self.volume)
        if self.profile:
            self.gluster("volume", "profile", self.volume, "start")
        pid_dir = d / "run" / "vols" / self.volume
        self._wait("bricks", lambda: len(list(pid_dir.glob("*.pid"))) >= self.n_bricks)
        self.state.brick_pids = self._brick_pids()
        for pid in self.state.brick_pids:          # their sockets under /run/gluster
            argv = _cmdline(pid)
            self.state.own_paths += [argv[i + 1] for i, a in enumerate(argv[:-1])
                                     if a == "-S"]
        self._save()
        for cg in {self.state.throttle_cgroup, self.state.memory_cgroup} - {None}:
            for pid in self.state.brick_pids:      # v2 io.max / the memory cap
                _write(os.path.join(cg, "cgroup.procs"), str(pid))
        t2 = time.monotonic()
        for i, mnt in enumerate(self.state.mounts):
            tag = "client" if len(self.state.mounts) == 1 else f"client{i + 1}"
            client = self._spawn(["glusterfs", "-N", f"--volfile-server={host}",
                                  f"--volfile-id={self.volume}",
                                  "-l", str(d / "log" / f"{tag}.log"), mnt], f"{tag}.out")
            self.state.client_pids.append(client.pid)
            self.state.client_pid = self.state.client_pids[0]
            self._save()
            self._wait(f"FUSE mount {mnt}", lambda m=mnt: mounted(m), client)
            os.statvfs(mnt)               # the mount answers
            self.state.client_bdis.append(dev_majmin(mnt))
            self._save()
        t3 = time.monotonic()
        self.state.timings_s = {"glusterd": round(t1 - t0, 3), "volume": round(t2 - t1, 3),
                                "mount": round(t3 - t2, 3), "up": round(t3 - t0, 3)}
        self._save()

    def _make_netns(self) -> None:
        ns = f"capes-gluster-{os.getpid()}"
        self.state.netns = ns
        self._save()
        steps = [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"]]
        if self.delay_ms:
            steps.append(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                          "netem", "delay", f"{self.delay_ms:g}ms"])
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                raise GlusterError(f"{' '.join(argv)}: {done.stderr.strip()[:300]}")
        if self.delay_ms:
            self.state.qdisc = f"netem delay {self.delay_ms:g}ms on lo in netns {ns}"
        self._save()

    def _make_disks(self, d: Path) -> None:
        """A sparse image, a loop device, XFS and a mount per brick; the throttle."""
        disk = self.disk
        self.state.throttle = throttle_mechanism()
        (d / "images").mkdir(exist_ok=True)
        if self.state.throttle == "cgroup v2 io.max" and disk.caps():
            cg = os.path.join(CGROUP_V2, f"capes-gluster-{os.getpid()}")
            os.makedirs(cg, exist_ok=True)
            self.state.throttle_cgroup = cg
            self._save()
        if disk.memory_mib:
            self._make_memory_cgroup(disk.memory_mib)
        for i, mnt in enumerate(self.state.brick_mounts):
            image = d / "images" / f"b{i + 1}.img"
            with open(image, "wb") as fh:
                fh.truncate(int(disk.size_gib * (1 << 30)))
            self.state.images.append(str(image))
            backing = self._seekdisk(d, i, image) if disk.seek_ms > 0 else image
            done = subprocess.run(["losetup", "--find", "--show", str(backing)],
                                  capture_output=True, text=True)
            if done.returncode:
                raise GlusterError(f"losetup: {done.stderr.strip()[:300]}")
            loop = done.stdout.strip()
            self.state.loops.append(loop)
            self._save()
            mm = dev_majmin(loop)
            for argv in (["mkfs.xfs", "-q", "-f", loop], ["mount", loop, mnt]):
                done = subprocess.run(argv, capture_output=True, text=True)
                if done.returncode:
                    raise GlusterError(f"{' '.join(argv)}: {done.stderr.strip()[:300]}")
            bdi = f"/sys/class/bdi/{mm}"
            if disk.dirty_mib and os.path.exists(f"{bdi}/strict_limit"):
                # max_bytes is max_ratio in other units: max_ratio_fine restores both
                for key, value in (("max_ratio_fine", None), ("strict_limit", "1"),
                                   ("max_bytes", str(disk.dirty_mib << 20))):
                    path = f"{bdi}/{key}"
                    if os.path.exists(path):
                        if key != "max_bytes":
                            self.state.sysfs_saved.setdefault(path, _read(path))
                        if value is not None:
                            _write(path, value)
            caps = disk.caps()
            if self.state.throttle == "cgroup v1 blkio":
                for key in caps:
                    f = os.path.join(BLKIO_V1, f"blkio.throttle.{key}_device")
                    self.state.throttle_rules.append([f, mm])
            elif caps:
                self.state.throttle_rules.append(
                    [os.path.join(self.state.throttle_cgroup, "io.max"), mm])
            self._save()
            self._write_caps(mm, caps)

    def _write_caps(self, mm: str, caps: dict[str, int]) -> None:
        """Device ``mm``'s throttle rules (a 0 in ``caps``: none for that key)."""
        if self.state.throttle == "cgroup v1 blkio":
            for key, value in caps.items():
                _write(os.path.join(BLKIO_V1, f"blkio.throttle.{key}_device"),
                       f"{mm} {value}\n")
        elif caps:
            _write(os.path.join(self.state.throttle_cgroup, "io.max"),
                   f"{mm} " + " ".join(f"{V2_KEYS[k]}={v or 'max'}" for k, v in caps.items())
                   + "\n")

    @contextlib.contextmanager
    def throttle_lifted(self):
        """The bricks' disks unthrottled for a while (laying data out at full speed), the
        throttle back on afterwards, whatever happens."""
        caps = self.disk.caps() if self.disk else {}
        devices = sorted({mm for _, mm in self.state.throttle_rules})
        for mm in devices:
            self._write_caps(mm, dict.fromkeys(caps, 0))
        try:
            yield
        finally:
            for mm in devices:
                self._write_caps(mm, caps)

    def _seekdisk(self, d: Path, i: int, image: Path) -> Path:
        """``tools/seekdisk`` serving ``image`` as DIR/seek/bK/disk (built when absent)."""
        exe = SEEKDISK
        if not exe.exists():
            subprocess.run(["make", "-s", "-C", str(exe.parent)], capture_output=True)
        if not exe.exists():
            raise GlusterError("tools/seekdisk cannot be built (make -C tools/seekdisk: "
                               "gcc, pkg-config, libfuse3-dev)")
        mnt = d / "seek" / f"b{i + 1}"
        mnt.mkdir(parents=True, exist_ok=True)
        self.state.seek_mounts.append(str(mnt))
        proc = self._spawn([str(exe), "--bandwidth-mbs", f"{self.disk.seek_mbs:g}",
                            "--seek-ms", f"{self.disk.seek_ms:g}", str(image), str(mnt),
                            "-f"], f"seekdisk-b{i + 1}.out")
        self.state.seek_pids.append(proc.pid)
        self._save()
        self._wait(f"seek disk {mnt}", lambda: mounted(mnt) and (mnt / "disk").exists(), proc)
        return mnt / "disk"

    def _make_memory_cgroup(self, mib: int) -> None:
        v1 = "/sys/fs/cgroup/memory"
        if os.path.isfile(os.path.join(v1, "memory.limit_in_bytes")):
            cg, key = os.path.join(v1, f"capes-gluster-{os.getpid()}"), "memory.limit_in_bytes"
        elif self.state.throttle_cgroup:
            cg, key = self.state.throttle_cgroup, "memory.max"
        else:
            cg, key = os.path.join(CGROUP_V2, f"capes-gluster-{os.getpid()}"), "memory.max"
        os.makedirs(cg, exist_ok=True)
        self.state.memory_cgroup = cg
        self._save()
        _write(os.path.join(cg, key), f"{int(mib) << 20}\n")

    def _undo_disks(self) -> list[str]:
        """Brick file systems unmounted, throttles off, sysfs as it was, loops detached."""
        st, problems = self.state, []
        for mnt in st.brick_mounts:
            if mounted(mnt):
                for argv in (["umount", mnt], ["umount", "-l", mnt]):
                    if subprocess.run(argv, capture_output=True).returncode == 0:
                        break
                if mounted(mnt):
                    problems.append(f"{mnt} still mounted")
        for f, mm in st.throttle_rules:
            try:
                if f.endswith("io.max"):
                    _write(f, f"{mm} rbps=max wbps=max riops=max wiops=max\n")
                else:
                    _write(f, f"{mm} 0\n")
            except OSError as exc:
                if os.path.exists(os.path.dirname(f)) and not f.endswith("io.max"):
                    problems.append(f"{f} {mm}: {exc}")
        st.throttle_rules = []
        for path, value in st.sysfs_saved.items():
            try:
                if os.path.exists(path) and _read(path) != value:
                    _write(path, value)
            except OSError as exc:
                problems.append(f"{path}: {exc}")
        st.sysfs_saved = {}
        for loop in st.loops:
            if subprocess.run(["losetup", "-d", loop], capture_output=True).returncode:
                if loop_backing(loop):
                    problems.append(f"{loop} still attached")
        st.loops = [lp for lp in st.loops
                    if loop_backing(lp) in st.images or
                    any(str(loop_backing(lp)).startswith(m) for m in st.seek_mounts)]
        for mnt in st.seek_mounts:
            if mounted(mnt):
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
        left = _signal_all(_signal_all(st.seek_pids, 0, 3.0), signal.SIGTERM, 3.0)
        left = _signal_all(left, signal.SIGKILL, 2.0)
        problems += [f"seek disk process {p} still running" for p in left]
        problems += [f"{m} still mounted" for m in st.seek_mounts if mounted(m)]
        for cg in dict.fromkeys([st.throttle_cgroup, st.memory_cgroup]):
            if not cg:
                continue
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                problems.append(f"{cg}: cgroup not removed")
        st.throttle_cgroup = st.memory_cgroup = None
        return problems

    def _undo_netns(self) -> list[str]:
        st = self.state
        if not st.netns:
            return []
        subprocess.run(["ip", "netns", "exec", st.netns, "tc", "qdisc", "del", "dev", "lo",
                        "root"], capture_output=True)
        subprocess.run(["ip", "netns", "del", st.netns], capture_output=True)
        if os.path.exists(f"/run/netns/{st.netns}"):
            return [f"network namespace {st.netns} still there"]
        st.netns = st.qdisc = None
        return []

    def _brick_pids(self) -> list[int]:
        out = []
        for f in sorted((self.dir / "run" / "vols" / self.volume).glob("*.pid")):
            try:
                out.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return out

    # -------------------------------------------------------------- status and down

    def our_pids(self) -> dict[int, list[str]]:
        """Our live gluster processes: the recorded PIDs and any gluster process whose
        arguments name our directory (a self-heal daemon, a brick restarted by glusterd)."""
        if self.state is None:
            return {}
        root = self.state.dir
        found = {p: a for p, a in gluster_processes().items() if _ours(a, root)}
        recorded = [self.state.glusterd_pid, self.state.client_pid, *self.state.client_pids,
                    *self.state.brick_pids]
        for p in recorded:
            if p and p not in found and _alive(p) and _ours(_cmdline(p), root):
                found[p] = _cmdline(p)
        return found

    def status(self) -> dict:
        if self.state is None:
            return {"up": False}
        pids = self.our_pids()
        return {"up": bool(pids) and mounted(self.state.mount), "dir": self.state.dir,
                "volume": self.state.volume, "host": self.state.host,
                "mount": self.state.mount, "mounted": mounted(self.state.mount),
                "bricks": self.state.bricks, "socket": self.state.socket,
                "gluster": self.gluster_argv(),
                "pids": {str(p): os.path.basename(a[0]) for p, a in sorted(pids.items())},
                "clients": [{"node": n, "mount": str(m), "pid": pid, "mounted": mounted(m),
                             "bdi": bdi, "read_ahead_kb": f"/sys/class/bdi/{bdi}/read_ahead_kb"}
                            for n, m, pid, bdi in zip(self.client_names, self.mounts,
                                                      self.state.client_pids,
                                                      self.state.client_bdis)],
                "loops": self.state.loops, "throttle": self.state.throttle or None,
                "netns": self.state.netns, "qdisc": self.state.qdisc,
                "timings_s": self.state.timings_s}

    def down(self) -> list[str]:
        """Tear everything down; return what is left behind (empty when clean)."""
        if self.state is None:
            return []
        st, t0 = self.state, time.monotonic()
        problems: list[str] = []
        mounts = st.mounts or [st.mount]
        for mnt in mounts:
            if mounted(mnt):
                for argv in (["umount", mnt], ["umount", "-l", mnt]):
                    if subprocess.run(argv, capture_output=True).returncode == 0:
                        break
        clients = [p for p in {st.client_pid, *st.client_pids} if p]
        if clients:
            _signal_all(_signal_all(clients, 0, 3.0), signal.SIGTERM, 3.0)
        t1 = time.monotonic()
        if st.glusterd_pid and _alive(st.glusterd_pid):
            for step in ("stop", "delete"):
                try:
                    self.gluster("volume", step, st.volume, check=False, timeout=30)
                except GlusterError as exc:           # the processes are killed below
                    log.warning("volume %s: %s", step, exc)
        t2 = time.monotonic()
        ours = self.our_pids()
        left = sorted(set(ours) | descendants(ours))
        left = _signal_all(left, signal.SIGTERM, 5.0)
        left = _signal_all(left, signal.SIGKILL, 3.0)
        for proc in self._procs:         # reap our own children
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        problems += [f"process {p} still running" for p in left]
        problems += self._undo_disks()
        problems += self._undo_netns()
        self._save_if_dir()
        still = [m for m in mounts + st.brick_mounts if mounted(m)]
        if still:
            problems += [f"{m} still mounted" for m in still]
        elif os.path.isdir(st.dir):
            try:
                shutil.rmtree(st.dir)
            except OSError as exc:
                problems.append(f"{st.dir}: {exc}")
        foreign = [p for p, a in gluster_processes().items()
                   if os.path.basename(a[0]) == "glusterd"]
        problems += remove_new(st.system_before, self._ours_path if foreign else None)
        if os.path.exists(st.dir):
            problems.append(f"{st.dir} still exists")
        t3 = time.monotonic()
        st.timings_s.update(down_umount=round(t1 - t0, 3), down_volume=round(t2 - t1, 3),
                            down_rest=round(t3 - t2, 3), down=round(t3 - t0, 3))
        return problems

    def _ours_path(self, path: str) -> bool:
        """A path gluster wrote for our volume: it names our directory (brick logs and
        dumps name the brick's path with '-' for '/') or one of our bricks' sockets."""
        token = self.state.dir.strip("/").replace("/", "-")
        return token in path or self.state.dir in path or path in self.state.own_paths

    def _save_if_dir(self) -> None:
        if self.dir is not None and os.path.isdir(self.dir):
            try:
                self._save()
            except OSError:
                pass

    def __enter__(self) -> "GlusterTestVolume":
        return self.up()

    def __exit__(self, *exc) -> None:
        problems = self.down()
        if problems and exc[0] is None:
            raise GlusterError("teardown left: " + "; ".join(problems))

    @classmethod
    def load(cls, dir: str | Path) -> "GlusterTestVolume":
        """The volume ``up`` started in DIR (from its state.json)."""
        path = Path(dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise GlusterError(f"{path}: no test volume state here ({exc})") from None
        state = VolumeState(**data)
        vol = cls(dir=state.dir, volume=state.volume, bricks=len(state.bricks),
                  replica=state.replica, host=state.host,
                  clients=max(1, len(state.mounts)), delay_ms=state.delay_ms,
                  netns=bool(state.netns))
        vol.dir, vol.state = Path(state.dir), state
        return vol


# ---------------------------------------------------------------- command line

# flag (aliases), the BrickDisk fields it sets, its type and help; a bench that stands a
# cluster up takes the same flags with its own defaults
BRICK_DISK_FLAGS = (
    (("--brick-mbs",), ("read_mbs", "write_mbs"), float,
     "throttle each brick's device to this many MB/s, reads and writes (cgroup v1 blkio "
     "or v2 io.max; needs --brick-gib)"),
    (("--brick-iops",), ("read_iops", "write_iops"), int,
     "throttle each brick's device to this many IOPS, reads and writes"),
    (("--brick-seek-ms", "--seek-ms"), ("seek_ms",), float,
     "serve each brick's image through tools/seekdisk: this seek cost per non-contiguous "
     "request, one request at a time (needs --brick-gib; 0: no seek disk)"),
    (("--brick-seek-mbs", "--seek-mbs"), ("seek_mbs",), float,
     "the seek disk's bandwidth (with --brick-seek-ms)"),
    (("--brick-memory-mib",), ("memory_mib",), int,
     "the brick processes' memory (page cache included) in a memory cgroup, so that "
     "reads reach the throttled disks (needs --brick-gib)"),
)


def add_brick_disk_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The bricks' disk flags (``BRICK_DISK_FLAGS``); ``defaults`` by the flag's name
    (``brick_mbs=80``), else BrickDisk's own."""
    base = BrickDisk()
    for flags, fields, kind, text in BRICK_DISK_FLAGS:
        dest = flags[0].lstrip("-").replace("-", "_")
        p.add_argument(*flags, dest=dest, type=kind,
                       default=defaults.get(dest, getattr(base, fields[0])), help=text)


def brick_disk_from_args(args, size_gib: float | None = None) -> BrickDisk:
    """The BrickDisk the flags of :func:`add_brick_disk_args` describe."""
    values = {f: getattr(args, flags[0].lstrip("-").replace("-", "_"))
              for flags, fields, _, _ in BRICK_DISK_FLAGS for f in fields}
    return BrickDisk(size_gib=args.brick_gib if size_gib is None else size_gib, **values)


def _volume_args(p: argparse.ArgumentParser, dir_required: bool) -> None:
    p.add_argument("--dir", required=dir_required,
                   help="an absent or empty directory" + ("" if dir_required else
                                                          " (default: a temp dir)"))
    p.add_argument("--volume", default="capes")
    p.add_argument("--bricks", type=int, default=3)
    p.add_argument("--replica", action="store_true", help="replica volume (default: "
                   "distributed)")
    p.add_argument("--host", help="brick host name resolving to loopback "
                   "(default: this host's name)")
    p.add_argument("--stats-dump", action="store_true",
                   help="diagnostics.stats-dump-interval 1 (per-second JSON stats)")
    p.add_argument("--profile", action="store_true", help="volume profile start")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a volume option set before the volume starts")
    p.add_argument("--clients", type=int, default=1,
                   help="FUSE client mounts, each its own process and node "
                   "(DIR/mnt1..N, nodes client1..N; 1: DIR/mnt)")
    p.add_argument("--brick-gib", type=float, default=0.0,
                   help="put each brick on a loop device of this size (XFS, a sparse "
                   "image under DIR); 0: bricks on DIR's file system")
    add_brick_disk_args(p)
    p.add_argument("--netns", action="store_true",
                   help="run glusterd, bricks and clients in a network namespace of our own "
                   "(beside another glusterd on this host)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="tc netem delay on the loopback of a network namespace of our own "
                   "in which glusterd, the bricks and the clients run (each way)")


def _from_args(args) -> GlusterTestVolume:
    opts = dict(kv.split("=", 1) for kv in args.set if "=" in kv)
    if (args.brick_mbs or args.brick_iops) and not args.brick_gib:
        raise GlusterError("--brick-mbs/--brick-iops throttle loop devices: give --brick-gib")
    disk = brick_disk_from_args(args) if args.brick_gib else None
    return GlusterTestVolume(args.dir, volume=args.volume, bricks=args.bricks,
                             replica=args.replica, host=args.host,
                             stats_dump=args.stats_dump, profile=args.profile,
                             options=opts, clients=args.clients, disk=disk,
                             delay_ms=args.delay_ms, netns=args.netns)


def run_on_volume(vol: GlusterTestVolume, command: list[str]) -> int:
    """Stand ``vol`` up, run ``command`` with the cluster in its environment
    (``CAPES_GLUSTER_DIR``, ``CAPES_GLUSTER_MOUNTS`` space-separated, ``CAPES_GLUSTER_SOCK``,
    ``CAPES_GLUSTER_VOLUME``), and tear it down whatever happens: the command's end, an
    error, SIGINT/SIGTERM/SIGHUP (the command's process group is signalled and the volume
    goes; exit 128 + signal)."""
    caught: list[int] = []
    child: list[subprocess.Popen] = []

    def on_signal(signum, _frame):
        caught.append(signum)
        if child and child[0].poll() is None:
            try:
                os.killpg(child[0].pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise KeyboardInterrupt
    old = {s: signal.signal(s, on_signal)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rc, problems = 1, []
    try:
        vol.up()
        st = vol.status()
        print(json.dumps(st, indent=1), file=sys.stderr, flush=True)
        env = {**os.environ, "CAPES_GLUSTER_DIR": str(vol.dir),
               "CAPES_GLUSTER_MOUNTS": " ".join(str(m) for m in vol.mounts),
               "CAPES_GLUSTER_SOCK": vol.socket_path, "CAPES_GLUSTER_VOLUME": vol.volume}
        child.append(subprocess.Popen(command, env=env, start_new_session=True))
        rc = child[0].wait()
    except KeyboardInterrupt:
        rc = 128 + (caught[0] if caught else signal.SIGINT)
    except (GlusterError, OSError) as exc:
        print(f"gluster-test-volume: {exc}", file=sys.stderr)
        rc = 1
    finally:
        if child and child[0].poll() is None:
            try:
                os.killpg(child[0].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child[0].wait()
        for s, h in old.items():          # a second signal no longer interrupts teardown
            signal.signal(s, signal.SIG_IGN)
        try:
            problems = vol.down()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    for p in problems:
        print(f"left behind: {p}", file=sys.stderr)
    return rc if not problems else (rc or 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gluster-test-volume", description=(
        "Stand up / tear down a local GlusterFS test volume (3 bricks, FUSE-mounted at "
        "DIR/mnt by default; a cluster with --bricks/--clients/--brick-gib), all on "
        "loopback, leaving nothing behind."))
    sub = ap.add_subparsers(dest="cmd", required=True)
    _volume_args(sub.add_parser("up", help="start glusterd, create, start and mount the "
                                "volume"), True)
    p_run = sub.add_parser("run", help="up, run COMMAND (after --), down on every exit path")
    _volume_args(p_run, False)
    p_run.add_argument("command", nargs=argparse.REMAINDER)
    for name, text in (("down", "unmount, stop and delete the volume, kill our processes, "
                                "undo loop devices, throttles and netns, remove DIR and "
                                "what gluster left in system paths"),
                       ("status", "print the volume's state as JSON")):
        sub.add_parser(name, help=text).add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                ap.error("run: give a command after --")
            return run_on_volume(_from_args(args), command)
        if args.cmd == "up":
            vol = _from_args(args).up()
            print(json.dumps(vol.status(), indent=1))
            return 0
        vol = GlusterTestVolume.load(args.dir)
        if args.cmd == "status":
            status = vol.status()
            print(json.dumps(status, indent=1))
            return 0 if status["up"] else 1
        problems = vol.down()
        for p in problems:
            print(f"left behind: {p}", file=sys.stderr)
        print(json.dumps({"down": not problems, "timings_s": vol.state.timings_s}))
        return 1 if problems else 0
    except GlusterError as exc:
        print(f"gluster-test-volume: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
