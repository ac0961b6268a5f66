"""The CUDA kernel target: what `match-patterns` and `fuse` ask of CUDA, answered from its renderer.

Both CUDA devices (`cuda`, `cuda-sim`) render with this target: the same
templates, launch plans and `emit-cuda` translation unit; only the compiler
that turns the unit into a binary and the runtime that loads and launches it
differ (`runtime.KernelCompiler`, `selection.open_runtime`). Importing this
module registers the target (`passes.targets`) and its lowering pass
`emit-cuda` (`render/emit.py`) in the pass registry; the tools layer imports
it (`sexpgpu.targets.register_targets`), as does the CUDA lowering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...dialects.core import TensorType
from ...passes.manager import Pass
from ...passes.targets import (
    KernelTarget,
    LaunchPlan,
    PatternKernel,
    PatternLaunches,
    PatternStep,
    register_target,
)
from .render import launches
from .render.emit import EmitCuda
from .render.pattern_kernels import ATTENTION_HEAD_DIMS, FLOAT_STORAGE, INDEX_STORAGE, pattern_program

#: Streaming multiprocessors of the device each architecture names, the one place the lowering learns the
#: device's size: sm_80 the A100 (108), sm_90 the H100 SXM and the H200 (132). A split column reduction fills
#: them (`launches.column_split`); an architecture not here, or none (`fuse` without `arch`, cpu-c), splits
#: nothing.
MULTIPROCESSORS = {"sm_80": 108, "sm_90": 132}


class CudaTarget(KernelTarget):
    """The CUDA C renderer's answers (see the module docstring)."""

    name = "cuda"
    float_storage = FLOAT_STORAGE
    index_storage = INDEX_STORAGE
    attention_head_dims = ATTENTION_HEAD_DIMS
    #: The target-specific lowering passes it registers: the translation to CUDA C.
    lowering_passes: tuple[type[Pass], ...] = (EmitCuda,)

    def pattern_operands(self, kernel: PatternKernel) -> tuple[list[str], list[str]]:
        params = pattern_program(kernel).params
        return [p.name for p in params if p.role == "input"], [p.name for p in params if p.role == "output"]

    def pattern_launches(self, kernel: PatternKernel, dtypes: Mapping[str, str], sizes: Mapping[str, int]
                         ) -> PatternLaunches:
        program = pattern_program(kernel, dtypes)
        sizes = program.all_sizes(sizes)
        steps = []
        for index, step in enumerate(program.steps):
            pointers = [(param, name) for param, name in zip(step.kernel.params, step.arguments) if param.is_pointer]
            shape = step.kernel.launch(sizes)
            steps.append(PatternStep(reads=tuple(name for param, name in pointers if param.role == "input"),
                                     writes=tuple(name for param, name in pointers if param.role != "input"),
                                     grid=shape.grid, block=shape.block, shared=shape.shared_bytes,
                                     name=step.kernel.family if index else ""))
        return PatternLaunches(tuple(steps), program.scratch_bytes(sizes))

    def plan_generated(self, kind: str, domain: Sequence[int], reduce_axes: Sequence[int],
                       maps: Sequence[Mapping[str, Any]], inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                       index_exprs: Sequence[Mapping[str, Any]] = (), arch: str = "",
                       accumulators: Sequence[str] = ()) -> LaunchPlan:
        return launches.plan_generated(kind, domain, reduce_axes, maps, inputs, outputs, index_exprs,
                                       MULTIPROCESSORS.get(arch, 0), accumulators)

    def plan_template(self, kind: str, attributes: Mapping[str, Any]) -> tuple[LaunchPlan, dict[str, int], list[int]]:
        return launches.plan_template(kind, attributes)


CUDA_TARGET = register_target(CudaTarget())
