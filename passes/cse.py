"""`cse`: merge pure ops that compute the same thing from the same operands."""

from __future__ import annotations

import math
from typing import Any

from attrs import define

from ..dialects.core import REGISTRY, Block, Operation
from ..dialects.graph import graph_funcs
from .manager import CompilationUnit, Pass, register_pass


def freeze_attribute(value: Any) -> Any:
    """A hashable key equal for two attribute values exactly when they print the same.

    Types are tagged so `1`, `1.0` and `true` stay apart; floats key by their
    repr so `nan` equals `nan` and `-0.0` differs from `0.0`.
    """
    kind = type(value)
    if kind is str:  # the common case (paths, dtypes, names)
        return value
    if kind is int:
        return ("i", value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, float):
        return ("f", repr(value) if not math.isnan(value) else "nan")
    if isinstance(value, (list, tuple)):
        return ("l", tuple(freeze_attribute(v) for v in value))
    if isinstance(value, dict):
        return ("d", tuple(sorted((k, freeze_attribute(v)) for k, v in value.items())))
    return value  # str, TensorType, SymbolRef: hashable and compared by value


#: Attributes that say where an op came from, not what it computes: two ops differing only in them merge.
PROVENANCE_ATTRIBUTES = frozenset({"path"})


def op_key(op: Operation) -> tuple:
    """What makes two ops interchangeable: name, operands, attributes but the model path, result types."""
    attributes = op.attributes
    results = op.results
    return (
        op.name,
        tuple(map(id, op.operands)),
        # Attribute names are unique: sorting the names alone orders the pairs.
        tuple([(k, freeze_attribute(attributes[k])) for k in sorted(attributes) if k not in PROVENANCE_ATTRIBUTES]),
        (results[0].type,) if len(results) == 1 else tuple(r.type for r in results),
    )


def eliminate_common_subexpressions(block: Block) -> int:
    """Replace each pure op equal to an earlier one by that one; returns how many were merged.

    Operands are compared by identity, so walking the block in order merges
    whole equal chains in one sweep: once `%b` is replaced by `%a`, users of
    `%b` key on `%a`. The op kept is the first: its location and model path
    (`path`) are those of the merged value, so a causal mask every layer builds
    alike is built once, under the first layer's path.
    """
    seen: dict[tuple, Operation] = {}
    merged = 0
    lookup = REGISTRY.ops.get
    for op in block.ops:
        opdef = lookup(op.name)
        if opdef is None or not opdef.pure or op.regions or not op.results:
            continue
        key = op_key(op)
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = op
            continue
        for old, new in zip(op.results, earlier.results):
            old.replace_all_uses_with(new)
        op.erase()
        merged += 1
    return merged


@register_pass
@define
class CommonSubexpressionElimination(Pass):
    """Merges equal pure ops within each block of every `graph.func`.

    Guarantees: afterwards no two pure ops of a block are equal, and every
    value the graph computes is unchanged. Two ops are equal when their names, operands (the same values), attributes
    and result types are equal; the model path (`path`) is not compared: it says where an op came from, not
    what it computes. The later op's uses move to the earlier op
    and the later op is erased. Impure ops (inputs, emits, returns) are never
    merged; ops holding regions are left alone.
    """

    name = "cse"
    summary = "merge pure ops with equal names, operands, attributes (but the model path) and result types"

    def run(self, unit: CompilationUnit) -> None:
        _cse_module(unit.require_module(self.name))


def _cse_module(module: Operation) -> None:
    for func in graph_funcs(module):
        for region in func.regions:
            for block in region.blocks:
                eliminate_common_subexpressions(block)
