"""Column reductions split across blocks to fill the device (issue 18, item 2).

A reduction whose innermost axis is kept (a bias gradient: the column sums of
dY over its rows) launches one block per 32 kept columns; on a 132-SM H200
that is 24 blocks for GPT-2's 768. Lowered for an architecture (`fuse{arch}`),
such a reduction splits its rows into chunks down the grid's y, each block
writes its partial results to a scratch, and the last block of a strip to
finish combines them in chunk order (`launches.column_split`, docs/cuda.md).
Here: the plan for GPT-2's sizes on sm_90 and sm_80; the split kernels on
cuda-sim (both of its block schedules) against the interpreter, for sizes that
split and that do not, odd ones, several reductions in one kernel and bf16;
bitwise the same result on every run; and a whole smoke GPT step kernel by
kernel, lowered for sm_90.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_lowering_harness import SimRunner, copies, graph, lower, random_inputs, reference_values
from sexpgpu.backends.cuda.render.launches import (
    COLUMN_LANES,
    COLUMN_PARTS,
    THREADS_PER_SM,
    chunk_rows,
    column_split,
)
from sexpgpu.backends.cuda.target import MULTIPROCESSORS
from sexpgpu.dialects.parser import parse_module

SPLIT_LOWERING = "gemm-layouts,fuse{arch=sm_90},emit-cuda"


def column_sums(rows: int, cols: int, dtype: str = "f32") -> str:
    """A column sum of a [rows, cols] input scaled after the reduction, and its column max beside it."""
    return f"""
graph.func @columns {{kind = "train"}} {{
  %x = graph.input {{name = "x", role = "batch"}} : () -> tensor<{rows}x{cols}x{dtype}>
  %scale = graph.input {{name = "scale", role = "param"}} : () -> tensor<{cols}xf32>
  %xf = graph.cast %x {{dtype = "f32", path = "m"}} : (tensor<{rows}x{cols}x{dtype}>) -> tensor<{rows}x{cols}xf32>
  %s = graph.sum %xf {{axes = [0], keep = false, path = "m"}} : (tensor<{rows}x{cols}xf32>) -> tensor<{cols}xf32>
  %m = graph.max %xf {{axes = [0], keep = false, path = "m"}} : (tensor<{rows}x{cols}xf32>) -> tensor<{cols}xf32>
  %d = graph.sub %s, %m {{path = "m"}} : (tensor<{cols}xf32>, tensor<{cols}xf32>) -> tensor<{cols}xf32>
  %e = graph.mul %d, %scale {{path = "m"}} : (tensor<{cols}xf32>, tensor<{cols}xf32>) -> tensor<{cols}xf32>
  %b = graph.sum %x {{axes = [0], keep = false, path = "m.bias"}} : (tensor<{rows}x{cols}x{dtype}>) -> tensor<{cols}x{dtype}>
  graph.return %e, %b {{names = ["e", "b"]}} : (tensor<{cols}xf32>, tensor<{cols}x{dtype}>) -> ()
}}
"""


def kernels(module) -> list:
    return [op for op in module.body.ops if op.name == "kern.kernel" and op.attributes["kind"] == "reduction"]


@pytest.mark.parametrize(("kept", "rows", "split"), [
    (768, 4096, 22), (2304, 4096, 8), (3072, 4096, 6), (768, 32768, 22), (768, 100, 1), (50304, 4096, 1)])
def test_gpt2_bias_gradients_fill_an_h200(kept: int, rows: int, split: int) -> None:
    strips = -(-kept // COLUMN_LANES)
    chosen = column_split(strips, rows, MULTIPROCESSORS["sm_90"], ["f32"])
    assert chosen == split
    if split > 1:
        assert strips * split >= MULTIPROCESSORS["sm_90"] * THREADS_PER_SM // (COLUMN_LANES * COLUMN_PARTS)
        assert chunk_rows(rows, split) * (split - 1) < rows, "every chunk has rows"


def test_the_split_depends_on_the_target_only_through_its_sms() -> None:
    assert column_split(24, 4096, MULTIPROCESSORS["sm_80"], ["f32"]) == 18  # 108 SMs: 432 blocks wanted
    assert column_split(24, 4096, 0, ["f32"]) == 1  # no architecture: nothing splits
    assert column_split(24, 4096, 132, ["i64"]) == 1  # integer accumulators are not split (f32 partials)


@pytest.mark.parametrize(("rows", "cols", "dtype", "split"), [
    (300, 70, "f32", 4),     # 70 columns: the last strip is partial; 300 rows in chunks of 75
    (1001, 33, "bf16", 15),  # rows not a multiple of the chunks (67 rows each, the last 63)
    (100, 5, "f32", 1),      # too few rows to split
    (64, 40, "bf16", 1),
])
def test_split_columns_on_cuda_sim_equal_the_interpreter(rows: int, cols: int, dtype: str, split: int) -> None:
    reference, lowered = copies(parse_module(column_sums(rows, cols, dtype), "columns.sxir"))
    lower(lowered, SPLIT_LOWERING)
    assert {op.attributes.get("split", 1) for op in kernels(lowered)} == {split}
    fills = [op for op in lowered.body.ops if op.name == "kern.kernel" and op.attributes["kind"] == "fill"]
    assert len(fills) == (1 if split > 1 else 0), "one fill of the counters a graph"
    inputs = random_inputs(graph(reference, "columns"), np.random.default_rng(rows))
    runner = SimRunner(lowered)
    outputs = runner.run(graph(lowered, "columns"), inputs, reference_values(graph(reference, "columns"), inputs))
    assert len(runner.errors) == 2, runner.errors  # both outputs compared, each within the dtype's tolerance
    assert set(outputs) == {"e", "b"}


def test_a_split_reduction_gives_the_same_bits_every_run() -> None:
    """Which block of a strip finishes last varies on a GPU; the chunks are combined in chunk order by
    whichever it is, so the bits do not. cuda-sim runs the blocks forwards and backwards (both schedules,
    compared by the runner); here the same launch ten times, the counters left zero by each."""
    module = parse_module(column_sums(1001, 33), "columns.sxir")
    lower(module, SPLIT_LOWERING)
    inputs = random_inputs(graph(module, "columns"), np.random.default_rng(7))
    runner = SimRunner(module)
    results = [runner.run(graph(module, "columns"), inputs, {}) for _ in range(10)]
    for result in results[1:]:
        for name in ("e", "b"):
            assert np.array_equal(result[name].view(np.uint32), results[0][name].view(np.uint32))


def test_the_counters_are_left_zero_for_the_next_launch() -> None:
    module = parse_module(column_sums(300, 70), "columns.sxir")
    lower(module, SPLIT_LOWERING)
    runner = SimRunner(module)
    [kernel] = [k for k in kernels(module) if k.attributes["path"] == "m"]
    dev = runner.device
    attrs = kernel.attributes
    x = (np.random.default_rng(1).standard_normal((300, 70))).astype(np.float32)
    scale = np.ones(70, np.float32)
    counters = np.zeros(attrs["inputs"][-1].shape, np.int32)
    buffers = {"in0": dev.upload(x, "x"), "in1": dev.upload(scale, "scale"), "in2": dev.upload(counters, "counters")}
    for k, t in enumerate(attrs["outputs"]):
        buffers[f"out{k}"] = dev.alloc(t.nbytes, f"out{k}")
    args = [buffers[a] if isinstance(a, str) else a for a in attrs["arguments"]]
    function = runner.sim_module.kernel(attrs["function"])
    firsts = []
    for _ in range(3):
        dev.launch(function, tuple(attrs["grid"]), tuple(attrs["block"]), attrs["shared"], args)
        assert not dev.download(buffers["in2"], np.int32, counters.shape).any()
        firsts.append(dev.download(buffers["out0"], np.float32, (70,)))
    assert all(np.array_equal(f, firsts[0]) for f in firsts)
    np.testing.assert_allclose(firsts[0], x.sum(0) - x.max(0), rtol=1e-5, atol=1e-4)


def test_the_cuda_sim_executor_lowers_for_its_architecture_and_replays_from_zeroed_counters() -> None:
    """The executor lowers for its device's architecture (cuda-sim reports sm_90), so a run splits; the
    arena the counters live in is shared with other graphs, and each call's fill zeroes them again."""
    from sexpgpu.backends.cuda.graph_plan import LaunchStep
    from sexpgpu.backends.devices import open_device

    module = parse_module(column_sums(1001, 33), "columns.sxir")
    executor = open_device("cuda-sim", "test")
    executable = executor.compile(graph(module, "columns"))
    grids = [step.grid for step in executable.plan.steps if isinstance(step, LaunchStep)]
    assert (2, 15, 1) in grids and (1, 1, 1) in grids  # the split reduction and the counters' fill
    inputs = random_inputs(graph(module, "columns"), np.random.default_rng(3))
    x = inputs["x"].astype(np.float64)
    want = {"e": (x.sum(0) - x.max(0)) * inputs["scale"], "b": x.sum(0)}
    calls = []
    for _ in range(3):
        result = executable({k: executor.upload(v) for k, v in inputs.items()})
        calls.append({k: np.array(executor.download(v)) for k, v in result.outputs.items()})
    for outputs in calls:
        for name in ("e", "b"):
            assert np.array_equal(outputs[name], calls[0][name])
    for name in ("e", "b"):
        np.testing.assert_allclose(np.asarray(calls[0][name], np.float64), want[name], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_a_smoke_gpt_step_lowered_for_sm_90_equals_the_interpreter_kernel_by_kernel(bf16: bool) -> None:
    from test_cuda_lowering import run_on_sim, training_module

    reference, lowered = copies(training_module("gpt.sx", "smoke", ("layers=1", "width=36", "heads=3"),
                                                bf16))
    lower(lowered, SPLIT_LOWERING)
    assert any(op.attributes.get("split", 1) > 1 for op in kernels(lowered)), "the smoke GPT has split bias gradients"
    runner = run_on_sim(reference, lowered, 7)
    launched = {op.attributes["sym_name"] for op in lowered.body.ops if op.name == "kern.kernel"}
    assert launched == set(runner.launched), launched - set(runner.launched)
