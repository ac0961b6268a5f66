"""The autodiff pass against central finite differences in float64, one test per op rule."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
from _graph_helpers import GraphBuilder, make_func, make_module, random_inputs
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.dialects.core import TensorType, Value
from sexpgpu.dialects.graph import normalize_axes
from sexpgpu.passes.autodiff import differentiate
from sexpgpu.passes.manager import PASSES, CompilationUnit, run_pipeline

from sexpgpu.diagnostics import Location, SxError

STEP = 1e-6
Forward = Callable[[GraphBuilder], Value]


def loss_graph(inputs: dict, forward: Forward):
    """A train graph: loss = Σ forward(...) · w, with w a random batch input so the cotangent is not all ones."""

    def body(g: GraphBuilder) -> dict[str, Value]:
        y = forward(g)
        w = g.create("graph.input", [], {"name": "w", "role": "batch"}, result_types=[y.type]).result
        return {"loss": g.sum(g.mul(y, w), axes=list(range(y.type.rank)), keep=False)}

    return make_func(inputs, body, name="train", kind="train")


def numeric_gradient(graph, values: dict[str, np.ndarray], name: str) -> np.ndarray:
    grad = np.zeros(values[name].shape)
    for i in np.ndindex(values[name].shape):
        shifted = []
        for sign in (1, -1):
            moved = dict(values)
            moved[name] = values[name].copy()
            moved[name][i] += sign * STEP
            shifted.append(graph(moved).outputs["loss"])
        grad[i] = (shifted[0] - shifted[1]) / (2 * STEP)
    return grad


def check(inputs: dict, forward: Forward, seed: int = 0, **values: np.ndarray) -> dict[str, np.ndarray]:
    """Differentiate, then compare every grad/<param> with central differences; returns the grads."""
    func = loss_graph(inputs, forward)
    differentiate(func)
    func.verify()
    graph = compile_graph(func, float_mode="f64")
    feed = {**random_inputs(func, np.random.default_rng(seed)), **values}
    result = graph(feed)
    params = [n for n, decl in inputs.items() if decl[2:] == ("param",) and decl[1] not in ("i32", "i64", "i1")]
    assert [n for n in result.outputs if n.startswith("grad/")] == [f"grad/{p}" for p in params]
    for p in params:
        assert result.outputs[f"grad/{p}"].shape == tuple(inputs[p][0])
        np.testing.assert_allclose(result.outputs[f"grad/{p}"], numeric_gradient(graph, feed, p), rtol=1e-5,
                                   atol=1e-6, err_msg=f"grad/{p}")
    return {p: result.outputs[f"grad/{p}"] for p in params}


def P(*shape: int, dtype: str = "f32"):
    return (shape, dtype, "param")


def B(*shape: int, dtype: str = "f32"):
    return (shape, dtype, "batch")


def positive(*shape: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 2.0, shape)


# -- unary --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["neg", "exp", "tanh", "erf", "abs", "sin", "cos"])
def test_unary_on_any_reals(op):
    check({"x": P(2, 3)}, lambda g: getattr(g, op)(g.inputs["x"]))


@pytest.mark.parametrize("op", ["log", "sqrt", "rsqrt", "recip"])
def test_unary_on_positive_reals(op):
    check({"x": P(2, 3)}, lambda g: getattr(g, op)(g.inputs["x"]), x=positive(2, 3))


def test_abs_has_zero_gradient_at_zero():
    grads = check({"x": P(3)}, lambda g: g.abs(g.inputs["x"]), x=np.array([-2.0, 0.5, 1.0]),
                  w=np.ones(3))
    func = loss_graph({"x": P(3)}, lambda g: g.abs(g.inputs["x"]))
    differentiate(func)
    out = compile_graph(func, "f64")({"x": np.array([-2.0, 0.0, 1.0]), "w": np.ones(3)})
    np.testing.assert_array_equal(out.outputs["grad/x"], [-1.0, 0.0, 1.0])
    np.testing.assert_array_equal(grads["x"], [-1.0, 1.0, 1.0])


# -- binary, select ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["add", "sub", "mul", "maximum", "minimum"])
def test_binary(op):
    check({"a": P(2, 3), "b": P(2, 3)}, lambda g: getattr(g, op)(g.inputs["a"], g.inputs["b"]))


def test_div():
    check({"a": P(2, 3), "b": P(2, 3)}, lambda g: g.div(g.inputs["a"], g.inputs["b"]), b=positive(2, 3))


def test_pow_in_base_and_exponent():
    check({"a": P(2, 3), "b": P(2, 3)}, lambda g: g.pow(g.inputs["a"], g.inputs["b"]), a=positive(2, 3))


def test_pow_with_constant_exponent():
    check({"a": P(4)}, lambda g: g.pow(g.inputs["a"], g.const(3.0, [4])))


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_elementwise_extremum_splits_ties_evenly(op):
    a = np.array([1.0, 2.0, -3.0, 0.5])
    b = np.array([1.0, 0.0, -3.0, 4.0])
    grads = check({"a": P(4), "b": P(4)}, lambda g: getattr(g, op)(g.inputs["a"], g.inputs["b"]),
                  a=a, b=b, w=np.ones(4))
    wins = a > b if op == "maximum" else a < b
    np.testing.assert_array_equal(grads["a"], np.where(a == b, 0.5, wins.astype(float)))
    np.testing.assert_array_equal(grads["a"] + grads["b"], np.ones(4))


def test_where_routes_the_gradient_by_condition():
    grads = check({"c": B(2, 3, dtype="i1"), "a": P(2, 3), "b": P(2, 3)},
                  lambda g: g.where(g.inputs["c"], g.inputs["a"], g.inputs["b"]))
    assert np.all((grads["a"] == 0) | (grads["b"] == 0))


def test_where_of_a_compare_of_params():
    check({"a": P(2, 3), "b": P(2, 3)},
          lambda g: g.where(g.gt(g.inputs["a"], g.inputs["b"]), g.exp(g.inputs["a"]), g.inputs["b"]))


# -- reduce -------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("axes", [[0, 2], [1], -1, None])
@pytest.mark.parametrize("keep", [False, True])
def test_reduce(op, axes, keep):
    check({"x": P(2, 3, 4)},
          lambda g: getattr(g, op)(g.inputs["x"], axes=normalize_axes(axes, 3), keep=keep))


@pytest.mark.parametrize("op", ["max", "min"])
def test_reduce_extremum_shares_ties_equally(op):
    x = np.array([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 0.0, -1.0]])
    if op == "min":
        x = -x
    func = loss_graph({"x": P(2, 4)}, lambda g: getattr(g, op)(g.inputs["x"], axes=[1], keep=False))
    differentiate(func)
    grad = compile_graph(func, "f64")({"x": x, "w": np.array([3.0, 2.0])}).outputs["grad/x"]
    np.testing.assert_allclose(grad, [[0, 1, 1, 1], [1, 1, 0, 0]])


# -- shape --------------------------------------------------------------------------------------


def test_reshape():
    check({"x": P(2, 6)}, lambda g: g.reshape(g.inputs["x"], shape=[3, 2, 2]))


def test_transpose():
    check({"x": P(2, 3, 4)}, lambda g: g.transpose(g.inputs["x"], perm=[2, 0, 1]))


@pytest.mark.parametrize(("source", "target"), [((3,), (2, 4, 3)), ((2, 1, 3), (4, 2, 5, 3)), ((1,), (3,)), ((), (2, 2))])
def test_broadcast(source, target):
    check({"x": P(*source)}, lambda g: g.broadcast(g.inputs["x"], shape=list(target)))


def test_slice_and_pad():
    check({"x": P(3, 5)}, lambda g: g.pad(g.slice(g.inputs["x"], axis=1, start=1, end=4), axis=0, before=2, after=1))


def test_concat_with_a_constant_operand():
    check({"a": P(2, 3), "b": P(2, 1), "c": B(2, 2)},
          lambda g: g.concat(g.inputs["a"], g.inputs["c"], g.inputs["b"], axis=1))


def test_squeeze_and_expand_dims():
    check({"x": P(2, 1, 3)}, lambda g: g.expand_dims(g.squeeze(g.inputs["x"], axis=1), axis=2))


# -- contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [((3, 4), (4, 2)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
                                      ((3, 4), (2, 4, 5)), ((2, 3, 4), (4, 1))])
def test_matmul_with_batch_broadcasting(a, b):
    check({"a": P(*a), "b": P(*b)}, lambda g: g.matmul(g.inputs["a"], g.inputs["b"]))


# -- index, cast --------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1])
def test_take_with_repeated_indices(axis):
    idx = np.array([[0, 2], [2, 2]], dtype=np.int32)
    check({"x": P(3, 3), "idx": B(2, 2, dtype="i32")}, lambda g: g.take(g.inputs["x"], g.inputs["idx"], axis=axis),
          idx=idx)


def test_take_along_with_repeated_indices():
    idx = np.array([[0, 0, 3], [1, 2, 1]], dtype=np.int64)
    check({"x": P(2, 4), "idx": B(2, 3, dtype="i64")},
          lambda g: g.take_along(g.inputs["x"], g.inputs["idx"], axis=1), idx=idx)


def test_scatter_add():
    idx = np.array([1, 1, 0], dtype=np.int32)
    check({"u": P(2, 3, 2), "idx": B(3, dtype="i32")},
          lambda g: g.scatter_add(g.inputs["idx"], g.inputs["u"], axis=1, dim=4), idx=idx)


def test_scatter_add_along():
    idx = np.array([[0, 0, 3], [1, 2, 1]], dtype=np.int32)
    check({"u": P(2, 3), "idx": B(2, 3, dtype="i32")},
          lambda g: g.scatter_add_along(g.inputs["idx"], g.inputs["u"], axis=1, dim=4), idx=idx)


def test_cast_between_floats_casts_back():
    check({"x": P(2, 3)}, lambda g: g.cast(g.exp(g.cast(g.inputs["x"], dtype="bf16")), dtype="f32"))


def test_one_hot_and_iota_are_constants():
    idx = np.array([2, 0, 1], dtype=np.int32)

    def forward(g):
        hot = g.one_hot(g.inputs["idx"], n=4)
        ramp = g.cast(g.iota(shape=[3, 4], axis=1), dtype="f32")
        return g.mul(g.add(hot, ramp), g.broadcast(g.inputs["x"], shape=[3, 4]))

    check({"x": P(4), "idx": B(3, dtype="i32")}, forward, idx=idx)


# -- the pass as a whole ------------------------------------------------------------------------


def test_a_value_used_twice_accumulates():
    check({"x": P(3)}, lambda g: g.add(g.mul(g.inputs["x"], g.inputs["x"]), g.exp(g.inputs["x"])))


def test_params_the_loss_ignores_get_zeros_and_integer_params_none():
    grads = check({"x": P(3), "unused": P(2, 2), "through_int": P(3), "table": P(2, dtype="i32")},
                  lambda g: g.add(g.inputs["x"], g.cast(g.cast(g.inputs["through_int"], dtype="i32"), dtype="f32")))
    assert set(grads) == {"x", "unused", "through_int"}
    np.testing.assert_array_equal(grads["unused"], np.zeros((2, 2)))
    np.testing.assert_array_equal(grads["through_int"], np.zeros(3))


def test_emits_are_not_differentiated():
    def forward(g):
        y = g.exp(g.inputs["x"])
        g.create("graph.observe", [y], {"name": "model.y"})
        g.create("graph.metric", [g.sum(y, axes=[0], keep=False)], {"name": "train/total"})
        return y

    check({"x": P(3)}, forward)


def test_backward_ops_carry_the_forward_loc():
    here = Location("model.sx", 7, 3)

    def forward(g):
        return g.create("graph.tanh", [g.inputs["x"]], loc=here).result

    func = loss_graph({"x": P(3)}, forward)
    forward_ops = set(func.body.ops)
    differentiate(func)
    backward = [op for op in func.body.ops if op not in forward_ops]
    assert {op.loc for op in backward} <= {op.loc for op in forward_ops}
    assert any(op.loc == here and op.name == "graph.sub" for op in backward)


def test_grad_dtype_follows_the_param():
    func = loss_graph({"x": P(3, dtype="bf16")}, lambda g: g.cast(g.mul(g.inputs["x"], g.inputs["x"]), dtype="f32"))
    differentiate(func)
    ret = func.body.last_op
    assert ret.attributes["names"] == ["loss", "grad/x"]
    assert ret.operands[1].type == TensorType((3,), "bf16")


def run_pass(module, **options):
    unit = CompilationUnit(module=module)
    PASSES["autodiff"](**options).run(unit)
    return unit


def test_pass_differentiates_train_graphs_only():
    train = loss_graph({"x": P(3)}, lambda g: g.exp(g.inputs["x"]))
    other = make_func({"x": P(3)}, lambda g: {"loss": g.sum(g.inputs["x"], axes=[0], keep=False)}, name="eval")
    run_pass(make_module(train, other))
    assert train.body.last_op.attributes["names"] == ["loss", "grad/x"]
    assert other.body.last_op.attributes["names"] == ["loss"]


def test_pass_option_names_the_graph():
    other = make_func({"x": P(3)}, lambda g: {"loss": g.sum(g.inputs["x"], axes=[0], keep=False)}, name="probe")
    run_pass(make_module(other), func="probe")
    assert other.body.last_op.attributes["names"] == ["loss", "grad/x"]
    with pytest.raises(SxError, match="no graph.func named @missing"):
        run_pass(make_module(), func="missing")


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (lambda g: {"total": g.sum(g.inputs["x"], axes=[0], keep=False)}, "no output named 'loss'"),
        (lambda g: {"loss": g.inputs["x"]}, "must be a float scalar"),
    ],
)
def test_bad_losses_are_reported(outputs, message):
    func = make_func({"x": P(3)}, outputs, name="train", kind="train")
    with pytest.raises(SxError, match=message):
        differentiate(func)


def test_differentiating_twice_is_an_error():
    func = loss_graph({"x": P(3)}, lambda g: g.exp(g.inputs["x"]))
    differentiate(func)
    with pytest.raises(SxError, match="already has gradient outputs"):
        differentiate(func)


def test_backward_ops_carry_the_forward_model_path():
    def forward(g):
        return g.create("graph.tanh", [g.inputs["x"]], {"path": "model.act"}).result

    func = loss_graph({"x": P(3)}, forward)
    forward_ops = set(func.body.ops)
    differentiate(func)
    backward = [op for op in func.body.ops if op not in forward_ops]
    # Only the tanh rule builds a sub (1 - y²); the loss's own backward ops have no path.
    assert {op.attributes.get("path") for op in backward if op.name == "graph.sub"} == {"model.act"}
    assert None in {op.attributes.get("path") for op in backward}


def test_traced_tiny_gpt_gradients_match_finite_differences():
    """End to end: the smoke tiny GPT (embedding, attention, layernorm, gelu, cross-entropy) in float64."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny-gpt.sx")
    with open(path, encoding="utf-8") as f:
        unit = CompilationUnit(path=path, text=f.read(), variant="smoke")
    run_pipeline(unit, "evaluate,autodiff")
    train = next(op for op in unit.module.body.ops if op.name == "graph.func" and op.attributes.get("kind") == "train")
    graph = compile_graph(train, float_mode="f64")
    rng = np.random.default_rng(0)
    feed = {spec.name: rng.standard_normal(spec.type.shape) * 0.3 if spec.role == "param"
            else rng.integers(0, 256, spec.type.shape).astype(spec.storage) for spec in graph.inputs}
    result = graph(feed)
    for spec in graph.inputs:
        if spec.role != "param":
            continue
        for _ in range(2):
            i = tuple(int(rng.integers(0, d)) for d in spec.type.shape)
            moved = [feed[spec.name].copy() for _ in range(2)]
            moved[0][i] += STEP
            moved[1][i] -= STEP
            plus, minus = (graph({**feed, spec.name: m}).outputs["loss"] for m in moved)
            assert result.outputs[f"grad/{spec.name}"][i] == pytest.approx((plus - minus) / (2 * STEP), rel=1e-5,
                                                                             abs=1e-7), spec.name
