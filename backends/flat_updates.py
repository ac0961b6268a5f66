"""Group-wide optimizer updates and gradient clipping over flat buffers.

`build-updates` makes one update graph per parameter; the graphs of a group
differ only in the parameter's shape (the same elementwise arithmetic on
`param`, `grad` and the states, with scalars computed from `step`). Run one
by one they cost ~35 small numpy calls per parameter. When the graphs of a
group are structurally identical up to that shape (`flat_update_graph`
checks it op by op), the driver keeps the group's parameters, gradients and
states as views into one flat float32 array per kind and runs ONE graph,
rebuilt for the flat `[N]` shape, over them: a few numpy calls over all N
elements. Elementwise float32 arithmetic does not depend on the shape it runs
over, so the result is bit-identical to the per-parameter graphs.

`flat_clip` does what a `kind = "clip"` graph does (torch's
clip_grad_norm_: per-tensor norms, the norm of the norms, one coefficient) on
a flat gradient buffer, with the same float32 operations in the same order
(each tensor's sum of squares over its own slice), so bit-identical too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dialects.core import Operation, Region, TensorType, Value
from ..dialects.traits import Trait, has_trait


def _signature(func: Operation) -> list[Any] | None:
    """The op-by-op structure of an update graph with the parameter's shape as "P"; None when the
    graph does anything but elementwise arithmetic on parameter-shaped values and on scalars."""
    param = next((op.result.type for op in func.body.ops
                  if op.name == "graph.input" and op.attributes.get("role") == "param"), None)
    if param is None:
        return None
    index: dict[Value, int] = {}
    signature: list[Any] = []

    def kind(t: TensorType) -> Any:
        if t.shape == param.shape:
            return ("P", t.dtype)
        if t.rank == 0:
            return ((), t.dtype)
        raise _NotFlat

    try:
        for op in func.body.ops:
            results = tuple(kind(r.type) for r in op.results)
            operands = [kind(v.type) for v in op.operands]
            attrs = dict(op.attributes)
            if op.name == "graph.broadcast":
                if operands[0][0] != () or results[0][0] != "P":
                    raise _NotFlat
                attrs["shape"] = "P"
            elif op.name == "graph.const":
                if isinstance(attrs.get("value"), list):
                    raise _NotFlat
            elif has_trait(op, Trait.ELEMENTWISE):
                if any(o[0] != results[0][0] for o in operands):
                    raise _NotFlat
            elif op.name not in ("graph.input", "graph.return"):
                raise _NotFlat
            signature.append((op.name, tuple(index[v] for v in op.operands), results, repr(sorted(attrs.items()))))
            for r in op.results:
                index[r] = len(index)
    except _NotFlat:
        return None
    return signature


class _NotFlat(Exception):
    pass


def flat_update_graph(funcs: Sequence[Operation], numel: int) -> Operation | None:
    """One `graph.func` doing what each of `funcs` (the update graphs of one group) does, over
    flat `[numel]` arrays; None when they are not all the same elementwise graph up to shape."""
    if not funcs:
        return None
    first = _signature(funcs[0])
    if first is None or any(_signature(f) != first for f in funcs[1:]):
        return None
    template = funcs[0]
    param_shape = next(op.result.type.shape for op in template.body.ops
                       if op.name == "graph.input" and op.attributes.get("role") == "param")

    def flat(t: TensorType) -> TensorType:
        return t.with_shape((numel,)) if t.shape == param_shape else t

    attrs = dict(template.attributes)
    attrs["sym_name"] = f"update/{attrs.get('group')}/*"
    attrs.pop("param", None)
    func = Operation.create("graph.func", attributes=attrs, regions=[Region.with_block()], loc=template.loc)
    mapped: dict[Value, Value] = {}
    for op in template.body.ops:
        op_attrs = dict(op.attributes)
        if op.name == "graph.broadcast":
            op_attrs["shape"] = [numel]
        clone = Operation.create(op.name, [mapped[v] for v in op.operands], [flat(r.type) for r in op.results],
                                 op_attrs, loc=op.loc)
        func.body.append(clone)
        mapped.update(zip(op.results, clone.results))
    func.verify()
    return func


def flat_clip(grads: np.ndarray, bounds: Sequence[tuple[int, int]], max_norm: float, eps: float) -> None:
    """Clip the gradients at `grads[a:b]` for each (a, b) in `bounds`, in place, as a clip graph
    would: norm_p = sqrt(sum g_p²), total = sqrt(Σ norm_p²) (added left to right), every
    gradient times min(max_norm / (total + eps), 1); all in float32."""
    span = slice(min(a for a, _ in bounds), max(b for _, b in bounds))
    squares = np.multiply(grads[span], grads[span])
    start = span.start
    f32 = np.float32
    total_sq = None
    for a, b in bounds:
        norm = np.sqrt(np.sum(squares[a - start:b - start], dtype=f32))
        square = f32(norm * norm)
        total_sq = square if total_sq is None else f32(total_sq + square)
    total = np.sqrt(f32(total_sq))
    coef = np.minimum(f32(f32(max_norm) / f32(total + f32(eps))), f32(1.0))
    contiguous = sorted(bounds)
    if all(b == c for (_, b), (c, _) in zip(contiguous, contiguous[1:])):
        grads[span] *= coef
    else:
        for a, b in bounds:
            grads[a:b] *= coef
