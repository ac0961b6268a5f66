"""`scale-gradients`: the graph dividing a step's summed microbatch gradients by their count.

With several microbatches a step's gradients are summed (`@train_accumulating`
adds each microbatch's into the sum, a stacked graph sums its k), so the step's
gradient, that of the mean loss, is the sum times 1/microbatches. The pass adds,
for the training driver, when the run has more than one microbatch:

    graph.func @"scale-gradients" {kind = "scale", derived = true}

with one input per gradient array the driver keeps (role grad): `grad/<path>`
for each parameter outside the flat layout of `flatten-updates` (typed as
`@train` returns it), in the order of their update graphs, then `flat-grads`,
the flat f32 gradient array of the flattened groups, when there is one. Each
output, under its input's name, is the input times the splat constant
1/microbatches, so the driver scales every gradient in place with one call.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import define

from ..diagnostics import Location
from ..dialects.core import Builder, Operation, Region, TensorType
from ..dialects.graph import erase_derived, func_kind, graph_funcs, is_derived, return_names
from .flat_updates import flat_layout
from .manager import CompilationUnit, Pass, register_pass
from .variants import run_microbatches, train_graph

#: The name of the scaling graph's input and output for the flat gradient array.
FLAT_GRADS = "flat-grads"
SCALE_GRAPH = "scale-gradients"


@register_pass
@define
class ScaleGradients(Pass):
    """Adds `@"scale-gradients"`, multiplying every gradient array by 1/microbatches, when the run has several.

    Guarantees: the experiment's graphs are unchanged; with one microbatch the
    module gets no scaling graph (none would run); run after
    `flatten-updates`, the graph takes the flat gradient array whole.
    """

    name = "scale-gradients"
    summary = "add @scale-gradients: each gradient array times 1/microbatches (several microbatches only)"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        erase_derived(module, "scale")
        microbatches = run_microbatches(module)
        if microbatches < 2:
            return
        train = train_graph(module, needs_grads=True)
        returned = dict(zip(return_names(train.body.last_op), (v.type for v in train.body.last_op.operands)))
        layout = flat_layout(module)
        types = {f"grad/{path}": returned[f"grad/{path}"] for path in _update_params(module) if path not in layout}
        if layout:
            types[FLAT_GRADS] = TensorType((max(end for _, end in layout.values()),), "f32")
        run = next(op for op in module.body.ops if op.name == "exp.run")
        module.body.append(scaling_graph(types, 1.0 / microbatches, run.loc))


def _update_params(module: Operation) -> list[str]:
    """The parameter of each update graph of the experiment, in their order."""
    return [str(f.attributes["param"]) for f in graph_funcs(module) if func_kind(f) == "update" and not is_derived(f)]


def scaling_graph(types: Mapping[str, TensorType], factor: float, loc: Location | None) -> Operation:
    """A graph multiplying each input (named and typed by `types`) by `factor`, each output under its
    input's name (may be written over it)."""
    func = Operation.create("graph.func", attributes={"sym_name": SCALE_GRAPH, "kind": "scale", "derived": True},
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
