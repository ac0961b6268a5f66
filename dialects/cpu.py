"""The `cpu` dialect: what the numpy interpreter runs in place of some `graph` op patterns.

`lower-cpu` rewrites a `graph.func` into these ops where one numpy call (or a
cheaper storage layout) does the work of several graph ops; everything else
stays a `graph` op. Each op is pure, computes what the graph ops it replaces
computed, bit for bit, and verifies its shapes as the graph ops do:

    cpu.pad_sum %a, %b {axis, starts}          zeros with each operand at its start along `axis`
    cpu.matmul_sum %a, %b                      Σ_i a[i] @ b[i] over the batch axis 0
    cpu.matmul %a, %b {layout}                 graph.matmul, stored as transpose(result, layout)
    cpu.broadcasting_binary %x, %y {kind}      graph.<kind> under numpy broadcasting
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .core import OpDef, Operation, TensorType, VerifyError, register_op
from .graph import (
    MatmulOp,
    ShapeError,
    broadcast_shapes,
    show_shape,
)
from .traits import Trait, ops_with

#: The float modes of the numpy interpreter: each float dtype computed as itself ("native": bf16
#: and f16 computed in float32 and rounded once per op) or every float dtype in float64 ("f64").
FLOAT_MODES = ("native", "f64")
#: Dtypes whose results a float mode computes wider and rounds per op: such an op writes no buffer.
ROUNDED_DTYPES = {"native": frozenset({"bf16", "f16"}), "f64": frozenset()}


def _same_dtypes(name: str, a: TensorType, b: TensorType) -> None:
    if a.dtype != b.dtype:
        raise ShapeError(f"'{name}' operands have dtypes {a.dtype} and {b.dtype}")


@register_op
class PadSumOp(OpDef):
    """`cpu.pad_sum %a, %b, ... {axis, starts}`: a tensor of the result type, zero except where
    operand i sits, from `starts[i]` along `axis` (disjoint ranges); there it is operand i plus
    zero (the adds it replaces turned -0.0 into +0.0). The result type is written out: the
    ranges need not cover the axis."""

    name = "cpu.pad_sum"
    family = "shape"
    required_attrs = ("axis", "starts")

    @classmethod
    def verify(cls, op: Operation) -> None:
        super().verify(op)
        if not op.operands:
            raise VerifyError("'cpu.pad_sum' needs at least one operand", op)
        axis, starts = op.attributes["axis"], list(op.attributes["starts"])
        result = op.results[0].type
        if len(starts) != len(op.operands):
            raise VerifyError(f"'cpu.pad_sum' has {len(op.operands)} operands but {len(starts)} starts", op)
        if not 0 <= axis < result.rank:
            raise VerifyError(f"'cpu.pad_sum' axis {axis} is out of range for {result}", op)
        ranges = []
        for value, start in zip(op.operands, starts):
            piece = value.type
            off_axis = [d for i, d in enumerate(piece.shape) if i != axis]
            if (piece.dtype != result.dtype or piece.rank != result.rank
                    or off_axis != [d for i, d in enumerate(result.shape) if i != axis]):
                raise VerifyError(f"'cpu.pad_sum' operand {piece} does not fit {result} along axis {axis}", op)
            if not 0 <= start <= start + piece.shape[axis] <= result.shape[axis]:
                raise VerifyError(f"'cpu.pad_sum' operand {piece} at {start} overruns axis {axis} of {result}", op)
            ranges.append((start, start + piece.shape[axis]))
        ordered = sorted(ranges)
        for (_, end), (start, _) in zip(ordered, ordered[1:]):
            if start < end:
                raise VerifyError(f"'cpu.pad_sum' ranges {ordered} overlap", op)


@register_op
class MatmulSumOp(OpDef):
    """`cpu.matmul_sum %a, %b`: Σ_i a[i] @ b[i] for a [B M K] and b [B K N], a [M N] result
    (sum(matmul(a, b)) over axis 0 without the [B M N] product)."""

    name = "cpu.matmul_sum"
    family = "contract"
    num_operands = 2

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        a, b = operands
        _same_dtypes(cls.name, a, b)
        if a.rank != 3 or b.rank != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise ShapeError(f"'cpu.matmul_sum' needs [B M K] and [B K N], got {show_shape(a.shape)} "
                             f"and {show_shape(b.shape)}")
        return [a.with_shape((a.shape[1], b.shape[2]))]


@register_op
class LayoutMatmulOp(OpDef):
    """`cpu.matmul %a, %b {layout}`: `graph.matmul`, its product stored as the contiguous array
    transpose(product, layout) (so that transpose of it is a view); `layout` keeps the last axis
    last, as BLAS writes the rows of a product at any stride."""

    name = "cpu.matmul"
    family = "contract"
    num_operands = 2
    required_attrs = ("layout",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        (product,) = MatmulOp.infer(operands, attrs)
        layout = list(attrs["layout"])
        if sorted(layout) != list(range(product.rank)) or layout[-1] != product.rank - 1:
            raise ShapeError(f"'cpu.matmul' layout {layout} is not a permutation of the axes of "
                             f"{show_shape(product.shape)} keeping the last axis last")
        return [product]


#: The graph ops `cpu.broadcasting_binary` stands for, by the `kind` it names them with.
_COMPARE_KINDS = frozenset(name.removeprefix("graph.") for name in ops_with(Trait.COMPARE))
BROADCASTING_KINDS = frozenset(name.removeprefix("graph.") for name in ops_with(Trait.BINARY)) | _COMPARE_KINDS


@register_op
class BroadcastingBinaryOp(OpDef):
    """`cpu.broadcasting_binary %x, %y {kind = "mul"}`: `graph.<kind>` of operands whose shapes
    broadcast as numpy's do (aligned from the right), in place of a `graph.broadcast` or a full
    splat constant feeding that op: the smaller operand is read, never expanded."""

    name = "cpu.broadcasting_binary"
    family = "binary"
    num_operands = 2
    required_attrs = ("kind",)

    @classmethod
    def infer(cls, operands: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        kind = attrs["kind"]
        if kind not in BROADCASTING_KINDS:
            raise ShapeError(f"'cpu.broadcasting_binary' kind must be a binary or compare op, got {kind!r}")
        x, y = operands
        _same_dtypes(cls.name, x, y)
        dtype = "i1" if kind in _COMPARE_KINDS else x.dtype
        return [TensorType(broadcast_shapes(x.shape, y.shape), dtype)]
