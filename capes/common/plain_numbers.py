"""Numbers as people read them: no e-notation in anything a user sees (``1e+06``,
``8.962e+05`` and ``1.2e-05`` in a log or a status line read as noise, and cannot be
pasted into ``--set`` as a knob's value)."""
from __future__ import annotations

import math


def plain(value, digits: int = 4, none: str = "-") -> str:
    """``value`` with ``digits`` significant digits in fixed notation, trailing zeros
    dropped: 896200, 0.1392, 0.00001234, 4194304 (a whole part is never rounded)."""
    if value is None:
        return none
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return none
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    text = f"{v:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text
