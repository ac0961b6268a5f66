"""The target-independent lowering passes ask the kernel target, never its renderer (passes/targets.py).

A test target that stores only bf16 makes every f32 row program fall back
with the target's words, and one whose generated kernels launch 128 threads
gets kernels of 128 threads from `fuse`: the passes take what the target
answers. The registry refuses a name twice and names the registered targets
when asked for another.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from sexpgpu.backends.cuda.target import CUDA_TARGET, CudaTarget
from sexpgpu.dialects.core import TensorType
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.targets import TARGETS, LaunchPlan, PatternKernel, kernel_target, register_target

from sexpgpu.diagnostics import UsageError

ROOT = Path(__file__).resolve().parents[2]
SOFTMAX = ROOT / "test" / "lit" / "passes" / "match-patterns-softmax.sx"
GRAPHS = "evaluate,autodiff,canonicalize,cse,dce"


class Bf16Only(CudaTarget):
    name = "test-bf16-only"
    float_storage = ("bf16",)


class NarrowBlocks(CudaTarget):
    name = "test-narrow-blocks"

    def plan_generated(self, kind: str, domain: Sequence[int], reduce_axes: Sequence[int],
                       maps: Sequence[Mapping[str, Any]], inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                       index_exprs: Sequence[Mapping[str, Any]] = (), arch: str = "",
                       accumulators: Sequence[str] = ()) -> LaunchPlan:
        return LaunchPlan("flat", (3, 1, 1), (128, 1, 1))


@pytest.fixture(scope="module", autouse=True)
def test_targets() -> Iterator[None]:
    for target in (Bf16Only(), NarrowBlocks()):
        register_target(target)
    yield
    for name in (Bf16Only.name, NarrowBlocks.name):
        TARGETS.pop(name)


def test_the_cuda_target_is_registered_for_the_tools() -> None:
    assert kernel_target("cuda") is CUDA_TARGET


def test_match_patterns_takes_the_dtypes_the_target_stores() -> None:
    unit = run_pipeline(CompilationUnit(path=str(SOFTMAX)), f"{GRAPHS},match-patterns{{target={Bf16Only.name}}}")
    softmax = unit.facts.lowering.patterns["train"]["softmax"]
    assert softmax["fired"] == 0
    assert [f["reason"] for f in softmax["fell_back"]] == ["dtype f32 of its x is not taken (bf16)"]
    cuda = run_pipeline(CompilationUnit(path=str(SOFTMAX)), f"{GRAPHS},match-patterns")
    assert cuda.facts.lowering.patterns["train"]["softmax"]["fired"] == 1


def test_fuse_launches_as_the_target_plans() -> None:
    unit = run_pipeline(CompilationUnit(path=str(SOFTMAX)), f"{GRAPHS},fuse{{target={NarrowBlocks.name}}}")
    generated = [op.attributes for op in unit.module.body.ops
                 if op.name == "kern.kernel" and op.attributes["kind"] in ("pointwise", "reduction")]
    assert generated and all(a["block"] == [128, 1, 1] and a["grid"] == [3, 1, 1] for a in generated)


def test_the_cuda_target_answers_from_its_templates() -> None:
    layernorm = PatternKernel("row", "layernorm_backward", 768, {"weight": True, "bias": True})
    inputs, outputs = CUDA_TARGET.pattern_operands(layernorm)
    assert "dy" in inputs and "dx" in outputs
    launches = CUDA_TARGET.pattern_launches(layernorm, {}, {"rows": 8192})
    assert [step.name for step in launches.steps][0] == ""
    assert all(nbytes > 0 for nbytes in launches.scratch.values())


def test_the_cpu_c_target_runs_an_attention_backward_in_one_step() -> None:
    """One CPU task holds a whole head: dQ, dK and dV come from one step, without the row sums D in
    between (the CUDA target's three steps); the forward is CUDA's."""
    cpu_c = kernel_target("cpu-c")
    backward = PatternKernel("attention", "backward", 32, {"causal": True, "scale": 0.125, "placements": {}})
    inputs, outputs = cpu_c.pattern_operands(backward)
    launches = cpu_c.pattern_launches(backward, {}, {"batch": 2, "heads": 3, "seq": 64})
    assert [(step.reads, step.writes, step.grid) for step in launches.steps] == [
        (tuple(inputs), tuple(outputs), (6, 1, 1))]
    assert set(outputs) == {"dq", "dk", "dv"} and "delta" not in inputs and not launches.scratch
    assert len(CUDA_TARGET.pattern_launches(backward, {}, {"batch": 2, "heads": 3, "seq": 64}).steps) == 3
    forward = PatternKernel("attention", "forward", 32, {"causal": True, "scale": 0.125, "placements": {}})
    assert cpu_c.pattern_launches(forward, {}, {"batch": 2, "heads": 3, "seq": 64}) == CUDA_TARGET.pattern_launches(
        forward, {}, {"batch": 2, "heads": 3, "seq": 64})


@pytest.mark.parametrize("rows, partial_rows", [(1, 1), (64, 1), (65, 2), (8192, 128)])
def test_the_cpu_c_target_sums_a_norm_backward_through_a_partial_row_a_chunk(rows, partial_rows) -> None:
    layernorm = PatternKernel("row", "layernorm_backward", 768, {"weight": True, "bias": True})
    launches = kernel_target("cpu-c").pattern_launches(layernorm, {}, {"rows": rows})
    assert launches.steps == CUDA_TARGET.pattern_launches(layernorm, {}, {"rows": rows}).steps
    assert launches.scratch == {"dweight_partials": partial_rows * 768 * 4, "dbias_partials": partial_rows * 768 * 4}


def test_a_target_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="kernel target cuda registered twice"):
        register_target(CudaTarget())


def test_an_unregistered_target_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"no kernel target 'c'; registered: cpu-c, cuda, test-bf16-only"):
        kernel_target("c")
