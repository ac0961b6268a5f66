"""A fused kernel's gather checks its index on the packed path too (issue 18, item 8).

An embedding lookup (`graph.take` of a table's rows) is fused into a kernel
that reads the table with packed accesses (`vector` > 1). An index counted
from the end wraps; one outside the table gives a row of NaN
(docs/cuda.md, "Index maps"), never a read past the table: cuda-sim faults
on such a read, so the kernel is run there on indices just outside both ends.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_lowering_harness import NUMPY, SimRunner, graph, lower
from sexpgpu.dialects.parser import parse_module

ROWS, COLS = 11, 8
IDS = np.array([[0, 10, 11, -1, -12], [5, -11, 40, 1, -40]], np.int32)


def embedding(dtype: str) -> str:
    return f"""
graph.func @embed {{kind = "train"}} {{
  %table = graph.input {{name = "table", role = "param"}} : () -> tensor<{ROWS}x{COLS}x{dtype}>
  %ids = graph.input {{name = "ids", role = "batch"}} : () -> tensor<2x5xi32>
  %e = graph.take %table, %ids {{axis = 0}} : (tensor<{ROWS}x{COLS}x{dtype}>, tensor<2x5xi32>) -> tensor<2x5x{COLS}x{dtype}>
  graph.return %e {{names = ["e"]}} : (tensor<2x5x{COLS}x{dtype}>) -> ()
}}
"""


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_packed_gather_gives_nan_rows_outside_the_table(dtype: str) -> None:
    module = parse_module(embedding(dtype), "embed.sxir")
    lower(module)
    [kernel] = [op for op in module.body.ops if op.name == "kern.kernel"]
    assert kernel.attributes.get("vector", 1) > 1, "the table is read with packed accesses"
    table = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(NUMPY[dtype])
    out = SimRunner(module).run(graph(module, "embed"), {"table": table, "ids": IDS}, {})["e"]
    got = np.asarray(out, np.float64).reshape(-1, COLS)
    for row, index in zip(got, IDS.reshape(-1)):
        if -ROWS <= index < ROWS:
            assert np.array_equal(row, np.asarray(table[index], np.float64)), index
        else:
            assert np.isnan(row).all(), index


def test_the_packed_check_is_once_per_access() -> None:
    module = parse_module(embedding("bf16"), "embed.sxir")
    lower(module)
    source = next(op for op in module.body.ops if op.name == "kern.source").attributes["text"]
    body = source[source.index("__global__ void __launch_bounds__"):]
    assert body.count(f"< {ROWS}LL)) sx_ld_vec(") == 1
