"""Operand patterns (`Pat`), rules over them, and the rewriter's operations and nested driver."""

from __future__ import annotations

import pytest
import sexpgpu.dialects  # noqa: F401  (registers the ops)
from sexpgpu.dialects.core import Operation, Region
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module, print_op
from sexpgpu.dialects.rewriting import (
    GreedyRewriteDriver,
    Pat,
    PatternRewriter,
    PatternRule,
    apply_patterns_greedily,
)


def func_of(body: str, inputs: str = "x, y", dtype: str = "tensor<4xf32>") -> Operation:
    lines = [f'  %{name} = graph.input {{name = "{name}", role = "batch"}} : () -> {dtype}\n'
             for name in inputs.split(", ")]
    module = parse_module("graph.func @f {\n" + "".join(lines) + body + "}\n", "t.sxir", verify=False)
    return next(module.body.ops)


def op_named(func: Operation, result_hint: str) -> Operation:
    return next(op for op in func.body.ops if op.results and op.result.name_hint == result_hint)


SCALE = (
    "  %c = graph.const {value = 2.0} : () -> tensor<4xf32>\n"
    "  %m = graph.mul %x, %c {path = \"model\"} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
    "  %r = graph.mul %c, %x : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
    "  %s = graph.add %m, %m : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
    "  %t = graph.add %m, %r : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
    '  graph.return %s, %t {names = ["s", "t"]} : (tensor<4xf32>, tensor<4xf32>) -> ()\n'
)


def test_nested_operand_patterns_bind_ops_and_values():
    func = func_of(SCALE)
    scaled = Pat("graph.mul", Pat.var("x"), Pat("graph.const", name="c"), name="mul")
    bindings = scaled.match(op_named(func, "m"))
    assert bindings is not None
    assert bindings["x"] is func.body.first_op.result  # a value
    assert bindings["c"] is op_named(func, "c")  # an op
    assert bindings["mul"] is op_named(func, "m")
    assert scaled.match(op_named(func, "r")) is None  # the constant on the other side
    assert Pat("graph.add", scaled, Pat.var()).match(op_named(func, "t"))["c"] is op_named(func, "c")


def test_commutative_patterns_try_both_operand_orders():
    func = func_of(SCALE)
    either_side = Pat("graph.mul", Pat.var("x"), Pat("graph.const", name="c"), commutative=True)
    for name in ("m", "r"):
        bindings = either_side.match(op_named(func, name))
        assert bindings is not None and bindings["x"].name_hint == "x" and bindings["c"].name == "graph.const"


def test_a_name_bound_twice_binds_the_same_value():
    func = func_of(SCALE)
    doubled = Pat("graph.add", Pat.var("a"), Pat.var("a"))
    assert doubled.match(op_named(func, "s"))["a"] is op_named(func, "m").result
    assert doubled.match(op_named(func, "t")) is None


def test_one_use_attribute_and_kind_constraints():
    func = func_of(SCALE)
    m, t = op_named(func, "m"), op_named(func, "t")
    # %m is read three times (twice by %s, once by %t), %r once.
    assert Pat("graph.add", Pat("graph.mul", one_use=True), Pat.var()).match(t) is None
    assert Pat("graph.add", Pat.var(), Pat("graph.mul", one_use=True)).match(t) is not None
    assert Pat("graph.mul", attrs={"path": "model"}).match(m) is not None
    assert Pat("graph.mul", attrs={"path": lambda path: path.startswith("mod")}).match(m) is not None
    assert Pat("graph.mul", attrs={"path": "other"}).match(m) is None
    assert Pat("graph.mul", attrs={"missing": 1}).match(m) is None
    assert Pat({"graph.add", "graph.sub"}).match(t) is not None
    assert Pat(lambda op: op.family == "binary", where=lambda op: op.operands[0] is op.operands[1]).match(t) is None


def test_attribute_constraints_tell_true_one_and_one_point_zero_apart():
    func = func_of("  %s = graph.sum %x {axes = [0], keep = true} : (tensor<4xf32>) -> tensor<1xf32>\n"
                   '  graph.return %s {names = ["s"]} : (tensor<1xf32>) -> ()\n', inputs="x")
    total = op_named(func, "s")
    assert Pat("graph.sum", attrs={"axes": (0,), "keep": True}).match(total) is not None
    assert Pat("graph.sum", attrs={"keep": 1}).match(total) is None
    assert Pat("graph.sum", attrs={"axes": [0.0]}).match(total) is None


class FoldAddOfDouble(PatternRule):
    """`add(x, x)` → `mul(x, 2)`, declined for anything but f32."""

    pattern = Pat("graph.add", Pat.var("x"), Pat.var("x"))

    def rewrite(self, rewriter: PatternRewriter, x, root) -> None:
        if x.type.dtype != "f32":
            return
        two = rewriter.create("graph.const", [], {"value": 2.0}, [x.type], loc=root.loc)
        rewriter.replace_op(root, rewriter.create("graph.mul", [x, two.result], loc=root.loc))


def test_rules_rewrite_with_their_bindings_and_may_decline():
    func = func_of(SCALE)
    assert FoldAddOfDouble.op_names == ("graph.add",)
    assert apply_patterns_greedily(func.body, [FoldAddOfDouble()])
    text = print_op(func)
    assert "graph.add %m, %r" in text and "graph.mul %m, %0" in text
    ints = func_of("  %s = graph.add %x, %x : (tensor<4xi32>, tensor<4xi32>) -> tensor<4xi32>\n"
                   '  graph.return %s {names = ["s"]} : (tensor<4xi32>) -> ()\n', inputs="x", dtype="tensor<4xi32>")
    before = print_op(ints)
    assert not apply_patterns_greedily(ints.body, [FoldAddOfDouble()])
    assert print_op(ints) == before


def test_nested_driver_rewrites_every_func_of_a_module():
    module = parse_module(
        "".join(f'graph.func @{name} {{\n  %x = graph.input {{name = "x", role = "batch"}} : () -> tensor<4xf32>\n'
                "  %s = graph.add %x, %x : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>\n"
                '  graph.return %s {names = ["s"]} : (tensor<4xf32>) -> ()\n}\n' for name in ("a", "b")),
        "t.sxir")
    assert GreedyRewriteDriver([FoldAddOfDouble()]).rewrite_nested(module)
    assert print_module(module).count("graph.mul %x") == 2
    assert "graph.add" not in print_module(module)


class HoistExpAfterNeg(PatternRule):
    """Moves a copy of each neg's operand computation after it, exercising insert-after."""

    pattern = Pat("graph.neg", Pat.var("x"), name="neg")

    def rewrite(self, rewriter: PatternRewriter, neg, x) -> None:
        if neg.attributes.get("done"):
            return
        neg.attributes["done"] = True
        after = rewriter.create("graph.exp", [neg.result], after=neg)
        copy = Operation.create("graph.tanh", [after.result], [after.result.type])
        rewriter.insert_op_after(copy, after)


def test_insert_after_places_ops_right_after_the_anchor():
    func = func_of("  %n = graph.neg %x : (tensor<4xf32>) -> tensor<4xf32>\n"
                   '  graph.return %n {names = ["n"]} : (tensor<4xf32>) -> ()\n', inputs="x")
    GreedyRewriteDriver([HoistExpAfterNeg()], erase_dead=False).rewrite_block(func.body)
    assert [op.name for op in func.body.ops] == ["graph.input", "graph.neg", "graph.exp", "graph.tanh", "graph.return"]


def test_move_into_region_and_clone():
    func = func_of(SCALE)
    holder = Operation.create("graph.func", attributes={"sym_name": "holder"}, regions=[Region.with_block()])
    func.parent.insert_after(holder, func)
    driver = GreedyRewriteDriver([])
    rewriter = PatternRewriter(driver)
    ret = func.body.last_op
    moved = op_named(func, "t")
    rewriter.move_op_into(moved, holder.regions[0])
    assert moved.parent is holder.body and moved not in list(func.body.ops)
    assert ret in driver.queued and moved in driver.queued  # the mover and its readers are revisited
    rewriter.move_op_into(op_named(func, "r"), holder.regions[0], before=moved)
    assert [op.result.name_hint for op in holder.body.ops] == ["r", "t"]
    with pytest.raises(ValueError, match="not in that region"):
        rewriter.move_op_into(op_named(func, "s"), func.regions[0], before=moved)

    original = print_op(holder)
    copy = holder.clone()
    assert print_op(copy) == original
    copied_ops = list(copy.body.ops)
    assert all(a is not b for a, b in zip(copied_ops, holder.body.ops))
    assert copied_ops[1].operands[1] is copied_ops[0].result  # operands inside the copy are the copy's
    assert copied_ops[0].operands[0] is op_named(func, "c").result  # those from outside are kept
