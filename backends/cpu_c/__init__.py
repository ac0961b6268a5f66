"""The compiled CPU target: registers the `cpu-c` executor (backends/executor.py).

Importing this package compiles nothing: the probe looks for a C compiler with OpenMP and numpy's OpenBLAS
(one line naming what to install when either is missing), and the factory imports the executor when the
device is opened.
"""

from __future__ import annotations

from typing import Any

from ..executor import Executor, register_executor


def _missing() -> str | None:
    from .blas import missing_blas
    from .compiler import missing_compiler

    return missing_compiler() or missing_blas()


def _factory(**options: Any) -> Executor:
    from .executor import open_cpu_c_executor

    return open_cpu_c_executor(**options)


register_executor("cpu-c", _factory, probe=_missing)
