"""Graphs the training driver builds beside the experiment's own: group-wide optimizer updates and
gradient clipping over flat buffers, and the scaling of summed microbatch gradients.

`build-updates` makes one update graph per parameter; run one by one they
cost ~35 small numpy calls per parameter. When the graphs of a group are
structurally identical up to the parameter's shape
(`passes/flat_updates.flat_update_graph`, which `fuse` shares), the driver
keeps the group's parameters, gradients and states as views into one flat
float32 array per kind and runs ONE graph, rebuilt for the flat `[N]`
shape, over them: a few numpy calls over all N elements, bit-identical to
the per-parameter graphs.

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

from ..diagnostics import Location
from ..dialects.core import Builder, Operation, Region, TensorType, Value
from ..dialects.exp import CLIP_EPS
from ..passes.flat_updates import flat_update_graph

#: The driver's flat group update (built in the passes layer, which `fuse` shares).
__all__ = ["flat_clip_graph", "flat_update_graph", "scaling_graph"]


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
