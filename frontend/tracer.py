"""Tracing: tensor operations in .sx code record graph ops (language.md §4).

A `Trace` owns one `graph.func` being built. While a trace is active (inside
`prepare`, `objective`, an evaluation function and the forward functions they
call), every primitive on a `Tensor` records exactly one op of the graph
dialect, plus an explicit `graph.broadcast` for each operand that numpy
broadcasting would stretch and a splat `graph.const` for each scalar operand.
Every op carries the location of the user's form that made it (the library
frame, when the op came from the prelude, rides along as `Location.via`) and,
when a module's forward function is running, a `path` attribute naming that
module (`model.blocks.0.attn`).

Shapes are static: a primitive checks its operands when it is traced and a
mismatch is an `SxError` at the user's form naming both shapes. `dim`,
`shape` and `numel` are compile-time ints.

Outside a trace there are no tensors: calling a primitive at top level is an
error that says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..diagnostics import Location, SxError
from ..dialects.core import FLOAT_DTYPES, INT_DTYPES, Builder, Operation, Region, TensorType, Value
from ..dialects.graph import ShapeError, broadcast_shapes, show_shape
from ..dialects.traits import Trait, has_trait
from .analysis import OPERAND_LOCATED
from .calls import BUILTINS, register_builtin, user_location
from .data import TENSOR_OPS, SxVector, Symbol, TensorLike
from .limits import MAX_ELEMENTS, MAX_GRAPH_OPS
from .printing import short_int

#: The language's dtype names and the graph dialect's (a bool tensor is `i1` in the IR).
DTYPE_OF_NAME = {"f32": "f32", "bf16": "bf16", "f16": "f16", "i32": "i32", "i64": "i64", "bool": "i1"}
NAME_OF_DTYPE = {v: k for k, v in DTYPE_OF_NAME.items()}


class Trace:
    """One graph being traced: its `graph.func`, builder, inputs, emits and module path."""

    def __init__(
        self,
        name: str,
        kind: str,
        loc: Location | None = None,
        *,
        record_counters: bool = True,
        record_observations: bool = True,
    ) -> None:
        self.func = Operation.create(
            "graph.func", attributes={"sym_name": name, "kind": kind}, regions=[Region.with_block()], loc=loc
        )
        self.builder = Builder(self.func.body)
        self.name = name
        self.record_counters = record_counters
        self.record_observations = record_observations
        #: Module paths of the forward functions running, innermost last.
        self.path_stack: list[str] = []
        #: Graph inputs by (role, name), so a parameter used twice is one input.
        self.inputs: dict[tuple[str, str], Tensor] = {}
        #: Emitted names, in order: metric name -> location, counter name -> static value or None.
        self.metrics: dict[str, Location | None] = {}
        self.counters: dict[str, int | float | None] = {}
        self.observed: list[str] = []
        #: Module path → the arguments of its first call in this graph (what `sample` traces a model with).
        self.module_calls: dict[str, list[Any]] = {}
        #: Ops recorded so far (see `MAX_GRAPH_OPS`).
        self.op_count = 0

    # -- building ---------------------------------------------------------------------------

    def emit(self, op: str, operands: Sequence[Value], loc: Location | None, **attributes: Any) -> Operation:
        """Create op `graph.<op>`, turning a shape error into a located SxError."""
        self._count_op(loc)
        if self.path_stack:
            attributes["path"] = self.path_stack[-1]
        try:
            created = self.builder.create(f"graph.{op}", operands, attributes, loc=loc)
        except ShapeError as err:
            raise SxError(_plain(err.message), loc) from None
        for result in created.results:
            check_shape(result.type.shape, f"'{_SOURCE_NAMES.get(op, op)}'", loc)
        return created

    def _count_op(self, loc: Location | None) -> None:
        self.op_count += 1
        if self.op_count > MAX_GRAPH_OPS:
            raise SxError(
                f"graph '{self.name}' has more than {MAX_GRAPH_OPS} ops; is a loop or a sub-list far longer than meant?",
                loc,
            )

    def value(self, op: str, operands: Sequence[Value], loc: Location | None, **attributes: Any) -> Tensor:
        return Tensor(self.emit(op, operands, loc, **attributes).result, self)

    def input(self, role: str, name: str, type_: TensorType, loc: Location | None = None) -> Tensor:
        """The graph input `name` of `role`, created on first use."""
        key = (role, name)
        found = self.inputs.get(key)
        if found is None:
            self._count_op(loc)
            op = self.builder.create("graph.input", (), {"name": name, "role": role}, result_types=[type_], loc=loc)
            found = self.inputs[key] = Tensor(op.result, self)
        return found

    def constant(self, value: int | float | bool, shape: Sequence[int], dtype: str, loc: Location | None) -> Tensor:
        """A splat constant of `shape`; ints stay ints in integer dtypes, and must fit them."""
        self._count_op(loc)
        if dtype in FLOAT_DTYPES:
            try:
                value = float(value)
            except OverflowError:
                raise SxError(f"the integer {short_int(value)} is too large for a float tensor", loc) from None
        elif dtype == "i1":
            value = bool(value)
        else:
            value = int(value)
            low, high = _INT_RANGES[dtype]
            if not low <= value <= high:
                raise SxError(f"{short_int(value)} does not fit in an {NAME_OF_DTYPE.get(dtype, dtype)} tensor ({low} to {high})", loc)
        attributes: dict[str, Any] = {"value": value}
        if self.path_stack:
            attributes["path"] = self.path_stack[-1]
        op = self.builder.create("graph.const", (), attributes, result_types=[TensorType(tuple(shape), dtype)], loc=loc)
        return Tensor(op.result, self)

    def finish(self, outputs: Sequence[tuple[str, Tensor]], loc: Location | None) -> Operation:
        """End the graph with `graph.return` of the named outputs."""
        self.builder.create(
            "graph.return", [t.value for _, t in outputs], {"names": [n for n, _ in outputs]}, result_types=[], loc=loc
        )
        return self.func

    @property
    def path(self) -> str:
        return self.path_stack[-1] if self.path_stack else ""


#: What .sx calls the graph ops whose name differs, for messages.
_SOURCE_NAMES = {"broadcast": "broadcast-to", "one_hot": "one-hot", "take_along": "take-along", "expand_dims": "expand-dims"}
#: The values of the integer dtypes.
_INT_RANGES = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}


def check_shape(shape: Sequence[int], what: str, loc: Location | None) -> None:
    """An error unless `shape`'s dimensions are ≥ 0 and its element count is within `MAX_ELEMENTS`."""
    if not shape or (min(shape) >= 0 and math.prod(shape) <= MAX_ELEMENTS):
        return
    if min(shape) < 0:
        raise SxError(f"{what} would make a tensor of shape {show_shape(shape)}: a dimension cannot be negative", loc)
    raise SxError(
        f"{what} would make a tensor of shape {show_shape(shape)}: {math.prod(shape)} elements, over the limit of "
        f"{MAX_ELEMENTS}",
        loc,
    )


def _plain(message: str) -> str:
    """A shape message without the IR's quoting of op names (users wrote `+`, not `graph.add`)."""
    return message.replace("'graph.", "'")


_ACTIVE: list[Trace] = []


def active_trace() -> Trace | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def tracing(trace: Trace) -> Iterator[Trace]:
    """Make `trace` the graph tensor operations record into."""
    _ACTIVE.append(trace)
    try:
        yield trace
    finally:
        _ACTIVE.pop()


@contextmanager
def module_path(path: str) -> Iterator[None]:
    """Run a module's forward function: ops traced inside carry `path`."""
    trace = active_trace()
    if trace is None:
        yield
        return
    trace.path_stack.append(path)
    try:
        yield
    finally:
        trace.path_stack.pop()


def require_trace(what: str, loc: Location | None) -> Trace:
    trace = active_trace()
    if trace is None:
        raise SxError(
            f"{what} called at top level: tensors exist only while a graph is traced "
            "(inside prepare, objective, an evaluation function or a module's forward function)",
            loc,
        )
    return trace


class Tensor(TensorLike):
    """A value of the graph being traced, with its static type."""

    __slots__ = ("value", "trace")

    def __init__(self, value: Value, trace: Trace) -> None:
        self.value = value
        self.trace = trace

    @property
    def type(self) -> TensorType:
        return self.value.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> str:
        return self.value.type.dtype

    def __sx_repr__(self) -> str:
        return f"#<tensor {show_shape(self.shape)} {NAME_OF_DTYPE.get(self.dtype, self.dtype)}>"


class Traceable(TensorLike):
    """A tensor-like that becomes a graph value when a trace uses it (a parameter)."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def trace_value(self, trace: Trace, loc: Location | None) -> Tensor:
        raise NotImplementedError


# -- operands ----------------------------------------------------------------------------------


def _is_tensor(x: object) -> bool:
    return isinstance(x, TensorLike)


def as_tensor(x: object, trace: Trace, loc: Location | None, what: str) -> Tensor:
    """`x` as a value of `trace`; a parameter becomes its graph input."""
    if isinstance(x, Tensor):
        if x.trace is not trace:
            raise SxError(f"'{what}' got a tensor of graph '{x.trace.name}' while tracing '{trace.name}'", loc)
        return x
    if isinstance(x, Traceable):
        return x.trace_value(trace, loc)
    raise SxError(f"'{what}' expects a tensor, got {describe(x)}", loc)


def describe(x: object) -> str:
    """A short account of a value's kind for error messages."""
    if isinstance(x, bool):
        return f"the boolean {'true' if x else 'false'}"
    if isinstance(x, (int, float)):
        return f"the number {x}"
    if x is None:
        return "nil"
    if isinstance(x, str):
        return f"the string {x!r}"
    if isinstance(x, Symbol):
        return f"the symbol {x.name}"
    shape = getattr(x, "shape", None)
    if isinstance(shape, tuple):
        return f"a tensor of shape {show_shape(shape)}"
    return f"a {type(x).__name__.lower()}"


def _scalar_dtype(x: int | float | bool) -> str:
    if isinstance(x, bool):
        return "i1"
    return "i32" if isinstance(x, int) else "f32"


def _common_dtype(a: str, b: str, what: str, loc: Location | None) -> str:
    if a == b:
        return a
    raise SxError(f"'{what}' operands have dtypes {NAME_OF_DTYPE.get(a, a)} and {NAME_OF_DTYPE.get(b, b)}; cast one", loc)


def _elementwise(
    what: str, args: Sequence[object], loc: Location | None, also: tuple[int, ...] = ()
) -> tuple[Trace, list[Tensor]]:
    """Operands of an elementwise op: tensors of one shape and dtype, scalars as splat constants.

    A tensor narrower than the broadcast shape (which includes `also`, the shape of
    a `where` condition) gets an explicit `graph.broadcast`. A Python float meeting
    an integer tensor promotes that tensor to f32, as numpy does.
    """
    trace = require_trace(f"'{what}'", loc)
    tensors = {i: as_tensor(a, trace, loc, what) for i, a in enumerate(args) if _is_tensor(a)}
    shape: tuple[int, ...] = also
    for i, t in tensors.items():
        try:
            shape = broadcast_shapes(shape, t.shape)
        except ShapeError:
            shapes = [show_shape(u.shape) for u in tensors.values()]
            if also:
                shapes.insert(0, show_shape(also))
            err = SxError(f"shapes {' and '.join(shapes)} do not broadcast", loc)
            # The operand that fails to broadcast with those before it: the caller may point at it.
            err.operand = i  # type: ignore[attr-defined]
            raise err from None
    scalars = [a for a in args if not _is_tensor(a)]
    for s in scalars:
        if not isinstance(s, (int, float)):
            raise SxError(f"'{what}' expects tensors or numbers, got {describe(s)}", loc)
    if not tensors:
        raise SxError(f"'{what}' needs a tensor operand, got only numbers", loc)
    dtype: str | None = None
    for t in tensors.values():
        dtype = t.dtype if dtype is None else _common_dtype(dtype, t.dtype, what, loc)
    assert dtype is not None
    if dtype in INT_DTYPES and any(s.__class__ is float for s in scalars):
        dtype = "f32"
    out: list[Tensor] = []
    for i, a in enumerate(args):
        if i in tensors:
            t = tensors[i]
            if t.dtype != dtype:
                t = trace.value("cast", [t.value], loc, dtype=dtype)
            if t.shape != shape:
                t = trace.value("broadcast", [t.value], loc, shape=list(shape))
            out.append(t)
        else:
            out.append(trace.constant(a, shape, dtype, loc))  # type: ignore[arg-type]
    return trace, out


def _op_loc(loc: Location | None) -> Location | None:
    """Where an op made at `loc` is located: the user's form, with a library frame as `via`."""
    return user_location(loc)


# -- elementwise primitives --------------------------------------------------------------------


def _unary(op: str) -> Callable[..., Any]:
    def run(loc: Location | None, x: object) -> Tensor:
        loc = _op_loc(loc)
        trace = require_trace(f"'{op}'", loc)
        t = as_tensor(x, trace, loc, op)
        if t.dtype not in FLOAT_DTYPES and has_trait(f"graph.{op}", Trait.FLOAT_ONLY):
            t = trace.value("cast", [t.value], loc, dtype="f32")
        return trace.value(op, [t.value], loc)

    return run


def _binary(op: str, what: str) -> Callable[..., Any]:
    def run(loc: Location | None, a: object, b: object) -> Tensor:
        loc = _op_loc(loc)
        trace, (ta, tb) = _elementwise(what, (a, b), loc)
        return trace.value(op, [ta.value, tb.value], loc)

    return run


def _variadic(op: str, what: str, unary: str | None) -> Callable[..., Any]:
    """`(+ a b c)` folds left; `(- x)` is `neg`, `(/ x)` is `recip`."""
    pair = _binary(op, what)
    single = _unary(unary) if unary else None

    def run(loc: Location | None, *args: object) -> Any:
        if len(args) == 1:
            if single is None:
                return args[0]
            return single(loc, args[0])
        if not args:
            raise SxError(f"'{what}' needs at least one argument", _op_loc(loc))
        acc = args[0]
        for k, b in enumerate(args[1:], 1):
            if not _is_tensor(acc) and not _is_tensor(b):
                # Numbers before the first tensor, as in (* 0.5 2 x): the scalar builtin computes them.
                acc = BUILTINS[what].call([acc, b], loc)
                continue
            try:
                acc = pair(loc, acc, b)
            except SxError as e:
                # The pair's operand 1 is argument k; its operand 0 is argument 0 only for the first pair.
                operand = getattr(e, "operand", None)
                if operand is not None:
                    e.operand = k if operand == 1 else (0 if k == 1 else None)  # type: ignore[attr-defined]
                raise
        return acc

    return run


def where(loc: Location | None, cond: object, a: object, b: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'where'", loc)
    c = as_tensor(cond, trace, loc, "where")
    if c.dtype != "i1":
        raise SxError(f"'where' needs a bool condition, got {NAME_OF_DTYPE.get(c.dtype, c.dtype)}", loc)
    if not _is_tensor(a) and not _is_tensor(b):
        for branch in (a, b):
            if isinstance(branch, bool) or not isinstance(branch, (int, float)):
                raise SxError(f"'where' expects tensors or numbers, got {describe(branch)}", loc)
        dtype = "f32" if isinstance(a, float) or isinstance(b, float) else "i32"
        ta, tb = trace.constant(a, c.shape, dtype, loc), trace.constant(b, c.shape, dtype, loc)  # type: ignore[arg-type]
        return trace.value("where", [c.value, ta.value, tb.value], loc)
    try:
        _, (ta, tb) = _elementwise("where", (a, b), loc, also=c.shape)
    except SxError as e:
        if getattr(e, "operand", None) is not None:
            e.operand += 1  # type: ignore[attr-defined]  (the condition is argument 0)
        raise
    if c.shape != ta.shape:
        c = trace.value("broadcast", [c.value], loc, shape=list(ta.shape))
    return trace.value("where", [c.value, ta.value, tb.value], loc)


# -- reductions --------------------------------------------------------------------------------


def _axes(axis: object, rank: int, what: str, loc: Location | None) -> list[int]:
    if axis is None:
        return list(range(rank))
    items = list(axis) if isinstance(axis, list) else [axis]
    out = set()
    for a in items:
        if not isinstance(a, int) or isinstance(a, bool):
            raise SxError(f"'{what}' axis must be an int or a vector of ints, got {describe(a)}", loc)
        if not -rank <= a < rank:
            raise SxError(f"'{what}' axis {a} is out of range for rank {rank}", loc)
        out.add(a % rank)
    return sorted(out)


def _reduce(op: str) -> Callable[..., Any]:
    def run(loc: Location | None, x: object, axis: object = None, *, keep: bool = False) -> Tensor:
        loc = _op_loc(loc)
        trace = require_trace(f"'{op}'", loc)
        if _is_tensor(axis):
            hint = {"max": "maximum", "min": "minimum"}.get(op)
            raise SxError(
                f"'{op}' of a tensor reduces along an axis, got a second tensor"
                + (f"; the elementwise {op} of two tensors is '{hint}'" if hint else ""),
                loc,
            )
        t = as_tensor(x, trace, loc, op)
        return trace.value(op, [t.value], loc, axes=_axes(axis, len(t.shape), op, loc), keep=bool(keep))

    return run


# -- shape -------------------------------------------------------------------------------------


def _dims(dims: object, what: str, loc: Location | None, infer: bool = False) -> list[int]:
    """A shape the user wrote: ints ≥ 0 (one may be -1 when `infer`), within `MAX_ELEMENTS`."""
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise SxError(f"'{what}' expects a vector of ints as a shape, got {describe(dims)}", loc)
    shape = list(dims)
    inferred = [i for i, d in enumerate(shape) if d == -1] if infer else []
    if len(inferred) > 1:
        raise SxError(f"'{what}' shape {show_shape(shape)} has more than one -1 (one dimension can be inferred)", loc)
    check_shape([1 if i in inferred else d for i, d in enumerate(shape)], f"'{what}'", loc)
    return shape


def _axis(axis: object, rank: int, what: str, loc: Location | None) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise SxError(f"'{what}' axis must be an int, got {describe(axis)}", loc)
    if not -rank <= axis < rank:
        raise SxError(f"'{what}' axis {axis} is out of range for rank {rank}", loc)
    return axis % rank


def reshape(loc: Location | None, x: object, dims: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'reshape'", loc)
    t = as_tensor(x, trace, loc, "reshape")
    shape = _dims(dims, "reshape", loc, infer=True)
    if shape.count(-1) == 1:
        known = math.prod(d for d in shape if d != -1)
        total = math.prod(t.shape)
        if known and total % known == 0:
            shape[shape.index(-1)] = total // known
    return trace.value("reshape", [t.value], loc, shape=shape)


def transpose(loc: Location | None, x: object, a: object = -2, b: object = -1) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'transpose'", loc)
    t = as_tensor(x, trace, loc, "transpose")
    rank = len(t.shape)
    perm = list(range(rank))
    i, j = _axis(a, rank, "transpose", loc), _axis(b, rank, "transpose", loc)
    perm[i], perm[j] = perm[j], perm[i]
    return trace.value("transpose", [t.value], loc, perm=perm)


def permute(loc: Location | None, x: object, axes: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'permute'", loc)
    t = as_tensor(x, trace, loc, "permute")
    rank = len(t.shape)
    if not isinstance(axes, list):
        raise SxError(f"'permute' expects a vector of axes, got {describe(axes)}", loc)
    perm = [_axis(a, rank, "permute", loc) for a in axes]
    return trace.value("transpose", [t.value], loc, perm=perm)


def broadcast_to(loc: Location | None, x: object, dims: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'broadcast-to'", loc)
    t = as_tensor(x, trace, loc, "broadcast-to")
    return trace.value("broadcast", [t.value], loc, shape=_dims(dims, "broadcast-to", loc))


def slice_(loc: Location | None, x: object, axis: object, start: object, end: object) -> Tensor:
    """`(slice x axis start end)`; negative axis and bounds count from the end, as in Python."""
    loc = _op_loc(loc)
    trace = require_trace("'slice'", loc)
    t = as_tensor(x, trace, loc, "slice")
    ax = _axis(axis, len(t.shape), "slice", loc)
    size = t.shape[ax]
    bounds = []
    for bound in (start, end):
        if not isinstance(bound, int) or isinstance(bound, bool):
            raise SxError(f"'slice' bounds must be ints, got {describe(bound)}", loc)
        bounds.append(bound + size if bound < 0 else bound)
    return trace.value("slice", [t.value], loc, axis=ax, start=bounds[0], end=bounds[1])


def concat(loc: Location | None, xs: object, axis: object = 0) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'concat'", loc)
    if not isinstance(xs, list) or not xs:
        raise SxError(f"'concat' expects a non-empty vector of tensors, got {describe(xs)}", loc)
    ts = [as_tensor(x, trace, loc, "concat") for x in xs]
    ax = _axis(axis, len(ts[0].shape), "concat", loc)
    return trace.value("concat", [t.value for t in ts], loc, axis=ax)


def squeeze(loc: Location | None, x: object, axis: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'squeeze'", loc)
    t = as_tensor(x, trace, loc, "squeeze")
    return trace.value("squeeze", [t.value], loc, axis=_axis(axis, len(t.shape), "squeeze", loc))


def expand_dims(loc: Location | None, x: object, axis: object) -> Tensor:
    """`(expand-dims x axis)`: a negative axis counts from the end of the result."""
    loc = _op_loc(loc)
    trace = require_trace("'expand-dims'", loc)
    t = as_tensor(x, trace, loc, "expand-dims")
    return trace.value("expand_dims", [t.value], loc, axis=_axis(axis, len(t.shape) + 1, "expand-dims", loc))


def _static_shape(x: object, what: str, loc: Location | None) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if not _is_tensor(x) or not isinstance(shape, tuple):
        raise SxError(f"'{what}' expects a tensor, got {describe(x)}", _op_loc(loc))
    return shape


def dim(loc: Location | None, x: object, i: object) -> int:
    shape = _static_shape(x, "dim", loc)
    return shape[_axis(i, len(shape), "dim", _op_loc(loc))]


def shape_of(loc: Location | None, x: object) -> SxVector:
    return SxVector(_static_shape(x, "shape", loc))


def numel(loc: Location | None, x: object) -> int:
    return math.prod(_static_shape(x, "numel", loc))


# -- contract, index, cast ---------------------------------------------------------------------


def matmul(loc: Location | None, a: object, b: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'matmul'", loc)
    ta, tb = as_tensor(a, trace, loc, "matmul"), as_tensor(b, trace, loc, "matmul")
    try:
        return trace.value("matmul", [ta.value, tb.value], loc)
    except SxError as err:
        # Both shapes are in the message; the caret goes under b, read against a.
        err.operand = 1  # type: ignore[attr-defined]
        raise


def take(loc: Location | None, x: object, idx: object, axis: object = 0) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'take'", loc)
    t, i = as_tensor(x, trace, loc, "take"), as_tensor(idx, trace, loc, "take")
    return trace.value("take", [t.value, i.value], loc, axis=_axis(axis, len(t.shape), "take", loc))


def take_along(loc: Location | None, x: object, idx: object, axis: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'take-along'", loc)
    t, i = as_tensor(x, trace, loc, "take-along"), as_tensor(idx, trace, loc, "take-along")
    return trace.value("take_along", [t.value, i.value], loc, axis=_axis(axis, len(t.shape), "take-along", loc))


def one_hot(loc: Location | None, idx: object, n: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'one-hot'", loc)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SxError(f"'one-hot' needs a positive int class count, got {describe(n)}", loc)
    return trace.value("one_hot", [as_tensor(idx, trace, loc, "one-hot").value], loc, n=n)


def iota(loc: Location | None, dims: object, axis: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'iota'", loc)
    shape = _dims(dims, "iota", loc)
    return trace.value("iota", [], loc, shape=shape, axis=_axis(axis, len(shape), "iota", loc))


def dtype_name(x: object, what: str, loc: Location | None) -> str:
    """The IR dtype a dtype symbol (`f32`, `bool`, …) names."""
    name = x.name if isinstance(x, Symbol) else x
    if not isinstance(name, str) or name not in DTYPE_OF_NAME:
        raise SxError(f"'{what}' expects a dtype ({', '.join(DTYPE_OF_NAME)}), got {describe(x)}", loc)
    return DTYPE_OF_NAME[name]


def cast(loc: Location | None, x: object, dtype: object) -> Tensor:
    loc = _op_loc(loc)
    trace = require_trace("'cast'", loc)
    t = as_tensor(x, trace, loc, "cast")
    target = dtype_name(dtype, "cast", loc)
    if target == t.dtype:
        return t
    return trace.value("cast", [t.value], loc, dtype=target)


def _no_tensor(name: str) -> Callable[..., Any]:
    def run(loc: Location | None, *args: object, **kwargs: object) -> Any:
        raise SxError(f"'{name}' works on numbers only; tensors have no '{name}'", _op_loc(loc))

    return run


# -- emits -------------------------------------------------------------------------------------


def emit_metric(loc: Location | None, name: str, x: object) -> object:
    """`(metric name x)`: a scalar averaged over a step's microbatches."""
    loc = _op_loc(loc)
    trace = require_trace(f"metric {name}", loc)
    t = as_tensor(x, trace, loc, "metric") if _is_tensor(x) else _scalar_const(trace, x, "metric", loc)
    if t.shape != ():
        raise SxError(f"metric {name} must be a scalar, got a tensor of shape {show_shape(t.shape)}", loc)
    if name in trace.metrics:
        raise SxError(f"metric {name} is emitted twice in graph '{trace.name}'", loc)
    trace.metrics[name] = loc
    trace.emit("metric", [t.value], loc, name=name)
    return x


def emit_counter(loc: Location | None, name: str, x: object) -> object:
    """`(counter name n)`: summed per step; static when `n` is known at compile time."""
    loc = _op_loc(loc)
    trace = require_trace(f"counter {name}", loc)
    if not trace.record_counters:
        return x
    if name in trace.counters:
        raise SxError(f"counter {name} is emitted twice in graph '{trace.name}'", loc)
    if _is_tensor(x):
        t = as_tensor(x, trace, loc, "counter")
        trace.counters[name] = None
    else:
        t = _scalar_const(trace, x, "counter", loc)
        trace.counters[name] = x  # type: ignore[assignment]
    trace.emit("counter", [t.value], loc, name=name)
    return x


def emit_observe(loc: Location | None, name: str, x: object) -> object:
    """`(observe name x)`: tags `x` as `<module path>.<name>` for diagnostics."""
    loc = _op_loc(loc)
    trace = require_trace(f"observe {name}", loc)
    full = f"{trace.path}.{name}" if trace.path else name
    if trace.record_observations:
        t = as_tensor(x, trace, loc, "observe")
        trace.observed.append(full)
        trace.emit("observe", [t.value], loc, name=full)
    return x


def _scalar_const(trace: Trace, x: object, what: str, loc: Location | None) -> Tensor:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise SxError(f"'{what}' expects a number or a tensor, got {describe(x)}", loc)
    return trace.constant(x, (), _scalar_dtype(x), loc)


# -- tables ------------------------------------------------------------------------------------

#: Builtins that compute on numbers and trace on tensors: installed into `data.TENSOR_OPS`.
OVERLOADED: dict[str, Callable[..., Any]] = {
    "+": _variadic("add", "+", None),
    "-": _variadic("sub", "-", "neg"),
    "*": _variadic("mul", "*", None),
    "/": _variadic("div", "/", "recip"),
    "pow": _binary("pow", "pow"),
    "min": _reduce("min"),
    "max": _reduce("max"),
    "abs": _unary("abs"),
    "sqrt": _unary("sqrt"),
    "exp": _unary("exp"),
    "log": _unary("log"),
    "cos": _unary("cos"),
    "sin": _unary("sin"),
    "tanh": _unary("tanh"),
    "floor": _no_tensor("floor"),
    "ceil": _no_tensor("ceil"),
    "round": _no_tensor("round"),
    "not": _no_tensor("not"),
    "=": _binary("eq", "="),
    "!=": _binary("ne", "!="),
    "<": _binary("lt", "<"),
    "<=": _binary("le", "<="),
    ">": _binary("gt", ">"),
    ">=": _binary("ge", ">="),
    # `concat` of lists is a list builtin; given tensors it lands here.
    "concat": concat,
}

#: Primitives that exist only for tensors (plus `dim shape numel`, which are compile-time).
PRIMITIVES: dict[str, Callable[..., Any]] = {
    "neg": _unary("neg"),
    "rsqrt": _unary("rsqrt"),
    "erf": _unary("erf"),
    "recip": _unary("recip"),
    "maximum": _binary("maximum", "maximum"),
    "minimum": _binary("minimum", "minimum"),
    "where": where,
    "sum": _reduce("sum"),
    "reshape": reshape,
    "transpose": transpose,
    "permute": permute,
    "broadcast-to": broadcast_to,
    "slice": slice_,
    "squeeze": squeeze,
    "expand-dims": expand_dims,
    "dim": dim,
    "shape": shape_of,
    "numel": numel,
    "matmul": matmul,
    "take": take,
    "take-along": take_along,
    "one-hot": one_hot,
    "iota": iota,
    "cast": cast,
}

#: Emits take their name unevaluated: `(metric train/loss loss)`.
EMITS: dict[str, Callable[..., Any]] = {"metric": emit_metric, "counter": emit_counter, "observe": emit_observe}

TENSOR_OPS.update(OVERLOADED)
#: Their broadcast errors name the operand at fault; a user's call points the caret at it.
OPERAND_LOCATED.update(("+", "-", "*", "/", "pow", "maximum", "minimum", "=", "!=", "<", "<=", ">", ">=", "where",
                        "matmul"))
for _name, _fn in PRIMITIVES.items():
    register_builtin(_name, _fn, loc=True, kwargs=_name == "sum")
