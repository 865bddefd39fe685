"""A group of ``capes`` child processes that is always stopped as a whole.

Used by ``capes demo`` and by the benchmarks that run the stack as real processes.
Each child logs to ``<workdir>/logs/<name>.log`` and runs in its own session, so a
Ctrl-C reaches only the parent, which then stops the children in order. On Linux every
child also asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so
even a ``kill -9`` of the parent stops the children (each one cleanly: the control agent
restores the defaults, the daemon commits, the engine checkpoints).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, looked up in the parent (a forked child must not dlopen)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn``: the child gets ``sig`` when the process that started it dies;
    None where the platform has no parent-death signal."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:      # the parent died before prctl took effect
            os.kill(os.getpid(), sig)
    return preexec


def kill_session(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc``'s process group (a child started with ``start_new_session``) if
    it still runs, and reap it; its exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


class ProcessGroup:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, module: str = "capes") -> None:
        """Start ``python -m MODULE ARGS`` (``capes`` by default) in the work dir."""
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, *args], cwd=self.workdir, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent())

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, s) each running child has used so far, its threads
        and reaped children included (``/proc/PID/stat``); a child already gone or
        unreadable is left out. What the stack itself costs the host it tunes."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, p in self.procs.items():
            if p.poll() is not None:
                continue
            try:
                stat = Path(f"/proc/{p.pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()      # after "pid (comm)"
            out[name] = sum(int(f) for f in fields[11:15]) / tick   # utime .. cstime
        return out

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise with the log tail of the first child that exited."""
        for name in self.dead():
            raise RuntimeError(f"{name} exited with status {self.procs[name].returncode}:\n"
                               f"{self.log_tail(name)}")

    def stop(self, timeout: float = 8.0, first: tuple[str, ...] = ()) -> dict[str, int | None]:
        """Stop every child with SIGTERM (agents restore defaults, the daemon commits)
        and SIGKILL whatever is left after ``timeout``; return the exit codes. The
        children named in ``first`` are stopped, and waited for, before the others
        (e.g. the engine, which reads the replay DB, before the daemon that writes it,
        so that the daemon is its last user and can fold the WAL into the DB file)."""
        deadline = time.monotonic() + timeout
        early = [n for n in first if n in self.procs]
        for group in (early, [n for n in reversed(list(self.procs)) if n not in early]):
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                p = self.procs[name]
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            deadline = max(deadline, time.monotonic() + timeout / 2)
        return {n: p.returncode for n, p in self.procs.items()}
