"""Wiring the built-in kernel targets into the pass registry, as `mlir-opt` registers its dialects and passes.

The target-independent lowering passes (`match-patterns`, `fuse`) ask a
target registered in `passes/targets.py`, and a target's own lowering passes
(`emit-cuda`) are registered by the target; neither layer below imports the
backends, so the layer above does it once here. `sexpgpu-opt` calls
`register_targets` before reading a pipeline; a program that runs those
passes through `passes.manager` itself calls it first. Registering imports
nothing: the target's module (and with it its renderer) is imported when a
pass first asks for the target or a pipeline first names its pass.
"""

from __future__ import annotations

from .passes.manager import register_pass_module
from .passes.targets import register_target_module

#: The module defining the CUDA target; importing it registers the target and its pass `emit-cuda`.
_CUDA_TARGET = f"{__package__}.backends.cuda.target"
#: The module defining the cpu-c target (the CUDA plan where a CPU task does not differ from a block).
_CPU_C_TARGET = f"{__package__}.backends.cpu_c.target"


def register_targets() -> None:
    """Register every built-in kernel target and its lowering passes (idempotent)."""
    register_target_module("cuda", _CUDA_TARGET)
    register_target_module("cpu-c", _CPU_C_TARGET)
    register_pass_module("emit-cuda", _CUDA_TARGET)
