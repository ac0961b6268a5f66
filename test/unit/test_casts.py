"""insert-casts: the bf16 policy on a small MLP train graph (structure and numerics)."""

from __future__ import annotations

from math import erf, pi, sqrt

import numpy as np
import pytest
from _graph_helpers import make_func, make_module
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.dialects import exp, graph  # noqa: F401  (registers the ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType, Value
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

from sexpgpu.diagnostics import Location, SxError

N, D, H, C = 4, 8, 16, 5


def mlp_train() -> Operation:
    """loss = cross-entropy(tanh(x @ w1) @ w2, onehot); returns loss, grad/model.out.w (closed form), a metric."""
    func = Operation.create(
        "graph.func", attributes={"sym_name": "train", "kind": "train"}, regions=[Region.with_block()]
    )
    path = ["model"]

    def stamp(op: Operation) -> None:
        op.attributes["path"] = path[0]

    b = Builder(func.body, loc=Location("mlp.sx", 3, 1), on_create=stamp)

    def inp(name: str, role: str, shape: tuple[int, ...]) -> Value:
        return b.create(
            "graph.input", (), {"name": name, "role": role}, result_types=[TensorType(shape, "f32")]
        ).result

    def const(value: float, shape: tuple[int, ...] = ()) -> Value:
        return b.create("graph.const", (), {"value": value}, result_types=[TensorType(shape, "f32")]).result

    x, onehot = inp("x", "batch", (N, D)), inp("onehot", "batch", (N, C))
    w1, w2 = inp("model.hidden.w", "param", (D, H)), inp("model.out.w", "param", (H, C))
    path[0] = "model.hidden"
    act = b.value("graph.tanh", b.value("graph.matmul", x, w1))
    path[0] = "model.out"
    logits = b.value("graph.matmul", act, w2)
    path[0] = "loss"
    top = b.value("graph.broadcast", b.value("graph.max", logits, axes=[1], keep=True), shape=[N, C])
    shifted = b.value("graph.sub", logits, top)
    total = b.value("graph.sum", b.value("graph.exp", shifted), axes=[1], keep=True)
    logp = b.value(
        "graph.sub", shifted, b.value("graph.broadcast", b.value("graph.log", total), shape=[N, C])
    )
    picked = b.value("graph.sum", b.value("graph.mul", logp, onehot), axes=[0, 1], keep=False)
    loss = b.value("graph.mul", b.value("graph.neg", picked), const(1.0 / N))
    b.create("graph.metric", [loss], {"name": "train/loss"})
    dlogits = b.value(
        "graph.mul", b.value("graph.sub", b.value("graph.exp", logp), onehot), const(1.0 / N, (N, C))
    )
    grad_w2 = b.value("graph.matmul", b.value("graph.transpose", act, perm=[1, 0]), dlogits)
    b.create("graph.return", [loss, grad_w2], {"names": ["loss", "grad/model.out.w"]})
    func.verify()
    return func


def run_casts(module: Operation, pipeline: str = "insert-casts{policy=bf16}") -> CompilationUnit:
    unit = CompilationUnit(module=module)
    run_pipeline(unit, pipeline)
    module.verify()
    return unit


def ops_named(func: Operation, name: str) -> list[Operation]:
    return [op for op in func.body.ops if op.name == name]


def test_f32_policy_adds_no_cast() -> None:
    func = mlp_train()
    unit = run_casts(make_module(func), "insert-casts{policy=f32}")
    assert ops_named(func, "graph.cast") == []
    assert unit.facts.casts == {"train": 0} and unit.facts.kept_f32 == []


def test_bf16_matmuls_in_bf16_reductions_and_outputs_in_f32() -> None:
    func = mlp_train()
    signature_before = [(op.attributes["name"], op.result.type) for op in ops_named(func, "graph.input")]
    unit = run_casts(make_module(func))
    for op in ops_named(func, "graph.matmul"):
        assert [v.type.dtype for v in op.operands] == ["bf16", "bf16"]
    for name in ("graph.max", "graph.sum"):
        for op in ops_named(func, name):
            assert op.operands[0].type.dtype == "f32"
    assert ops_named(func, "graph.tanh")[0].result.type.dtype == "bf16"
    assert all(
        op.result.type.dtype == "f32" for op in ops_named(func, "graph.exp") + ops_named(func, "graph.log")
    )
    ret = func.body.last_op
    assert [v.type for v in ret.operands] == [TensorType((), "f32"), TensorType((H, C), "f32")]
    assert [
        (op.attributes["name"], op.result.type) for op in ops_named(func, "graph.input")
    ] == signature_before
    casts = ops_named(func, "graph.cast")
    # x, w1, w2 to bf16; logits to f32; act (transposed) stays bf16 into the second matmul; dlogits to bf16;
    # grad/model.out.w back to f32
    assert unit.facts.casts == {"train": len(casts)} and len(casts) == 6
    assert len({id(op.operands[0]) for op in casts}) == len(casts)  # each value cast once
    kept = unit.facts.kept_f32
    assert {"graph": "train", "op": "reduce max", "path": "loss"} in kept
    assert {"graph": "train", "op": "unary exp", "path": "loss"} in kept
    assert not any(k["path"] == "model.hidden" for k in kept)
    assert unit.facts.cast_policy == "bf16"


def test_bf16_graph_runs_close_to_f32() -> None:
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.standard_normal((N, D)).astype(np.float32),
        "onehot": np.eye(C, dtype=np.float32)[rng.integers(0, C, N)],
        "model.hidden.w": (0.5 * rng.standard_normal((D, H))).astype(np.float32),
        "model.out.w": (0.5 * rng.standard_normal((H, C))).astype(np.float32),
    }
    want = compile_graph(mlp_train())(inputs)
    func = mlp_train()
    run_casts(make_module(func))
    got = compile_graph(func)(inputs)
    assert got.outputs["loss"].dtype == np.float32
    np.testing.assert_allclose(got.outputs["loss"], want.outputs["loss"], rtol=2e-2)
    np.testing.assert_allclose(
        got.outputs["grad/model.out.w"], want.outputs["grad/model.out.w"], rtol=5e-2, atol=1e-2
    )
    assert got.metrics["train/loss"] == pytest.approx(want.metrics["train/loss"], rel=2e-2)


def test_auto_policy_reads_the_run_and_leaves_update_graphs_alone() -> None:
    run = Operation.create(
        "exp.run", attributes={"steps": 1, "loader": "l", "microbatches": 1, "precision": "bf16", "seed": 0}
    )
    update = mlp_train()
    update.attributes.update(sym_name="update/default/model.out.w", kind="update")
    train = mlp_train()
    unit = run_casts(make_module(run, train, update), "insert-casts")
    assert unit.facts.casts == {"train": 6}
    assert ops_named(update, "graph.cast") == []


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(SxError, match="unknown policy 'fp8'"):
        run_casts(make_module(mlp_train()), "insert-casts{policy=fp8}")


def test_bf16_accumulates_gradients_in_f32() -> None:
    """`train_accumulating` adds each microbatch's gradient to the sum of the ones before (an f32 input):
    the add runs in f32, the new bf16 gradient cast up, so no microbatch rounds the sum to bf16."""
    run = Operation.create(
        "exp.run", attributes={"steps": 1, "loader": "l", "microbatches": 4, "precision": "bf16", "seed": 0}
    )
    module = make_module(run, mlp_train())
    run_casts(module, "accumulate,insert-casts")
    accumulating = next(op for op in module.body.ops
                        if op.name == "graph.func" and op.attributes["sym_name"] == "train_accumulating")
    grad = next(op.result for op in ops_named(accumulating, "graph.input") if op.attributes["role"] == "grad")
    [add] = [user for user in grad.users() if user.name == "graph.add"]
    assert [v.type.dtype for v in add.operands] == ["f32", "f32"] and add.result.type.dtype == "f32"
    assert add.operands[1].op.name == "graph.cast"
    assert add.operands[1].op.operands[0].type.dtype == "bf16"


def gelu_train(count: int) -> Operation:
    """loss = Σ gelu(x) with the prelude's erf GELU, x·½(1 + erf(x·(1/√2))): its gradient is GELU's derivative."""
    def body(g):
        x = g.inputs["x"]
        inner = g.erf(g.mul(x, g.const(0.7071067811865476, (count,))))
        y = g.mul(g.mul(x, g.const(0.5, (count,))), g.add(g.const(1.0, (count,)), inner))
        return {"loss": g.sum(y, axes=[0], keep=False)}

    return make_func({"x": ((count,), "f32", "param")}, body, name="train", kind="train")


def test_bf16_gelu_gradient_keeps_its_constants_exact() -> None:
    """Under bf16 the GELU gradient is GELU's derivative to bf16's rounding, with no systematic bias: 1/√2
    and 2/√π stay f32 (bf16 holds them as 0.70703125 and 1.125, 0.3% low in the φ term)."""
    count = 4096
    func = gelu_train(count)
    run_casts(make_module(func), "autodiff,insert-casts{policy=bf16},canonicalize,cse,dce")
    constants = {op.attributes["value"]: op.result.type.dtype for op in ops_named(func, "graph.const")}
    assert constants[0.7071067811865476] == "f32" and constants[2 / np.sqrt(np.pi)] == "f32"
    assert 0.70703125 not in constants and 1.125 not in constants
    x = np.linspace(-3.0, 3.0, count).astype(np.float32)
    grad = compile_graph(func)({"x": x}).outputs["grad/x"].astype(np.float64)
    # GELU'(x) = Φ(x) + x·φ(x), in float64.
    xs = x.astype(np.float64)
    cdf = np.array([0.5 * (1 + erf(v / sqrt(2))) for v in xs])
    phi_term = xs * np.exp(-xs * xs / 2) / sqrt(2 * pi)
    np.testing.assert_allclose(grad, cdf + phi_term, atol=2e-2)
    # Each bf16 op rounds by up to 2^-9 relative, either way; 1.125 for 2/√π scaled the whole x·φ(x) term
    # by 0.997. The least-squares scale of what the gradient adds to Φ(x) is 1 to bf16's noise.
    scale = np.sum((grad - cdf) * phi_term) / np.sum(phi_term * phi_term)
    assert abs(scale - 1) < 1e-3, f"the GELU gradient scales x·φ(x) by {scale:.5f}"
