"""`fold-constants`: folds the input-independent arithmetic of the update and clip graphs.

In every `graph.func` of kind "update" or "clip", an op whose operands are all
splat `graph.const`s is replaced by one splat `graph.const` of its result
type, repeatedly in block order (so whole constant subexpressions collapse),
and constants left unused are erased. Folded ops: unary and binary
arithmetic, `sum`/`max`/`min` reductions, and the shape ops that keep a splat
a splat (broadcast, reshape, transpose, squeeze, expand_dims, slice). A fold
whose result is not finite, or not a float, is left alone.

Folding evaluates in float64 and stores the value to 15 significant digits
(far below f32 and bf16 resolution), so the value is rounded once to the
tensor's dtype when the graph runs -- as torch.optim treats Python-float
hyperparameters -- and `1 - 0.9` reads `0.1`.

Then each exp.group gets `constants = [sorted unique float values of the
const ops in its update graphs and the clip graphs covering it]`, the list
`explain` prints.
"""

from __future__ import annotations

import math

from attrs import define

from ..dialects.core import FLOAT_DTYPES, Builder, Operation
from ..dialects.exp import OPTIMIZER_GRAPH_KINDS
from ..dialects.graph_semantics import FLOAT64_ARITH, FLOAT64_UNARY
from ..dialects.traits import SPLAT_PRESERVING_OPS
from .manager import CompilationUnit, Pass, register_pass


def splat_value(op: Operation | None) -> float | None:
    """The value of a splat `graph.const`, else None."""
    if op is None or op.name != "graph.const":
        return None
    value = op.attributes["value"]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fold_value(op: Operation, operands: list[float]) -> float | None:
    """The splat value of `op` applied to splat operands, or None when it does not fold."""
    try:
        if op.name in FLOAT64_UNARY:
            result = FLOAT64_UNARY[op.name](*operands)
        elif op.name in FLOAT64_ARITH:
            result = FLOAT64_ARITH[op.name](*operands)
        elif op.name in SPLAT_PRESERVING_OPS:
            result = operands[0]
        elif op.name == "graph.sum":
            x = op.operands[0].type
            result = operands[0] * float(math.prod(x.shape[a] for a in op.attributes["axes"]))
        else:
            return None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    if not isinstance(result, float) or not math.isfinite(result):
        return None
    return float(f"{result:.15g}")


def fold_graph(func: Operation) -> int:
    """Fold the constant subexpressions of one graph; returns the number of ops folded."""
    folded = 0
    for op in list(func.body.ops):
        if not op.operands or len(op.results) != 1 or op.result.type.dtype not in FLOAT_DTYPES:
            continue
        values = [splat_value(v.op) for v in op.operands]
        if any(v is None for v in values):
            continue
        result = fold_value(op, values)  # type: ignore[arg-type]
        if result is None:
            continue
        const = Builder(func.body, anchor=op).create(
            "graph.const", (), {"value": result}, result_types=[op.result.type], loc=op.loc
        )
        op.result.replace_all_uses_with(const.result)
        inputs = [v.op for v in op.operands]
        op.erase()
        for producer in inputs:
            if producer is not None and producer.parent is not None and not producer.result.has_uses:
                producer.erase()
        folded += 1
    return folded


@register_pass
@define
class FoldConstants(Pass):
    """Folds constant subexpressions of update/clip graphs to splat consts; sets `constants` on exp.group.

    Guarantees: no op in those graphs has only splat-constant operands unless
    its fold is not finite; every graph computes the same values.
    """

    name = "fold-constants"
    summary = "fold input-independent arithmetic of update graphs; list each group's constants"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        constants: dict[str, set[float]] = {}
        for func in module.body.ops:
            if func.name != "graph.func" or func.attributes.get("kind") not in OPTIMIZER_GRAPH_KINDS:
                continue
            fold_graph(func)
            owners = func.attributes.get("groups") or [func.attributes.get("group")]
            values = {v for op in func.body.ops if (v := splat_value(op)) is not None}
            for owner in owners:
                constants.setdefault(owner, set()).update(values)
        for group in module.body.ops:
            if group.name == "exp.group":
                group.attributes["constants"] = sorted(constants.get(group.attributes["name"], ()))

