"""The numpy interpreter: runs any `graph.func` on the CPU; the numeric reference and the `cpu` executor.

    graph = compile_graph(func_op)                  # or float_mode="f64" for gradient checks
    result = graph({"model.w": w, "tokens": t})     # a dict of numpy arrays by input name
    result.outputs["loss"], result.metrics, result.counters, result.observed

The training driver reaches it only as an executor (`open_executor("cpu")`, see backends/executor.py).
"""

from ..executor import register_executor
from .compiler import (
    CompiledGraph,
    GraphInputError,
    GraphResult,
    InputSpec,
    compile_graph,
)
from .dtypes import FLOAT_MODES
from .executor import InterpreterExecutor

register_executor("cpu", InterpreterExecutor)

__all__ = [
    "FLOAT_MODES", "CompiledGraph", "GraphInputError", "GraphResult", "InputSpec", "InterpreterExecutor",
    "compile_graph",
]
