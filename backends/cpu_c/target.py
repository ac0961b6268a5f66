"""The `cpu-c` kernel target: the CUDA target's plan, except where one CPU task holds more than a CUDA block.

cpu-c renders the plan `match-patterns` and `fuse` make for it (`CPU_C_LOWERING` names this target). It
takes the CUDA target's answers for the row and cross-entropy programs, the generated kernels and the
templates (their launch shapes mean nothing on a CPU: the C renderer ignores them) and answers itself
where a CPU task is not a CUDA block:

- An attention backward is one step. One task (a batch and a head) holds the whole head, so each block
  of query rows gives its dQ rows at once (dS·K, every key in the block's reach) beside its share of dK
  and dV, and its row sums D = rowsum(dO·O) as it starts. CUDA's three steps (`delta`, `dkdv`, `dq`)
  exist because its blocks split the keys: the dQ step recomputes the scores and dP, and D goes through
  device memory between them.
- A norm backward's column sums go through one partial row per `NORM_CHUNK_ROWS` rows, not one per row
  as a CUDA block writes them: the partials are a fixed split of the rows (so the sums do not depend on
  the thread count) small enough to stay in cache, and enough of them to share among threads.

Importing this module registers the target (`passes.targets`); the tools layer registers the module
(`sexpgpu.targets.register_targets`), and the cpu-c executor imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...dialects.core import TensorType
from ...passes.targets import (
    KernelTarget,
    LaunchPlan,
    PatternKernel,
    PatternLaunches,
    PatternStep,
    register_target,
)
from ..cuda.target import CUDA_TARGET

#: Rows of a norm backward summed into one partial row of its column sums (at least one partial row).
NORM_CHUNK_ROWS = 64
#: What the one step of an attention backward reads and writes.
ATTENTION_BACKWARD_READS = ("q", "k", "v", "o", "lse", "do")
ATTENTION_BACKWARD_WRITES = ("dq", "dk", "dv")


class CpuCTarget(KernelTarget):
    """The C renderer's answers (see the module docstring)."""

    name = "cpu-c"
    float_storage = CUDA_TARGET.float_storage
    index_storage = CUDA_TARGET.index_storage
    attention_head_dims = CUDA_TARGET.attention_head_dims

    def pattern_operands(self, kernel: PatternKernel) -> tuple[list[str], list[str]]:
        if _is_attention_backward(kernel):
            return list(ATTENTION_BACKWARD_READS), list(ATTENTION_BACKWARD_WRITES)
        return CUDA_TARGET.pattern_operands(kernel)

    def pattern_launches(self, kernel: PatternKernel, dtypes: Mapping[str, str], sizes: Mapping[str, int]
                         ) -> PatternLaunches:
        if _is_attention_backward(kernel):
            tasks = sizes["batch"] * sizes["heads"]
            step = PatternStep(ATTENTION_BACKWARD_READS, ATTENTION_BACKWARD_WRITES, (tasks, 1, 1), (1, 1, 1), 0, "")
            return PatternLaunches((step,), {})
        launches = CUDA_TARGET.pattern_launches(kernel, dtypes, sizes)
        if not kernel.family.endswith("norm_backward"):
            return launches
        partial_rows = -(-sizes["rows"] // NORM_CHUNK_ROWS)
        return PatternLaunches(launches.steps, {name: partial_rows * kernel.cols * 4 for name in launches.scratch})

    def plan_generated(self, kind: str, domain: Sequence[int], reduce_axes: Sequence[int],
                       maps: Sequence[Mapping[str, Any]], inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                       index_exprs: Sequence[Mapping[str, Any]] = (), arch: str = "",
                       accumulators: Sequence[str] = ()) -> LaunchPlan:
        # No device size: a CPU splits no reduction across blocks (the C's own loops share the work).
        return CUDA_TARGET.plan_generated(kind, domain, reduce_axes, maps, inputs, outputs, index_exprs, "",
                                          accumulators)

    def plan_template(self, kind: str, attributes: Mapping[str, Any]) -> tuple[LaunchPlan, dict[str, int], list[int]]:
        return CUDA_TARGET.plan_template(kind, attributes)


def _is_attention_backward(kernel: PatternKernel) -> bool:
    return kernel.kind == "attention" and kernel.family == "backward"


CPU_C_TARGET = register_target(CpuCTarget())
