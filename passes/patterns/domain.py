"""The row domain of a reduction along one axis, and the graph ops that live in it.

A reduction of a tensor of shape `S` along axis `a` makes rows: `S[a]`
elements each (the row length `C`), `prod(S) / C` of them. The values a row
program computes with are of four kinds:

- `ROW`: shape `S`, one element per row element;
- `PER_ROW`: one value per row, shape `S` with axis `a` kept as 1 or dropped;
- `COLUMN`: one value per column, broadcast along the rows (a layernorm's
  weight): a shape that broadcasts to `S` and varies only along `a`;
- `WHOLE`: one value (a scalar, a splat constant, a loss).

`classify` says what an op of the graph dialect does in this domain (an
elementwise op on rows, a per-row value broadcast along the rows, a reduction
along the rows, a gather by per-row indices, ...), so the region grower can
grow through it and the evaluator can compute it on sample rows whatever
the tensor's real layout. An op with no meaning in the domain (a matmul, a
transpose, a broadcast over other axes) is None: a region stops there.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence

from attrs import frozen

from ...dialects.core import FLOAT_DTYPES, INT_DTYPES, Operation, Value
from ...dialects.graph import cast_dtype, op_axis, reduction_axes
from ...dialects.traits import Trait, ops_with


class Kind(enum.Enum):
    ROW = "row"
    PER_ROW = "per-row"
    COLUMN = "column"
    WHOLE = "whole"


class OpClass(enum.Enum):
    """What an op does in the domain (the evaluator computes each class on canonical arrays)."""

    ELEMENTWISE = "elementwise"
    BROADCAST = "broadcast"  # a per-row, column or whole value repeated along the rows or the row
    VIEW = "view"  # the same values in another shape (keep or drop of the reduced axis)
    REDUCE_ROW = "reduce row"  # along each row: a per-row value
    REDUCE_ROWS = "reduce rows"  # over the rows: a column value
    REDUCE_ALL = "reduce all"  # to one value
    TAKE_ALONG = "take along"  # one element per row, at a per-row index
    ONE_HOT = "one hot"  # a row of zeros with a one at a per-row index
    SCATTER_ALONG = "scatter along"  # a row of zeros with a per-row value added at a per-row index
    IOTA = "iota"  # the column index


@frozen
class Classified:
    """An op's class, its result's kind and the kind each operand is read as."""

    op_class: OpClass
    result_kind: Kind
    operand_kinds: tuple[Kind, ...]


ELEMENTWISE_OPS = ops_with(Trait.ELEMENTWISE)
REDUCTION_OPS = ops_with(Trait.REDUCTION)
VIEW_OPS = frozenset({"graph.reshape", "graph.expand_dims", "graph.squeeze"})


def is_float(value: Value) -> bool:
    return value.type.dtype in FLOAT_DTYPES


def is_index(value: Value) -> bool:
    return value.type.dtype in INT_DTYPES


def is_float_cast(op: Operation) -> bool:
    """A cast between float dtypes: a precision boundary (insert-casts), never part of a region."""
    return op.name == "graph.cast" and is_float(op.operands[0]) and cast_dtype(op) in FLOAT_DTYPES


def splat_value(op: Operation | None) -> float | None:
    """The value of a splat `graph.const`, else None."""
    if op is None or op.name != "graph.const":
        return None
    value = op.attributes["value"]
    return None if isinstance(value, list) else float(value)


@frozen
class RowDomain:
    """Rows along `axis` of tensors of `shape`."""

    shape: tuple[int, ...]
    axis: int

    @property
    def cols(self) -> int:
        return self.shape[self.axis]

    @property
    def rows(self) -> int:
        return math.prod(self.shape) // self.cols

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def keep_shape(self) -> tuple[int, ...]:
        return self.shape[: self.axis] + (1,) + self.shape[self.axis + 1 :]

    @property
    def drop_shape(self) -> tuple[int, ...]:
        return self.shape[: self.axis] + self.shape[self.axis + 1 :]

    @property
    def is_last_axis(self) -> bool:
        return self.axis == self.rank - 1

    def is_column_shape(self, shape: Sequence[int]) -> bool:
        """Broadcasts to the domain's shape varying only along its axis ([C], [1, C], [C, 1] for axis -2...)."""
        lead = self.rank - len(shape)
        if lead < 0 or self.axis < lead:
            return False
        return all(d == (self.cols if lead + i == self.axis else 1) for i, d in enumerate(shape))

    def kinds_of_shape(self, shape: Sequence[int]) -> frozenset[Kind]:
        """The kinds a value of this shape can be (several when shapes coincide, e.g. a square domain)."""
        return _kinds_of_shape(self, tuple(shape))

    def _kinds(self, shape: tuple[int, ...]) -> frozenset[Kind]:
        kinds = set()
        if shape == self.shape:
            kinds.add(Kind.ROW)
        if shape in (self.keep_shape, self.drop_shape):
            kinds.add(Kind.PER_ROW)
        if self.is_column_shape(shape):
            kinds.add(Kind.COLUMN)
        if math.prod(shape) == 1:
            kinds.add(Kind.WHOLE)
        return frozenset(kinds)

    def right_aligned(self, shape: Sequence[int]) -> tuple[int, ...] | None:
        lead = self.rank - len(shape)
        return None if lead < 0 else (1,) * lead + tuple(shape)


@functools.lru_cache(maxsize=4096)
def _kinds_of_shape(domain: RowDomain, shape: tuple[int, ...]) -> frozenset[Kind]:
    return domain._kinds(shape)


KnownKind = Callable[[Value], "Kind | None"]


def _pick(possible: frozenset[Kind], known: Kind | None) -> Kind | None:
    if known is not None:
        return known if known in possible else None
    return next(iter(possible)) if len(possible) == 1 else None


def classify(op: Operation, domain: RowDomain, known: KnownKind, casts: bool = False) -> Classified | None:
    """What `op` does in `domain`, given the kinds already known of some values (None: nothing it does there).

    A cast between float dtypes is a precision boundary: elementwise only when `casts` says the caller takes it
    (a region absorbs the casts on its inputs, not those on its outputs).
    """
    name = op.name
    if len(op.results) != 1:
        return None
    result = op.result
    if name in ELEMENTWISE_OPS:
        return None if is_float_cast(op) and not casts else _elementwise(op, domain, known)
    if name == "graph.broadcast":
        return _broadcast(op, domain, known)
    if name in VIEW_OPS:
        return _view(op, domain, known)
    if name in REDUCTION_OPS:
        return _reduction(op, domain, known)
    if name == "graph.take_along":
        x, idx = op.operands
        if (op_axis(op) == domain.axis and x.type.shape == domain.shape and is_index(idx)
                and idx.type.shape == domain.keep_shape and known(x) in (None, Kind.ROW)):
            return Classified(OpClass.TAKE_ALONG, Kind.PER_ROW, (Kind.ROW, Kind.PER_ROW))
        return None
    if name == "graph.one_hot":
        (idx,) = op.operands
        if domain.is_last_axis and idx.type.shape == domain.drop_shape and op.attributes["n"] == domain.cols:
            return Classified(OpClass.ONE_HOT, Kind.ROW, (Kind.PER_ROW,))
        return None
    if name == "graph.scatter_add_along":
        idx, upd = op.operands
        if (op_axis(op) == domain.axis and op.attributes["dim"] == domain.cols and is_index(idx)
                and upd.type.shape == domain.keep_shape and result.type.shape == domain.shape):
            return Classified(OpClass.SCATTER_ALONG, Kind.ROW, (Kind.PER_ROW, Kind.PER_ROW))
        return None
    if name == "graph.iota":
        if result.type.shape == domain.shape and op_axis(op) == domain.axis:
            return Classified(OpClass.IOTA, Kind.ROW, ())
        return None
    return None


def _elementwise(op: Operation, domain: RowDomain, known: KnownKind) -> Classified | None:
    possible = domain.kinds_of_shape(op.result.type.shape)
    kinds = {k for k in (known(v) for v in op.operands) if k is not None}
    kinds |= {k for k in [known(op.result)] if k is not None}
    if len(kinds) > 1:
        return None
    kind = _pick(possible, next(iter(kinds)) if kinds else None)
    if kind is None:
        return None
    return Classified(OpClass.ELEMENTWISE, kind, (kind,) * len(op.operands))


def _broadcast(op: Operation, domain: RowDomain, known: KnownKind) -> Classified | None:
    (source,) = op.operands
    target = op.result.type.shape
    aligned = domain.right_aligned(source.type.shape)
    if aligned is None:
        return None
    result_kinds = domain.kinds_of_shape(target)
    source_known = known(source)
    if target == domain.shape:
        if aligned == domain.keep_shape and source_known in (None, Kind.PER_ROW):
            return Classified(OpClass.BROADCAST, Kind.ROW, (Kind.PER_ROW,))
        if domain.is_column_shape(source.type.shape) and source_known in (None, Kind.COLUMN):
            return Classified(OpClass.BROADCAST, Kind.ROW, (Kind.COLUMN,))
    if source.type.numel == 1 and source_known in (None, Kind.WHOLE):
        kind = _pick(result_kinds - {Kind.WHOLE}, known(op.result))
        if kind is not None:
            return Classified(OpClass.BROADCAST, kind, (Kind.WHOLE,))
    return None


def _view(op: Operation, domain: RowDomain, known: KnownKind) -> Classified | None:
    source = op.operands[0]
    before = domain.kinds_of_shape(source.type.shape)
    after = domain.kinds_of_shape(op.result.type.shape)
    kind = _pick(before & after, known(source) or known(op.result))
    if kind is None or (kind is Kind.ROW and source.type.shape != op.result.type.shape):
        return None
    return Classified(OpClass.VIEW, kind, (kind,))


def _reduction(op: Operation, domain: RowDomain, known: KnownKind) -> Classified | None:
    source = op.operands[0]
    shape = source.type.shape
    axes = reduction_axes(op)
    kind = _pick(domain.kinds_of_shape(shape), known(source))
    if kind is None:
        return None
    if all(shape[i] == 1 for i in axes):
        return Classified(OpClass.VIEW, kind, (kind,))
    if kind is Kind.ROW and axes == [domain.axis]:
        return Classified(OpClass.REDUCE_ROW, Kind.PER_ROW, (Kind.ROW,))
    if op.result.type.numel == 1:
        return Classified(OpClass.REDUCE_ALL, Kind.WHOLE, (kind,))
    if kind is not Kind.ROW:
        return None
    others = [i for i in range(domain.rank) if i != domain.axis and shape[i] != 1]
    if [i for i in axes if shape[i] != 1] == others and Kind.COLUMN in domain.kinds_of_shape(op.result.type.shape):
        return Classified(OpClass.REDUCE_ROWS, Kind.COLUMN, (Kind.ROW,))
    return None


def seed_domain(op: Operation) -> RowDomain | None:
    """The domain of a reduction along one axis of a float tensor of rank >= 1 with rows of >= 2 elements."""
    if op.name not in REDUCTION_OPS or not is_float(op.operands[0]):
        return None
    shape = op.operands[0].type.shape
    axes = reduction_axes(op)
    if len(axes) != 1 or shape[axes[0]] < 2:
        return None
    return RowDomain(tuple(shape), axes[0])
