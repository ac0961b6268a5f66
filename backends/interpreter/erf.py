"""A vectorized, float64-accurate error function (numpy has none; scipy is not a dependency).

Two classical expansions, each used where it converges quickly and without
cancellation worth mentioning:

- |x| < 3: the Maclaurin series erf(x) = 2/√π Σ (-1)^n x^(2n+1) / (n! (2n+1)),
  summed to 60 terms; the largest term at |x| = 3 is about 1e3, so about 13
  significant digits survive the alternating sum.
- |x| ≥ 3: the continued fraction erfc(x) = e^(-x²)/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))),
  evaluated bottom-up with 80 levels; erf = 1 - erfc.

Both agree with `math.erf` to about 1e-13 absolute over the real line, far below
what a 1e-4 reference tolerance or a float64 finite difference needs.
"""

from __future__ import annotations

import math

import numpy as np

_SERIES_LIMIT = 3.0
_SERIES_TERMS = 60
_FRACTION_DEPTH = 80
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def erf(x: np.ndarray) -> np.ndarray:
    """erf of every element, computed in float64 and returned as float64."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    out = np.empty_like(x)
    near = ax < _SERIES_LIMIT
    out[near] = _series(x[near])
    far = ~near
    out[far] = np.copysign(1.0 - _erfc_fraction(ax[far]), x[far])
    return out


def _series(x: np.ndarray) -> np.ndarray:
    minus_x2 = -x * x
    term = x.copy()
    total = x.copy()
    for n in range(1, _SERIES_TERMS):
        term *= minus_x2 / n
        total += term / (2 * n + 1)
    return _TWO_OVER_SQRT_PI * total


def _erfc_fraction(x: np.ndarray) -> np.ndarray:
    """erfc for x ≥ 3 (positive), where e^(-x²) is already below 1.3e-4."""
    tail = x.copy()
    for n in range(_FRACTION_DEPTH, 0, -1):
        tail = x + (n / 2.0) / tail
    return np.exp(-x * x) / (math.sqrt(math.pi) * tail)
