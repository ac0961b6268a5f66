"""Op traits: what each `graph` op kind is, in one table.

A pass or backend that treats a group of ops alike asks for a trait instead
of listing op names: `has_trait(op, Trait.VIEW)`, or a set of names made
once with `ops_with(Trait.REDUCTION, Trait.IDEMPOTENT)` (ops having every
trait given). As MLIR's op traits (`Pure`, `Commutative`, `Elementwise`,
`ConstantLike`, `Involution`, `Idempotent`) and tinygrad's `GroupOp` sets, a
trait states a fact about the op kind that holds for every op of it.

Every op has exactly one *kind* trait, whose value is the op's family as
reports print it (`reduce sum`, `unary exp`); the others are properties.
`OP_TRAITS` below is the only place an op kind's traits are written: a new
op adds its row there, and `dialects/graph.py` takes the op's family and its
`pure` flag from that row when it registers the op.
"""

from __future__ import annotations

import enum

from .core import Operation


class Trait(enum.Enum):
    # -- kinds: exactly one per op; the value is its family -----------------------------------
    #: The structure of a graph: `graph.func` and its terminator `graph.return`.
    FUNC = "func"
    #: A graph argument (`graph.input`).
    INPUT = "input"
    #: A constant written in the IR (`graph.const`).
    CONST = "const"
    #: Elementwise math of one operand.
    UNARY = "unary"
    #: Elementwise arithmetic of two operands of one type.
    BINARY = "binary"
    #: Elementwise comparison of two operands of one type; an `i1` result.
    COMPARE = "compare"
    #: Elementwise choice between two operands by an `i1` condition (`graph.where`).
    SELECT = "select"
    #: Reduces its operand along `axes`, keeping them as size 1 when `keep`.
    REDUCTION = "reduce"
    #: Moves, repeats or pads elements without computing new values.
    SHAPE = "shape"
    #: A tensor contraction (`graph.matmul`).
    CONTRACTION = "contract"
    #: Gathers, scatters or makes indices.
    INDEX = "index"
    #: Converts each element to another dtype (`graph.cast`).
    CAST = "cast"
    #: Records its operand under a name when the graph runs; no result, never erased.
    EMIT = "emit"

    # -- properties ---------------------------------------------------------------------------
    #: No side effect: erased when its results are unused, merged with an equal op (MLIR `Pure`).
    PURE = "pure"
    #: Result element i depends on operand elements i only; operands and result of one shape.
    ELEMENTWISE = "elementwise"
    #: The result is a view of the operand's storage (no element is computed or copied).
    VIEW = "view"
    #: The value is fixed when the graph is built (MLIR `ConstantLike`).
    CONSTANT_LIKE = "constant-like"
    #: Swapping the two operands changes no bit of the result (maximum and minimum are not:
    #: numpy gives the second operand's zero when comparing -0.0 with +0.0).
    COMMUTATIVE = "commutative"
    #: Applied twice gives the operand back exactly: f(f(x)) = x (MLIR `Involution`).
    INVOLUTION = "involution"
    #: f(f(x)) = f(x) for a unary op, g(x, x) = x for a binary one (MLIR `Idempotent`); a
    #: reduction with it reduces by such an operator, so equal elements reduce to that element.
    IDEMPOTENT = "idempotent"
    #: Its operands must be floats (the tracer casts integers to f32 first).
    FLOAT_ONLY = "float-only"

    # Members are singletons compared by identity: hashing by identity (in C) keeps `trait in traits`
    # cheap, which every op's type rule and many patterns ask (Enum's own hashes the name, in Python).
    __hash__ = object.__hash__


T = Trait

#: Every graph op kind and its traits; the kind trait first.
OP_TRAITS: dict[str, frozenset[Trait]] = {
    name: frozenset(traits)
    for name, traits in {
        "graph.func": (T.FUNC,),
        "graph.return": (T.FUNC,),
        "graph.input": (T.INPUT,),
        "graph.const": (T.CONST, T.PURE, T.CONSTANT_LIKE),
        "graph.neg": (T.UNARY, T.PURE, T.ELEMENTWISE, T.INVOLUTION),
        "graph.exp": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.log": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.sqrt": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.rsqrt": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.tanh": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.erf": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.abs": (T.UNARY, T.PURE, T.ELEMENTWISE, T.IDEMPOTENT),
        "graph.recip": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.sin": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.cos": (T.UNARY, T.PURE, T.ELEMENTWISE, T.FLOAT_ONLY),
        "graph.add": (T.BINARY, T.PURE, T.ELEMENTWISE, T.COMMUTATIVE),
        "graph.sub": (T.BINARY, T.PURE, T.ELEMENTWISE),
        "graph.mul": (T.BINARY, T.PURE, T.ELEMENTWISE, T.COMMUTATIVE),
        "graph.div": (T.BINARY, T.PURE, T.ELEMENTWISE),
        "graph.pow": (T.BINARY, T.PURE, T.ELEMENTWISE),
        "graph.maximum": (T.BINARY, T.PURE, T.ELEMENTWISE, T.IDEMPOTENT),
        "graph.minimum": (T.BINARY, T.PURE, T.ELEMENTWISE, T.IDEMPOTENT),
        "graph.eq": (T.COMPARE, T.PURE, T.ELEMENTWISE, T.COMMUTATIVE),
        "graph.ne": (T.COMPARE, T.PURE, T.ELEMENTWISE, T.COMMUTATIVE),
        "graph.lt": (T.COMPARE, T.PURE, T.ELEMENTWISE),
        "graph.le": (T.COMPARE, T.PURE, T.ELEMENTWISE),
        "graph.gt": (T.COMPARE, T.PURE, T.ELEMENTWISE),
        "graph.ge": (T.COMPARE, T.PURE, T.ELEMENTWISE),
        "graph.where": (T.SELECT, T.PURE, T.ELEMENTWISE),
        "graph.sum": (T.REDUCTION, T.PURE),
        "graph.max": (T.REDUCTION, T.PURE, T.IDEMPOTENT),
        "graph.min": (T.REDUCTION, T.PURE, T.IDEMPOTENT),
        "graph.reshape": (T.SHAPE, T.PURE, T.VIEW),
        "graph.transpose": (T.SHAPE, T.PURE, T.VIEW),
        "graph.broadcast": (T.SHAPE, T.PURE, T.VIEW),
        "graph.slice": (T.SHAPE, T.PURE, T.VIEW),
        "graph.pad": (T.SHAPE, T.PURE),
        "graph.concat": (T.SHAPE, T.PURE),
        "graph.squeeze": (T.SHAPE, T.PURE, T.VIEW),
        "graph.expand_dims": (T.SHAPE, T.PURE, T.VIEW),
        "graph.matmul": (T.CONTRACTION, T.PURE),
        "graph.take": (T.INDEX, T.PURE),
        "graph.take_along": (T.INDEX, T.PURE),
        "graph.scatter_add": (T.INDEX, T.PURE),
        "graph.scatter_add_along": (T.INDEX, T.PURE),
        "graph.one_hot": (T.INDEX, T.PURE),
        "graph.iota": (T.INDEX, T.PURE, T.CONSTANT_LIKE),
        "graph.cast": (T.CAST, T.PURE, T.ELEMENTWISE),
        "graph.metric": (T.EMIT,),
        "graph.counter": (T.EMIT,),
        "graph.observe": (T.EMIT,),
    }.items()
}

#: The kind traits, in the order reports list families.
KINDS = (
    T.INPUT, T.CONST, T.UNARY, T.BINARY, T.COMPARE, T.SELECT, T.REDUCTION,
    T.SHAPE, T.CONTRACTION, T.INDEX, T.CAST, T.EMIT, T.FUNC,
)
#: The families of the graph dialect, in report order.
FAMILIES = tuple(kind.value for kind in KINDS)


def traits_of(op: Operation | str) -> frozenset[Trait]:
    """The traits of an op (or op name); none for an op kind outside the table."""
    return OP_TRAITS.get(op if isinstance(op, str) else op.name, frozenset())


def has_trait(op: Operation | str, trait: Trait) -> bool:
    return trait in traits_of(op)


def ops_with(*traits: Trait) -> frozenset[str]:
    """The names of the op kinds that have every one of `traits`."""
    wanted = set(traits)
    return frozenset(name for name, have in OP_TRAITS.items() if wanted <= have)


def kind_of(op: Operation | str) -> Trait:
    """An op kind's kind trait (its family); a KeyError for an op kind outside the table."""
    name = op if isinstance(op, str) else op.name
    (kind,) = (t for t in OP_TRAITS[name] if t in KINDS)
    return kind


#: Ops whose result is a splat of the operand's scalar when the operand is a splat (constant
#: folding asks): the views, and the reductions by an idempotent operator.
SPLAT_PRESERVING_OPS = ops_with(Trait.VIEW) | ops_with(Trait.REDUCTION, Trait.IDEMPOTENT)
