"""What one fused kernel computes: its ops, iteration domain, the maps it reads through, its body.

`fuse` (passes/fuse.py) decides which ops share a kernel; this module says
whether a set of ops can, and how (`plan_group`), and writes the kernel body
(`build_body`). As in PyTorch Inductor, a view is never computed: a kernel
reads a broadcast, a transpose, a slice, a reshape, a pad or a gather of a
buffer through an index expression of its domain index
(`dialects/index_maps.py`), and a value computed inside the kernel is
computed at whatever index its readers need it.

A plan exists when:
- the reductions in the set (if any) reduce operands of one shape over the
  same axes; that shape is the domain, and every value that depends on a
  reduction is read only at kept indices (the epilogue);
- otherwise every output has one element count and some output's (or
  value's) shape is a domain over which each output is stored row-major;
- every value computed inside is read at one index per domain index (no
  value is needed at two places by one thread), a pad's or concat piece's
  operand and a gather's index are buffers (read outside the group), and
  every view between a reader and what it reads is expressible as an
  index map.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from attrs import define, field, frozen

from ..dialects.core import Block, Builder, Operation, Region, TensorType, Value
from ..dialects.graph import op_axis, pad_widths, reduction_axes, slice_bounds, transpose_perm
from ..dialects.index_maps import Expr, reshape_index, storage_offset
from ..dialects.traits import Trait, has_trait

#: Views a kernel reads through instead of computing (pads and gathers too: they are index maps).
INDEX_VIEWS = frozenset({"graph.reshape", "graph.transpose", "graph.broadcast", "graph.slice", "graph.squeeze",
                         "graph.expand_dims", "graph.pad", "graph.take", "graph.take_along"})
#: Views that cost nothing on a contiguous buffer: the reshaped value is the same bytes.
FREE_VIEWS = frozenset({"graph.reshape", "graph.squeeze", "graph.expand_dims"})
#: Ops computed inside fused kernels besides the elementwise and reduction ops.
INDEX_COMPUTE_OPS = frozenset({"graph.iota", "graph.one_hot", "graph.concat", "graph.scatter_add_along", "kern.copy"})
#: A scatter-add-along is fused as one select per index along its axis, up to this many.
MAX_SCATTER_ALONG = 16
_REDUCE_OPS = {"graph.sum": "sum", "graph.max": "max", "graph.min": "min"}


def is_fusible(op: Operation) -> bool:
    """Whether `op` is computed inside fused kernels (elementwise, reductions, index computations)."""
    if op.name in INDEX_COMPUTE_OPS:
        return op.name != "graph.scatter_add_along" or op.operands[0].type.shape[op_axis(op)] <= MAX_SCATTER_ALONG
    return op.name.startswith("graph.") and (has_trait(op, Trait.ELEMENTWISE) or has_trait(op, Trait.REDUCTION))


def splat_value(value: Value) -> Any:
    """The scalar of a splat `graph.const` (a number or bool), else None."""
    op = value.op
    if op is None or op.name != "graph.const" or isinstance(op.attributes.get("value"), list):
        return None
    return op.attributes["value"]


def free_view_root(value: Value) -> Value:
    """What `value` is a free view of: follow reshapes, squeezes and expand_dims down to a non-view."""
    while value.op is not None and value.op.name in FREE_VIEWS:
        value = value.op.operands[0]
    return value


def view_sources(value: Value, cache: dict[Value, list[Value]] | None = None) -> list[Value]:
    """The non-view values a read of `value` reaches through views (a gather's indices too);
    `cache` keeps the answers of a graph that does not change meanwhile."""
    if cache is not None:
        found = cache.get(value)
        if found is None:
            found = cache[value] = view_sources(value)
        return found
    found = []
    stack = [value]
    while stack:
        v = stack.pop()
        op = v.op
        if op is not None and op.name in INDEX_VIEWS:
            stack.extend(op.operands)
        else:
            found.append(v)
    return found


@frozen
class Access:
    """A read of a buffer: `root`'s element at `offset` in its row-major storage, or `fill` where a
    guard `(expr, size)` fails (`0 <= expr < size` must hold for the element to exist)."""

    root: Value
    offset: Expr
    guards: tuple[tuple[Expr, int], ...] = ()
    fill: float | None = None


@frozen
class Literal:
    """A splat constant read inside the body."""

    value: Any
    dtype: str


Source = Value | Access | Literal


@define
class GroupPlan:
    """A kernel for `ops`: its domain, reduced axes, outputs, inputs and how each operand is read."""

    ops: list[Operation]
    domain: tuple[int, ...]
    reduce_axes: tuple[int, ...]
    outputs: list[Value]
    inputs: list[Access] = field(factory=list)
    #: (op, operand slot) -> where the body reads it; scatter_add_along slots are (operand, j).
    sources: dict[tuple[Operation, Any], Source] = field(factory=dict)
    #: The domain-index expression an iota, one_hot, concat or scatter_add_along needs.
    index_exprs: dict[Operation, Expr] = field(factory=dict)
    #: The ops that read a reduction's result: computed once per kept element, not per domain element.
    epilogue: set[Operation] = field(factory=set)

    def input_number(self) -> dict[Access, int]:
        return {a: i for i, a in enumerate(self.inputs)}

    def evaluations(self, op: Operation) -> int:
        """How many times one launch computes `op`: once per kept element in the epilogue, else once per
        element of the domain."""
        reduced = math.prod(self.domain[a] for a in self.reduce_axes)
        return math.prod(self.domain) // reduced if op in self.epilogue else math.prod(self.domain)


def _kept_index(sizes: Sequence[int], axes: Sequence[int], keep: bool) -> tuple[Expr, ...]:
    return tuple(Expr.axis(sizes, d) if d not in axes else Expr.constant(sizes, 0)
                 for d in range(len(sizes)) if keep or d not in axes)


class _Propagation:
    """Required indices of the group's values, derived from outputs to inputs (consumers first)."""

    def __init__(self, ops: list[Operation], members: set[Operation], domain: tuple[int, ...],
                 reduce_axes: tuple[int, ...], epilogue: set[Operation]) -> None:
        self.ops = ops
        self.members = members
        self.sizes = domain
        self.reduce_axes = set(reduce_axes)
        self.epilogue = epilogue
        self.required: dict[Value, tuple[Expr, ...]] = {}
        self.sources: dict[tuple[Operation, Any], Source] = {}
        self.index_exprs: dict[Operation, Expr] = {}

    def require(self, value: Value, index: Sequence[Expr]) -> bool:
        index = tuple(index)
        old = self.required.setdefault(value, index)
        return old == index

    def identity(self) -> list[Expr]:
        return [Expr.axis(self.sizes, d) for d in range(len(self.sizes))]

    def run(self, outputs: dict[Value, tuple[Expr, ...]]) -> bool:
        for value, index in outputs.items():
            if not self.require(value, index):
                return False
        for op in reversed(self.ops):
            index = self.required.get(op.result)
            if index is None or not self._operands(op, list(index)):
                return False
        return True

    def _touches_reduced(self, exprs: Iterable[Expr]) -> bool:
        return any(e.axes() & self.reduce_axes or any(_gather_touches(g, self.reduce_axes) for g in e.gathers)
                   for e in exprs)

    def _operands(self, op: Operation, index: list[Expr]) -> bool:
        if op in self.epilogue and self._touches_reduced(index):
            return False
        name = op.name
        if name in _REDUCE_OPS:
            axes = reduction_axes(op)
            if tuple(index) != _kept_index(self.sizes, axes, op.attributes["keep"]):
                return False
            return self._read(op, 0, op.operands[0], self.identity())
        if name == "graph.iota":
            expr = index[op_axis(op)]
            self.index_exprs[op] = expr
            return not expr.gathers
        if name == "graph.one_hot":
            self.index_exprs[op] = index[-1]
            return not index[-1].gathers and self._read(op, 0, op.operands[0], index[:-1])
        if name == "graph.concat":
            axis = op_axis(op)
            self.index_exprs[op] = index[axis]
            start = 0
            for k, piece in enumerate(op.operands):
                size = piece.type.shape[axis]
                shifted = index[axis] + (-start)
                piece_index = [*index[:axis], shifted, *index[axis + 1:]]
                if not self._read(op, k, piece, piece_index, ((shifted, size),), 0.0, external=True):
                    return False
                start += size
            return True
        if name == "graph.scatter_add_along":
            axis = op_axis(op)
            self.index_exprs[op] = index[axis]
            idx, upd = op.operands
            count = idx.type.shape[axis]
            for j in range(count):
                at = [*index[:axis], Expr.constant(self.sizes, j), *index[axis + 1:]]
                if not (self._read(op, (0, j), idx, at, external=count > 1)
                        and self._read(op, (1, j), upd, at, external=count > 1)):
                    return False
            return True
        return all(self._read(op, k, v, index) for k, v in enumerate(op.operands))

    def _read(self, op: Operation, slot: Any, value: Value, index: list[Expr],
              guards: tuple[tuple[Expr, int], ...] = (), fill: float | None = None, external: bool = False) -> bool:
        if op in self.epilogue and self._touches_reduced(index):
            return False
        scalar = splat_value(value)
        source = Literal(scalar, value.type.dtype) if scalar is not None else self.reach(value, index, guards, fill)
        if source is None or (external and not isinstance(source, (Access, Literal))):
            return False
        self.sources[(op, slot)] = source
        return True

    def reach(self, value: Value, index: list[Expr], guards: tuple[tuple[Expr, int], ...] = (),
              fill: float | None = None) -> Source | None:
        """Where reading `value` at `index` leads: a value of the group, a splat, or a buffer access."""
        while True:
            op = value.op
            if op is not None and op in self.members:
                return value if not guards and self.require(value, index) else None
            scalar = splat_value(value)
            if scalar is not None:
                return Literal(scalar, value.type.dtype) if not guards else None
            if op is None or op.name not in INDEX_VIEWS:
                return self._access(value, storage_offset(value.type.shape, index, self.sizes), guards, fill)
            if op.name in FREE_VIEWS and self._is_buffer(root := free_view_root(value)):
                # Free views of a buffer are its bytes in row-major order: no per-axis index needed.
                return self._access(root, storage_offset(value.type.shape, index, self.sizes), guards, fill)
            moved = self._through_view(op, index, guards, fill)
            if moved is None:
                return None
            value, index, guards, fill = moved

    def _is_buffer(self, value: Value) -> bool:
        op = value.op
        return op is None or (op not in self.members and op.name not in INDEX_VIEWS and splat_value(value) is None)

    def _access(self, root: Value, offset: Expr, guards: tuple[tuple[Expr, int], ...],
                fill: float | None) -> Access | None:
        if any(g.gathers for g, _ in guards):
            return None
        return Access(root, offset, guards, fill)

    def _through_view(self, op: Operation, index: list[Expr], guards: tuple[tuple[Expr, int], ...],
                      fill: float | None) -> tuple[Value, list[Expr], tuple[tuple[Expr, int], ...], float | None] | None:
        """The operand of view `op` and the index into it of the element at `index` of its result."""
        source = op.operands[0]
        shape = source.type.shape
        name = op.name
        zero = Expr.constant(self.sizes, 0)
        if name in ("graph.reshape", "graph.squeeze", "graph.expand_dims"):
            moved = reshape_index(shape, op.result.type.shape, index)
            return None if moved is None else (source, moved, guards, fill)
        if name == "graph.transpose":
            perm = transpose_perm(op)
            moved_index = [zero] * len(shape)
            for i, p in enumerate(perm):
                moved_index[p] = index[i]
            return source, moved_index, guards, fill
        if name == "graph.broadcast":
            offset = len(index) - len(shape)
            return source, [zero if n == 1 else index[offset + k] for k, n in enumerate(shape)], guards, fill
        if name == "graph.slice":
            axis, start, _ = slice_bounds(op)
            return source, [*index[:axis], index[axis] + start, *index[axis + 1:]], guards, fill
        if name == "graph.pad":
            axis, before, _ = pad_widths(op)
            if fill is not None and fill != 0.0:
                return None
            shifted = index[axis] + (-before)
            return source, [*index[:axis], shifted, *index[axis + 1:]], (*guards, (shifted, shape[axis])), 0.0
        if name == "graph.take":
            axis = op_axis(op)
            rank = op.operands[1].type.rank
            gathered = self._gather(op.operands[1], index[axis:axis + rank], shape[axis])
            if gathered is None:
                return None
            return source, [*index[:axis], gathered, *index[axis + rank:]], guards, fill
        if name == "graph.take_along":
            axis = op_axis(op)
            gathered = self._gather(op.operands[1], index, shape[axis])
            if gathered is None:
                return None
            return source, [*index[:axis], gathered, *index[axis + 1:]], guards, fill
        raise AssertionError(name)

    def _gather(self, indices: Value, index: list[Expr], dim: int) -> Expr | None:
        source = self.reach(indices, index)
        if not isinstance(source, Access) or source.guards:
            return None
        return Expr.gathered(self.sizes, source, dim)


def _gather_touches(gather: Any, axes: set[int]) -> bool:
    access = gather.source
    return bool(access.offset.axes() & axes)


def _outputs(ops: Sequence[Operation], members: set[Operation], escapes: set[Value]) -> list[Value]:
    """The group's values read outside it (through views too) or escaping the graph, in block order."""
    outputs = []
    for op in ops:
        for r in op.results:
            if r in escapes or _read_outside(r, members):
                outputs.append(r)
    return outputs


def _read_outside(value: Value, members: set[Operation]) -> bool:
    for user in value.users():
        if user in members:
            continue
        if user.name in INDEX_VIEWS and user.operands[0] is value:
            if _read_outside(user.result, members):
                return True
            continue
        if user.name in ("graph.take", "graph.take_along") and user.operands[1] is value:
            if _read_outside(user.result, members):
                return True
            continue
        return True
    return False


def _epilogue(ops: Sequence[Operation], members: set[Operation], sources: dict[Value, list[Value]] | None
              ) -> set[Operation]:
    """The group's ops that read a reduction's result (directly or through other such ops)."""
    after: set[Operation] = set()
    for op in ops:
        for operand in op.operands:
            for source in view_sources(operand, sources):
                producer = source.op
                if producer in members and (producer.name in _REDUCE_OPS or producer in after):
                    after.add(op)
    return after


def plan_group(ops: Sequence[Operation], escapes: set[Value],
               sources: dict[Value, list[Value]] | None = None) -> GroupPlan | None:
    """A kernel computing `ops` (in block order), or None when they cannot share one.

    `escapes`: values the graph returns or emits (always outputs); `sources` a cache of
    `view_sources` for the graph.
    """
    ops = list(ops)
    members = set(ops)
    outputs = _outputs(ops, members, escapes)
    reductions = [op for op in ops if op.name in _REDUCE_OPS]
    epilogue = _epilogue(ops, members, sources) if reductions else set()
    if reductions:
        first = reductions[0]
        domain = first.operands[0].type.shape
        axes = tuple(reduction_axes(first))
        if any(r.operands[0].type.shape != domain or tuple(reduction_axes(r)) != axes or r in epilogue
               for r in reductions):
            return None
        return _plan_in(ops, members, tuple(domain), axes, outputs, epilogue)
    counts = {o.type.numel for o in outputs}
    if len(counts) != 1:
        return None
    count = counts.pop()
    candidates: list[tuple[int, ...]] = []
    for value in [*outputs, *(r for op in ops for r in op.results)]:
        shape = tuple(value.type.shape)
        if value.type.numel == count and shape not in candidates:
            candidates.append(shape)
    candidates.sort(key=len, reverse=True)
    for domain in candidates:
        plan = _plan_in(ops, members, domain, (), outputs, epilogue)
        if plan is not None:
            return plan
    return None


def _plan_in(ops: list[Operation], members: set[Operation], domain: tuple[int, ...], axes: tuple[int, ...],
             outputs: list[Value], epilogue: set[Operation]) -> GroupPlan | None:
    kept = [d for d in range(len(domain)) if d not in axes]
    kept_shape = [domain[d] for d in kept]
    full_index = [Expr.axis(domain, d) for d in range(len(domain))]
    kept_index = [Expr.axis(domain, d) for d in kept]
    required: dict[Value, tuple[Expr, ...]] = {}
    for out in outputs:
        after = out.op in epilogue or out.op.name in _REDUCE_OPS
        shape, index = (kept_shape, kept_index) if after else (list(domain), full_index)
        if out.type.numel != math.prod(shape):
            return None
        moved = reshape_index(out.type.shape, shape, index)
        if moved is None:
            return None
        required[out] = tuple(moved)
    propagation = _Propagation(ops, members, domain, axes, epilogue)
    if not propagation.run(required):
        return None
    plan = GroupPlan(ops, domain, axes, outputs, sources=propagation.sources, index_exprs=propagation.index_exprs,
                     epilogue=epilogue)
    by_op: dict[Operation, list[Source]] = {}
    for (owner, _), source in propagation.sources.items():
        by_op.setdefault(owner, []).append(source)
    numbered: dict[Access, None] = {}
    for op in ops:  # inputs numbered in the order the body reads them
        for source in by_op.get(op, []):
            if isinstance(source, Access):
                _number(source, numbered)
    plan.inputs = list(numbered)
    return plan


def _number(access: Access, numbered: dict[Access, None]) -> None:
    for g in access.offset.gathers:
        _number(g.source, numbered)
    numbered.setdefault(access, None)


def access_attribute(access: Access, numbers: dict[Access, int]) -> dict[str, Any]:
    """An input's map in attribute form (`kern.kernel {maps}`)."""
    attribute = access.offset.attribute(numbers)
    if access.guards:
        attribute["guards"] = [[e.attribute(numbers), size] for e, size in access.guards]
        attribute["fill"] = access.fill
    return attribute


def build_body(plan: GroupPlan) -> Region:
    """The kernel body: one block argument per input element, the group's ops on scalars, a yield."""
    region = Region.with_block()
    block: Block = region.blocks[0]
    args = {access: block.add_arg(TensorType((), access.root.type.dtype)) for access in plan.inputs}
    b = Builder(block)
    env: dict[Value, Value] = {}
    literals: dict[tuple[Any, str], Value] = {}

    def read(op: Operation, slot: Any) -> Value:
        source = plan.sources[(op, slot)]
        if isinstance(source, Access):
            return args[source]
        if isinstance(source, Literal):
            key = (source.value, source.dtype)
            if key not in literals:
                literals[key] = b.create("graph.const", (), {"value": source.value},
                                         [TensorType((), source.dtype)]).result
            return literals[key]
        return env[source]

    def literal(value: Any, dtype: str) -> Value:
        key = (value, dtype)
        if key not in literals:
            literals[key] = b.create("graph.const", (), {"value": value}, [TensorType((), dtype)]).result
        return literals[key]

    positions: dict[tuple[Expr, str], Value] = {}

    def index(op: Operation, dtype: str) -> Value:
        key = (plan.index_exprs[op], dtype)
        if key not in positions:
            position = b.create("kern.index", (), {"expr": plan.index_exprs[op].attribute()}).result
            positions[key] = position if dtype == "i32" else b.value("graph.cast", position, dtype=dtype)
        return positions[key]

    for op in plan.ops:
        scalar = TensorType((), op.result.type.dtype)
        attributes = {k: v for k, v in op.attributes.items() if k != "path"}
        name = op.name
        if name in _REDUCE_OPS:
            result = b.create("kern.reduce", [read(op, 0)], {"op": _REDUCE_OPS[name]}).result
        elif name == "kern.copy":
            result = read(op, 0)
        elif name == "graph.iota":
            result = index(op, scalar.dtype)
        elif name == "graph.one_hot":
            idx = read(op, 0)
            hit = b.value("graph.eq", idx, index(op, idx.type.dtype))
            result = b.value("graph.cast", hit, dtype=scalar.dtype)
        elif name == "graph.concat":
            position = index(op, "i32")
            bounds = []
            start = 0
            for piece in op.operands[:-1]:
                start += piece.type.shape[op_axis(op)]
                bounds.append(start)
            result = read(op, len(op.operands) - 1)
            for k in reversed(range(len(bounds))):
                below = b.value("graph.lt", position, literal(bounds[k], "i32"))
                result = b.value("graph.where", below, read(op, k), result)
        elif name == "graph.scatter_add_along":
            idx_type = op.operands[0].type.dtype
            position = index(op, idx_type)
            zero = literal(0.0, scalar.dtype)
            result = zero
            for j in range(op.operands[0].type.shape[op_axis(op)]):
                hit = b.value("graph.eq", read(op, (0, j)), position)
                result = b.value("graph.add", result, b.value("graph.where", hit, read(op, (1, j)), zero))
        else:
            operands = [read(op, k) for k in range(len(op.operands))]
            result = b.create(name, operands, attributes, [scalar]).result
        env[op.result] = result
    b.create("kern.yield", [env[v] for v in plan.outputs])
    return region
