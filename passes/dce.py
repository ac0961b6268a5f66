"""`dce`: erase pure ops whose results nobody reads."""

from __future__ import annotations

from attrs import define

from ..dialects.core import Block, Operation
from ..dialects.graph import graph_funcs
from ..dialects.rewriting import is_trivially_dead
from .manager import CompilationUnit, Pass, register_pass


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
