"""The numpy interpreter: runs any `graph.func` on the CPU; the numeric reference.

    graph = compile_graph(func_op)                  # or float_mode="f64" for gradient checks
    result = graph({"model.w": w, "tokens": t})     # a dict of numpy arrays by input name
    result.outputs["loss"], result.metrics, result.counters, result.observed
"""

from .compiler import (
    CompiledGraph,
    GraphInputError,
    GraphResult,
    InputSpec,
    compile_graph,
)
from .dtypes import FLOAT_MODES

__all__ = ["FLOAT_MODES", "CompiledGraph", "GraphInputError", "GraphResult", "InputSpec", "compile_graph"]
