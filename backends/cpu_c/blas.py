"""The BLAS the generated C calls for GEMMs: the OpenBLAS numpy already loads (`scipy-openblas`).

numpy's wheels bundle OpenBLAS built with 64-bit integers and prefixed symbols (`scipy_cblas_sgemm64_`);
numpy itself calls it for every f32 `matmul`, so the interpreter and `cpu-c` multiply with the same code.
The C gets the address of `cblas_sgemm` (no copy of an operand: the transposes are BLAS's flags and the
strides its leading dimensions), and the thread count is set with `openblas_set_num_threads`. OpenBLAS
splits a GEMM among threads by blocks of the output, each element's sum over k made in the same order
whatever the count, so the results do not depend on it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from attrs import frozen

#: (cblas_sgemm, set_num_threads) symbol pairs of the 64-bit-integer OpenBLAS builds numpy ships (the C
#: passes sizes as 64-bit integers).
_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_"),
            ("cblas_sgemm64_", "openblas_set_num_threads64_"))


@frozen
class Blas:
    library: str
    sgemm: int
    set_threads: ctypes._CFuncPtr


@functools.cache
def numpy_blas() -> Blas | None:
    """numpy's OpenBLAS: its path, the address of its `cblas_sgemm`, its thread setter; None if not found."""
    folders = [Path(np.__file__).parent.parent / "numpy.libs", Path(np.__file__).parent / ".dylibs"]
    for folder in folders:
        for path in sorted(folder.glob("*openblas*")):
            try:
                library = ctypes.CDLL(str(path))
            except OSError:
                continue
            for sgemm, threads in _SYMBOLS:
                if hasattr(library, sgemm) and hasattr(library, threads):
                    setter = getattr(library, threads)
                    setter.argtypes = [ctypes.c_int]
                    setter.restype = None
                    return Blas(str(path), ctypes.cast(getattr(library, sgemm), ctypes.c_void_p).value, setter)
    return None


def missing_blas() -> str | None:
    if numpy_blas() is not None:
        return None
    return "numpy's bundled OpenBLAS (scipy-openblas) was not found; install numpy from its wheels (pip install numpy)"
