"""Compiles a `graph.func` for the numpy interpreter: clone, lower, build steps.

1. The function is cloned, so compiling never changes the caller's IR.
2. `lower-cpu` (`passes/lower_cpu.py`) rewrites the clone with its patterns:
   sums of pads, matmuls summed over a batch, matmuls stored transposed,
   splat constants and broadcasts read by broadcasting ufuncs become `cpu`
   ops. `sexpgpu-opt -p '...,lower-cpu'` prints the same graph.
3. The step builder (`steps.py`) turns each op of the lowered graph into a
   closure over a register file, with buffers from the shared liveness
   analysis (`dialects/liveness.py`), into a `CompiledGraph` (`compiled_graph.py`).
"""

from __future__ import annotations

from ...diagnostics import SxError
from ...dialects.core import Operation
from ...passes.lower_cpu import lower_func
from .compiled_graph import CompiledGraph, GraphInputError, GraphResult, InputSpec
from .dtypes import DtypePolicy
from .steps import build_steps

__all__ = ["CompiledGraph", "GraphInputError", "GraphResult", "InputSpec", "compile_graph"]


def compile_graph(func: Operation, float_mode: str = "native") -> CompiledGraph:
    """Compile a `graph.func` for the numpy interpreter.

    `float_mode` is "native" (each float dtype as itself; bf16 through
    ml_dtypes, computed in float32 and rounded per op) or "f64" (every float
    dtype in float64, for gradient checks).
    """
    if func.name != "graph.func":
        raise ValueError(f"compile_graph needs a graph.func, got {func.name}")
    _check_shapes(func)
    policy = DtypePolicy(float_mode)
    lowered = func.clone()
    lower_func(lowered, float_mode)
    return build_steps(lowered, policy)


def _check_shapes(func: Operation) -> None:
    """A negative dimension (a shape the frontend let through) is an error at the form that made it,
    not numpy's failure in the middle of a step."""
    for op in func.body.ops:
        for result in op.results:
            if any(d < 0 for d in result.type.shape):
                raise SxError(f"the result of {op.name} has a negative dimension: {list(result.type.shape)}", op.loc)
