"""The traits table's queries and the graph dialect's typed accessors."""

from __future__ import annotations

from typing import Any

from _graph_helpers import make_func
from sexpgpu.dialects.core import REGISTRY, Operation
from sexpgpu.dialects.graph import (
    MatmulDims,
    cast_dtype,
    data_operand,
    emit_collection,
    emit_name,
    func_kind,
    input_name,
    input_role,
    is_input,
    keeps_axes,
    matmul_dims,
    op_axis,
    pad_widths,
    reduction_axes,
    return_names,
    slice_bounds,
    transpose_perm,
)
from sexpgpu.dialects.traits import (
    FAMILIES,
    SPLAT_PRESERVING_OPS,
    Trait,
    has_trait,
    kind_of,
    ops_with,
    traits_of,
)


def test_queries_take_an_op_or_its_name() -> None:
    func = make_func({"x": ((2,), "f32")}, lambda g: {"y": g.neg(g.inputs["x"])})
    neg = next(op for op in func.body.ops if op.name == "graph.neg")
    assert has_trait(neg, Trait.INVOLUTION) and has_trait("graph.neg", Trait.INVOLUTION)
    assert kind_of(neg) is Trait.UNARY and neg.family == "unary"
    assert not has_trait("graph.exp", Trait.INVOLUTION)
    assert traits_of("exp.run") == frozenset() and not has_trait("exp.run", Trait.PURE)


def test_ops_with_asks_for_every_trait_given() -> None:
    assert ops_with(Trait.REDUCTION, Trait.IDEMPOTENT) == {"graph.max", "graph.min"}
    assert ops_with(Trait.BINARY, Trait.COMMUTATIVE) == {"graph.add", "graph.mul"}
    assert ops_with(Trait.VIEW) < ops_with(Trait.SHAPE)
    assert SPLAT_PRESERVING_OPS == ops_with(Trait.VIEW) | {"graph.max", "graph.min"}


def test_purity_and_families_come_from_the_table() -> None:
    for name in ("graph.input", "graph.return", "graph.metric", "graph.add", "graph.iota"):
        assert REGISTRY.ops[name].pure == has_trait(name, Trait.PURE)
    assert FAMILIES[:3] == ("input", "const", "unary") and "emit" in FAMILIES


def test_accessors_read_the_attributes_passes_read() -> None:
    def body(g: Any) -> dict[str, Any]:
        x, idx = g.inputs["x"], g.inputs["idx"]
        g.create("graph.metric", [g.sum(x, axes=[0, 1], keep=False)], {"name": "total"})
        return {
            "t": g.transpose(x, perm=[1, 0]),
            "s": g.slice(x, axis=1, start=1, end=3),
            "p": g.pad(x, axis=0, before=1, after=2),
            "m": g.max(x, axes=[1], keep=True),
            "c": g.cast(x, dtype="bf16"),
            "g": g.take(x, idx, axis=0),
            "u": g.scatter_add(idx, g.inputs["upd"], axis=0, dim=5),
            "b": g.matmul(g.inputs["a"], g.inputs["w"]),
        }

    func = make_func({"x": ((2, 4), "f32", "param"), "idx": ((3,), "i32", "batch"), "upd": ((3, 4), "f32"),
                      "a": ((6, 2, 3, 4), "f32"), "w": ((4, 5), "f32")}, body, kind="train")
    ops: dict[str, Operation] = {}
    for op in func.body.ops:
        ops.setdefault(op.name, op)
    assert func_kind(func) == "train"
    assert return_names(func.body.last_op) == ["t", "s", "p", "m", "c", "g", "u", "b"]
    x = ops["graph.input"]
    assert (input_name(x), input_role(x), is_input(x, "param"), is_input(x, "batch")) == ("x", "param", True, False)
    assert (emit_name(ops["graph.metric"]), emit_collection(ops["graph.metric"])) == ("total", "metrics")
    assert emit_collection("graph.observe") == "observed"
    assert (reduction_axes(ops["graph.sum"]), keeps_axes(ops["graph.sum"])) == ([0, 1], False)
    assert (reduction_axes(ops["graph.max"]), keeps_axes(ops["graph.max"])) == ([1], True)
    assert transpose_perm(ops["graph.transpose"]) == [1, 0]
    assert slice_bounds(ops["graph.slice"]) == (1, 1, 3)
    assert pad_widths(ops["graph.pad"]) == (0, 1, 2)
    assert op_axis(ops["graph.take"]) == 0
    assert cast_dtype(ops["graph.cast"]) == "bf16"
    assert data_operand(ops["graph.take"]) is x.result
    assert data_operand(ops["graph.scatter_add"]).type.shape == (3, 4)
    assert matmul_dims(ops["graph.matmul"]) == MatmulDims((6, 2), 3, 4, 5)
