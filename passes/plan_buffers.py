"""`plan-buffers`: where every buffer of a lowered module lives, so an executor plans nothing.

Two arenas:

- **One transient arena per graph** (`arena_bytes` on the `graph.func`): each
  value a kernel or a GEMM computes gets a byte offset in it
  (`offsets = [...]` on the op, one per result), from the shared liveness
  analysis (`dialects/liveness.py`: a buffer is free again after the last
  read of its storage through any view; reshapes, squeezes and expand_dims
  are views of their operand). Offsets and sizes are multiples of 256 bytes
  (cudaMalloc's alignment, and more than the 16 a packed access needs).
  A free range is reused by the smallest value that fits. An output of an
  elementwise kernel (pointwise or multi-tensor update) may take exactly the
  buffer of an operand the kernel reads for the last time through the
  identity map (same element, same size): each thread reads that element
  before it writes it. A GEMM, a reduction or a template kernel never writes
  over what it reads. Values the graph returns or emits have no offset
  (`none`): they live where the caller wants them (an output array, a
  gradient in the persistent arena).
- **The persistent arena** (`persistent_bytes` on `exp.run`): parameters,
  gradients and optimizer states, group after group, and the bf16 working
  copies of a group whose update writes them (`working-copies`: kind `bf16`,
  laid out as the parameters at half their bytes); within a group each
  kind (param, grad, each state) is one span holding the members in the
  order of the group's flat update graph (`members`), so the group's
  multi-tensor update reads `[N]` spans. Each span and each member in it
  starts at a multiple of 256 bytes (`MEMBER_ALIGNMENT`; the gaps between
  members are zeros the update leaves zero): a kernel given one member's
  view (its gradient's `fill`, a norm's weight) may use 16-byte vector
  accesses, whatever the sizes of the members before it. The training
  driver lays its flat arrays out the same way (`member_offsets`).
  `exp.group {arena = {param = offset, grad = offset, m = ...}}`
  gives each span's start; `exp.param {arena = {param = offset, grad =
  offset, ...}}` each member's place in them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from attrs import define

from ..dialects.core import Operation, Value
from ..dialects.graph import func_kind, graph_funcs, return_names
from ..dialects.index_maps import Expr
from ..dialects.kern import find_kernel
from ..dialects.liveness import ArenaPlan, StorageLiveness
from .manager import CompilationUnit, Pass, register_pass
from .working_copies import UPDATE_OUTPUT

ALIGNMENT = 256
#: Where each member of a persistent group's span starts: a multiple of this many bytes (the arena's
#: alignment; vectorized kernels need 16 of every pointer they are given).
MEMBER_ALIGNMENT = ALIGNMENT
#: Kernels each of whose threads reads an operand element and then writes the result element of
#: the same index (so an output may overwrite an operand read through the identity map).
ELEMENTWISE_KINDS = ("pointwise", "multi_tensor_update")


def _identity_map(attribute: dict[str, Any], domain: list[int]) -> bool:
    """Whether an input map reads the element at the domain index's own row-major position."""
    return set(attribute) == {"offset", "strides"} and Expr.from_attribute(domain, attribute) == Expr.flat(domain)


def in_place_reuse(op: Operation, liveness: StorageLiveness) -> dict[Value, Value]:
    """For an elementwise launch: which result may take which operand's buffer (the operand is
    read through the identity map, has the result's byte size, and its storage ends here)."""
    if op.name != "kern.launch":
        return {}
    kernel = find_kernel(op)
    if kernel is None or kernel.attributes["kind"] not in ELEMENTWISE_KINDS:
        return {}
    domain = kernel.attributes["domain"]
    here = liveness.defined[op.results[0]]
    reuse: dict[Value, Value] = {}
    taken: set[Value] = set()
    for result in op.results:
        for operand, attribute in zip(op.operands, kernel.attributes["maps"]):
            root = liveness.root.get(operand, operand)
            if (root in taken or root in liveness.fixed or root in liveness.escaping
                    or liveness.storage_end.get(root) != here or root.type.nbytes != result.type.nbytes
                    or not _identity_map(attribute, domain)
                    or any(o is not operand and liveness.root.get(o, o) is root for o in op.operands)):
                continue
            reuse[result] = root
            taken.add(root)
            break
    return reuse


def member_offsets(sizes: Iterable[int], alignment: int) -> tuple[list[int], int]:
    """Where each member of a span starts when the members are laid out in order, each at a multiple of
    `alignment` (in the sizes' unit: bytes here, elements in the training driver's flat arrays); and
    where the last one ends."""
    starts, end = [], 0
    for size in sizes:
        starts.append(-(-end // alignment) * alignment)
        end = starts[-1] + size
    return starts, end


def plan_graph(func: Operation) -> int:
    """Offsets of every computed value of one lowered graph; returns the arena's bytes."""
    block = func.body
    liveness = StorageLiveness(block)
    plan = ArenaPlan(liveness, alignment=ALIGNMENT, exact=False)
    for op in block.ops:
        if op.name not in ("kern.launch", "kern.gemm"):
            continue
        buffers = plan.assign_op(op.results, in_place_reuse(op, liveness))
        op.attributes["offsets"] = [None if b is None else b.offset for b in buffers]
    func.attributes["arena_bytes"] = plan.size
    return plan.size


def plan_persistent(module: Operation) -> int:
    """Spans for each group's parameters, gradients and states; returns the arena's bytes."""
    params = {op.attributes["path"]: op for op in module.body.ops if op.name == "exp.param"}
    orders = {f.attributes["group"]: [m["path"] for m in f.attributes["members"]]
              for f in graph_funcs(module) if func_kind(f) == "update" and "members" in f.attributes}
    copied = {f.attributes.get("group") for f in graph_funcs(module)
              if func_kind(f) == "update" and UPDATE_OUTPUT in return_names(f.body.last_op)}
    offset = 0
    for group in (op for op in module.body.ops if op.name == "exp.group"):
        members = orders.get(group.attributes["name"], list(group.attributes["members"]))
        kinds = ["param", "grad", *sorted(group.attributes.get("states", {}))]
        starts: dict[str, int] = {}
        member_starts, span = member_offsets((params[path].attributes["type"].nbytes for path in members),
                                             MEMBER_ALIGNMENT)
        for kind in kinds:
            offset = -(-offset // ALIGNMENT) * ALIGNMENT
            starts[kind] = offset
            for path, start in zip(members, member_starts):
                params[path].attributes.setdefault("arena", {})[kind] = offset + start
            offset += span
        if group.attributes["name"] in copied:
            # The weights' bf16 working copies (`working-copies`): laid out as the parameters, at half the bytes.
            offset = -(-offset // ALIGNMENT) * ALIGNMENT
            starts[UPDATE_OUTPUT] = offset
            for path, start in zip(members, member_starts):
                params[path].attributes["arena"][UPDATE_OUTPUT] = offset + start // 2
            offset += span // 2
        group.attributes["arena"] = starts
    return -(-offset // ALIGNMENT) * ALIGNMENT


@register_pass
@define
class PlanBuffers(Pass):
    """Gives every buffer of a lowered module its place: a transient arena per graph and one
    persistent arena for parameters, gradients and optimizer states.

    Guarantees: every result of a `kern.launch` and `kern.gemm` has an offset
    (`offsets`, `none` for one the graph returns or emits) such that two values
    whose storage is live at once never overlap, except an elementwise kernel's
    output written over an operand it reads through the identity map for the
    last time; offsets are multiples of 256, and so is every persistent
    member's (parameter, gradient, state); each `graph.func` has
    `arena_bytes`; `exp.param`s and `exp.group`s have `arena`, `exp.run`
    `persistent_bytes`. Run it after `fuse`.
    """

    name: ClassVar[str] = "plan-buffers"
    summary: ClassVar[str] = "arena offsets for every buffer: one transient arena per graph, one persistent"

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        arenas = {f.attributes["sym_name"]: plan_graph(f) for f in graph_funcs(module)}
        persistent = plan_persistent(module)
        for op in module.body.ops:
            if op.name == "exp.run":
                op.attributes["persistent_bytes"] = persistent
        lowering = unit.facts.lowering_facts()
        lowering.arenas = arenas
        lowering.persistent_bytes = persistent
