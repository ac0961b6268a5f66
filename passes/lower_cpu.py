"""`lower-cpu`: rewrite graph op patterns into the `cpu` ops the numpy interpreter runs faster.

The interpreter compiles every graph by cloning it and running these
patterns (with its float mode), so `sexpgpu-opt -p '...,lower-cpu'` prints
exactly the ops it runs. Each pattern keeps the computed bits; the
conditions keep what the interpreter's buffer plan can do for the result
(an op whose result is stored in a wider dtype and rounded, bf16 or f16 in
the native float mode, takes no `out=` buffer, so the patterns that write
into one leave it alone).
"""

from __future__ import annotations

from attrs import define

from ..diagnostics import UsageError
from ..dialects.core import Operation, Value
from ..dialects.cpu import BROADCASTING_KINDS, FLOAT_MODES, ROUNDED_DTYPES
from ..dialects.liveness import VIEW_OPS, lets_escape
from ..dialects.rewriting import GreedyRewriteDriver, Pat, PatternRewriter, PatternRule, RewritePattern
from .manager import CompilationUnit, Pass, register_pass

#: The graph ops numpy's binary ufuncs run, by their `cpu.broadcasting_binary` kind.
_UFUNC_KINDS = {f"graph.{kind}": kind for kind in BROADCASTING_KINDS}


class _CpuRule(PatternRule):
    """A rule knowing which dtypes the interpreter rounds per op in its float mode."""

    def __init__(self, float_mode: str) -> None:
        self.rounded = ROUNDED_DTYPES[float_mode]


# -- pad sums ----------------------------------------------------------------------------------

#: What a pad sum adds: pads, and pad sums made of earlier adds.
_PIECES = ("graph.pad", "cpu.pad_sum")


def _pieces(op: Operation) -> tuple[int, list[tuple[Value, int]]]:
    """The axis of a pad or pad sum, and its (operand, start) pieces."""
    if op.name == "graph.pad":
        return op.attributes["axis"], [(op.operands[0], op.attributes["before"])]
    return op.attributes["axis"], list(zip(op.operands, op.attributes["starts"]))


class SumPads(_CpuRule):
    """`add(pad(a), pad(b))` along one axis into disjoint ranges, each pad read only by the add,
    is `cpu.pad_sum(a, b)`; an add of such a sum and a pad (or of two sums) extends it, so a
    tree of adds over pads (the gradient of slicing q, k and v out of one projection) becomes one
    op writing each piece into its range, with no padded copies."""

    pattern = Pat("graph.add", Pat(_PIECES, name="lhs", one_use=True), Pat(_PIECES, name="rhs", one_use=True),
                  name="add")

    def rewrite(self, rewriter: PatternRewriter, add: Operation, lhs: Operation, rhs: Operation) -> None:
        if add.result.type.dtype in self.rounded:
            return
        axis, pieces = _pieces(lhs)
        rhs_axis, rhs_pieces = _pieces(rhs)
        pieces += rhs_pieces
        ranges = sorted((start, start + v.type.shape[axis]) for v, start in pieces)
        if rhs_axis != axis or any(start < end for (_, end), (start, _) in zip(ranges, ranges[1:])):
            return
        fused = rewriter.create("cpu.pad_sum", [v for v, _ in pieces], {"axis": axis, "starts": [s for _, s in pieces]},
                                [add.result.type], loc=add.loc)
        rewriter.replace_op(add, fused)
        rewriter.erase_op(lhs)
        rewriter.erase_op(rhs)


# -- matmuls -----------------------------------------------------------------------------------


class SumBatchedMatmul(_CpuRule):
    """`sum(matmul(a, b), axes [0])` of a [B M K] and b [B K N], the product read only by the sum
    right after it (a linear layer's weight gradient over a batch), is `cpu.matmul_sum(a, b)`:
    one [M B·K] @ [B·K N] product, no [B M N] intermediate."""

    pattern = Pat("graph.sum", Pat("graph.matmul", Pat.var("a"), Pat.var("b"), name="product", one_use=True),
                  name="total", attrs={"axes": [0], "keep": False})

    def rewrite(self, rewriter: PatternRewriter, total: Operation, product: Operation, a: Value, b: Value) -> None:
        # Only when adjacent: the fused op reads a and b where the matmul did.
        if product.next_op is not total or a.type.rank != 3 or b.type.rank != 3 or a.type.shape[0] != b.type.shape[0]:
            return
        if a.type.dtype in self.rounded or product.result.type.dtype in self.rounded:
            return
        rewriter.replace_op(total, rewriter.create("cpu.matmul_sum", [a, b], loc=product.loc))
        rewriter.erase_op(product)


def _keeps_last_axis_last(transpose: Operation) -> bool:
    perm = list(transpose.attributes["perm"])
    return perm[-1] == len(perm) - 1 and perm != list(range(len(perm)))


def _escapes(value: Value) -> bool:
    """Whether `value`, or a view of it, is returned or emitted (its storage is then the caller's)."""
    for user in value.users():
        if user.name in VIEW_OPS:
            if _escapes(user.result):
                return True
        elif lets_escape(user):
            return True
    return False


class StoreMatmulTransposed(_CpuRule):
    """A stacked `matmul` (both operands with batch axes: one gemm per batch element) read only by
    a `transpose` keeping the last axis last is `cpu.matmul {layout = perm}`: each gemm writes its
    rows into the transpose's layout, so the transpose, and a reshape merging its axes after it
    (attention's merge of heads), are views instead of copies. Not when the product escapes (it
    is then the caller's array, stored as usual)."""

    pattern = Pat("graph.transpose", Pat("graph.matmul", Pat.var("a"), Pat.var("b"), name="product", one_use=True),
                  name="transpose", where=_keeps_last_axis_last)

    def rewrite(self, rewriter: PatternRewriter, transpose: Operation, product: Operation, a: Value, b: Value) -> None:
        if a.type.rank < 3 or b.type.rank < 3 or product.result.type.dtype in self.rounded or _escapes(product.result):
            return
        stored = rewriter.create("cpu.matmul", [a, b], {**product.attributes, "layout": transpose.attributes["perm"]},
                                 loc=product.loc, before=product)
        rewriter.replace_op(product, stored)


# -- implicit broadcasts -------------------------------------------------------------------------

#: Constants: a splat may become 0-d and an iota is a broadcast view, so neither gives a reader
#: its full shape. A broadcast does (it is a full-shape view) unless it is itself read implicitly.
_CONSTANT_OPS = frozenset({"graph.const", "graph.iota"})
_NOT_FULL_FOR_BROADCAST = _CONSTANT_OPS | {"graph.broadcast"}


def _read_by_broadcasting_ops(value: Value, not_full: frozenset[str]) -> bool:
    """Whether `value` has readers, each a graph binary or compare op reading it once whose other
    operand has its full shape (is defined by no op in `not_full`), so that numpy's broadcasting
    of `value`'s smaller stand-in gives each reader its result shape."""
    readers = list(value.users())
    for reader in readers:
        if reader.name not in _UFUNC_KINDS or sum(v is value for v in reader.operands) != 1:
            return False
        other = reader.operands[1] if reader.operands[0] is value else reader.operands[0]
        if other.op is None or other.op.name in not_full:
            return False
    return bool(readers)


def _broadcast_readers(rewriter: PatternRewriter, old: Value, new: Value) -> None:
    """Replace each reader of `old` by a `cpu.broadcasting_binary` reading `new` in its place."""
    for reader in list(old.users()):
        operands = [new if v is old else v for v in reader.operands]
        attributes = {**reader.attributes, "kind": _UFUNC_KINDS[reader.name]}
        rewriter.replace_op(reader, rewriter.create("cpu.broadcasting_binary", operands, attributes,
                                                    loc=reader.loc, before=reader))


class ScalarSplat(PatternRule):
    """A splat constant of rank > 0 read only by binary and compare ops whose other operand is no
    constant is a 0-d constant, its readers `cpu.broadcasting_binary`: they read one number, and
    no full-shape constant is kept."""

    pattern = Pat("graph.const", name="splat", attrs={"value": lambda value: not isinstance(value, list)},
                  where=lambda op: op.result.type.rank > 0)

    def rewrite(self, rewriter: PatternRewriter, splat: Operation) -> None:
        if not _read_by_broadcasting_ops(splat.result, _CONSTANT_OPS):
            return
        scalar = rewriter.create("graph.const", [], dict(splat.attributes), [splat.result.type.with_shape(())],
                                 loc=splat.loc)
        _broadcast_readers(rewriter, splat.result, scalar.result)
        rewriter.erase_op(splat)


class ImplicitBroadcast(PatternRule):
    """A `graph.broadcast` read only by binary and compare ops whose other operand has the full
    shape goes: its readers become `cpu.broadcasting_binary` of its operand (numpy broadcasts
    from the right, as `graph.broadcast` does), with no strided view in between."""

    pattern = Pat("graph.broadcast", Pat.var("x"), name="broadcast")

    def rewrite(self, rewriter: PatternRewriter, broadcast: Operation, x: Value) -> None:
        if not _read_by_broadcasting_ops(broadcast.result, _NOT_FULL_FOR_BROADCAST):
            return
        _broadcast_readers(rewriter, broadcast.result, x)
        rewriter.erase_op(broadcast)


def cpu_patterns(float_mode: str = "native") -> list[RewritePattern]:
    """The patterns of `lower-cpu` for the interpreter's float mode ("native" or "f64")."""
    return [SumPads(float_mode), SumBatchedMatmul(float_mode), StoreMatmulTransposed(float_mode),
            ScalarSplat(), ImplicitBroadcast()]


def lower_func(func: Operation, float_mode: str = "native") -> None:
    """Rewrite one `graph.func` (or every one nested in an op) with `cpu_patterns`, in place."""
    GreedyRewriteDriver(cpu_patterns(float_mode), erase_dead=False).rewrite_nested(func)


@register_pass
@define
class LowerCpu(Pass):
    """Rewrites every `graph.func` into what the numpy interpreter runs, with the `cpu` dialect.

    Guarantees: every value a graph returns or emits is unchanged, bit for bit;
    the ops left are `graph` ops and `cpu.pad_sum`, `cpu.matmul_sum`,
    `cpu.matmul` (a product stored transposed) and `cpu.broadcasting_binary`
    (with 0-d splat constants); no other op is added, erased or moved. Option
    `float-mode` (`native` or `f64`): the interpreter's, which decides which
    dtypes are rounded per op (bf16 and f16 in `native`, none in `f64`).
    """

    name = "lower-cpu"
    summary = "rewrite graph op patterns into the cpu ops the numpy interpreter runs"
    float_mode: str = "native"

    def run(self, unit: CompilationUnit) -> None:
        if self.float_mode not in FLOAT_MODES:
            raise UsageError(f"option 'float-mode' of pass 'lower-cpu' must be one of {', '.join(FLOAT_MODES)}, "
                             f"not '{self.float_mode}'")
        lower_func(unit.require_module(self.name), self.float_mode)
