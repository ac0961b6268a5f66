"""Tracing: one graph op per primitive, explicit broadcasts and constants, located static shape errors."""

import pytest
from sexpgpu.dialects.core import TensorType
from sexpgpu.frontend.evaluator import Evaluator
from sexpgpu.frontend.tracer import Tensor, Trace, tracing

from sexpgpu.diagnostics import SxError


def trace_text(text: str, **inputs: tuple[tuple[int, ...], str]) -> tuple[Trace, object]:
    """Evaluate `text` with batch inputs bound as globals while a trace is active."""
    evaluator = Evaluator()
    trace = Trace("t", "train")
    with tracing(trace):
        for name, (shape, dtype) in inputs.items():
            evaluator.globals[name] = trace.input("batch", name, TensorType(shape, dtype))
        value = evaluator.eval_text(text, "t.sx")[-1]
    return trace, value


def op_names(trace: Trace) -> list[str]:
    return [op.name for op in trace.func.body.ops if op.name != "graph.input"]


def test_scalar_operand_is_a_splat_constant():
    trace, y = trace_text("(* x 2)", x=((4, 8), "f32"))
    assert op_names(trace) == ["graph.const", "graph.mul"]
    const = next(op for op in trace.func.body.ops if op.name == "graph.const")
    assert const.attributes["value"] == 2.0 and const.result.type == TensorType((4, 8), "f32")
    assert isinstance(y, Tensor) and y.shape == (4, 8)


def test_implicit_broadcasting_is_an_explicit_op():
    trace, y = trace_text("(+ x b)", x=((2, 3, 8), "f32"), b=((8,), "f32"))
    assert op_names(trace) == ["graph.broadcast", "graph.add"]
    assert y.shape == (2, 3, 8)


def test_ops_carry_the_users_location():
    trace, _ = trace_text("(def y 1)\n(exp\n  x)", x=((3,), "f32"))
    (op,) = [op for op in trace.func.body.ops if op.name == "graph.exp"]
    assert (op.loc.file, op.loc.line, op.loc.col) == ("t.sx", 2, 1)


def test_shape_mismatch_names_both_shapes_at_the_operand():
    """verbs.md: the caret goes under the operand that fails to broadcast, spanning it."""
    with pytest.raises(SxError) as err:
        trace_text("(+ a b)", a=((4, 64, 128), "f32"), b=((64, 256), "f32"))
    assert err.value.message == "shapes [4, 64, 128] and [64, 256] do not broadcast"
    assert (err.value.loc.line, err.value.loc.col, err.value.loc.end_col) == (1, 6, 7)


@pytest.mark.parametrize("text,col,end", [
    ("(+ b (exp  a))", 6, 14),     # a list operand: spanned to its closing bracket
    ("(* b b a 2.0)", 8, 9),       # a variadic call: the argument that fails
    ("(- (exp b) a)", 12, 13),
    ("(where (> a 0.0) a b)", 20, 21),
    ("(maximum a b)", 12, 13),
])
def test_shape_mismatch_points_at_the_failing_operand(text, col, end):
    with pytest.raises(SxError) as err:
        trace_text(text, a=((4, 64, 128), "f32"), b=((64, 256), "f32"))
    assert "do not broadcast" in err.value.message
    assert (err.value.loc.col, err.value.loc.end_col) == (col, end)


def test_shape_mismatch_of_an_accumulated_operand_stays_at_the_form():
    with pytest.raises(SxError) as err:
        trace_text("(+ a a b)", a=((4, 64, 128), "f32"), b=((64, 256), "f32"))
    assert (err.value.loc.col, err.value.loc.end_col) == (8, 9)
    with pytest.raises(SxError) as err:
        trace_text("(+ b b a)", a=((4, 64, 128), "f32"), b=((64, 256), "f32"))
    assert err.value.loc.col == 8


def test_matmul_shape_error():
    with pytest.raises(SxError, match=r"matmul shapes \[2, 3\] and \[4, 5\] do not contract"):
        trace_text("(matmul a b)", a=((2, 3), "f32"), b=((4, 5), "f32"))


def test_dtype_mismatch_is_an_error():
    with pytest.raises(SxError, match="operands have dtypes f32 and i32"):
        trace_text("(+ a b)", a=((2,), "f32"), b=((2,), "i32"))


def test_dim_shape_numel_are_compile_time_ints():
    trace, value = trace_text("[(dim x 1) (dim x -1) (numel x) (shape x)]", x=((4, 65), "i32"))
    assert value == [65, 65, 260, [4, 65]]
    assert op_names(trace) == []


def test_max_reduces_a_tensor_and_maximum_is_elementwise():
    trace, y = trace_text("(max x -1 :keep true)", x=((4, 8), "f32"))
    assert op_names(trace) == ["graph.max"] and y.shape == (4, 1)
    trace, y = trace_text("(maximum x 0.0)", x=((4, 8), "f32"))
    assert op_names(trace) == ["graph.const", "graph.maximum"]
    with pytest.raises(SxError, match="'maximum'"):
        trace_text("(max x x)", x=((4,), "f32"))


def test_sum_axes_and_keep():
    _, y = trace_text("(sum x [0 2])", x=((2, 3, 4), "f32"))
    assert y.shape == (3,)
    _, y = trace_text("(sum x)", x=((2, 3, 4), "f32"))
    assert y.shape == ()


def test_shape_primitives():
    _, y = trace_text("(slice x -1 1 3)", x=((2, 5), "f32"))
    assert y.shape == (2, 2)
    _, y = trace_text("(transpose x 0 2)", x=((2, 3, 4), "f32"))
    assert y.shape == (4, 3, 2)
    _, y = trace_text("(permute x [2 0 1])", x=((2, 3, 4), "f32"))
    assert y.shape == (4, 2, 3)
    _, y = trace_text("(reshape x [3 -1])", x=((2, 3, 4), "f32"))
    assert y.shape == (3, 8)
    _, y = trace_text("(expand-dims (squeeze x 0) -1)", x=((1, 3), "f32"))
    assert y.shape == (3, 1)
    _, y = trace_text("(concat [x x] 1)", x=((2, 3), "f32"))
    assert y.shape == (2, 6)


def test_index_and_cast():
    _, y = trace_text("(take table idx 0)", table=((10, 4), "f32"), idx=((2, 3), "i32"))
    assert y.shape == (2, 3, 4)
    _, y = trace_text("(one-hot idx 5)", idx=((3,), "i32"))
    assert (y.shape, y.dtype) == ((3, 5), "f32")
    _, y = trace_text("(cast (> x 0.0) bool)", x=((3,), "f32"))
    assert y.dtype == "i1"
    _, y = trace_text("(where (> x 0.0) x 0)", x=((3,), "f32"))
    assert (y.shape, y.dtype) == ((3,), "f32")


def test_tensor_op_outside_a_trace_is_an_error():
    with pytest.raises(SxError, match="'iota' called at top level"):
        Evaluator().eval_text("(iota [2 2] 0)")


def test_emits():
    trace, _ = trace_text("(metric loss (mean x))\n(counter tokens (numel x))", x=((2, 3), "f32"))
    assert trace.metrics.keys() == {"loss"}
    assert trace.counters == {"tokens": 6}
    with pytest.raises(SxError, match=r"metric m must be a scalar, got a tensor of shape \[2, 3\]"):
        trace_text("(metric m x)", x=((2, 3), "f32"))


def test_prelude_functions_trace_to_primitives():
    trace, y = trace_text("(softmax x -1)", x=((2, 5), "f32"))
    assert op_names(trace) == [
        "graph.max", "graph.broadcast", "graph.sub", "graph.exp", "graph.sum", "graph.broadcast", "graph.div",
    ]  # fmt: skip
    trace, y = trace_text("(cross-entropy logits targets)", logits=((2, 3, 7), "f32"), targets=((2, 3), "i32"))
    assert y.shape == () and "graph.take_along" in op_names(trace)
    _, y = trace_text("(causal-mask 4)")
    assert (y.shape, y.dtype) == ((4, 4), "f32")
    _, y = trace_text("(merge-heads (split-heads x 4))", x=((2, 3, 8), "f32"))
    assert y.shape == (2, 3, 8)
