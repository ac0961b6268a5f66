"""Graphs the training driver builds beside the experiment's own: group-wide optimizer updates and
gradient clipping over flat buffers, and the scaling of summed microbatch gradients.

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

`flat_clip_graph` does what a `kind = "clip"` graph does (torch's
clip_grad_norm_: per-tensor norms, the norm of the norms, one coefficient) on
a flat gradient buffer its members fill, with the same float32 operations in
the same order (each tensor's sum of squares over its own slice), so
bit-identical too, in one multiply over the buffer instead of one per member.

These are graphs, not numpy code, so that the driver computes nothing on
arrays itself: any executor runs them (backends/executor.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..diagnostics import Location
from ..dialects.core import Builder, Operation, Region, TensorType, Value
from ..dialects.exp import CLIP_EPS
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


def flat_clip_graph(clip: Operation, bounds: Sequence[tuple[int, int]]) -> Operation:
    """The clip graph `clip` over one flat gradient array that its members fill: member i (in the
    order of `clip`'s inputs) at `bounds[i]` = (start, end). Input "grad" (the flat array), outputs
    "grad" (clipped; may be written over the input) and "norm": norm_p = sqrt(sum g_p²),
    total = sqrt(Σ norm_p²) (added left to right), grad times min(max_norm / (total + eps), 1)."""
    member = next(op.result.type for op in clip.body.ops if op.name == "graph.input")
    numel = max(end for _, end in bounds)
    attrs = {**clip.attributes, "sym_name": f"{clip.attributes['sym_name']}/flat"}
    func = Operation.create("graph.func", attributes=attrs, regions=[Region.with_block()], loc=clip.loc)
    b = Builder(func.body, loc=clip.loc)
    grad = b.create("graph.input", (), {"name": "grad", "role": "grad"},
                    result_types=[member.with_shape((numel,))]).result
    squares = b.value("graph.mul", grad, grad)
    total_sq: Value | None = None
    for start, end in bounds:
        part = b.value("graph.slice", squares, axis=0, start=start, end=end)
        norm = b.value("graph.sqrt", b.value("graph.sum", part, axes=[0], keep=False))
        square = b.value("graph.mul", norm, norm)
        total_sq = square if total_sq is None else b.value("graph.add", total_sq, square)
    assert total_sq is not None
    total = b.value("graph.sqrt", total_sq)

    def scalar(value: float) -> Value:
        return b.create("graph.const", (), {"value": value}, result_types=[member.with_shape(())]).result

    coef = b.value("graph.div", scalar(float(clip.attributes["max_norm"])), b.value("graph.add", total, scalar(CLIP_EPS)))
    coef = b.value("graph.minimum", coef, scalar(1.0))
    clipped = b.value("graph.mul", grad, b.value("graph.broadcast", coef, shape=[numel]))
    b.create("graph.return", [clipped, total], {"names": ["grad", "norm"]})
    func.verify()
    return func


def scaling_graph(types: Mapping[str, TensorType], factor: float, loc: Location | None) -> Operation:
    """A graph multiplying each input (named and typed by `types`) by `factor`, each output under its
    input's name (may be written over it): the mean of gradients summed over microbatches."""
    func = Operation.create("graph.func", attributes={"sym_name": "scale-gradients", "kind": "scale"},
                            regions=[Region.with_block()], loc=loc)
    b = Builder(func.body, loc=loc)
    scaled = []
    for name, type_ in types.items():
        value = b.create("graph.input", (), {"name": name, "role": "grad"}, result_types=[type_]).result
        splat = b.create("graph.const", (), {"value": factor}, result_types=[type_]).result
        scaled.append(b.value("graph.mul", value, splat))
    b.create("graph.return", scaled, {"names": list(types)})
    func.verify()
    return func
