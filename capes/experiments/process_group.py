"""A group of ``capes`` child processes that is always stopped as a whole.

Used by ``capes demo`` and by the benchmarks that run the stack as real processes.
Each child logs to ``<workdir>/logs/<name>.log`` and runs in its own session, so a
Ctrl-C reaches only the parent, which then stops the children in order.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


class ProcessGroup:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> None:
        """Start ``python -m capes ARGS`` in the work dir."""
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "capes", *args], cwd=self.workdir, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

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

    def stop(self, timeout: float = 8.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order (agents restore defaults, the daemon commits),
        then SIGKILL whatever is left after ``timeout``; return the exit codes."""
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {n: p.returncode for n, p in self.procs.items()}
