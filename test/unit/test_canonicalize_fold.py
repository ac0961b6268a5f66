"""canonicalize's pure-Python float32 folding gives numpy's float32 results exactly, or declines."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sexpgpu.dialects.graph_semantics import numpy_binary, numpy_unary
from sexpgpu.passes.canonicalize import (
    _EXACT_ARITH,
    _EXACT_COMPARE,
    _EXACT_UNARY,
    _exact_f32_fold,
)

EDGES = [0.0, -0.0, 1.0, -1.0, 0.1, 3.4e38, -3.4e38, 1e-45, 1.17e-38, 2.5e-39, 7.0, 1e30, 1e-30, math.inf, -math.inf,
         math.nan, 1e39]


def _samples() -> list[float]:
    rng = np.random.default_rng(0)
    values = list(EDGES)
    values += [float(x) for x in rng.standard_normal(40)]
    values += [float(x) for x in rng.standard_normal(20) * 1e37]
    values += [float(x) for x in rng.standard_normal(20) * 1e-39]
    return values


def _numpy_f32(name: str, scalars: list[float]):
    unary, binary = numpy_unary(), numpy_binary()
    with np.errstate(all="ignore"):
        args = [np.float32(s) for s in scalars]
        out = unary[name](args[0]) if name in unary else binary[name](*args)
    return out


@pytest.mark.parametrize("name", [*_EXACT_UNARY, *_EXACT_ARITH, *_EXACT_COMPARE, "graph.maximum", "graph.minimum"])
def test_exact_fold_is_numpy_float32(name):
    values = _samples()
    arity = 1 if name in _EXACT_UNARY else 2
    pairs = [[a] for a in values] if arity == 1 else [[a, b] for a in values for b in values[::3]]
    folded = 0
    for scalars in pairs:
        ours = _exact_f32_fold(name, scalars)
        if ours is None:
            continue
        folded += 1
        theirs = _numpy_f32(name, scalars)
        if isinstance(ours, bool):
            assert ours == bool(theirs), (name, scalars)
        else:
            # Bit for bit, the sign of zero included.
            assert np.float32(ours).tobytes() == np.float32(theirs).tobytes(), (name, scalars, ours, theirs)
            assert ours == float(np.float32(ours))
    assert folded > len(pairs) // 2


def test_exact_fold_declines_what_it_cannot_promise():
    assert _exact_f32_fold("graph.div", [1.0, 0.0]) is None
    assert _exact_f32_fold("graph.mul", [3e38, 10.0]) is None  # overflows float32
    assert _exact_f32_fold("graph.add", [math.nan, 1.0]) is None
    assert _exact_f32_fold("graph.sqrt", [-1.0]) is None
    assert _exact_f32_fold("graph.exp", [1.0]) is None  # not correctly rounded: numpy decides
    assert _exact_f32_fold("graph.maximum", [0.0, -0.0]) is None
