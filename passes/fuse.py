"""`fuse`: every graph op that computes becomes part of a kernel launch or a cuBLASLt GEMM.

The way PyTorch Inductor schedules: each pointwise, reduction and index op
is a node over an iteration domain; views (broadcast, transpose, slice,
reshape, pad, gathers) are never nodes but index maps of the reads that
cross them (`passes/fuse_plan.py`). Pairs of groups that touch the same
buffer (a producer and its consumer, or siblings reading one input) are
candidates, scored by the bytes a kernel would no longer write and read
again; the best legal merge goes first, round after round, until none is
left. A merge is legal when the result fits `max-nodes`, creates no cycle
(so a group never spans a GEMM, a pattern kernel or a template kernel that
sits between its parts), and has a plan: a domain over which every output
is stored row-major, every value computed inside is read at one index per
element, and a reduction's result is read only by its epilogue. A value of
one element computed from values of one element (a schedule's `cos` of the
step) is computed once a launch: never in a kernel that would compute it per
element (`scalar_ops`).

Around the groups:
- `graph.matmul` becomes `kern.gemm` (cuBLASLt), a transpose of the last two
  axes folded into `transpose_a`/`transpose_b`, batches flattened, a
  following bias add into the `bias` epilogue and a following add of a
  same-shaped buffer into `beta = 1` (the accumulating gradient);
- `graph.scatter_add` becomes the deterministic scatter-add template kernel
  (over rows; another axis is moved first by a fused copy), one whose only
  use adds it to a buffer (the accumulating gradient) adding into that buffer;
- a value a GEMM, a template kernel, the graph's outputs or an emit reads
  that is not a buffer or a free view of one (reshape, squeeze,
  expand_dims) is materialised: `kern.copy` (fused with its neighbours like
  any node) or, for a splat constant, `kern.fill` (the fill template);
- the update graphs of an optimizer group, when they are the same
  arithmetic up to the parameter's shape, become one graph over the group's
  flat `[N]` arrays (the training driver's) and that graph one
  `multi_tensor_update` kernel: one launch per group, as llm.c's AdamW. The
  graph says where each member lies (`members`); update graphs are fused
  without the cap.

A reduction the target splits across blocks (`split`: a column sum whose
blocks would not fill the device of the pass's `arch`) also writes a scratch
of partial results (one more output, which nothing reads) and reads the
graph's counters (one more input: i32 zeros from one `fill` a graph, which
every split launch leaves zero).

Kernels are deduplicated by what they compute (kind, body, maps, shapes):
identical layers share one symbol. Facts for the lowering report:
`unit.facts.lowering.graphs[graph]` = nodes before, kernels per call,
launches, GEMMs, fused group sizes; `["updates"][group]` the graphs an
update kernel replaced; `["fell_back"]` what was not lowered as asked.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from typing import Any

from attrs import define

from ..diagnostics import Location, UsageError
from ..dialects.core import Block, Builder, Operation, SymbolRef, TensorType, Value, VerifyError
from ..dialects.exp import OPTIMIZER_GRAPH_KINDS
from ..dialects.graph import cast_dtype, func_kind, graph_funcs, is_derived, op_axis, transpose_perm
from ..dialects.index_maps import Expr, reshape_index
from ..dialects.kern import body_plan_facts
from ..dialects.printer import print_op
from ..dialects.traits import Trait, has_trait
from .dce import eliminate_dead_ops
from .flat_updates import group_update_graph
from .fuse_plan import (
    FREE_VIEWS,
    INDEX_VIEWS,
    GroupPlan,
    access_attribute,
    build_body,
    free_view_root,
    is_fusible,
    plan_group,
    splat_value,
    view_sources,
)
from .fuse_recompute import recompute_pointwise
from .gemm_layouts import precedes
from .manager import CompilationUnit, Pass, register_pass
from .targets import KernelTarget, kernel_target

#: Ops the lowering leaves in a graph as they are.
_KEPT = frozenset({"graph.input", "graph.return", "graph.metric", "graph.counter", "graph.observe", "kern.launch",
                   "kern.gemm"})
#: Ops that end a fused group: kernels of their own.
_BARRIERS = frozenset({"kern.launch", "kern.gemm", "kern.fill", "graph.return", "graph.metric", "graph.counter",
                       "graph.observe"})
#: Dtypes a kernel stores.
_DTYPES = ("f32", "bf16", "i32", "i64", "i1")


@register_pass
@define
class Fuse(Pass):
    """Lowers every graph to kernel launches, GEMMs, inputs, outputs, emits and free views.

    Guarantees: afterwards each `graph.func` holds only `graph.input`,
    `graph.return`, the emits, `graph.reshape`/`squeeze`/`expand_dims` of
    buffers, `graph.const` with a dense value, `kern.launch` of module-level
    `kern.kernel`s and `kern.gemm`; each launch computes what the ops it
    replaced computed; no group has more than `max-nodes` nodes (update
    graphs and ops recomputed after a GEMM aside) or spans a GEMM or a
    pattern kernel. An op the lowering does
    not take is a located error.
    """

    name = "fuse"
    summary = "fuse pointwise, reduction and index ops into kernels; matmuls become cuBLASLt GEMMs"
    max_nodes: int = 15
    #: The most elementwise ops recomputed in a reader's kernel for a value another kernel would store only
    #: for it (`passes/fuse_recompute.py`); 0 stores every such value.
    recompute: int = 8
    #: The kernel target that plans each kernel's launch (`passes/targets.py`).
    target: str = "cuda"
    #: The device architecture the launches are planned for (`sm_90`); empty: any (no launch depends on the
    #: device's size, as on cpu-c).
    arch: str = ""

    def run(self, unit: CompilationUnit) -> None:
        module = unit.require_module(self.name)
        if self.max_nodes < 1:
            raise UsageError(f"option 'max-nodes' of pass 'fuse' must be at least 1, not {self.max_nodes}")
        if self.recompute < 0:
            raise UsageError(f"option 'recompute' of pass 'fuse' must be at least 0, not {self.recompute}")
        facts = unit.facts.lowering_facts()
        kernels = KernelTable(module, kernel_target(self.target), self.arch)
        updates, fell_back = merge_update_groups(module)
        facts.updates.update(updates)
        facts.fell_back.extend(fell_back)
        graphs = facts.graphs = facts.graphs if facts.graphs is not None else {}
        for func in graph_funcs(module):
            cap = None if func_kind(func) in OPTIMIZER_GRAPH_KINDS else self.max_nodes
            graphs[func.attributes["sym_name"]] = lower_func(func, kernels, cap, self.recompute)
        kernels.place()
        facts.kernels = len(kernels.symbols)


# -- the module's kernels ---------------------------------------------------------------------


class KernelTable:
    """The module's `kern.kernel`s, one per distinct computation, launched as `target` plans them for `arch`."""

    def __init__(self, module: Operation, target: KernelTarget, arch: str = "") -> None:
        self.module = module
        self.target = target
        self.arch = arch
        self.symbols: dict[str, Operation] = {}
        for op in module.body.ops:
            if op.name == "kern.kernel":
                self.symbols[op.attributes["sym_name"]] = op
        self._by_text: dict[str, str] = {}
        #: Each graph's counters of split reductions (`counters`), by its block and their type.
        self._counters: dict[tuple[Block, TensorType], Value] = {}

    def counters(self, counters: TensorType, before: Operation) -> Value:
        """The graph's counters for split reductions: one `kern.fill` of zeros a graph (made before the first
        launch that reads them; `schedule` moves it before any other), which every split launch leaves zero."""
        key = (before.parent, counters)
        if key not in self._counters:
            fill = _create("kern.fill", [], {"value": 0, "counters": True}, before, [counters])
            fill.result.name_hint = "counters"
            self._counters[key] = fill.result
        return self._counters[key]

    def intern(self, attributes: dict[str, Any], body: Any, stem: str, loc: Location | None = None) -> str:
        """The symbol of the kernel with these attributes and body (its path aside), made when new."""
        op = Operation.create("kern.kernel", attributes={k: v for k, v in attributes.items() if k != "path"},
                              regions=[body] if body is not None else [])
        text = print_op(op)
        known = self._by_text.get(text)
        if known is not None:
            return known
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        symbol = f"{stem}_{digest}"
        op.attributes.update(sym_name=symbol, path=attributes["path"])
        op.loc = loc
        op.verify_one()
        self._by_text[text] = symbol
        self.symbols[symbol] = op
        return symbol

    def place(self) -> None:
        """Put the new kernels at the top of the module, before the graphs, in order of creation."""
        anchor = next((op for op in self.module.body.ops if op.name == "graph.func"), None)
        for op in self.symbols.values():
            if op.parent is None:
                if anchor is None:
                    self.module.body.append(op)
                else:
                    self.module.body.insert_before(op, anchor)


# -- update groups ----------------------------------------------------------------------------


def merge_update_groups(module: Operation) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each optimizer group whose member update graphs are one arithmetic up to shape: its graphs
    replaced by the flat graph over the group's members laid end to end (`members` gives each
    member's path, start and size). Returns, per merged group, how many graphs and nodes it had,
    and a `fell back` fact for each group of several graphs that could not be merged."""
    merged: dict[str, dict[str, Any]] = {}
    fell_back: list[dict[str, Any]] = []
    by_group: dict[str, list[Operation]] = {}
    for func in graph_funcs(module):
        # A group's flat update that `flatten-updates` added for the driver is not one of its members.
        if func_kind(func) == "update" and "group" in func.attributes and not is_derived(func):
            by_group.setdefault(func.attributes["group"], []).append(func)
    for group, funcs in by_group.items():
        flat = group_update_graph(funcs)
        if flat is None:
            if len(funcs) > 1:
                fell_back.append({"graph": f"update {group}", "family": "multi-tensor update", "path": group,
                                  "reason": "its members' update graphs differ beyond their shapes: "
                                            "one update kernel per member"})
            continue
        module.body.insert_before(flat, funcs[0])
        merged[group] = {"graphs": len(funcs), "nodes": sum(len(f.body) for f in funcs),
                         "graph": flat.attributes["sym_name"]}
        for func in funcs:
            func.erase()
    return merged, fell_back


# -- one graph --------------------------------------------------------------------------------


def lower_func(func: Operation, kernels: KernelTable, cap: int | None, recompute: int = 0) -> dict[str, Any]:
    """Lower one `graph.func` in place; the facts of its row in the lowering report."""
    block = func.body
    eliminate_dead_ops(block)
    nodes = len(block)
    _check_lowerable(block)
    for op in list(block.ops):
        if op.name == "graph.matmul":
            lower_matmul(op)
        elif op.name == "graph.scatter_add":
            lower_scatter_add(op, kernels)
    _materialise_reads(block)
    _materialise_split_reshapes(block)
    eliminate_dead_ops(block)
    path_of = {op: op.attributes["path"] for op in block.ops if isinstance(op.attributes.get("path"), str)}
    kind = "multi_tensor_update" if func_kind(func) == "update" else "pointwise"
    fusion = Fusion(block, cap)
    groups = fusion.run()
    barriers = sum(group.mask for group in fusion.groups if not group.fusible)
    groups = recompute_pointwise(groups, barriers, fusion.escapes, fusion.sources, recompute)
    sizes = []
    launched: dict[Value, Value] = {}
    for group in groups:
        if group.plan is not None:
            # An update graph's schedule scalars are a kernel of their own, not a multi-tensor update.
            scalar = all(op in fusion.scalars for op in group.ops)
            _launch_group(group.plan, "pointwise" if scalar else kind, kernels, path_of, launched)
            if group.size > 1:
                sizes.append(group.size)
    for op in list(block.ops):
        if op.name == "kern.fill":
            _launch_fill(op, kernels, path_of)
    eliminate_dead_ops(block)
    schedule(block)
    launches = sum(op.name == "kern.launch" for op in block.ops)
    gemms = sum(op.name == "kern.gemm" for op in block.ops)
    return {"nodes": nodes, "kernels": launches + gemms, "launches": launches, "gemms": gemms,
            "fused_groups": sorted(sizes)}


def _check_lowerable(block: Block) -> None:
    """A located error for the first op the lowering does not take."""
    for op in block.ops:
        for value in [*op.operands, *op.results]:
            if value.type.dtype not in _DTYPES:
                raise VerifyError(f"the CUDA lowering does not take {value.type.dtype} values ('{op.name}')", op)
        dtype = op.results[0].type.dtype if op.results else None
        if op.name == "graph.matmul" and dtype not in ("f32", "bf16"):
            raise VerifyError(f"the CUDA lowering multiplies f32 and bf16 matrices (cuBLASLt), not {dtype}", op)
        if op.name == "graph.pow" and dtype not in ("f32", "bf16"):
            raise VerifyError(f"the CUDA lowering takes pow of floats, not of {dtype}", op)
        if op.name == "graph.scatter_add_along" and not is_fusible(op):
            raise VerifyError(f"the CUDA lowering takes a scatter-add-along of at most 16 indices per row, "
                              f"not {op.operands[0].type.shape[op_axis(op)]}", op)
        lowered_elsewhere = ("graph.const", "graph.matmul", "graph.scatter_add", "kern.copy", "kern.fill")
        if not (op.name in _KEPT or op.name in INDEX_VIEWS or op.name in lowered_elsewhere or is_fusible(op)):
            raise VerifyError(f"the CUDA lowering does not take '{op.name}'", op)


# -- GEMMs ------------------------------------------------------------------------------------


def _create(name: str, operands: Sequence[Value], attributes: dict[str, Any], before: Operation,
            result_types: Sequence[TensorType] | None = None) -> Operation:
    return Builder(before.parent, anchor=before, loc=before.loc).create(name, operands, attributes, result_types)


def _reshape(value: Value, shape: Sequence[int], before: Operation) -> Value:
    if tuple(value.type.shape) == tuple(shape):
        return value
    return _create("graph.reshape", [value], {"shape": list(shape)}, before).result


def is_buffer(value: Value) -> bool:
    """Whether `value` is stored contiguously as it is: a non-view, or a free view of one (not a splat)."""
    root = free_view_root(value)
    return (root.op is None or root.op.name not in INDEX_VIEWS) and splat_value(root) is None


def legal_read(value: Value, before: Operation) -> Value:
    """`value` as a buffer a GEMM, a template kernel or the graph's caller can read: itself, a fill of
    a splat constant, or a copy of a view."""
    if is_buffer(value):
        return value
    root = value
    while root.op is not None and root.op.name in INDEX_VIEWS and root.op.name not in ("graph.take", "graph.take_along"):
        root = root.op.operands[0]
    scalar = splat_value(root)
    if scalar is not None and root.op is not None and _is_splat_view(value):
        return _create("kern.fill", [], {"value": scalar}, before, [value.type]).result
    return _create("kern.copy", [value], {}, before).result


def _is_splat_view(value: Value) -> bool:
    """A view of a splat constant that is a splat too (no pads or gathers on the way)."""
    while value.op is not None and value.op.name in INDEX_VIEWS:
        if value.op.name in ("graph.pad", "graph.take", "graph.take_along"):
            return False
        value = value.op.operands[0]
    return splat_value(value) is not None


def _transposed(value: Value) -> tuple[Value, bool]:
    """`x, True` when `value` is `x` with its last two axes swapped, else `value, False`."""
    op = value.op
    if op is not None and op.name == "graph.transpose":
        rank = value.type.rank
        if transpose_perm(op) == [*range(rank - 2), rank - 1, rank - 2]:
            return op.operands[0], True
    return value, False


def _shared_read(value: Value, before: Operation) -> Value:
    """`legal_read(value, before)`, or the copy of `value` an earlier GEMM's operand made: a layout
    (the head layout of K read by the forward and the backward) is written once."""
    if not is_buffer(value):
        for user in value.users():
            if user.name == "kern.copy" and precedes(user, before):
                return user.result
    return legal_read(value, before)


def lower_matmul(op: Operation) -> None:
    """`graph.matmul` as one `kern.gemm` (batches flattened, transposes and an epilogue folded)."""
    a, b = op.operands
    out = op.result.type
    batch = out.shape[:-2]
    count = math.prod(batch)
    m, n = out.shape[-2:]
    final, bias, accumulate = _epilogue(op)
    anchor = final.op
    path = op.attributes.get("path", "")
    left, transpose_a = _transposed(a)
    right, transpose_b = _transposed(b)
    if a.type.rank > 2 and b.type.rank == 2 and not transpose_a:
        left = _reshape(_shared_read(left, anchor), [count * m, left.type.shape[-1]], anchor)
        count = 1
    else:
        left = _batched(left, a.type, batch, anchor)
        right = _batched(right, b.type, batch, anchor)
    right = _shared_read(right, anchor) if right.type.rank == 2 else right
    shape = [count, m, n] if count > 1 else [math.prod(batch) * m, n]
    operands = [left, right]
    epilogue = "none"
    if bias is not None:
        operands.append(legal_read(bias, anchor))
        epilogue = "bias"
    beta = 0.0
    if accumulate is not None:
        operands.append(_reshape(legal_read(accumulate, anchor), shape, anchor))
        beta = 1.0
    gemm = _create("kern.gemm", operands, {"transpose_a": transpose_a, "transpose_b": transpose_b, "batch": count,
                                           "epilogue": epilogue, "alpha": 1.0, "beta": beta, "path": path},
                   anchor, [TensorType(tuple(shape), final.type.dtype)])
    result = _reshape(gemm.result, final.type.shape, anchor)
    gemm.result.name_hint = result.name_hint = final.name_hint
    final.replace_all_uses_with(result)


def _batched(value: Value, read: TensorType, batch: Sequence[int], before: Operation) -> Value:
    """A GEMM operand over `batch` (the product's batch shape): rank 2 when shared by every batch,
    else rank 3 with the batches flattened (a broadcast batch is materialised first)."""
    if read.rank == 2:
        return _shared_read(value, before)
    if tuple(read.shape[:-2]) != tuple(batch):
        full = _create("graph.broadcast", [value], {"shape": [*batch, *value.type.shape[-2:]]}, before).result
        value = _create("kern.copy", [full], {}, before).result
    return _reshape(_shared_read(value, before), [math.prod(batch), *value.type.shape[-2:]], before)


def _epilogue(op: Operation) -> tuple[Value, Value | None, Value | None]:
    """The value a GEMM for `op` produces (the matmul's, its cast from bf16 to f32 — cuBLASLt
    writes f32 from bf16 operands — or the adds it absorbs), and the bias (a [n] vector broadcast
    over the rows) and the buffer added (`beta = 1`) it absorbs: a bias, a buffer, or a bias then
    a buffer (a projection's bias and the residual stream it is added to, as llm.c's matmul
    with its residual)."""
    result = op.result
    users = list(result.users())
    if (len(result.uses) == 1 and users[0].name == "graph.cast" and result.type.dtype == "bf16"
            and cast_dtype(users[0]) == "f32"):
        result = users[0].result
    absorbed = _only_add(result)
    if absorbed is None:
        return result, None, None
    add, other = absorbed
    n = result.type.shape[-1]
    # The bf16 policy casts the broadcast f32 bias: the broadcast of the cast [n] vector is the same.
    cast = other.op if other.op is not None and other.op.name == "graph.cast" else None
    broadcast = cast.operands[0].op if cast is not None else other.op
    if broadcast is not None and broadcast.name == "graph.broadcast":
        vector = broadcast.operands[0]
        if not (vector.type.numel == n and vector.type.shape[-1:] == (n,) and is_buffer(vector)):
            return result, None, None
        bias = _reshape(vector, [n], add)
        if cast is not None:
            bias = _create("graph.cast", [bias], dict(cast.attributes), add).result
        residual = _only_add(add.result)
        if residual is not None and _accumulable(residual[1], add.result):
            return residual[0].result, bias, residual[1]
        return add.result, bias, None
    if _accumulable(other, result):
        return add.result, None, other
    return result, None, None


def _only_add(value: Value) -> tuple[Operation, Value] | None:
    """The `graph.add` that is `value`'s only use, and its other operand."""
    users = list(value.users())
    if len(users) != 1 or len(value.uses) != 1 or users[0].name != "graph.add":
        return None
    add = users[0]
    return add, add.operands[1] if add.operands[0] is value else add.operands[0]


def _accumulable(other: Value, product: Value) -> bool:
    """Whether a GEMM producing `product` can add `other` as its C operand (`beta = 1`)."""
    return other.type == product.type and is_buffer(other)


# -- scatter-add ------------------------------------------------------------------------------


def lower_scatter_add(op: Operation, kernels: KernelTable) -> None:
    """`graph.scatter_add` as the deterministic scatter-add template over rows: indices flattened to
    [positions], updates to [positions, columns] (the indexed axes moved first by a copy when they
    are not first), the result [dim, columns] viewed back.

    An f32 scatter over rows whose only use adds it to a buffer of its type (`train_accumulating`'s
    gradient sum) adds into that buffer instead, as an accumulating GEMM adds into its C (`accumulate`:
    the buffer is its third input): no zeroed table, no add, and in place only the rows named are touched."""
    idx, upd = op.operands
    axis = op_axis(op)
    final, initial = op.result, None
    absorbed = _only_add(op.result) if axis == 0 and op.result.type.dtype == "f32" else None
    if absorbed is not None and _accumulable(absorbed[1], op.result):
        final, initial = absorbed[0].result, absorbed[1]
    anchor = final.op  # the add, when absorbed: after the buffer it adds into
    rank = idx.type.rank
    positions = idx.type.numel
    before, after = upd.type.shape[:axis], upd.type.shape[axis + rank:]
    columns = math.prod(before) * math.prod(after)
    indices = _reshape(legal_read(idx, anchor), [positions], anchor)
    if axis:
        perm = [*range(axis, axis + rank), *range(axis), *range(axis + rank, upd.type.rank)]
        moved = _create("graph.transpose", [upd], {"perm": perm}, anchor).result
        upd = _create("kern.copy", [moved], {}, anchor).result
    source = _reshape(legal_read(upd, anchor), [positions, columns], anchor)
    dim = op.attributes["dim"]
    out = TensorType((dim, columns), op.result.type.dtype)
    operands = [indices, source]
    if initial is not None:
        operands.append(_reshape(legal_read(initial, anchor), [dim, columns], anchor))
    path = op.attributes.get("path", "")
    attributes: dict[str, Any] = {"kind": "scatter_add", "inputs": [v.type for v in operands], "outputs": [out],
                                  "path": path}
    if initial is not None:
        attributes["accumulate"] = True
    launch, sizes, scratch = kernels.target.plan_template("scatter_add", attributes)
    # A template's scratch buffer is one more output of the kernel, which nothing reads: plan-buffers
    # gives it arena space for the launch alone.
    attributes.update(launch.attributes(), sizes=sizes)
    attributes["outputs"] = [out, *(TensorType((nbytes // 4,), "f32") for nbytes in scratch)]
    symbol = kernels.intern(attributes, None, "scatter_add", op.loc)
    result = _create("kern.launch", operands, {"kernel": SymbolRef(symbol), "path": path}, anchor,
                     attributes["outputs"]).results[0]
    if axis:
        unmoved = _reshape(result, [dim, *before, *after], anchor)
        back = [*range(1, len(before) + 1), 0, *range(len(before) + 1, len(before) + 1 + len(after))]
        result = _create("graph.transpose", [unmoved], {"perm": back}, anchor).result
    result = _reshape(result, final.type.shape, anchor)
    result.name_hint = final.name_hint
    final.replace_all_uses_with(result)


# -- reads that must be buffers ---------------------------------------------------------------


def _materialise_reads(block: Block) -> None:
    """Operands of GEMMs, template and pattern launches, returns and emits that are not buffers
    become copies (or fills)."""
    for op in list(block.ops):
        if op.name not in _BARRIERS or op.name == "kern.fill":
            continue
        for k, value in enumerate(op.operands):
            legal = legal_read(value, op)
            if legal is not value:
                op.set_operand(k, legal)


def _materialise_split_reshapes(block: Block) -> None:
    """A reshape of a view whose merged axes cannot be split again as index expressions (one that
    straddles a stride, such as a transposed [3, 2] read as [2, 3]) reads a copy of the view."""
    for op in list(block.ops):
        if op.name not in FREE_VIEWS or is_buffer(op.operands[0]):
            continue
        shape = op.result.type.shape
        identity = [Expr.axis(shape, d) for d in range(len(shape))]
        if reshape_index(op.operands[0].type.shape, shape, identity) is None:
            op.set_operand(0, _create("kern.copy", [op.operands[0]], {}, op).result)


# -- fusion -----------------------------------------------------------------------------------


@define(eq=False)
class Group:
    """A set of ops computed by one kernel (or a barrier: one op, never fused)."""

    ops: list[Operation]
    fusible: bool
    index: int
    mask: int = 0
    #: The ops (as group bits) this group's ops read from, transitively, as the graph had them.
    ancestors: int = 0
    #: The ops (as group bits) that read from this group's ops, transitively, as the graph had them.
    descendants: int = 0
    plan: GroupPlan | None = None
    alive: bool = True
    #: Bumped by every merge into this group (so a failed merge is not tried again unchanged).
    version: int = 0

    @property
    def size(self) -> int:
        return len(self.ops)


class Fusion:
    """Greedy fusion of one block's fusible ops, best-scored legal merge first."""

    def __init__(self, block: Block, cap: int | None) -> None:
        self.block = block
        self.cap = cap
        self.position: dict[Operation, int] = {op: i for i, op in enumerate(block.ops)}
        self.escapes: set[Value] = set()
        for op in block.ops:
            if op.name in ("graph.return", "graph.metric", "graph.counter", "graph.observe"):
                self.escapes.update(free_view_root(v) for v in op.operands)
        self.groups: list[Group] = []
        self.group_of: dict[Operation, Group] = {}
        #: view_sources of the block's values (the block does not change while groups form).
        self.sources: dict[Value, list[Value]] = {}
        for op in block.ops:
            if is_fusible(op) or op.name in _BARRIERS:
                group = Group([op], is_fusible(op), len(self.groups))
                self.groups.append(group)
                self.group_of[op] = group
        readers: dict[int, list[Group]] = {}
        for group in self.groups:
            op = group.ops[0]
            found = set()
            for operand in op.operands:
                for source in view_sources(operand, self.sources):
                    if source.op is not None and source.op in self.group_of:
                        found.add(source.op)
            group.mask = 1 << group.index
            for producer in found:
                pred = self.group_of[producer]
                group.ancestors |= pred.ancestors | pred.mask
                readers.setdefault(pred.index, []).append(group)
        for group in reversed(self.groups):
            for reader in readers.get(group.index, ()):
                group.descendants |= reader.descendants | reader.mask
        #: Ops of one element computed from values of one element, computed once by whatever kernel has them.
        self.scalars = scalar_ops(block, self.sources)
        #: The groups of more than one op (the only ones that add paths op ancestry does not show).
        self.fused: list[Group] = []
        #: Merges found illegal, by the groups' indices and versions.
        self.refused: set[tuple[int, int, int, int]] = set()

    def run(self) -> list[Group]:
        for group in self.groups:
            if group.fusible:
                group.plan = plan_group(group.ops, self.escapes, self.sources)
                if group.plan is None:
                    raise VerifyError(f"the CUDA lowering found no kernel for '{group.ops[0].name}'", group.ops[0])
        for _ in range(32):
            if not self._round():
                break
        return [g for g in self.groups if g.alive and g.fusible]

    def _round(self) -> bool:
        merged = False
        for _, _, a, b in sorted(self._candidates(), key=lambda c: (-c[0], c[1])):
            a, b = self._live(a), self._live(b)
            if a is b:
                continue
            plan = self._legal(a, b)
            if plan is not None:
                self._merge(a, b, plan)
                merged = True
        return merged

    def _live(self, group: Group) -> Group:
        return self.group_of[group.ops[0]]

    def _candidates(self) -> list[tuple[int, int, Group, Group]]:
        found: dict[tuple[int, int], tuple[int, int, Group, Group]] = {}

        def add(a: Group, b: Group, score: int) -> None:
            if a.index > b.index:
                a, b = b, a
            key = (a.index, b.index)
            old = found.get(key)
            position = min(self.position[a.ops[0]], self.position[b.ops[0]])
            found[key] = (score + (old[0] if old else 0), position, a, b)

        readers: dict[Value, list[Group]] = {}
        for group in self.groups:
            if not (group.alive and group.fusible):
                continue
            for op in group.ops:
                for operand in op.operands:
                    for source in view_sources(operand, self.sources):
                        producer = self.group_of.get(source.op) if source.op is not None else None
                        if producer is group:
                            continue
                        if producer is not None and producer.fusible:
                            add(producer, group, source.type.nbytes)
                        elif producer is None or not producer.fusible:
                            readers.setdefault(source, []).append(group)
        for source, groups in readers.items():
            unique = sorted(set(groups), key=lambda g: self.position[g.ops[0]])
            for a, b in zip(unique, unique[1:]):
                add(a, b, source.type.nbytes)
        return list(found.values())

    def _legal(self, a: Group, b: Group) -> GroupPlan | None:
        if self.cap is not None and a.size + b.size > self.cap:
            return None
        key = (a.index, a.version, b.index, b.version)
        if key in self.refused:
            return None
        plan = None
        if not self._creates_cycle(a, b):
            plan = plan_group(sorted([*a.ops, *b.ops], key=self.position.__getitem__), self.escapes, self.sources)
        if plan is not None and any(plan.evaluations(op) > 1 for op in plan.ops if op in self.scalars):
            plan = None
        if plan is None:
            self.refused.add(key)
        return plan

    def _creates_cycle(self, a: Group, b: Group) -> bool:
        """Whether some other group lies on a path from one of `a`, `b` to the other.

        `ancestors` and `descendants` are op-level (as the graph had them), so they show every path
        through ops; a fused group adds paths through its other ops: whatever one of its ops follows
        the pair, all of it does. The pair's followers grown that way must not meet its ancestors.
        """
        combined = a.mask | b.mask
        before = (a.ancestors | b.ancestors) & ~combined
        after = (a.descendants | b.descendants) & ~combined
        while not after & before:
            grown = after
            for group in self.fused:
                if group.alive and group is not a and group is not b and group.mask & after:
                    grown |= group.mask | group.descendants
            grown &= ~combined
            if grown == after:
                return False
            after = grown
        return True

    def _merge(self, a: Group, b: Group, plan: GroupPlan) -> None:
        a.ops = list(plan.ops)
        a.mask |= b.mask
        a.ancestors = (a.ancestors | b.ancestors) & ~a.mask
        a.descendants = (a.descendants | b.descendants) & ~a.mask
        a.plan = plan
        a.version += 1
        b.alive = False
        for op in b.ops:
            self.group_of[op] = a
        if a not in self.fused:
            self.fused.append(a)


def scalar_ops(block: Block, sources: dict[Value, list[Value]]) -> set[Operation]:
    """The block's elementwise ops of one element whose operands all have one element (a learning-rate
    schedule's arithmetic on the step and the knobs, a bias correction's powers).

    Inductor's scheduler fuses nodes of one iteration size: such a value is its own node of one element,
    stored once and read by the large kernels with stride 0, where inlining it would recompute its `cos`
    and `pow` in every thread. It may share a kernel with a reduction that computes it once (a full
    reduction's epilogue). The step stays a device scalar, so a captured graph replays the computation."""
    return {op for op in block.ops
            if is_fusible(op) and not has_trait(op, Trait.REDUCTION) and op.results
            and all(r.type.numel == 1 for r in op.results)
            and all(s.type.numel == 1 for v in op.operands for s in view_sources(v, sources))}


# -- kernels and launches ---------------------------------------------------------------------


def _group_path(ops: Sequence[Operation], path_of: dict[Operation, str]) -> str:
    return next((path_of[op] for op in ops if path_of.get(op)), "")


def _stem(plan: GroupPlan, kind: str) -> str:
    names = []
    for op in plan.ops:
        short = op.name.split(".", 1)[1]
        if short not in names:
            names.append(short)
    return "_".join([kind, *names[:3]])


def _launch_group(plan: GroupPlan, kind: str, kernels: KernelTable, path_of: dict[Operation, str],
                  launched: dict[Value, Value]) -> None:
    """Replace the group's ops by a launch of its (deduplicated) kernel. `launched` maps the outputs
    of groups launched before to the launches' results (plans were made before any launch)."""
    path = _group_path(plan.ops, path_of)
    numbers = plan.input_number()
    maps = [access_attribute(a, numbers) for a in plan.inputs]
    inputs = [a.root.type for a in plan.inputs]
    outputs = [v.type for v in plan.outputs]
    attributes: dict[str, Any] = {"inputs": inputs, "outputs": outputs, "path": path, "domain": list(plan.domain),
                                  "maps": maps, "nodes": len(plan.ops)}
    only = plan.ops[0] if len(plan.ops) == 1 else None
    if only is not None and only.name == "kern.copy" and _plain(plan):
        attributes["kind"] = "copy"
        launch, sizes, _ = kernels.target.plan_template("copy", attributes)
        attributes.update(launch.attributes())
        symbol = kernels.intern(attributes, None, "copy", plan.ops[0].loc)
    else:
        if plan.reduce_axes:
            kind = "reduction"
            attributes["reduce"] = {"axes": list(plan.reduce_axes)}
        attributes["kind"] = kind
        body = build_body(plan)
        index_exprs, accumulators = body_plan_facts(body.blocks[0].ops)
        launch = kernels.target.plan_generated(kind, plan.domain, plan.reduce_axes, maps, inputs, outputs, index_exprs,
                                               kernels.arch, accumulators)
        attributes.update(launch.attributes())
        if launch.split > 1:
            attributes["inputs"] = [*inputs, launch.counters]
            attributes["outputs"] = [*outputs, launch.scratch]
        symbol = kernels.intern(attributes, body, _stem(plan, kind), plan.ops[0].loc)
    members = set(plan.ops)
    operands = [launched.get(a.root, a.root) for a in plan.inputs]
    if attributes.get("split", 1) > 1:
        operands.append(kernels.counters(launch.counters, plan.ops[-1]))
    op = _create("kern.launch", operands, {"kernel": SymbolRef(symbol), "path": path}, plan.ops[-1],
                 attributes["outputs"])
    if len(op.results) > len(plan.outputs):
        op.results[-1].name_hint = "partials"
    for old, new in zip(plan.outputs, op.results):
        new.name_hint = old.name_hint
        launched[old] = new
        for use in list(old.uses):
            if use.op not in members:
                use.op.set_operand(use.index, new)


def _plain(plan: GroupPlan) -> bool:
    """Whether the group is one copy through plain strides (a gathering copy also reads its index input)."""
    if len(plan.inputs) != 1:
        return False
    access = plan.inputs[0]
    return not access.guards and not access.offset.gathers and access.offset.strides() is not None and all(
        s >= 0 for s in access.offset.strides()) and access.offset.const >= 0


def _launch_fill(op: Operation, kernels: KernelTable, path_of: dict[Operation, str]) -> None:
    attributes: dict[str, Any] = {"kind": "fill", "value": op.attributes["value"], "inputs": [],
                                  "outputs": [op.result.type], "path": path_of.get(op, "")}
    launch, _, _ = kernels.target.plan_template("fill", attributes)
    attributes.update(launch.attributes())
    symbol = kernels.intern(attributes, None, f"fill_{op.result.type.dtype}", op.loc)
    new = _create("kern.launch", [], {"kernel": SymbolRef(symbol), "path": attributes["path"]}, op,
                  [op.result.type])
    new.result.name_hint = op.result.name_hint
    op.result.replace_all_uses_with(new.result)
    op.erase()


# -- scheduling -------------------------------------------------------------------------------


def schedule(block: Block) -> None:
    """Reorder the block so every op follows what it reads, keeping the present order where it can
    (a launch sits where its group's last op was; its readers may have been earlier)."""
    ops = list(block.ops)
    position = {op: i for i, op in enumerate(ops)}
    waiting: dict[Operation, int] = {}
    readers: dict[Operation, list[Operation]] = {}
    for op in ops:
        producers = {v.op for v in op.operands if v.op is not None and v.op in position}
        waiting[op] = len(producers)
        for p in producers:
            readers.setdefault(p, []).append(op)
    ready = [(position[op], op) for op in ops if waiting[op] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, op = heapq.heappop(ready)
        order.append(op)
        for reader in readers.get(op, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (position[reader], reader))
    if len(order) != len(ops):
        raise AssertionError("fuse made a cycle")
    for op in order:
        block.detach(op)
    for op in order:
        block.append(op)
