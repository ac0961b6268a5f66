"""The `graph` dialect: statically shaped tensor ops by family.

Families: input, const, unary, binary, compare, select, reduce, shape,
contract, index, cast, emit (plus the structural `graph.func` and
`graph.return`). An op's family and its other traits are its row in the
traits table (`dialects/traits.py`); `graph_op` registers an op with them.
Binary, compare and select ops take operands of one shape: broadcasting is
always an explicit `graph.broadcast`. Every op infers its result type from
its operands and attributes, and its verifier rejects bad shapes with both
shapes in the message. The typed accessors at the end read the attributes
passes read (`transpose_perm(op)` rather than `op.attributes["perm"]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from attrs import frozen

from .core import (
    DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    REGISTRY,
    OpDef,
    Operation,
    TensorType,
    Value,
    VerifyError,
    register_op,
)
from .traits import OP_TRAITS, Trait, has_trait, kind_of, ops_with


class ShapeError(VerifyError):
    """Operand shapes or dtypes an op cannot take; the message names both."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def show_shape(shape: Sequence[int]) -> str:
    """A shape as messages and reports write it: `[4, 128, 50304]` (the explain page's spelling)."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes: Any, rank: int) -> list[int]:
    if axes is None:
        return list(range(rank))
    if isinstance(axes, int):
        axes = [axes]
    out = sorted({normalize_axis(a, rank) for a in axes})
    return out


def broadcast_shapes(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """numpy's broadcasting of two shapes; a ShapeError naming both when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and da != 1 and db != 1:
            raise ShapeError(f"shapes {show_shape(a)} and {show_shape(b)} do not broadcast")
        out.append(max(da, db) if da != 0 and db != 0 else 0)
    return tuple(reversed(out))


def _same_shape(name: str, operands: Sequence[TensorType]) -> None:
    first = operands[0]
    for t in operands[1:]:
        if t.shape != first.shape:
            raise ShapeError(f"'{name}' operands have shapes {show_shape(first.shape)} and {show_shape(t.shape)}")


def _same_dtype(name: str, operands: Sequence[TensorType]) -> None:
    first = operands[0]
    for t in operands[1:]:
        if t.dtype != first.dtype:
            raise ShapeError(f"'{name}' operands have dtypes {first.dtype} and {t.dtype}")


def graph_op(opdef: type[OpDef]) -> type[OpDef]:
    """Register a graph op kind with the family and purity of its row in the traits table."""
    if opdef.name not in OP_TRAITS:
        raise ValueError(f"op {opdef.name} has no row in the traits table (dialects/traits.py)")
    opdef.family = kind_of(opdef.name).value
    opdef.pure = Trait.PURE in OP_TRAITS[opdef.name]
    return register_op(opdef)


def _graph_ops(base: type[OpDef], kind: Trait, prefix: str = "") -> None:
    """One op kind on `base` (its verifier) for each op the traits table gives `kind`."""
    for name in sorted(ops_with(kind)):
        short = name.removeprefix("graph.").capitalize()
        graph_op(type(f"{prefix}{short}Op", (base,), {"name": name}))


# -- structure ---------------------------------------------------------------------------------


@graph_op
class FuncOp(OpDef):
    """`graph.func @name { ... }`: one graph; its block ends with `graph.return`."""

    name = "graph.func"
    num_operands = 0
    num_results = 0
    num_regions = 1
    required_attrs = ("sym_name",)

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        region = op.regions[0]
        if len(region.blocks) != 1:
            raise VerifyError("'graph.func' must have exactly one block", op)
        last = region.blocks[0].last_op
        if last is None or last.name != "graph.return":
            raise VerifyError("'graph.func' body must end with 'graph.return'", op)
        defined: set[int] = {id(arg) for arg in region.blocks[0].args}
        for inner in region.blocks[0].ops:
            for v in inner.operands:
                if id(v) not in defined:
                    raise VerifyError(f"'{inner.name}' uses a value before it is defined", inner)
            defined.update(map(id, inner.results))


@graph_op
class ReturnOp(OpDef):
    """`graph.return %a, %b {names = [...]}`: the graph's named outputs."""

    name = "graph.return"
    num_results = 0
    required_attrs = ("names",)
    is_terminator = True

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        names = op.attributes["names"]
        if len(names) != len(op.operands):
            raise VerifyError(f"'graph.return' has {len(op.operands)} operands but {len(names)} names", op)


def graph_funcs(module: Operation) -> list[Operation]:
    """The `graph.func` ops at the top of a module."""
    return [op for op in module.body.ops if op.name == "graph.func"]


# -- input, const ------------------------------------------------------------------------------

INPUT_ROLES = ("param", "batch", "grad", "state", "step", "value", "working_copy")


@graph_op
class InputOp(OpDef):
    """`graph.input {name, role}`: a graph argument (a parameter, a batch field, a gradient, ...)."""

    name = "graph.input"
    num_operands = 0
    required_attrs = ("name", "role")

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        if op.attributes["role"] not in INPUT_ROLES:
            raise VerifyError(f"'graph.input' role must be one of {', '.join(INPUT_ROLES)}", op)


@graph_op
class ConstOp(OpDef):
    """`graph.const {value = 0.5}`: a splat constant of the result type (or a nested list)."""

    name = "graph.const"
    num_operands = 0
    required_attrs = ("value",)

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        value = op.attributes["value"]
        if isinstance(value, list):
            shape = []
            v: Any = value
            while isinstance(v, list):
                shape.append(len(v))
                v = v[0] if v else None
            if tuple(shape) != op.results[0].type.shape:
                raise VerifyError(
                    f"'graph.const' value of shape {show_shape(shape)} does not fit {op.results[0].type}", op
                )
        elif not isinstance(value, (int, float, bool)):
            raise VerifyError("'graph.const' value must be a number or a nested list of numbers", op)


# -- elementwise -------------------------------------------------------------------------------


class _Unary(OpDef):
    num_operands = 1

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        if x.dtype not in FLOAT_DTYPES and has_trait(cls.name, Trait.FLOAT_ONLY):
            raise ShapeError(f"'{cls.name}' needs a float operand, got {x.dtype}")
        return [x]


_graph_ops(_Unary, Trait.UNARY)


class _Binary(OpDef):
    num_operands = 2

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        _same_shape(cls.name, operands)
        _same_dtype(cls.name, operands)
        return [operands[0]]


_graph_ops(_Binary, Trait.BINARY)


class _Compare(OpDef):
    num_operands = 2

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        _same_shape(cls.name, operands)
        _same_dtype(cls.name, operands)
        return [operands[0].with_dtype("i1")]


_graph_ops(_Compare, Trait.COMPARE)


@graph_op
class WhereOp(OpDef):
    """`graph.where %cond, %a, %b`: `a` where `cond` holds, else `b`."""

    name = "graph.where"
    num_operands = 3

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        c, a, b = operands
        if c.dtype != "i1":
            raise ShapeError(f"'graph.where' condition must be i1, got {c.dtype}")
        _same_shape(cls.name, operands)
        _same_dtype(cls.name, [a, b])
        return [a]


# -- reduce ------------------------------------------------------------------------------------


class _Reduce(OpDef):
    """Reduce along `axes` (sorted, non-negative); `keep` keeps them as size 1."""

    num_operands = 1
    required_attrs = ("axes", "keep")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        axes = attrs["axes"]
        if list(axes) != normalize_axes(axes, x.rank):
            raise ShapeError(f"'{cls.name}' axes {list(axes)} must be sorted, unique and in 0..{x.rank - 1}")
        if attrs["keep"]:
            shape = [1 if i in axes else d for i, d in enumerate(x.shape)]
        else:
            shape = [d for i, d in enumerate(x.shape) if i not in axes]
        return [x.with_shape(shape)]


_graph_ops(_Reduce, Trait.REDUCTION, prefix="Reduce")


# -- shape -------------------------------------------------------------------------------------


@graph_op
class ReshapeOp(OpDef):
    name = "graph.reshape"
    num_operands = 1
    required_attrs = ("shape",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        shape = list(attrs["shape"])
        target = TensorType(shape, x.dtype)
        if any(d < 0 for d in shape) or target.numel != x.numel:
            raise ShapeError(f"cannot reshape {show_shape(x.shape)} to {show_shape(shape)}")
        return [target]


@graph_op
class TransposeOp(OpDef):
    """Permute axes: result axis i is operand axis `perm[i]`."""

    name = "graph.transpose"
    num_operands = 1
    required_attrs = ("perm",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        perm = list(attrs["perm"])
        if sorted(perm) != list(range(x.rank)):
            raise ShapeError(f"{perm} is not a permutation of the axes of {show_shape(x.shape)}")
        return [x.with_shape([x.shape[p] for p in perm])]


@graph_op
class BroadcastOp(OpDef):
    """numpy broadcasting of the operand to `shape` (dimensions aligned from the right)."""

    name = "graph.broadcast"
    num_operands = 1
    required_attrs = ("shape",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        shape = tuple(attrs["shape"])
        if len(shape) < x.rank or broadcast_shapes(x.shape, shape) != shape:
            raise ShapeError(f"cannot broadcast {show_shape(x.shape)} to {show_shape(shape)}")
        return [x.with_shape(shape)]


@graph_op
class SliceOp(OpDef):
    """Elements `start` to `end` (exclusive) along `axis`."""

    name = "graph.slice"
    num_operands = 1
    required_attrs = ("axis", "start", "end")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        axis = attrs["axis"]
        if not 0 <= axis < x.rank:
            raise ShapeError(f"slice axis {axis} is out of range for {show_shape(x.shape)}")
        start, end = attrs["start"], attrs["end"]
        if not 0 <= start <= end <= x.shape[axis]:
            raise ShapeError(f"slice {start}:{end} of axis {axis} is out of range for {show_shape(x.shape)}")
        shape = list(x.shape)
        shape[axis] = end - start
        return [x.with_shape(shape)]


@graph_op
class PadOp(OpDef):
    """Zeros before and after the operand along `axis` (the adjoint of slice)."""

    name = "graph.pad"
    num_operands = 1
    required_attrs = ("axis", "before", "after")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        axis = attrs["axis"]
        if not 0 <= axis < x.rank or attrs["before"] < 0 or attrs["after"] < 0:
            raise ShapeError(f"bad pad of axis {axis} for {show_shape(x.shape)}")
        shape = list(x.shape)
        shape[axis] += attrs["before"] + attrs["after"]
        return [x.with_shape(shape)]


@graph_op
class ConcatOp(OpDef):
    name = "graph.concat"
    num_operands = None
    required_attrs = ("axis",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        if not operands:
            raise ShapeError("'graph.concat' needs at least one operand")
        axis = attrs["axis"]
        first = operands[0]
        if not 0 <= axis < first.rank:
            raise ShapeError(f"concat axis {axis} is out of range for {show_shape(first.shape)}")
        _same_dtype(cls.name, operands)
        total = 0
        for t in operands:
            if t.rank != first.rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis):
                raise ShapeError(f"cannot concat {show_shape(first.shape)} and {show_shape(t.shape)} along axis {axis}")
            total += t.shape[axis]
        shape = list(first.shape)
        shape[axis] = total
        return [first.with_shape(shape)]


@graph_op
class SqueezeOp(OpDef):
    name = "graph.squeeze"
    num_operands = 1
    required_attrs = ("axis",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        axis = attrs["axis"]
        if not 0 <= axis < x.rank or x.shape[axis] != 1:
            raise ShapeError(f"cannot squeeze axis {axis} of {show_shape(x.shape)}")
        return [x.with_shape(x.shape[:axis] + x.shape[axis + 1 :])]


@graph_op
class ExpandDimsOp(OpDef):
    name = "graph.expand_dims"
    num_operands = 1
    required_attrs = ("axis",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        axis = attrs["axis"]
        if not 0 <= axis <= x.rank:
            raise ShapeError(f"cannot insert axis {axis} into {show_shape(x.shape)}")
        return [x.with_shape(x.shape[:axis] + (1,) + x.shape[axis:])]


# -- contract ----------------------------------------------------------------------------------


@graph_op
class MatmulOp(OpDef):
    """numpy matmul of rank ≥ 2 operands; batch dimensions broadcast."""

    name = "graph.matmul"
    num_operands = 2

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        a, b = operands
        _same_dtype(cls.name, operands)
        if a.rank < 2 or b.rank < 2:
            raise ShapeError(f"matmul needs rank ≥ 2 operands, got {show_shape(a.shape)} and {show_shape(b.shape)}")
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"matmul shapes {show_shape(a.shape)} and {show_shape(b.shape)} do not contract")
        try:
            batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ShapeError:
            raise ShapeError(
                f"matmul batch dimensions of {show_shape(a.shape)} and {show_shape(b.shape)} do not broadcast"
            ) from None
        return [a.with_shape(batch + (a.shape[-2], b.shape[-1]))]


# -- index -------------------------------------------------------------------------------------


def _int_index(name: str, idx: TensorType) -> None:
    if idx.dtype not in INT_DTYPES:
        raise ShapeError(f"'{name}' indices must be i32 or i64, got {idx.dtype}")


@graph_op
class TakeOp(OpDef):
    """Gather whole slices of `x` along `axis` at `idx`: shape x[:axis] + idx + x[axis+1:]."""

    name = "graph.take"
    num_operands = 2
    required_attrs = ("axis",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        x, idx = operands
        _int_index(cls.name, idx)
        axis = attrs["axis"]
        if not 0 <= axis < x.rank:
            raise ShapeError(f"take axis {axis} is out of range for {show_shape(x.shape)}")
        return [x.with_shape(x.shape[:axis] + idx.shape + x.shape[axis + 1 :])]


@graph_op
class TakeAlongOp(OpDef):
    """numpy take_along_axis: idx has x's rank; the result has idx's shape."""

    name = "graph.take_along"
    num_operands = 2
    required_attrs = ("axis",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        x, idx = operands
        _int_index(cls.name, idx)
        axis = attrs["axis"]
        if idx.rank != x.rank or not 0 <= axis < x.rank:
            raise ShapeError(f"take-along of {show_shape(x.shape)} by {show_shape(idx.shape)} on axis {axis}")
        for i, (dx, di) in enumerate(zip(x.shape, idx.shape)):
            if i != axis and dx != di:
                raise ShapeError(f"take-along of {show_shape(x.shape)} by {show_shape(idx.shape)} on axis {axis}")
        return [x.with_shape(idx.shape)]


@graph_op
class ScatterAddOp(OpDef):
    """The adjoint of take: zeros of size `dim` on `axis`, `updates` slices added at `idx`."""

    name = "graph.scatter_add"
    num_operands = 2
    required_attrs = ("axis", "dim")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        idx, upd = operands
        _int_index(cls.name, idx)
        axis = attrs["axis"]
        if upd.shape[axis : axis + idx.rank] != idx.shape:
            raise ShapeError(f"scatter-add updates {show_shape(upd.shape)} do not fit indices {show_shape(idx.shape)}")
        return [upd.with_shape(upd.shape[:axis] + (attrs["dim"],) + upd.shape[axis + idx.rank :])]


@graph_op
class ScatterAddAlongOp(OpDef):
    """The adjoint of take-along: zeros of size `dim` on `axis`, `updates` added at `idx`."""

    name = "graph.scatter_add_along"
    num_operands = 2
    required_attrs = ("axis", "dim")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        idx, upd = operands
        _int_index(cls.name, idx)
        if idx.shape != upd.shape:
            raise ShapeError(f"scatter-add-along indices {show_shape(idx.shape)} and updates {show_shape(upd.shape)}")
        shape = list(upd.shape)
        shape[attrs["axis"]] = attrs["dim"]
        return [upd.with_shape(shape)]


@graph_op
class OneHotOp(OpDef):
    name = "graph.one_hot"
    num_operands = 1
    required_attrs = ("n",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (idx,) = operands
        _int_index(cls.name, idx)
        return [TensorType(idx.shape + (attrs["n"],), "f32")]


@graph_op
class IotaOp(OpDef):
    """0, 1, 2, ... along `axis` of a tensor of `shape` (i32)."""

    name = "graph.iota"
    num_operands = 0
    required_attrs = ("shape", "axis")

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        shape = tuple(attrs["shape"])
        if not 0 <= attrs["axis"] < len(shape):
            raise ShapeError(f"iota axis {attrs['axis']} is out of range for {show_shape(shape)}")
        return [TensorType(shape, "i32")]


# -- cast, emit --------------------------------------------------------------------------------


@graph_op
class CastOp(OpDef):
    name = "graph.cast"
    num_operands = 1
    required_attrs = ("dtype",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (x,) = operands
        if attrs["dtype"] not in DTYPES:
            raise ShapeError(f"unknown dtype {attrs['dtype']}")
        return [x.with_dtype(attrs["dtype"])]


class _Emit(OpDef):
    """An emit records a value under `name` when the graph runs; it is never erased."""

    num_operands = 1
    num_results = 0
    required_attrs = ("name",)
    #: Where a run reports the values of this emit, by name (a call's `metrics`, ...).
    collection: ClassVar[str]
    #: The generic checks (one operand of any type, no result, a `name`) are the whole verifier.
    generic_verify_suffices: ClassVar[bool] = True


@graph_op
class MetricOp(_Emit):
    name = "graph.metric"
    collection = "metrics"

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        if op.operands[0].type.rank != 0:
            raise VerifyError(f"metric {op.attributes['name']} must be a scalar, got {op.operands[0].type}", op)


@graph_op
class CounterOp(_Emit):
    name = "graph.counter"
    collection = "counters"


@graph_op
class ObserveOp(_Emit):
    name = "graph.observe"
    collection = "observed"



# -- typed accessors ---------------------------------------------------------------------------
#
# What passes read off an op, by name and type instead of `op.attributes["..."]` string keys.


def func_kind(func: Operation) -> str | None:
    """A `graph.func`'s kind (`exp.GRAPH_KINDS`), None when it has none."""
    return func.attributes.get("kind")


def is_derived(func: Operation) -> bool:
    """Whether a `graph.func` is one the run pipeline derived from the experiment's graphs for the
    training driver (`derived = true`: a group's flat update, a flat clip, the gradient scaling, a
    stacking variant), which follows from them and so is no part of what the experiment is."""
    return func.attributes.get("derived") is True


def erase_derived(module: Operation, *kinds: str) -> None:
    """Erase the derived graphs of these kinds from a module (a pass that adds them, run again, replaces them)."""
    for func in graph_funcs(module):
        if is_derived(func) and func_kind(func) in kinds:
            func.erase()


def return_names(ret: Operation) -> list[str]:
    """The names of a `graph.return`'s operands: the graph's outputs, in order."""
    return ret.attributes["names"]


def input_name(op: Operation) -> str:
    """A `graph.input`'s name: a parameter path, a batch field, `grad/<path>`, ..."""
    return op.attributes["name"]


def input_role(op: Operation) -> str:
    """A `graph.input`'s role, one of INPUT_ROLES."""
    return op.attributes["role"]


def is_input(op: Operation, role: str) -> bool:
    """Whether `op` is a `graph.input` of `role`."""
    return op.name == "graph.input" and op.attributes["role"] == role


def emit_name(op: Operation) -> str:
    """The name an emit (metric, counter, observe) records its operand under."""
    return op.attributes["name"]


def emit_collection(op: Operation | str) -> str:
    """Where a run reports an emit's values: `metrics`, `counters` or `observed`."""
    return REGISTRY.ops[op if isinstance(op, str) else op.name].collection


def reduction_axes(op: Operation) -> list[int]:
    """The axes a reduction reduces: sorted, unique, non-negative."""
    return list(op.attributes["axes"])


def keeps_axes(op: Operation) -> bool:
    """Whether a reduction keeps its reduced axes as size 1."""
    return bool(op.attributes["keep"])


def transpose_perm(op: Operation) -> list[int]:
    """A `graph.transpose`'s permutation: result axis i is operand axis `perm[i]`."""
    return list(op.attributes["perm"])


def op_axis(op: Operation) -> int:
    """The one axis a slice, pad, concat, squeeze, expand_dims, take, scatter or iota works on."""
    return op.attributes["axis"]


def slice_bounds(op: Operation) -> tuple[int, int, int]:
    """A `graph.slice`'s (axis, start, end): elements start to end (exclusive) of the axis."""
    attrs = op.attributes
    return attrs["axis"], attrs["start"], attrs["end"]


def pad_widths(op: Operation) -> tuple[int, int, int]:
    """A `graph.pad`'s (axis, before, after): the zeros added on each side of the axis."""
    attrs = op.attributes
    return attrs["axis"], attrs["before"], attrs["after"]


def cast_dtype(op: Operation) -> str:
    """The dtype a `graph.cast` converts to."""
    return op.attributes["dtype"]


def data_operand(op: Operation) -> Value:
    """The operand a shape or index op takes its elements from: a scatter's updates, else the
    first operand (the indices of `one_hot`)."""
    return op.operands[1] if op.name in (ScatterAddOp.name, ScatterAddAlongOp.name) else op.operands[0]


@frozen
class MatmulDims:
    """A matmul as `batch` (broadcast) products of an [m k] and a [k n] matrix."""

    batch: tuple[int, ...]
    m: int
    k: int
    n: int


def matmul_dims(op: Operation) -> MatmulDims:
    """The dimensions of a `graph.matmul` (its result's batch dimensions, m, k and n)."""
    a, b = (v.type.shape for v in op.operands)
    return MatmulDims(op.results[0].type.shape[:-2], a[-2], a[-1], b[-1])
