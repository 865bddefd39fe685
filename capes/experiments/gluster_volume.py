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

Use from Python::

    with GlusterTestVolume() as vol:          # a temp dir; removed on exit
        vol.gluster("volume", "set", vol.volume, "performance.read-ahead", "on")
        open(vol.mount / "f", "wb").write(b"x")

or from the shell (``tools/gluster-test-volume``)::

    tools/gluster-test-volume up --dir /var/tmp/capes-gluster --stats-dump
    tools/gluster-test-volume status --dir /var/tmp/capes-gluster
    tools/gluster-test-volume down --dir /var/tmp/capes-gluster

Stdlib only (the shell tool runs with any Python 3.11).
"""
from __future__ import annotations

import argparse
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


def remove_new(before: dict[str, list[str] | None]) -> list[str]:
    """Remove what appeared in the trees since ``before``; return what could not be."""
    failed = []
    for tree, old in before.items():
        if not os.path.lexists(tree):
            continue
        if old is None:
            try:
                shutil.rmtree(tree)
            except OSError as exc:
                failed.append(f"{tree}: {exc}")
            continue
        keep = set(old)
        now = snapshot([tree])[tree] or []
        for rel in sorted(now, key=lambda r: r.count(os.sep), reverse=True):
            if rel in keep:
                continue
            path = os.path.join(tree, rel)
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


class GlusterTestVolume:
    def __init__(self, dir: str | Path | None = None, volume: str = "capes", bricks: int = 3,
                 replica: bool = False, host: str | None = None, stats_dump: bool = False,
                 profile: bool = False, options: dict[str, str] | None = None,
                 timeout_s: float = 30.0):
        if bricks < 1 or (replica and bricks < 2):
            raise ValueError("bricks: need at least 1 (2 for a replica volume)")
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
        running = gluster_processes()
        if any(os.path.basename(a[0]) == "glusterd" for a in running.values()):
            raise GlusterError(f"a glusterd is already running (pids "
                               f"{sorted(running)}); this tool runs only its own")
        if port_in_use():
            raise GlusterError(f"port {GLUSTERD_PORT} is taken: a glusterd runs here")
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
        self.state = VolumeState(
            dir=str(d), volume=self.volume, host=host, replica=self.replica,
            bricks=[str(d / "bricks" / f"b{i + 1}") for i in range(self.n_bricks)],
            mount=str(d / "mnt"), socket=self.socket_path, system_before=snapshot())
        try:
            self._up(d, host)
        except BaseException:
            self.down()
            raise
        return self

    def _up(self, d: Path, host: str) -> None:
        t0 = time.monotonic()
        for sub in ("state", "run", "log", "mnt", *self.state.bricks):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self._save()                      # from here on, `down --dir` can clean up
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
        self._save()
        t2 = time.monotonic()
        client = self._spawn(["glusterfs", "-N", f"--volfile-server={host}",
                              f"--volfile-id={self.volume}",
                              "-l", str(d / "log" / "client.log"), self.state.mount],
                             "client.out")
        self.state.client_pid = client.pid
        self._save()
        self._wait("FUSE mount", lambda: mounted(self.state.mount), client)
        os.statvfs(self.state.mount)      # the mount answers
        t3 = time.monotonic()
        self.state.timings_s = {"glusterd": round(t1 - t0, 3), "volume": round(t2 - t1, 3),
                                "mount": round(t3 - t2, 3), "up": round(t3 - t0, 3)}
        self._save()

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
        recorded = [self.state.glusterd_pid, self.state.client_pid, *self.state.brick_pids]
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
                "timings_s": self.state.timings_s}

    def down(self) -> list[str]:
        """Tear everything down; return what is left behind (empty when clean)."""
        if self.state is None:
            return []
        st, t0 = self.state, time.monotonic()
        problems: list[str] = []
        if mounted(st.mount):
            for argv in (["umount", st.mount], ["umount", "-l", st.mount]):
                if subprocess.run(argv, capture_output=True).returncode == 0:
                    break
        if st.client_pid:
            _signal_all(_signal_all([st.client_pid], 0, 3.0), signal.SIGTERM, 3.0)
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
        if mounted(st.mount):
            problems.append(f"{st.mount} still mounted")
        elif os.path.isdir(st.dir):
            try:
                shutil.rmtree(st.dir)
            except OSError as exc:
                problems.append(f"{st.dir}: {exc}")
        problems += remove_new(st.system_before)
        if os.path.exists(st.dir):
            problems.append(f"{st.dir} still exists")
        t3 = time.monotonic()
        st.timings_s.update(down_umount=round(t1 - t0, 3), down_volume=round(t2 - t1, 3),
                            down_rest=round(t3 - t2, 3), down=round(t3 - t0, 3))
        return problems

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
                  replica=state.replica, host=state.host)
        vol.dir, vol.state = Path(state.dir), state
        return vol


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gluster-test-volume", description=(
        "Stand up / tear down a local 3-brick GlusterFS test volume, FUSE-mounted at "
        "DIR/mnt, all on loopback, leaving nothing behind."))
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start glusterd, create, start and mount the volume")
    p_up.add_argument("--dir", required=True, help="an absent or empty directory")
    p_up.add_argument("--volume", default="capes")
    p_up.add_argument("--bricks", type=int, default=3)
    p_up.add_argument("--replica", action="store_true", help="replica volume (default: "
                      "distributed)")
    p_up.add_argument("--host", help="brick host name resolving to loopback "
                      "(default: this host's name)")
    p_up.add_argument("--stats-dump", action="store_true",
                      help="diagnostics.stats-dump-interval 1 (per-second JSON stats)")
    p_up.add_argument("--profile", action="store_true", help="volume profile start")
    p_up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a volume option set before the volume starts")
    for name, text in (("down", "unmount, stop and delete the volume, kill our processes, "
                                "remove DIR and what gluster left in system paths"),
                       ("status", "print the volume's state as JSON")):
        sub.add_parser(name, help=text).add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            opts = dict(kv.split("=", 1) for kv in args.set if "=" in kv)
            vol = GlusterTestVolume(args.dir, volume=args.volume, bricks=args.bricks,
                                    replica=args.replica, host=args.host,
                                    stats_dump=args.stats_dump, profile=args.profile,
                                    options=opts).up()
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
