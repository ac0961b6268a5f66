"""`flatten-updates`: one update graph for a whole optimizer group, and clip graphs, over flat arrays.

`build-updates` makes one update graph per parameter; the graphs of a group
differ only in the parameter's shape (the same elementwise arithmetic on
`param`, `grad` and the states, with scalars computed from `step`). When
they are structurally identical up to that shape (`flat_update_graph`
checks it op by op), one graph rebuilt for the flat `[N]` shape does what
all of them do over the members laid one after the other (each starting
256-byte aligned, the gaps zeros that every update leaves zero): elementwise float32
arithmetic does not depend on the shape it runs over, so it is bit-identical
to the per-parameter graphs and costs a few array operations over all N
elements instead of ~35 per parameter. `fuse` lowers the same graph to one
multi-tensor update kernel per group (llm.c's AdamW launch).

The pass adds, for the training driver (`backends/training.py`), which keeps
the parameters, gradients and states of these groups as views into one flat
float32 array per kind:

    graph.func @"update/<group>/*" {kind = "update", group, derived = true,
                                    members = [{path, start, numel}, ...]}

after the update graphs, for every group of several members
whose graphs flatten (`start` counts from the group's first element; the
groups are laid one after the other, each aligned, in the order of these
graphs: `flat_layout`), and

    graph.func @"<clip>/flat" {kind = "clip", ..., derived = true, span = [start, end]}

after each clip graph whose members together fill one span of that layout
(`flat_clip_graph`: input "grad" is the span, outputs "grad" clipped and
"norm", with the same float32 operations in the same order as the clip graph,
each member's sum of squares over its own slice, so bit-identical too, in one
multiply over the span instead of one per member). The experiment's own
graphs stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attrs import define

from ..dialects.core import Builder, Operation, Region, TensorType, Value
from ..dialects.exp import CLIP_EPS
from ..dialects.graph import erase_derived, func_kind, graph_funcs, input_name, is_derived
from ..dialects.traits import Trait, has_trait
from .manager import CompilationUnit, Pass, register_pass
from .plan_buffers import MEMBER_ALIGNMENT, member_offsets

#: Each member of the flat parameter, gradient and state arrays (float32) starts at a multiple of this many
#: elements, and so does each group: plan-buffers' member alignment (256 bytes), so a vectorized kernel may
#: take any member's view.
FLAT_MEMBER_ALIGNMENT = MEMBER_ALIGNMENT // 4


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
    "grad" (clipped; may be written over the input) and "norm". With the clip's `grad_scale`, g is the
    input times it (as the clip graph scales each member first); norm_p = sqrt(sum g_p²),
    total = sqrt(Σ norm_p²) (added left to right), grad times min(max_norm / (total + eps), 1)."""
    member = next(op.result.type for op in clip.body.ops if op.name == "graph.input")
    numel = max(end for _, end in bounds)
    attrs = {**clip.attributes, "sym_name": f"{clip.attributes['sym_name']}/flat"}
    func = Operation.create("graph.func", attributes=attrs, regions=[Region.with_block()], loc=clip.loc)
    b = Builder(func.body, loc=clip.loc)
    grad = b.create("graph.input", (), {"name": "grad", "role": "grad"},
                    result_types=[member.with_shape((numel,))]).result
    grad_scale = clip.attributes.get("grad_scale")
    if grad_scale is not None:
        splat = b.create("graph.const", (), {"value": float(grad_scale)}, result_types=[grad.type]).result
        grad = b.value("graph.mul", grad, splat)
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


def group_update_graph(funcs: Sequence[Operation]) -> Operation | None:
    """The flat update graph of a group of several update graphs (`flat_update_graph`) with `members`:
    each member's path, start (from the group's first element) and size; None when they do not flatten."""
    if len(funcs) < 2:
        return None
    sizes = [param_type(func).numel for func in funcs]
    starts, span = member_offsets(sizes, FLAT_MEMBER_ALIGNMENT)
    flat = flat_update_graph(funcs, span)
    if flat is not None:
        flat.attributes["members"] = [{"path": func.attributes["param"], "start": start, "numel": size}
                                      for func, start, size in zip(funcs, starts, sizes)]
    return flat


def flat_update_graphs(module: Operation) -> list[Operation]:
    """The flat group update graphs `flatten-updates` added, in the order their groups are laid out."""
    return [f for f in graph_funcs(module) if is_derived(f) and func_kind(f) == "update"]


def flat_layout(module: Operation) -> dict[str, tuple[int, int]]:
    """Where each parameter of a flattened group lies in the flat arrays: (start, end), the groups laid
    end to end in the order of their flat update graphs, each group's members in its `members` order."""
    layout: dict[str, tuple[int, int]] = {}
    offset = 0
    for func in flat_update_graphs(module):
        offset = -(-offset // FLAT_MEMBER_ALIGNMENT) * FLAT_MEMBER_ALIGNMENT
        for member in func.attributes["members"]:
            start = offset + int(member["start"])
            layout[str(member["path"])] = (start, start + int(member["numel"]))
        offset += param_type(func).numel
    return layout


@register_pass
@define
class FlattenUpdates(Pass):
    """Adds each optimizer group's update over flat arrays and the clip graphs over the flat gradients.

    Guarantees: the experiment's graphs are unchanged; every group of several
    update graphs that are one elementwise arithmetic up to shape has
    `@"update/<group>/*"` (`derived`, `members`), and every clip graph whose
    members fill one span of the flat layout has `@"<clip>/flat"` (`derived`,
    `span`), each bit-identical to the graphs it stands for.
    """

    name = "flatten-updates"
    summary = "add each optimizer group's update over flat arrays and the clip graphs over the flat gradients"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        erase_derived(module, "update", "clip")
        groups: dict[str, list[Operation]] = {}
        for func in graph_funcs(module):
            if func_kind(func) == "update":
                groups.setdefault(str(func.attributes.get("group")), []).append(func)
                anchor = func
        for funcs in groups.values():
            flat = group_update_graph(funcs)
            if flat is None:
                continue
            flat.attributes["derived"] = True
            # After every update graph, in the groups' order: the flat layout's order.
            anchor = module.body.insert_after(flat, anchor)
        layout = flat_layout(module)
        for clip in [func for func in graph_funcs(module) if func_kind(func) == "clip"]:
            paths = [input_name(op).removeprefix("grad/") for op in clip.body.ops if op.name == "graph.input"]
            bounds = [layout[path] for path in paths if path in layout]
            start = min((a for a, _ in bounds), default=0)
            end = max((b for _, b in bounds), default=0)
            # Over the flat array when every member is in it and together they fill one span of it (laid out
            # one after the other, each aligned, as the flat arrays lay them out).
            ordered = sorted(bounds)
            laid_out = member_offsets([b - a for a, b in ordered], FLAT_MEMBER_ALIGNMENT)
            if bounds and len(bounds) == len(paths) and laid_out == ([a - start for a, _ in ordered], end - start):
                flat = flat_clip_graph(clip, [(a - start, b - start) for a, b in bounds])
                flat.attributes.update(derived=True, span=[start, end])
                module.body.insert_after(flat, clip)


def param_type(func: Operation) -> TensorType:
    """The type of an update graph's parameter."""
    return next(op.result.type for op in func.body.ops
                if op.name == "graph.input" and op.attributes.get("role") == "param")
