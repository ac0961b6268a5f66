"""The pattern rewriter and the basic passes as library functions."""

import pytest
import sexpgpu.dialects  # noqa: F401
from sexpgpu.dialects.core import Operation
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module
from sexpgpu.dialects.rewriting import (
    GreedyRewriteDriver,
    PatternRewriter,
    RewritePattern,
    apply_patterns_greedily,
)
from sexpgpu.passes.canonicalize import canonical_patterns
from sexpgpu.passes.cse import eliminate_common_subexpressions, freeze_attribute
from sexpgpu.passes.dce import eliminate_dead_ops
from sexpgpu.passes.manager import CompilationUnit, parse_pipeline, run_pipeline
from sexpgpu.passes.verify import VerificationFailed, verify_errors

HEADER = 'graph.func @f {\n  %x = graph.input {name = "x", role = "batch"} : () -> tensor<4xf32>\n'


def func_of(body: str) -> Operation:
    module = parse_module(HEADER + body + "}\n", "t.sxir", verify=False)
    return next(module.body.ops)


def names(func: Operation) -> list[str]:
    return [op.name for op in func.body.ops]


class ExpToTanh(RewritePattern):
    op_names = ("graph.exp",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        rewriter.replace_op(op, rewriter.create("graph.tanh", op.operands, loc=op.loc))
        return True


class TanhToExp(RewritePattern):
    op_names = ("graph.tanh",)

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> bool:
        rewriter.replace_op(op, rewriter.create("graph.exp", op.operands, loc=op.loc))
        return True


def test_driver_rewrites_new_ops_and_erases_dead_ones():
    func = func_of(
        "  %0 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
        "  %1 = graph.neg %x : (tensor<4xf32>) -> tensor<4xf32>\n"
        '  graph.return %0 {names = ["y"]} : (tensor<4xf32>) -> ()\n'
    )
    assert apply_patterns_greedily(func.body, [ExpToTanh()])
    assert names(func) == ["graph.input", "graph.tanh", "graph.return"]
    assert not apply_patterns_greedily(func.body, [ExpToTanh()])


def test_driver_reports_patterns_that_never_converge():
    func = func_of(
        "  %0 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
        '  graph.return %0 {names = ["y"]} : (tensor<4xf32>) -> ()\n'
    )
    with pytest.raises(RuntimeError, match="did not converge"):
        GreedyRewriteDriver([ExpToTanh(), TanhToExp()], max_rewrites=50).rewrite_block(func.body)


def test_rewriter_refuses_type_changing_replacement():
    func = func_of(
        "  %0 = graph.reshape %x {shape = [2, 2]} : (tensor<4xf32>) -> tensor<2x2xf32>\n"
        '  graph.return %0 {names = ["y"]} : (tensor<2x2xf32>) -> ()\n'
    )

    class Bad(RewritePattern):
        op_names = ("graph.reshape",)

        def match_and_rewrite(self, op, rewriter):
            rewriter.replace_op(op, [op.operands[0]])
            return True

    with pytest.raises(ValueError, match="replacing a tensor<2x2xf32> value"):
        apply_patterns_greedily(func.body, [Bad()])


def test_canonical_patterns_reach_a_fixpoint_on_a_long_chain():
    body = "".join(f"  %{i + 1} = graph.neg %{i if i else 'x'} : (tensor<4xf32>) -> tensor<4xf32>\n" for i in range(200))
    func = func_of(body.replace("%0 ", "%x ") + '  graph.return %200 {names = ["y"]} : (tensor<4xf32>) -> ()\n')
    apply_patterns_greedily(func.body, canonical_patterns())
    assert names(func) == ["graph.input", "graph.return"]


def test_cse_then_dce():
    func = func_of(
        "  %0 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
        "  %1 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
        "  %2 = graph.add %0, %1 : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
        "  %3 = graph.tanh %2 : (tensor<4xf32>) -> tensor<4xf32>\n"
        '  graph.return %2 {names = ["y"]} : (tensor<4xf32>) -> ()\n'
    )
    assert eliminate_common_subexpressions(func.body) == 1
    assert eliminate_dead_ops(func.body) == 1
    assert names(func) == ["graph.input", "graph.exp", "graph.add", "graph.return"]
    add = func.body.last_op.operands[0].op
    assert add.operands[0] is add.operands[1]


def test_freeze_attribute_keeps_kinds_apart():
    assert freeze_attribute(1) != freeze_attribute(1.0) != freeze_attribute(True)
    assert freeze_attribute(float("nan")) == freeze_attribute(float("nan"))
    assert freeze_attribute(0.0) != freeze_attribute(-0.0)
    assert freeze_attribute({"a": [1, 2]}) == freeze_attribute({"a": [1, 2]})


def test_verify_collects_every_error():
    func = func_of(
        "  %0 = graph.exp %x : (tensor<4xf32>) -> tensor<5xf32>\n"
        "  %1 = graph.sum %x {axes = [0]} : (tensor<4xf32>) -> tensor<f32>\n"
        '  graph.return %1 {names = ["y"]} : (tensor<f32>) -> ()\n'
    )
    errors = verify_errors(func)
    assert [e.op.name for e in errors] == ["graph.exp", "graph.sum"]
    unit = CompilationUnit(module=func.parent.parent.parent)
    with pytest.raises(VerificationFailed) as err:
        run_pipeline(unit, "verify")
    assert err.value.render().count("error:") == 2


def test_pipeline_options_and_pass_docstrings():
    (canon,) = parse_pipeline("canonicalize{fast-math=true}")
    assert canon.fast_math is True
    for p in parse_pipeline("verify,canonicalize,cse,dce"):
        assert "Guarantees" in type(p).__doc__


def test_passes_need_ir():
    from sexpgpu.diagnostics import SxError

    for name in ("verify", "canonicalize", "cse", "dce"):
        with pytest.raises(SxError, match="needs IR"):
            run_pipeline(CompilationUnit(path="x.sx", text="(x)"), name)


def test_canonicalize_cse_dce_pipeline_is_idempotent():
    text = (HEADER + "  %0 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
            "  %1 = graph.exp %x : (tensor<4xf32>) -> tensor<4xf32>\n"
            "  %2 = graph.add %0, %1 : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
            '  graph.return %2 {names = ["y"]} : (tensor<4xf32>) -> ()\n}\n')
    unit = CompilationUnit(module=parse_module(text, "t.sxir"))
    once = run_pipeline(unit, "canonicalize,cse,dce").printable()
    twice = run_pipeline(unit, "canonicalize,cse,dce").printable()
    assert once == twice == print_module(unit.module)
