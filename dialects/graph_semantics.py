"""numpy reference semantics of the elementwise graph ops, for folding and execution.

One place says what `graph.add`, `graph.exp`, `graph.lt`, ... compute, so the
folding passes and the backends cannot drift apart (which ops are unary,
binary or compares is the traits table's to say: `dialects/traits.py`):

- `numpy_unary()` / `numpy_binary()`: the op on numpy values of the operand's
  dtype (`numpy_dtype()` maps a dialect dtype to its numpy scalar type);
- `FLOAT64_UNARY` / `FLOAT64_ARITH` / `FLOAT64_COMPARE`: the same ops on Python
  floats (IEEE float64), for folds that need no numpy.

numpy (and ml_dtypes) are imported on first use: most folds take the
pure-Python path, and `sexpgpu check` should not pay numpy's import for them.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any


def numpy_dtype(dtype: str) -> Any:
    """The numpy scalar type of one dialect dtype. Only bf16 imports ml_dtypes, which takes
    about a second (0.7): a fold of an f32 constant, `sexpgpu check`'s commonest, does not pay it."""
    if dtype == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _builtin_numpy_dtypes()[dtype]


@functools.cache
def _builtin_numpy_dtypes() -> dict[str, Any]:
    import numpy as np

    return {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64, "i1": np.bool_}


@functools.cache
def numpy_dtypes() -> dict[str, Any]:
    """The numpy scalar type of each dialect dtype (bf16 included: for the backends)."""
    return {dtype: numpy_dtype(dtype) for dtype in ("f32", "f16", "bf16", "i32", "i64", "i1")}


def _rsqrt(x: Any) -> Any:
    import numpy as np

    return 1 / np.sqrt(x)


def _erf(x: Any) -> Any:
    # numpy has no erf: this one takes a scalar (the interpreter brings a vectorized one).
    return type(x)(math.erf(float(x)))


@functools.cache
def numpy_unary() -> dict[str, Callable[[Any], Any]]:
    """Each unary op on a numpy value, computed in that value's dtype."""
    import numpy as np

    return {
        "graph.neg": np.negative,
        "graph.exp": np.exp,
        "graph.log": np.log,
        "graph.sqrt": np.sqrt,
        "graph.rsqrt": _rsqrt,
        "graph.tanh": np.tanh,
        "graph.erf": _erf,
        "graph.abs": np.abs,
        "graph.recip": np.reciprocal,
        "graph.sin": np.sin,
        "graph.cos": np.cos,
    }


@functools.cache
def numpy_binary() -> dict[str, Callable[[Any, Any], Any]]:
    """Each binary arithmetic and compare op on numpy values, computed in their dtype."""
    import numpy as np

    return {
        "graph.add": np.add,
        "graph.sub": np.subtract,
        "graph.mul": np.multiply,
        "graph.div": np.divide,
        "graph.pow": np.power,
        "graph.maximum": np.maximum,
        "graph.minimum": np.minimum,
        "graph.eq": np.equal,
        "graph.ne": np.not_equal,
        "graph.lt": np.less,
        "graph.le": np.less_equal,
        "graph.gt": np.greater,
        "graph.ge": np.greater_equal,
    }


#: On Python floats; a domain error raises (ValueError, ZeroDivisionError, OverflowError) where numpy gives nan/inf.
FLOAT64_UNARY: dict[str, Callable[[float], float]] = {
    "graph.neg": operator.neg,
    "graph.exp": math.exp,
    "graph.log": math.log,
    "graph.sqrt": math.sqrt,
    "graph.rsqrt": lambda x: 1.0 / math.sqrt(x),
    "graph.tanh": math.tanh,
    "graph.erf": math.erf,
    "graph.abs": abs,
    "graph.recip": lambda x: 1.0 / x,
    "graph.sin": math.sin,
    "graph.cos": math.cos,
}
FLOAT64_ARITH: dict[str, Callable[[float, float], float]] = {
    "graph.add": operator.add,
    "graph.sub": operator.sub,
    "graph.mul": operator.mul,
    "graph.div": operator.truediv,
    "graph.pow": operator.pow,
    "graph.maximum": max,
    "graph.minimum": min,
}
FLOAT64_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "graph.eq": operator.eq,
    "graph.ne": operator.ne,
    "graph.lt": operator.lt,
    "graph.le": operator.le,
    "graph.gt": operator.gt,
    "graph.ge": operator.ge,
}
