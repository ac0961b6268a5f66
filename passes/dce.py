"""`dce`: erase pure ops whose results nobody reads."""

from __future__ import annotations

from attrs import define

from ..dialects.core import REGISTRY, Block, Operation
from .manager import CompilationUnit, Pass, register_pass


def is_trivially_dead(op: Operation) -> bool:
    """A pure, region-free op none of whose results is used (unknown ops are never dead)."""
    for r in op.results:  # most ops are live: look at their uses before their definition
        if r.uses:
            return False
    opdef = REGISTRY.ops.get(op.name)
    return opdef is not None and opdef.pure and not op.regions


def eliminate_dead_ops(block: Block) -> int:
    """Erase the dead ops of `block` in one backward sweep; returns how many were erased.

    Walking from the end erases a dead op's users before the op itself, so
    whole dead chains go in a single sweep.
    """
    erased = 0
    for op in block.reversed_ops():
        if is_trivially_dead(op):
            op.erase()
            erased += 1
    return erased


def graph_funcs(module: Operation) -> list[Operation]:
    """The `graph.func` ops at the top of a module."""
    return [op for op in module.body.ops if op.name == "graph.func"]


@register_pass
@define
class DeadCodeElimination(Pass):
    """Erases pure ops with unused results in every `graph.func`.

    Guarantees: afterwards every pure op's result has a use. Impure ops are
    always kept: `graph.input` (so a graph keeps its signature), `graph.return`
    and the emits (`graph.metric`, `graph.counter`, `graph.observe`).
    """

    name = "dce"
    summary = "erase pure ops whose results are unused"

    def run(self, unit: CompilationUnit) -> None:
        _dce_module(unit.require_module(self.name))


def _dce_module(module: Operation) -> None:
    for func in graph_funcs(module):
        for region in func.regions:
            for block in region.blocks:
                eliminate_dead_ops(block)
