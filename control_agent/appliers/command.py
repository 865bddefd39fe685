"""Knobs set by a program: an argv template such as
``["lctl", "set_param", "osc.*.max_rpcs_in_flight={value}"]``.

``{param}`` and ``{value}`` are replaced inside each argument (the value written as an
integer when integral); nothing else is interpreted and no shell ever runs, so a value
cannot smuggle in a command. A non-zero exit, a timeout or more than
``max_output_bytes`` of output is an ApplyError; the program runs in a process group
of its own, killed whole when it is done (``capes.common.bounded_run``). The
optional ``read_argv`` template (``{param}`` only) prints the current value, e.g.
``["lctl", "get_param", "-n", "osc.*.max_rpcs_in_flight"]``; the first number it prints
is the knob's value.
"""
from __future__ import annotations

from capes.common.bounded_run import MAX_OUTPUT, program_problem, run_bounded
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
                 timeout_s: float = 10.0, max_output_bytes: int = MAX_OUTPUT):
        self.argv = _argv_option("argv", argv)
        self.read_argv = _argv_option("read_argv", read_argv) if read_argv is not None else None
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
        if not isinstance(max_output_bytes, int) or max_output_bytes < 1:
            raise ValueError(f"max_output_bytes: must be an integer >= 1 "
                             f"(got {max_output_bytes!r})")
        self.timeout_s, self.max_output = float(timeout_s), max_output_bytes

    @staticmethod
    def _fill(template: list[str], param: str, value: str = "") -> list[str]:
        return [a.replace("{param}", param).replace("{value}", value) for a in template]

    def _run(self, argv: list[str], param: str) -> str:
        try:
            done = run_bounded(argv, self.timeout_s, self.max_output)
        except OSError as exc:
            raise ApplyError(f"{param}: cannot run {argv[0]}: {exc}") from None
        if not done.ok:
            raise ApplyError(f"{param}: {argv[0]}: {done.why(self.timeout_s, self.max_output)}")
        return done.stdout

    def check(self, param: str) -> str | None:
        """The programs exist (neither is run: a check changes nothing)."""
        for name, argv in (("argv", self.argv), ("read_argv", self.read_argv)):
            why = argv and program_problem(argv[0])
            if why:
                return f"{name}: {why}"
        return None

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
