"""A vectorized, float64-accurate error function (numpy has none; scipy is not a dependency).

Piecewise Chebyshev interpolants of `math.erf`, fitted once at import on
intervals of width 1 (degree 18: past it the coefficients of this
entire function are below 1e-15 and only fit noise):

- |x| < 1: erf(x) = x·h(x²) with h(u) = erf(√u)/√u fitted on u ∈ [0, 1], so
  tiny arguments keep full relative precision;
- 1 ≤ |x| < 6: erf fitted directly on [k, k+1];
- |x| ≥ 6: ±1 (erfc(6) ≈ 2e-17 is below float64's resolution at 1).

Agrees with `math.erf` to about 3e-15 (absolute and relative) over the real line; each element costs
one Clenshaw evaluation, so this is about as fast as a few numpy ufuncs.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import chebyshev

_DEGREE = 18
_SATURATION = 6


def _fit(f, lo: float, hi: float) -> np.ndarray:
    """Chebyshev coefficients of f on [lo, hi], in the variable t ∈ [-1, 1]."""
    return chebyshev.chebinterpolate(lambda t: np.array([f(lo + (v + 1) * (hi - lo) / 2) for v in t]), _DEGREE)


def _erf_over_root(u: float) -> float:
    if u == 0:
        return 2 / math.sqrt(math.pi)
    root = math.sqrt(u)
    return math.erf(root) / root


_NEAR_ZERO = _fit(_erf_over_root, 0.0, 1.0)
_UNIT_INTERVALS = [_fit(math.erf, k, k + 1) for k in range(1, _SATURATION)]


def erf(x: np.ndarray) -> np.ndarray:
    """erf of every element, computed in float64 and returned as float64."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    # fmin maps NaN to the saturated interval (NaN is restored below) so the cast is defined.
    interval = np.floor(np.fmin(ax, _SATURATION)).astype(np.int64)
    near = interval == 0
    if near.all():
        out = ax * _clenshaw(2 * ax * ax - 1, _NEAR_ZERO)
    else:
        out = np.ones_like(x)
        if near.any():
            a = ax[near]
            out[near] = a * _clenshaw(2 * a * a - 1, _NEAR_ZERO)
        for k, coeffs in enumerate(_UNIT_INTERVALS, start=1):
            inside = interval == k
            if inside.any():
                out[inside] = _clenshaw(2 * (ax[inside] - k) - 1, coeffs)
        out[np.isnan(x)] = np.nan
    return np.copysign(out, x)


def _clenshaw(t: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """Σ c_k T_k(t) by Clenshaw's recurrence, in place over three rotating buffers."""
    two_t = 2 * t
    b1 = np.zeros_like(t)
    b2 = np.zeros_like(t)
    scratch = np.empty_like(t)
    for c in coeffs[:0:-1]:
        np.multiply(two_t, b1, out=scratch)
        scratch -= b2
        scratch += c
        b2, b1, scratch = b1, scratch, b2
    np.multiply(t, b1, out=scratch)
    scratch -= b2
    scratch += coeffs[0]
    return scratch
