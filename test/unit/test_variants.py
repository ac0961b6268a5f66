"""The accumulate, stack and diagnose passes, run through the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from _graph_helpers import make_func, make_module
from sexpgpu.backends.interpreter import compile_graph
from sexpgpu.dialects.core import Operation
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

from sexpgpu.diagnostics import SxError

RNG = np.random.default_rng(3)
PARAMS = {"model.blocks.0.w": ((3, 2), "f32", "param"), "model.head.b": ((2,), "f32", "param")}
BATCH = {"x": ((4, 3), "f32", "batch"), "y": ((4, 2), "f32", "batch")}


def regression(g):
    """loss = mean((x·w + b - y)²), with a metric, a counter and an observation."""
    w, b, x, y = (g.inputs[k] for k in ("model.blocks.0.w", "model.head.b", "x", "y"))
    hidden = g.matmul(x, w)
    g.create("graph.observe", [hidden], {"name": "model.blocks.0.hidden"})
    err = g.sub(g.add(hidden, g.broadcast(b, shape=[4, 2])), y)
    loss = g.div(g.sum(g.mul(err, err), axes=[0, 1], keep=False), g.const(8.0))
    g.create("graph.metric", [loss], {"name": "train/loss"})
    g.create("graph.counter", [g.const(4, [], "i32")], {"name": "records"})
    return {"loss": loss}


def differentiated_module(*extra: Operation) -> Operation:
    module = make_module(make_func({**PARAMS, **BATCH}, regression, name="train", kind="train"), *extra)
    run_pipeline(CompilationUnit(module=module), "autodiff")
    return module


def graph(module: Operation, name: str) -> Operation:
    return next(op for op in module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == name)


def params() -> dict[str, np.ndarray]:
    return {name: RNG.standard_normal(decl[0]).astype(np.float32) for name, decl in PARAMS.items()}


def batch(*lead: int) -> dict[str, np.ndarray]:
    return {name: RNG.standard_normal(lead + decl[0]).astype(np.float32) for name, decl in BATCH.items()}


def test_accumulating_adds_fresh_gradients_into_the_previous_ones():
    module = differentiated_module()
    run_pipeline(CompilationUnit(module=module), "accumulate")
    acc = graph(module, "train_accumulating")
    assert acc.attributes["kind"] == "train_accumulating"
    grad_inputs = [op.attributes for op in acc.body.ops if op.name == "graph.input" and op.attributes["role"] == "grad"]
    assert [a["name"] for a in grad_inputs] == ["grad/model.blocks.0.w", "grad/model.head.b"]
    p, data = params(), batch()
    fresh = compile_graph(graph(module, "train"))({**p, **data}).outputs
    previous = {name: RNG.standard_normal(v.shape).astype(np.float32) for name, v in fresh.items() if name != "loss"}
    out = compile_graph(acc)({**p, **data, **previous}).outputs
    assert list(out) == list(fresh)
    np.testing.assert_allclose(out["loss"], fresh["loss"])
    for name in previous:
        np.testing.assert_allclose(out[name], previous[name] + fresh[name], rtol=1e-6)


@pytest.mark.parametrize(("microbatches", "built"), [(1, False), (2, True)])
def test_accumulating_is_built_only_for_runs_of_several_microbatches(microbatches, built):
    run = Operation.create("exp.run", attributes={"steps": 1, "loader": "data", "microbatches": microbatches,
                                                  "precision": "f32", "seed": 0})
    module = differentiated_module(run)
    run_pipeline(CompilationUnit(module=module), "accumulate")
    kinds = [op.attributes["kind"] for op in module.body.ops if op.name == "graph.func"]
    assert ("train_accumulating" in kinds) == built


@pytest.mark.parametrize("k", [1, 3])
def test_stacked_sums_gradients_and_averages_loss_and_metrics(k):
    module = differentiated_module()
    run_pipeline(CompilationUnit(module=module), f"stack{{k={k}}}")
    stacked = graph(module, "train_stacked")
    assert (stacked.attributes["kind"], stacked.attributes["k"]) == ("train_stacked", k)
    p, data = params(), batch(k)
    train = compile_graph(graph(module, "train"))
    singles = [train({**p, **{name: v[i] for name, v in data.items()}}) for i in range(k)]
    result = compile_graph(stacked)({**p, **data})
    np.testing.assert_allclose(result.outputs["loss"], np.mean([s.outputs["loss"] for s in singles]), rtol=1e-6)
    for name in ("grad/model.blocks.0.w", "grad/model.head.b"):
        np.testing.assert_allclose(result.outputs[name], sum(s.outputs[name] for s in singles), rtol=1e-5, atol=1e-6)
    assert result.metrics["train/loss"] == pytest.approx(np.mean([s.metrics["train/loss"] for s in singles]), rel=1e-6)
    assert result.counters["records"] == 4 * k
    assert result.observed == {}


def test_stacked_embedding_gradient_is_one_scatter_equal_to_the_sum_of_the_microbatches():
    """An embedding's gradient over k stacked microbatches: one scatter-add over every position, equal to
    the k microbatches' gradients summed (up to f32 rounding: one sum per row instead of k partial ones)."""
    def embedding(g):
        rows = g.take(g.inputs["table"], g.inputs["ids"], axis=0)
        return {"loss": g.sum(g.mul(rows, g.inputs["x"]), axes=[0, 1, 2], keep=False)}

    inputs = {"table": ((7, 4), "f32", "param"), "ids": ((2, 5), "i32", "batch"), "x": ((2, 5, 4), "f32", "batch")}
    module = make_module(make_func(inputs, embedding, name="train", kind="train"))
    run_pipeline(CompilationUnit(module=module), "autodiff,stack{k=3}")
    stacked = graph(module, "train_stacked")
    assert sum(op.name == "graph.scatter_add" for op in stacked.body.ops) == 1
    table = RNG.standard_normal((7, 4)).astype(np.float32)
    # Rows 0 to 5 named five times each, in shuffled order; row 6 by no position.
    ids = RNG.permutation(np.arange(30) % 6).reshape(3, 2, 5).astype(np.int32)
    x = RNG.standard_normal((3, 2, 5, 4)).astype(np.float32)
    train = compile_graph(graph(module, "train"))
    summed = sum(train({"table": table, "ids": ids[i], "x": x[i]}).outputs["grad/table"] for i in range(3))
    result = compile_graph(stacked)({"table": table, "ids": ids, "x": x}).outputs["grad/table"]
    np.testing.assert_allclose(result, summed, rtol=1e-6, atol=1e-6)
    assert not result[6].any() and result[:6].all()


def diagnostic(name: str, kind: str, glob: str, reducer: str, enabled: bool = True) -> Operation:
    return Operation.create("exp.diagnostic", attributes={
        "name": name, "of": {"kind": kind, "glob": glob}, "reducer": reducer, "every": 10, "enabled": enabled})


def test_diagnose_strips_train_and_emits_one_scalar_per_matching_tensor():
    module = differentiated_module(
        diagnostic("act", "observed", "model.blocks.*", "rms"),
        diagnostic("gnorm", "grads", "model.*", "norm"),
        diagnostic("pmax", "params", "*.b", "max"),
        diagnostic("pmean", "params", "model.blocks.*", "mean"),
        diagnostic("pmin", "params", "*", "min", enabled=False),
    )
    run_pipeline(CompilationUnit(module=module), "diagnose")
    train, diagnosed = graph(module, "train"), graph(module, "train_diagnosed")
    assert not any(op.name == "graph.observe" for op in train.body.ops)
    assert diagnosed.attributes["kind"] == "train_diagnosed"
    p, data = params(), batch()
    result = compile_graph(diagnosed)({**p, **data})
    plain = compile_graph(train)({**p, **data})
    assert plain.observed == {}
    w, b = p["model.blocks.0.w"], p["model.head.b"]
    hidden = data["x"] @ w
    expected = {
        "act:model.blocks.0.hidden": np.sqrt(np.mean(hidden**2)),
        "gnorm:model.blocks.0.w": np.linalg.norm(plain.outputs["grad/model.blocks.0.w"]),
        "gnorm:model.head.b": np.linalg.norm(plain.outputs["grad/model.head.b"]),
        "pmax:model.head.b": b.max(),
        "pmean:model.blocks.0.w": w.mean(),
    }
    assert list(result.observed) == list(expected)
    for name, value in expected.items():
        assert result.observed[name].shape == ()
        np.testing.assert_allclose(result.observed[name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(result.outputs["loss"], plain.outputs["loss"])


def test_diagnose_without_enabled_diagnostics_only_strips():
    module = differentiated_module(diagnostic("off", "params", "*", "min", enabled=False))
    run_pipeline(CompilationUnit(module=module), "diagnose")
    names = [op.attributes["sym_name"] for op in module.body.ops if op.name == "graph.func"]
    assert names == ["train"]
    assert not any(op.name == "graph.observe" for op in graph(module, "train").body.ops)


def test_bad_reducer_is_reported_at_the_diagnostic():
    module = differentiated_module(diagnostic("bad", "params", "*", "median"))
    with pytest.raises(SxError, match="unknown reducer 'median'"):
        run_pipeline(CompilationUnit(module=module), "diagnose")


@pytest.mark.parametrize("pipeline", ["accumulate", "stack", "diagnose"])
def test_variants_need_a_train_graph(pipeline):
    with pytest.raises(SxError, match='no graph.func with kind = "train"'):
        run_pipeline(CompilationUnit(module=make_module()), pipeline)


@pytest.mark.parametrize("pipeline", ["accumulate", "stack{k=2}"])
def test_variants_need_gradients(pipeline):
    module = make_module(make_func({**PARAMS, **BATCH}, regression, name="train", kind="train"))
    with pytest.raises(SxError, match="run 'autodiff' first"):
        run_pipeline(CompilationUnit(module=module), pipeline)


def test_running_a_variant_twice_replaces_its_graph():
    module = differentiated_module()
    run_pipeline(CompilationUnit(module=module), "stack{k=2},stack{k=3}")
    stacked = [op for op in module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == "train_stacked"]
    assert len(stacked) == 1 and stacked[0].attributes["k"] == 3
