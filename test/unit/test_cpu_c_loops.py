"""How cpu-c's element-wise loops and column sums share their work among threads (`backends/cpu_c/
kernels.py`): a flat loop over one long axis (an update over every parameter) is cut into runs of
`INNER_CHUNK` elements, and a column sum's rows into `row_runs` fixed runs, each summed into its own partial
row, the partial rows then added in order. The results are checked against numpy computing in that same
order, bit for bit, on 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
from sexpgpu.backends.cpu_c import executor as cpu_c_executor
from sexpgpu.backends.cpu_c.compiler import missing_compiler
from sexpgpu.backends.cpu_c.kernels import INNER_CHUNK, ROW_RUN, ROW_RUNS, row_runs
from sexpgpu.backends.devices import open_device
from sexpgpu.dialects.parser import parse_module

pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="no C compiler with OpenMP on this machine")

FLAT = 300_001  # 19 runs of INNER_CHUNK, the last one short
ROWS, COLUMNS = 1031, 384  # 16 runs of 65 rows, the last one of 56

GRAPHS = f"""
graph.func @flat {{kind = "eval"}} {{
  %x = graph.input {{name = "x", role = "batch"}} : () -> tensor<{FLAT}xf32>
  %y = graph.input {{name = "y", role = "batch"}} : () -> tensor<{FLAT}xf32>
  %p = graph.mul %x, %y {{path = "m"}} : (tensor<{FLAT}xf32>, tensor<{FLAT}xf32>) -> tensor<{FLAT}xf32>
  %z = graph.add %p, %x {{path = "m"}} : (tensor<{FLAT}xf32>, tensor<{FLAT}xf32>) -> tensor<{FLAT}xf32>
  graph.return %z {{names = ["z"]}} : (tensor<{FLAT}xf32>) -> ()
}}
graph.func @columns {{kind = "eval"}} {{
  %x = graph.input {{name = "x", role = "batch"}} : () -> tensor<{ROWS}x{COLUMNS}xf32>
  %s = graph.sum %x {{axes = [0], keep = false, path = "m"}} : (tensor<{ROWS}x{COLUMNS}xf32>) -> tensor<{COLUMNS}xf32>
  graph.return %s {{names = ["s"]}} : (tensor<{COLUMNS}xf32>) -> ()
}}
"""


@pytest.fixture
def rendered_units(monkeypatch) -> list[str]:
    """The C translation units the cpu-c executor renders while the test runs, as they are made."""
    units: list[str] = []
    real = cpu_c_executor.render_module

    def spy(*args):
        rendered = real(*args)
        units.extend(rendered.units)
        return rendered

    monkeypatch.setattr(cpu_c_executor, "render_module", spy)
    return units


def run(name: str, threads: int, **inputs: np.ndarray) -> np.ndarray:
    module = parse_module(GRAPHS, "loops.sxir")
    func = next(op for op in module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == name)
    executor = open_device("cpu-c", "test", threads=threads)
    result = executor.compile(func)({key: executor.upload(value) for key, value in inputs.items()})
    return np.array(executor.download(next(iter(result.outputs.values()))))


def test_row_runs_are_powers_of_two_of_at_least_row_run_rows():
    assert row_runs(ROW_RUN * 2 - 1) == 1
    assert row_runs(ROW_RUN * 2) == 2
    assert row_runs(1024) == 16 and row_runs(1023) == 8
    assert row_runs(10**6) == ROW_RUNS


@pytest.mark.parametrize("threads", [1, 2])
def test_a_flat_loop_is_cut_into_runs_and_computes_numpys_values(threads, rendered_units):
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(FLAT).astype(np.float32) for _ in range(2))
    got = run("flat", threads, x=x, y=y)
    assert np.array_equal(got, x * y + x)
    chunks = -(-FLAT // INNER_CHUNK)
    assert any(f"oc < {chunks}LL" in unit for unit in rendered_units)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_column_sum_adds_its_row_runs_in_order(threads, rendered_units):
    x = np.random.default_rng(1).standard_normal((ROWS, COLUMNS)).astype(np.float32)
    got = run("columns", threads, x=x)
    runs = row_runs(ROWS)
    assert any(f"run < {runs}LL" in unit for unit in rendered_units)
    rows = -(-ROWS // runs)
    partials = []
    for start in range(0, ROWS, rows):
        partial = np.zeros(COLUMNS, np.float32)
        for row in x[start:start + rows]:
            partial = partial + row
        partials.append(partial)
    want = partials[0]
    for partial in partials[1:]:
        want = want + partial
    assert np.array_equal(got, want)
    assert np.allclose(got, x.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)
