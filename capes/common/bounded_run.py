"""Run a configured program with a deadline and an output cap, and leave nothing behind.

The command collector and applier and the GlusterFS plug-ins run programs every tick.
``subprocess.run(timeout=...)`` kills only the direct child: a wrapper script that hangs
leaves its children behind, one more every tick (86,400 a day), and it reads the output
whole, so a program that prints 256 MB costs that much memory and the tick. Here:

* the program starts in its own session and process group (``start_new_session``), and
  the whole group is killed with SIGKILL when it is done: on a timeout, on output over
  the cap, and also after a normal exit (a background child it left would otherwise
  live on; these programs are meant to be quick queries and setters, not daemons). The
  group is killed while its leader is still an unreaped zombie, so its id cannot have
  been reused by an unrelated group. A child that starts a session of its own escapes
  (only a cgroup could hold it);
* stdout and stderr are read as they come, at most ``max_output`` bytes each: past that
  the program is killed and the result says ``overflow``;
* never a shell; stdin is /dev/null.
"""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

MAX_OUTPUT = 1 << 20          # bytes of stdout (and of stderr) kept from one run


@dataclass
class Finished:
    """What one bounded run gave: ``returncode`` None when it was killed (``timed_out``
    or ``overflow``)."""
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    overflow: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self, timeout_s: float, max_output: int = MAX_OUTPUT) -> str:
        """Why the run failed, in words (for a log line or an error)."""
        if self.timed_out:
            return f"timed out after {timeout_s:g} s"
        if self.overflow:
            return f"printed more than {max_output} bytes; stopped"
        return (f"exit status {self.returncode}: "
                f"{(self.stderr.strip() or self.stdout.strip())[-300:]}")


def run_bounded(argv: list[str], timeout_s: float, max_output: int = MAX_OUTPUT
                ) -> Finished:
    """Run ``argv`` (OSError when it cannot start) until it exits, ``timeout_s`` passes
    or it prints more than ``max_output`` bytes on one stream; its whole process group
    is killed before this returns."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout_s
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    timed_out = overflow = False
    sel = selectors.DefaultSelector()
    try:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not overflow:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                if len(buf) + len(chunk) > max_output:
                    buf += chunk[:max_output - len(buf)]
                    overflow = True
                    break
                buf += chunk
        if not (timed_out or overflow):
            timed_out = not _exited(proc.pid, deadline)
    finally:
        sel.close()
        _kill_group(proc.pid)              # the leader is alive or a zombie: id still ours
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out, err = (bufs[f].decode("utf-8", "replace") for f in bufs)
    code = None if (timed_out or overflow) else proc.returncode
    return Finished(list(argv), code, out, err, timed_out, overflow)


def _exited(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` has exited, without reaping it; False at ``deadline``."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def program_problem(program: str) -> str | None:
    """Why ``program`` (a path, or a name looked up on PATH) cannot be run (None: it
    can); looks, never runs."""
    found = shutil.which(program) if os.sep not in program else (
        program if os.path.isfile(program) and os.access(program, os.X_OK) else None)
    if found is None:
        return (f"{program!r}: no such program on PATH" if os.sep not in program else
                f"{program!r}: no such executable file")
    return None
