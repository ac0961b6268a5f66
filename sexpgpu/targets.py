"""Wiring the built-in kernel targets into the pass registry, as `mlir-opt` registers its dialects and passes.

The target-independent lowering passes (`match-patterns`, `fuse`) ask a
target registered in `passes/targets.py`, and a target's own lowering passes
(`emit-cuda`) are registered by the target; neither layer below imports the
backends, so the layer above does it once here. `sexpgpu-opt` calls
`register_targets` before reading a pipeline; a program that runs those
passes through `passes.manager` itself calls it first.
"""

from __future__ import annotations


def register_targets() -> None:
    """Register every built-in kernel target and its lowering passes (idempotent)."""
    from .backends.cuda import target  # noqa: F401  (importing it registers the CUDA target and emit-cuda)
