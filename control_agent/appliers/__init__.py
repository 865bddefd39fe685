"""Built-in appliers, one per file; see ``base`` for the interface."""
from control_agent.appliers.base import APPLIERS, Applier, ApplyError, build_applier, register

__all__ = ["APPLIERS", "Applier", "ApplyError", "build_applier", "register"]
