"""`canonicalize`: algebraic identities, shape-op chains and splat-constant folding.

Every rewrite is a `RewritePattern` driven to a fixpoint by the greedy driver
of `dialects/rewriting.py`, which also erases pure ops left unused.

Which identities are safe: `x + 0`, `x - 0`, `x * 1`, `x / 1`, `x ** 1` give
exactly `x` for every value except that `-0.0 + 0.0` is `+0.0`, a zero of
the other sign, which compares equal (XLA and Grappler make the same call).
`x * 0` is not `0` for floats when `x` is inf or nan, so it folds only for
integer and boolean tensors, or for floats with the `fast-math` option.

One contraction per weight gradient: autodiff writes a linear layer's weight
gradient as a `[batch, in, out]` product summed over the batch; the sum of
the batch's products is one product over the batch folded into the
contraction, so the interpreter, the memory bound and a GEMM lowering all
see one `[in, B·T] × [B·T, out]` matmul and no `[batch, in, out]` tensor.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from attrs import define

from ..dialects.core import FLOAT_DTYPES, Operation, Value
from ..dialects.graph import graph_funcs, op_axis, pad_widths, reduction_axes, transpose_perm
from ..dialects.graph_semantics import (
    FLOAT64_ARITH,
    FLOAT64_COMPARE,
    FLOAT64_UNARY,
    numpy_binary,
    numpy_dtype,
    numpy_unary,
)
from ..dialects.rewriting import GreedyRewriteDriver, Pat, PatternRewriter, PatternRule, RewritePattern
from ..dialects.traits import SPLAT_PRESERVING_OPS, Trait, has_trait, ops_with
from .manager import CompilationUnit, Pass, register_pass


def splat_value(value: Value) -> Any:
    """The scalar of a splat `graph.const` (a number or bool), else None."""
    op = value.op
    if op is None or op.name != "graph.const":
        return None
    scalar = op.attributes.get("value")
    return None if isinstance(scalar, list) else scalar


def _is_splat_of(value: Value, number: float) -> bool:
    scalar = splat_value(value)
    return scalar is not None and not isinstance(scalar, bool) and scalar == number


def _python_scalar(x: Any, dtype: str) -> Any:
    """A numpy scalar as the attribute value a const of `dtype` holds."""
    if dtype == "i1":
        return bool(x)
    if dtype in FLOAT_DTYPES:
        return float(x)
    return int(x)


# -- identities --------------------------------------------------------------------------------


class _Identity(RewritePattern):
    """`op(x, c)` (and `op(c, x)` when the op is commutative) is `x` when `c` is a splat of `unit`."""

    unit: float = 0.0

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        x, c = op.operands
        if _is_splat_of(c, self.unit):
            rewriter.replace_op(op, [x])
            return True
        if has_trait(op, Trait.COMMUTATIVE) and _is_splat_of(x, self.unit):
            rewriter.replace_op(op, [c])
            return True
        return False


class AddZero(_Identity):
    """`x + 0 → x`, `0 + x → x`."""

    op_names = ("graph.add",)
    unit = 0.0


class SubZero(_Identity):
    """`x - 0 → x`."""

    op_names = ("graph.sub",)
    unit = 0.0


class MulOne(_Identity):
    """`x * 1 → x`, `1 * x → x`."""

    op_names = ("graph.mul",)
    unit = 1.0


class DivOne(_Identity):
    """`x / 1 → x`."""

    op_names = ("graph.div",)
    unit = 1.0


class PowOne(_Identity):
    """`x ** 1 → x`."""

    op_names = ("graph.pow",)
    unit = 1.0


@define
class MulZero(RewritePattern):
    """`x * 0 → 0` for integer and boolean tensors; for floats only under fast math (inf * 0 is nan)."""

    fast_math: bool = False
    op_names = ("graph.mul",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        if op.result.type.dtype in FLOAT_DTYPES and not self.fast_math:
            return False
        for zero in op.operands:
            if _is_splat_of(zero, 0.0):
                rewriter.replace_op(op, [zero])
                return True
        return False


class SelfInverse(RewritePattern):
    """An involution applied twice is its operand: `neg(neg(x)) → x`."""

    op_names = tuple(sorted(ops_with(Trait.INVOLUTION)))

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        inner = op.operands[0].op
        if inner is not None and inner.name == op.name:
            rewriter.replace_op(op, [inner.operands[0]])
            return True
        return False


class NoOpShape(RewritePattern):
    """Shape ops that change nothing: reshape/broadcast to the same shape, the identity
    transpose, cast to the same dtype, a slice of the whole axis, a pad by zero."""

    op_names = ("graph.reshape", "graph.broadcast", "graph.transpose", "graph.cast", "graph.slice", "graph.pad")

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        x = op.operands[0]
        if op.result.type != x.type:
            return False
        if op.name == "graph.transpose" and transpose_perm(op) != list(range(x.type.rank)):
            return False
        if op.name == "graph.pad" and any(pad_widths(op)[1:]):
            return False
        rewriter.replace_op(op, [x])
        return True


class ComposeShapeChains(RewritePattern):
    """Two shape ops in a row become one: reshape∘reshape, broadcast∘broadcast,
    transpose∘transpose (composed permutation); squeeze∘expand_dims and
    expand_dims∘squeeze of the same axis are `x`."""

    op_names = ("graph.reshape", "graph.broadcast", "graph.transpose", "graph.squeeze", "graph.expand_dims")
    _INVERSES = {"graph.squeeze": "graph.expand_dims", "graph.expand_dims": "graph.squeeze"}

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        inner = op.operands[0].op
        if inner is None:
            return False
        x = inner.operands[0] if inner.operands else None
        if op.name in self._INVERSES:
            if inner.name == self._INVERSES[op.name] and op_axis(inner) == op_axis(op):
                rewriter.replace_op(op, [x])
                return True
            return False
        if inner.name != op.name:
            return False
        if op.name == "graph.transpose":
            inner_perm = transpose_perm(inner)
            attributes = {"perm": [inner_perm[p] for p in transpose_perm(op)]}
        else:
            attributes = dict(op.attributes)
        rewriter.replace_op(op, rewriter.create(op.name, [x], attributes, loc=op.loc))
        return True


class SelectOfKnown(RewritePattern):
    """`where(c, x, x) → x`; `where(splat c, a, b)` → `a` or `b`."""

    op_names = ("graph.where",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        cond, a, b = op.operands
        if a is b:
            rewriter.replace_op(op, [a])
            return True
        known = splat_value(cond)
        if known is None:
            return False
        rewriter.replace_op(op, [a if known else b])
        return True


# -- splat constant folding --------------------------------------------------------------------


#: The ops IEEE 754 rounds correctly (so computing in float64 and rounding once to float32 gives
#: numpy's float32 result exactly: 53 >= 2·24 + 2 bits), on finite values, in pure Python.
_EXACT_UNARY = {name: FLOAT64_UNARY[name] for name in ("graph.neg", "graph.abs", "graph.sqrt")}
_EXACT_ARITH = {name: FLOAT64_ARITH[name] for name in ("graph.add", "graph.sub", "graph.mul", "graph.div")}
_EXACT_COMPARE = FLOAT64_COMPARE
_F32 = struct.Struct("<f")
_F32_BITS = struct.Struct("<I")


def _swaps_last_two(transpose: Operation) -> bool:
    rank = transpose.result.type.rank
    return rank >= 3 and transpose_perm(transpose) == [*range(rank - 2), rank - 1, rank - 2]


class FoldBatchIntoContraction(PatternRule):
    """`sum(matmul(transpose(x), dy), axes = [0 .. b-1])`, where `x` is `[b..., k, m]`, the
    transpose swaps its last two axes and `dy` is `[b..., k, n]` (a weight gradient `xᵀ·dy` summed
    over the batch), is one contraction over the batch and `k` together:
    `matmul(transpose(reshape(x, [B·k, m])), reshape(dy, [B·k, n]))`, `[m, n]`, with B the
    product of the batch dimensions. Only when the product is read by the sum alone."""

    pattern = Pat("graph.sum",
                  Pat("graph.matmul", Pat("graph.transpose", Pat.var("x"), where=_swaps_last_two), Pat.var("dy"),
                      name="product", one_use=True),
                  name="total", attrs={"keep": False})

    def rewrite(self, rewriter: PatternRewriter, total: Operation, product: Operation, x: Value, dy: Value) -> None:
        batch_rank = x.type.rank - 2
        if reduction_axes(total) != list(range(batch_rank)) or dy.type.shape[:-2] != x.type.shape[:-2]:
            return
        rows = math.prod(x.type.shape[:-1])
        attributes = {"path": product.attributes["path"]} if "path" in product.attributes else {}
        loc = product.loc
        flat_x = rewriter.create("graph.reshape", [x], {**attributes, "shape": [rows, x.type.shape[-1]]}, loc=loc)
        left = rewriter.create("graph.transpose", flat_x.results, {**attributes, "perm": [1, 0]}, loc=loc)
        right = rewriter.create("graph.reshape", [dy], {**attributes, "shape": [rows, dy.type.shape[-1]]}, loc=loc)
        rewriter.replace_op(total, rewriter.create("graph.matmul", [left.result, right.result], attributes, loc=loc))


def _exact_f32_fold(name: str, scalars: list[Any]) -> Any:
    """numpy's float32 result of `name` on float32 scalars, in pure Python; None where not sure.

    Only finite operands and results, and only the correctly rounded ops: anything else
    (inf, nan, overflow, a zero divisor, exp, ...) is left to numpy.
    """
    try:
        args = [_F32.unpack(_F32.pack(float(s)))[0] for s in scalars]
        if not all(math.isfinite(a) for a in args):
            return None
        if name in _EXACT_COMPARE:
            return _EXACT_COMPARE[name](args[0], args[1])
        if name in ("graph.maximum", "graph.minimum"):
            if args[0] == args[1]:
                return None  # signed zeros: leave numpy's choice to numpy
            return max(args) if name == "graph.maximum" else min(args)
        if name in _EXACT_UNARY:
            result = _EXACT_UNARY[name](args[0])
        elif name in _EXACT_ARITH:
            result = _EXACT_ARITH[name](args[0], args[1])
        else:
            return None
        rounded = _F32.unpack(_F32.pack(result))[0]
    except (OverflowError, ValueError, ZeroDivisionError, TypeError):
        return None
    return rounded if math.isfinite(rounded) else None


def _exact_bf16_cast(scalar: Any) -> float | None:
    """ml_dtypes' bfloat16 of a float32 scalar (to nearest, ties to even; overflow to inf), in pure Python,
    so folding a bf16 model's casts imports neither numpy nor ml_dtypes; None for NaN or a value beyond f32."""
    try:
        bits = _F32_BITS.unpack(_F32.pack(float(scalar)))[0]
    except (OverflowError, TypeError):
        return None
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: its payload is numpy's to keep
        return None
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return _F32.unpack(_F32_BITS.pack(bits))[0]


#: Integer division and power round differently across backends; those fold for floats only.
_FLOAT_ONLY = frozenset({"graph.div", "graph.pow"})
#: Ops whose fold computes the result from the operands' scalars: the elementwise ops but
#: `where` (which `SelectOfKnown` folds).
_COMPUTED = ops_with(Trait.ELEMENTWISE) - ops_with(Trait.SELECT)


class FoldSplatConstants(RewritePattern):
    """An elementwise, compare, cast or splat-preserving shape op whose operands are all
    splat constants becomes a splat constant, computed in the operand dtype as the
    backends compute it."""

    op_names = tuple(sorted(_COMPUTED | SPLAT_PRESERVING_OPS))

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        if not op.operands:
            return False
        scalars = []
        for v in op.operands:  # most ops fail on their first operand: stop there
            scalar = splat_value(v)
            if scalar is None:
                return False
            scalars.append(scalar)
        folded = self.fold(op, scalars)
        if folded is None:
            return False
        const = rewriter.create("graph.const", [], {"value": folded}, [op.result.type], loc=op.loc)
        rewriter.replace_op(op, const)
        return True

    def fold(self, op: Operation, scalars: list[Any]) -> Any:
        """The folded scalar, or None when folding would not be exact or portable."""
        in_dtype = op.operands[0].type.dtype
        out_dtype = op.result.type.dtype
        if op.name in SPLAT_PRESERVING_OPS:
            return scalars[0]
        if in_dtype == "f32" and out_dtype in ("f32", "i1") and op.name != "graph.cast":
            exact = _exact_f32_fold(op.name, scalars)
            if exact is not None:
                return exact
        if op.name == "graph.cast" and in_dtype == "f32" and out_dtype == "bf16":
            exact = _exact_bf16_cast(scalars[0])
            if exact is not None:
                return exact
        import numpy as np

        unary, binary = numpy_unary(), numpy_binary()
        in_type, out_type = numpy_dtype(in_dtype), numpy_dtype(out_dtype)
        args = [in_type(s) for s in scalars]
        with np.errstate(all="ignore"):
            if op.name == "graph.cast":
                if out_dtype not in FLOAT_DTYPES and out_dtype != "i1" and not np.isfinite(args[0]):
                    return None
                result = np.array(args[0]).astype(out_type)[()]
            elif op.name in unary:
                if in_dtype == "i1":
                    return None
                result = unary[op.name](args[0])
            else:
                if in_dtype == "i1" or (op.name in _FLOAT_ONLY and in_dtype not in FLOAT_DTYPES):
                    return None
                result = binary[op.name](args[0], args[1])
        return _python_scalar(out_type(result), out_dtype)


def canonical_patterns(fast_math: bool = False) -> list[RewritePattern]:
    """The canonicalization patterns of the graph dialect."""
    return [
        FoldSplatConstants(),
        AddZero(),
        SubZero(),
        MulOne(),
        DivOne(),
        PowOne(),
        MulZero(fast_math),
        SelfInverse(),
        NoOpShape(),
        ComposeShapeChains(),
        SelectOfKnown(),
        FoldBatchIntoContraction(),
    ]


@register_pass
@define
class Canonicalize(Pass):
    """Rewrites every `graph.func` to canonical form with the patterns above, to a fixpoint.

    Guarantees: afterwards no pattern applies and no pure op is unused; the
    values computed by the graph's returns and emits are unchanged (up to the
    sign of a zero, see the module docstring). Option `fast-math` also folds
    `x * 0 → 0` for floats.
    """

    name = "canonicalize"
    summary = "fold identities, shape-op chains and splat constants"
    fast_math: bool = False

    def run(self, unit: CompilationUnit) -> None:
        self._run_module(unit.require_module(self.name))

    def _run_module(self, module: Operation) -> None:
        driver = GreedyRewriteDriver(canonical_patterns(self.fast_math))
        for func in graph_funcs(module):
            for region in func.regions:
                for block in region.blocks:
                    driver.rewrite_block(block)
