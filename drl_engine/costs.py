"""A knob's cost category (seed 000, table 9.1): which knobs the engine moves online.

Only ``dynamic`` knobs (changed live) are tuned online: exploration, greedy moves, the
trust region and rollback skip the others (``remount``, ``reboot``, ``reformat``), which
the per-node mode reports as recommendations. One reading for every engine mode.
"""
from __future__ import annotations

from capes.common.params import COSTS


def knob_cost(spec) -> str:
    """A knob's cost category, validated (ValueError on an unknown one). Read with a
    default until :class:`~capes.common.params.ParameterSpec` carries the field."""
    cost = getattr(spec, "cost", "dynamic")
    if cost not in COSTS:
        raise ValueError(f"{spec.name}: cost must be one of {', '.join(COSTS)} "
                         f"(got {cost!r})")
    return cost


def tuned_online(spec) -> bool:
    """Only knobs that take effect live are moved online (``ParameterSpec.cost``)."""
    return getattr(spec, "cost", "dynamic") == "dynamic"


__all__ = ["COSTS", "knob_cost", "tuned_online"]
