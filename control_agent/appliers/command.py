"""Knobs set by a program: an argv template such as
``["lctl", "set_param", "osc.*.max_rpcs_in_flight={value}"]``.

``{param}`` and ``{value}`` are replaced inside each argument (the value written as an
integer when integral); nothing else is interpreted and no shell ever runs, so a value
cannot smuggle in a command. A non-zero exit or a timeout is an ApplyError. The
optional ``read_argv`` template (``{param}`` only) prints the current value, e.g.
``["lctl", "get_param", "-n", "osc.*.max_rpcs_in_flight"]``; the first number it prints
is the knob's value.
"""
from __future__ import annotations

import subprocess

from control_agent.appliers.base import (CATEGORICAL, NUMERIC, Applier, ApplyError,
                                         format_value, register)


def _argv_option(name: str, argv) -> list[str]:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"{name}: must be a non-empty list of strings")
    return list(argv)


@register("command")
class CommandApplier(Applier):
    kinds = (NUMERIC, CATEGORICAL)        # a text knob is written by name
    def __init__(self, argv: list[str], read_argv: list[str] | None = None,
                 timeout_s: float = 10.0):
        self.argv = _argv_option("argv", argv)
        self.read_argv = _argv_option("read_argv", read_argv) if read_argv is not None else None
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
        self.timeout_s = float(timeout_s)

    @staticmethod
    def _fill(template: list[str], param: str, value: str = "") -> list[str]:
        return [a.replace("{param}", param).replace("{value}", value) for a in template]

    def _run(self, argv: list[str], param: str) -> str:
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise ApplyError(f"{param}: {argv[0]} timed out after {self.timeout_s} s") from None
        except OSError as exc:
            raise ApplyError(f"{param}: cannot run {argv[0]}: {exc}") from None
        if done.returncode != 0:
            raise ApplyError(f"{param}: {argv[0]} exited with status {done.returncode}: "
                             f"{done.stderr.strip()[-300:]}")
        return done.stdout

    def apply(self, param: str, value: float) -> None:
        self._run(self._fill(self.argv, param, format_value(value)), param)

    def read(self, param: str) -> float | None:
        if self.read_argv is None:
            return None
        try:
            out = self._run(self._fill(self.read_argv, param), param)
        except ApplyError:
            return None
        for token in out.replace("=", " ").split():
            try:
                return float(token)
            except ValueError:
                continue
        return None
