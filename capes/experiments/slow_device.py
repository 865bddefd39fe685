"""A loop device that behaves like a slow disk, for trying CAPES on a real device in
minutes: a sparse image (in ``/dev/shm`` by default), a loop device over it, and a
cgroup that caps the reads of the processes put in it (cgroup v1
``blkio.throttle.read_iops_device`` / ``read_bps_device``, or v2 ``io.max`` ``riops`` /
``rbps``). Where each request costs a fixed share of a capped IOPS budget, the request
size, and so ``read_ahead_kb``, decides the throughput, as on a disk or a cloud volume.

Everything is named after ``NAME``, so it is torn down by name::

    python -m capes.experiments.slow_device create walk --read-iops 200 --read-mbs 100
    DEV=loop3
    CGROUP=/sys/fs/cgroup/blkio/capes-slow-walk
    python -m capes.experiments.slow_device destroy walk

(``tools/slow-loop-device`` is the same from a source tree.) ``create`` prints shell
assignments, so ``eval "$(... create walk)"`` sets ``$DEV`` and ``$CGROUP``. Only the
processes in the cgroup are capped: run the reader there (the workload driver's
``--cgroup $CGROUP``). The recipe by hand, cgroup v2 (v1: the ``blkio`` hierarchy and
``blkio.throttle.read_iops_device``)::

    truncate -s 2G /dev/shm/slow.img && losetup --find --show /dev/shm/slow.img
    mkdir /sys/fs/cgroup/slow && echo "7:3 riops=200 rbps=100000000" > /sys/fs/cgroup/slow/io.max
    echo $$ > /sys/fs/cgroup/slow/cgroup.procs      # this shell and what it starts

Root only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from capes.experiments.workload_driver import ThrottledCgroup, WorkloadError

PREFIX = "capes-slow-"


def image_name(name: str) -> str:
    return f"{PREFIX}{name}.img"


def cgroup_candidates(name: str) -> list[Path]:
    """Where ``create`` may have made the cgroup (v1 blkio, or v2)."""
    return [Path(ThrottledCgroup.V1) / f"{PREFIX}{name}",
            Path(ThrottledCgroup.V2) / f"{PREFIX}{name}"]


def loops_of(name: str) -> list[tuple[str, str]]:
    """(loop device, backing file) of every loop device over ``name``'s image."""
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                         capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and Path(parts[1].split(" (deleted)")[0]).name == image_name(name):
            found.append((parts[0], parts[1].split(" (deleted)")[0]))
    return found


def create(name: str, size_gib: float = 2.0, read_iops: int = 200, read_mbs: float = 100.0,
           read_ahead_kb: int | None = None, directory: str = "/dev/shm") -> dict[str, str]:
    """Make ``name``'s image, loop device and throttled cgroup; return DEV and CGROUP.
    On any failure what was made is removed again."""
    if not name or "/" in name or name.startswith("."):
        raise WorkloadError(f"bad name {name!r}")
    if loops_of(name) or any(p.exists() for p in cgroup_candidates(name)):
        raise WorkloadError(f"{name!r} exists: destroy it first "
                            f"(python -m capes.experiments.slow_device destroy {name})")
    image = Path(directory) / image_name(name)
    dev = None
    try:
        with open(image, "xb"):
            pass
        os.truncate(image, int(size_gib * (1 << 30)))
        dev = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True,
                             text=True, check=True).stdout.strip()
        if read_ahead_kb is not None:
            Path(f"/sys/block/{Path(dev).name}/queue/read_ahead_kb").write_text(
                f"{int(read_ahead_kb)}\n")
        cg = ThrottledCgroup(dev, read_iops=read_iops, read_bps=int(read_mbs * 1e6),
                             name=f"{PREFIX}{name}")
    except (OSError, subprocess.CalledProcessError, WorkloadError) as exc:
        if dev:
            subprocess.run(["losetup", "--detach", dev], check=False)
        image.unlink(missing_ok=True)
        detail = getattr(exc, "stderr", "") or exc
        raise WorkloadError(f"cannot make {name!r}: {str(detail).strip()}") from None
    return {"DEV": Path(dev).name, "CGROUP": cg.path}


def destroy(name: str) -> list[str]:
    """Remove ``name``'s loop devices, cgroup and image; return what was removed. A
    cgroup that still holds processes is left (named in the error)."""
    removed = []
    for dev, back in loops_of(name):
        subprocess.run(["losetup", "--detach", dev], check=True)
        removed.append(dev)
        Path(back).unlink(missing_ok=True)
        removed.append(back)
    busy = []
    for path in cgroup_candidates(name):
        if path.is_dir():
            try:
                path.rmdir()
                removed.append(str(path))
            except OSError:
                busy.append(str(path))
    if busy:
        raise WorkloadError(f"{', '.join(busy)}: processes are still in it (stop the "
                            "workload first)")
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m capes.experiments.slow_device",
                                 description="a loop device that behaves like a slow disk")
    sub = ap.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="make it; prints DEV=... and CGROUP=...")
    c.add_argument("name")
    c.add_argument("--size-gib", type=float, default=2.0, help="(default: %(default)g)")
    c.add_argument("--read-iops", type=int, default=200, help="(default: %(default)d)")
    c.add_argument("--read-mbs", type=float, default=100.0,
                   help="read MB/s cap (default: %(default)g)")
    c.add_argument("--read-ahead-kb", type=int, default=None,
                   help="set the device's read_ahead_kb (default: the kernel's)")
    c.add_argument("--dir", default="/dev/shm", help="where the sparse image lives "
                                                      "(default: %(default)s)")
    d = sub.add_parser("destroy", help="remove it: loop device, cgroup, image")
    d.add_argument("name")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("slow_device: needs root (losetup, cgroups)", file=sys.stderr)
        return 1
    try:
        if args.action == "create":
            made = create(args.name, args.size_gib, args.read_iops, args.read_mbs,
                          args.read_ahead_kb, args.dir)
            for key, value in made.items():
                print(f"{key}={value}")
            print(f"slow_device: /dev/{made['DEV']} is capped at {args.read_iops} read IOPS "
                  f"and {args.read_mbs:g} MB/s for processes in {made['CGROUP']} (the "
                  f"workload driver's --cgroup); remove it with: python -m "
                  f"capes.experiments.slow_device destroy {args.name}", file=sys.stderr)
        else:
            gone = destroy(args.name)
            print(f"slow_device: removed {', '.join(gone) or 'nothing (none found)'}",
                  file=sys.stderr)
    except WorkloadError as exc:
        print(f"slow_device: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
