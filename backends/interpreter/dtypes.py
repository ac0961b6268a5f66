"""How the interpreter stores and computes each IR dtype.

Every value is stored in the numpy dtype of its IR dtype (bf16 through
ml_dtypes). Arithmetic on bf16 and f16 runs in float32 and rounds the result
once per op, as a GPU kernel does; f32 runs in float32 (float32 BLAS for
matmul). In float64 mode every float dtype is stored and computed in float64,
so finite differences are precise.
"""

from __future__ import annotations

import numpy as np

from ...dialects.core import FLOAT_DTYPES
from ...dialects.cpu import FLOAT_MODES
from ...dialects.graph_semantics import numpy_dtypes

#: The dialect dtypes' numpy dtypes (one table, shared with the folding passes).
_STORAGE = {name: np.dtype(scalar) for name, scalar in numpy_dtypes().items()}

__all__ = ["FLOAT_MODES", "DtypePolicy"]


class DtypePolicy:
    """Maps IR dtypes to numpy storage and compute dtypes under one float mode."""

    def __init__(self, float_mode: str = "native") -> None:
        if float_mode not in FLOAT_MODES:
            raise ValueError(f"float_mode must be one of {', '.join(FLOAT_MODES)}, not {float_mode!r}")
        self.float_mode = float_mode

    def storage(self, dtype: str) -> np.dtype:
        if self.float_mode == "f64" and dtype in FLOAT_DTYPES:
            return np.dtype(np.float64)
        return _STORAGE[dtype]

    def compute(self, dtype: str) -> np.dtype:
        """The dtype arithmetic runs in: float32 for the 16-bit floats, else the storage dtype."""
        storage = self.storage(dtype)
        if storage.itemsize == 2 and dtype in FLOAT_DTYPES:
            return np.dtype(np.float32)
        return storage

    def rounds(self, dtype: str) -> bool:
        """Whether results of this dtype are computed wider and rounded to storage."""
        return self.compute(dtype) != self.storage(dtype)
