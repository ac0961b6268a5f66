"""`plan-memory`: an upper bound on the peak activation memory of one microbatch.

For every graph of kind train, train_accumulating, train_stacked,
train_diagnosed, evaluation or inference, with the block order as the schedule (op i at
program point i):

- a value is live from the point of its defining op to the point of its last
  user; values the graph returns are live to the end (the `graph.return`);
  a value nobody uses is live at its definition only;
- parameters (inputs of role param) count as `param_bytes`, gradients (the
  values returned as `grad/<path>`, and inputs of role grad, which are the
  running sums an accumulating graph adds into) as `grad_bytes`; every other
  value -- batch inputs and every intermediate -- is an activation;
- `peak_bytes` = max over program points of the bytes of the activations live
  there (an op's operands and results are live together: nothing is reused
  in place, hence an upper bound).

Facts: `unit.facts.memory[graph] = {"peak_bytes", "param_bytes",
"grad_bytes", "largest"}`, where `largest` lists the 10 values with the most
elements (ties in schedule order), each `{"op": defining op without the
"graph." prefix, "shape": [...], "dtype", "elements", "loc": "file.sx:25" or
None}`. The IR is not changed.
"""

from __future__ import annotations

from typing import Any

from attrs import define

from ..dialects.core import Operation, Value
from ..dialects.exp import MODEL_GRAPH_KINDS
from ..dialects.liveness import Liveness
from .manager import CompilationUnit, Pass, register_pass

LARGEST = 10


def plan_graph(func: Operation) -> dict[str, Any]:
    """The memory facts of one graph (see the module docstring)."""
    liveness = Liveness(func.body)
    ret = liveness.ops[-1]
    returned_grads = {v for v, name in zip(ret.operands, ret.attributes["names"]) if name.startswith("grad/")}
    values: list[Value] = []
    params: list[Value] = []
    grads: list[Value] = []
    activations: list[Value] = []
    for op in liveness.ops:
        role = op.attributes["role"] if op.name == "graph.input" else None
        for v in op.results:
            values.append(v)
            if role == "param":
                params.append(v)
            elif role == "grad" or v in returned_grads:
                grads.append(v)
            else:
                activations.append(v)
    peak = liveness.peak_live_bytes(activations)
    largest = sorted(values, key=lambda v: -v.type.numel)[:LARGEST]
    return {
        "peak_bytes": peak,
        "param_bytes": sum(v.type.nbytes for v in params),
        "grad_bytes": sum(v.type.nbytes for v in grads),
        "largest": [
            {
                "op": v.owner.name.removeprefix("graph."),
                "shape": list(v.type.shape),
                "dtype": v.type.dtype,
                "elements": v.type.numel,
                "loc": v.owner.loc.short() if v.owner.loc is not None else None,
            }
            for v in largest
        ],
    }


@define
class PlanMemory(Pass):
    """Computes the peak-activation bound of every training and evaluation graph into `unit.facts.memory`.

    Guarantees: the IR is unchanged; `peak_bytes` is exact for the block
    order with no buffer reuse within an op.
    """

    name = "plan-memory"
    summary = "upper bound on peak activation memory per microbatch (liveness over the op order)"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        memory = unit.facts.memory
        for func in module.body.ops:
            if func.name == "graph.func" and func.attributes.get("kind") in MODEL_GRAPH_KINDS:
                memory[func.attributes["sym_name"]] = plan_graph(func)


register_pass(PlanMemory)
