"""Every registered `graph.*` op is covered: a row in the traits table, numpy reference semantics
where folding computes it, an interpreter kernel, an autodiff rule or a declared "no gradient",
and a verifier. A new op lacking one fails `test_every_graph_op_is_covered`, which names it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from _graph_helpers import make_func
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.backends.interpreter.kernels import BUILDERS
from sexpgpu.dialects.core import REGISTRY, OpDef, TensorType, register_op
from sexpgpu.dialects.graph import graph_op
from sexpgpu.dialects.graph_semantics import (
    FLOAT64_ARITH,
    FLOAT64_COMPARE,
    FLOAT64_UNARY,
    numpy_binary,
    numpy_unary,
)
from sexpgpu.dialects.traits import KINDS, OP_TRAITS, Trait, has_trait, kind_of
from sexpgpu.passes.autodiff import NO_GRADIENT, RULES

#: Ops the interpreter's compiler lowers itself, with no kernel: the structure, inputs, values
#: fixed at compile time and emits (`test_ops_the_compiler_lowers_itself_run` runs each).
LOWERED_BY_THE_COMPILER = (Trait.FUNC, Trait.INPUT, Trait.CONSTANT_LIKE, Trait.EMIT)
#: Where the folding passes look up what an op computes, by the op's kind.
SEMANTICS = {
    Trait.UNARY: (numpy_unary(), FLOAT64_UNARY),
    Trait.BINARY: (numpy_binary(), FLOAT64_ARITH),
    Trait.COMPARE: (numpy_binary(), FLOAT64_COMPARE),
}


def graph_ops() -> list[type[OpDef]]:
    return [opdef for name, opdef in REGISTRY.ops.items() if name.startswith("graph.")]


def _overrides(opdef: type[OpDef], method: str) -> bool:
    return getattr(opdef, method).__func__ is not getattr(OpDef, method).__func__


def coverage_gaps(opdefs: Iterable[type[OpDef]]) -> list[str]:
    """`<op>: <what it lacks>` for each thing each op kind lacks."""
    gaps = []
    for opdef in opdefs:
        name = opdef.name
        lacks = []
        traits = OP_TRAITS.get(name)
        if traits is None:
            lacks.append("no row in the traits table (dialects/traits.py)")
        elif sum(t in KINDS for t in traits) != 1:
            lacks.append("not exactly one kind trait in its traits row")
        elif opdef.family != kind_of(name).value:
            lacks.append(f"family {opdef.family!r} is not its kind's ({kind_of(name).value!r})")
        for kind, tables in SEMANTICS.items():
            if has_trait(name, kind) and any(name not in table for table in tables):
                lacks.append("no numpy reference semantics (dialects/graph_semantics.py)")
        if name not in BUILDERS and not any(has_trait(name, t) for t in LOWERED_BY_THE_COMPILER):
            lacks.append("no interpreter kernel (backends/interpreter/kernels.py)")
        if name in RULES and name in NO_GRADIENT:
            lacks.append("both an autodiff rule and a place in NO_GRADIENT")
        elif name not in RULES and name not in NO_GRADIENT:
            lacks.append("no autodiff rule and no place in NO_GRADIENT (passes/autodiff.py)")
        if not (_overrides(opdef, "infer") or _overrides(opdef, "verify")
                or getattr(opdef, "generic_verify_suffices", False)):
            lacks.append("no verifier (an OpDef infer or verify, or generic_verify_suffices)")
        gaps += [f"{name}: {lack}" for lack in lacks]
    return gaps


def test_every_graph_op_is_covered() -> None:
    gaps = coverage_gaps(graph_ops())
    assert not gaps, "graph ops lacking coverage:\n" + "\n".join(gaps)


def test_every_traits_row_is_a_registered_op() -> None:
    assert sorted(set(OP_TRAITS) - set(REGISTRY.ops)) == []


def test_an_op_lacking_coverage_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker names a throwaway op for each thing it lacks, and for nothing once it has them."""

    class ThrowawayOp(OpDef):
        name = "graph.throwaway"
        family = "unary"
        num_operands = 1

    register_op(ThrowawayOp)
    try:
        assert coverage_gaps(graph_ops()) == [
            "graph.throwaway: no row in the traits table (dialects/traits.py)",
            "graph.throwaway: no interpreter kernel (backends/interpreter/kernels.py)",
            "graph.throwaway: no autodiff rule and no place in NO_GRADIENT (passes/autodiff.py)",
            "graph.throwaway: no verifier (an OpDef infer or verify, or generic_verify_suffices)",
        ]
        monkeypatch.setitem(OP_TRAITS, ThrowawayOp.name, frozenset({Trait.UNARY, Trait.PURE}))
        assert coverage_gaps([ThrowawayOp])[0] == (
            "graph.throwaway: no numpy reference semantics (dialects/graph_semantics.py)"
        )
        monkeypatch.setitem(OP_TRAITS, ThrowawayOp.name, frozenset({Trait.CAST, Trait.PURE}))
        assert coverage_gaps([ThrowawayOp])[0] == "graph.throwaway: family 'unary' is not its kind's ('cast')"
        monkeypatch.setitem(OP_TRAITS, ThrowawayOp.name, frozenset({Trait.UNARY, Trait.CAST}))
        assert coverage_gaps([ThrowawayOp])[0] == "graph.throwaway: not exactly one kind trait in its traits row"
        monkeypatch.setitem(OP_TRAITS, ThrowawayOp.name, frozenset({Trait.SHAPE, Trait.PURE}))
        monkeypatch.setattr(ThrowawayOp, "family", "shape")
        monkeypatch.setitem(BUILDERS, ThrowawayOp.name, BUILDERS["graph.reshape"])
        monkeypatch.setitem(RULES, ThrowawayOp.name, RULES["graph.reshape"])
        assert coverage_gaps([ThrowawayOp]) == [
            "graph.throwaway: no verifier (an OpDef infer or verify, or generic_verify_suffices)"
        ]
        monkeypatch.setattr(ThrowawayOp, "generic_verify_suffices", True, raising=False)
        assert coverage_gaps([ThrowawayOp]) == []
    finally:
        del REGISTRY.ops[ThrowawayOp.name]


def test_registering_a_graph_op_needs_its_traits_row() -> None:
    class UndeclaredOp(OpDef):
        name = "graph.undeclared"

    with pytest.raises(ValueError, match="graph.undeclared has no row in the traits table"):
        graph_op(UndeclaredOp)
    assert "graph.undeclared" not in REGISTRY.ops


def test_ops_the_compiler_lowers_itself_run() -> None:
    """Input, const, iota, the emits and the return have no kernel: the compiler runs them itself."""
    lowered = sorted(n for n in OP_TRAITS if any(has_trait(n, t) for t in LOWERED_BY_THE_COMPILER))
    assert lowered == ["graph.const", "graph.counter", "graph.func", "graph.input", "graph.iota", "graph.metric",
                       "graph.observe", "graph.return"]

    def body(g: Any) -> dict[str, Any]:
        x = g.inputs["x"]
        two = g.const(2.0, (3,))
        index = g.create("graph.iota", [], {"shape": [3], "axis": 0}, result_types=[TensorType((3,), "i32")]).result
        g.create("graph.metric", [g.sum(x, axes=[0], keep=False)], {"name": "total"})
        g.create("graph.counter", [g.const(3.0)], {"name": "seen"})
        g.create("graph.observe", [x], {"name": "x"})
        return {"y": g.mul(x, two), "i": index}

    result = compile_graph(make_func({"x": ((3,), "f32")}, body))({"x": np.array([1, 2, 3], np.float32)})
    np.testing.assert_array_equal(result.outputs["y"], [2, 4, 6])
    np.testing.assert_array_equal(result.outputs["i"], [0, 1, 2])
    assert result.metrics == {"total": 6.0}
    assert result.counters == {"seen": 3.0}
    np.testing.assert_array_equal(result.observed["x"], [1, 2, 3])
