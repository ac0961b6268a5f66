"""The text of a float that both the IR printer and the value printer write."""

from __future__ import annotations

import math


def shortest_float(x: float) -> str:
    """The shortest repr that reads back as the same float and never as an int; `nan`, `inf`, `-inf`."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))
