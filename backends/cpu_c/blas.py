"""The BLAS the generated C calls for GEMMs: the OpenBLAS numpy already loads (`scipy-openblas`).

numpy's wheels bundle OpenBLAS built with 64-bit integers and prefixed symbols (`scipy_cblas_sgemm64_`);
numpy itself calls it for every f32 `matmul`, so the interpreter and `cpu-c` multiply with the same code.
The C gets the address of `cblas_sgemm` (no copy of an operand: the transposes are BLAS's flags and the
strides its leading dimensions) and of OpenBLAS's thread-count getter and setter: a graph runs OpenBLAS
single-threaded (and restores numpy's setting when it returns), cutting a large GEMM into blocks of rows
that its own OpenMP threads take (`render.py`, `sx_gemm`). OpenBLAS's own threads would spin beside the
OpenMP team for the same cores (on a busy machine a GEMM then waits for a descheduled thread), and the
fixed blocks keep every result the same for any thread count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from attrs import frozen

#: (cblas_sgemm, get_num_threads, set_num_threads) of the 64-bit-integer OpenBLAS builds numpy ships (the C
#: passes sizes as 64-bit integers).
_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("cblas_sgemm64_", "openblas_get_num_threads64_", "openblas_set_num_threads64_"))


@frozen
class Blas:
    library: str
    #: The addresses of cblas_sgemm, openblas_get_num_threads and openblas_set_num_threads.
    sgemm: int
    get_threads: int
    set_threads: int


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
            for names in _SYMBOLS:
                if all(hasattr(library, name) for name in names):
                    addresses = [ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names]
                    return Blas(str(path), *addresses)
    return None


def blas_config() -> str:
    """OpenBLAS's description of its build and of the kernels it picked for this CPU (its `get_config`)."""
    blas = numpy_blas()
    if blas is None:
        return "no OpenBLAS"
    library = ctypes.CDLL(blas.library)
    for name in ("scipy_openblas_get_config64_", "openblas_get_config64_"):
        if hasattr(library, name):
            getter = getattr(library, name)
            getter.restype = ctypes.c_char_p
            return " ".join(getter().decode().split())
    return Path(blas.library).name


def missing_blas() -> str | None:
    if numpy_blas() is not None:
        return None
    return "numpy's bundled OpenBLAS (scipy-openblas) was not found; install numpy from its wheels (pip install numpy)"
