"""Built-in collectors, one per file; see ``base`` for the interface."""
from monitor_agent.collectors.base import COLLECTORS, Collector, build_collector, register

__all__ = ["COLLECTORS", "Collector", "build_collector", "register"]
