"""One update graph for a whole optimizer group, over flat `[N]` arrays.

`build-updates` makes one update graph per parameter; the graphs of a group
differ only in the parameter's shape (the same elementwise arithmetic on
`param`, `grad` and the states, with scalars computed from `step`). When
they are structurally identical up to that shape (`flat_update_graph`
checks it op by op), one graph rebuilt for the flat `[N]` shape does what
all of them do over the members laid end to end: elementwise float32
arithmetic does not depend on the shape it runs over. The training driver
runs it over flat arrays (`backends/flat_updates.py`); `fuse` lowers it to
one multi-tensor update kernel per group (llm.c's AdamW launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
