"""The numpy interpreter, op family by op family, against numpy itself."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from _graph_helpers import make_func
from sexpgpu.backends.interpreter import GraphInputError, compile_graph
from sexpgpu.backends.interpreter.erf import erf, erf_f32

RNG = np.random.default_rng(7)


def run(inputs: dict, body, feed: dict, float_mode: str = "native") -> dict[str, np.ndarray]:
    return compile_graph(make_func(inputs, body), float_mode)(feed).outputs


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def close(actual, expected, rtol: float = 1e-6) -> None:
    assert np.asarray(actual).dtype == np.asarray(expected).dtype
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=1e-6)


# -- elementwise --------------------------------------------------------------------------------

UNARY = {
    "neg": np.negative, "exp": np.exp, "tanh": np.tanh, "abs": np.abs, "sin": np.sin, "cos": np.cos,
    "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "recip": np.reciprocal,
    "erf": lambda x: np.vectorize(math.erf)(x.astype(np.float64)).astype(np.float32),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op):
    x = np.abs(f32(3, 4)) + 0.1
    x[0] *= -1 if op not in ("log", "sqrt", "rsqrt") else 1
    out = run({"x": ((3, 4), "f32")}, lambda g: {"y": getattr(g, op)(g.inputs["x"])}, {"x": x})
    close(out["y"], UNARY[op](x), rtol=1e-5)


def test_erf_matches_math_erf_to_float64_precision():
    x = np.concatenate([np.linspace(-7, 7, 20001), [1e-300, -3e-9, 0.999999, 1.0, 5.999, 6.0]])
    exact = np.vectorize(math.erf)(x)
    assert np.max(np.abs(erf(x) - exact)) < 1e-14
    assert np.max(np.abs(erf(x) - exact)[exact != 0] / np.abs(exact[exact != 0])) < 1e-14
    np.testing.assert_array_equal(erf(np.array([np.inf, -np.inf, 0.0])), [1.0, -1.0, 0.0])
    assert np.isnan(erf(np.array([np.nan]))).all()


@pytest.mark.parametrize("scale", [0.2, 1.0, 4.0])
def test_erf_f32_within_two_ulps(scale):
    """The float32 path (a float32 polynomial below |x| = 0.84375, the float64-evaluated rational
    elsewhere, per block by what the block mostly holds) is within 1.6 float32 ulps of math.erf,
    keeps NaN, -0.0 and saturates ±inf; mostly-small, mixed and mostly-large blocks alike."""
    x = (np.random.default_rng(7).standard_normal(300_000) * scale).astype(np.float32)
    x[:8] = [np.nan, np.inf, -np.inf, -0.0, 1e30, -1e30, 0.84375, -np.float32(1e-30)]
    got = erf_f32(x)
    assert got.dtype == np.float32
    exact = np.vectorize(math.erf)(x[1:].astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[1:] - exact) / ulp) < 1.6
    assert np.isnan(got[0]) and np.signbit(got[3]) and got[3] == 0
    np.testing.assert_array_equal(got[1:3], [1.0, -1.0])


def test_erf_f32_of_an_element_does_not_depend_on_the_others():
    """Blocks with few, some and mostly large arguments take different routes (polynomial only,
    gathered rational, masked rational): each element's bits are the same in all of them."""
    x = (np.random.default_rng(3).standard_normal(2000) * 0.6).astype(np.float32)
    want = erf_f32(x)
    for filler in (0.1, 2.0):
        for share in (0.0, 0.3, 0.9):
            mixed = np.concatenate([x, np.full(int(len(x) * share / (1 - share + 1e-9)), filler, np.float32)])
            assert erf_f32(mixed)[: len(x)].tobytes() == want.tobytes(), (filler, share)
    for value in x[:50]:
        assert erf_f32(np.array([value])).tobytes() == erf_f32(x)[x == value][:1].tobytes()


BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
    "minimum": np.minimum, "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
}


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_and_compare(op):
    a, b = f32(2, 5), f32(2, 5)
    b[0, :2] = a[0, :2]
    out = run({"a": ((2, 5), "f32"), "b": ((2, 5), "f32")}, lambda g: {"y": getattr(g, op)(g.inputs["a"], g.inputs["b"])},
              {"a": a, "b": b})
    close(out["y"], BINARY[op](a, b))


def test_pow():
    a, b = np.abs(f32(4)) + 0.5, f32(4)
    out = run({"a": ((4,), "f32"), "b": ((4,), "f32")}, lambda g: {"y": g.pow(g.inputs["a"], g.inputs["b"])},
              {"a": a, "b": b})
    close(out["y"], np.power(a, b), rtol=1e-5)


def test_integer_division_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6], dtype=np.int32)
    b = np.array([2, 2, -2, -2, 3], dtype=np.int32)
    out = run({"a": ((5,), "i32"), "b": ((5,), "i32")}, lambda g: {"q": g.div(g.inputs["a"], g.inputs["b"])},
              {"a": a, "b": b})
    np.testing.assert_array_equal(out["q"], [3, -3, -3, 3, 2])
    assert out["q"].dtype == np.int32


def test_where():
    c, a, b = RNG.random((3, 2)) < 0.5, f32(3, 2), f32(3, 2)
    out = run({"c": ((3, 2), "i1"), "a": ((3, 2), "f32"), "b": ((3, 2), "f32")},
              lambda g: {"y": g.where(g.inputs["c"], g.inputs["a"], g.inputs["b"])}, {"c": c, "a": a, "b": b})
    close(out["y"], np.where(c, a, b))


# -- reduce -------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize(("axes", "keep"), [([0, 2], False), ([1], True), ([], False), ([0, 1, 2], False)])
def test_reduce(op, axes, keep):
    x = f32(2, 3, 4)
    out = run({"x": ((2, 3, 4), "f32")}, lambda g: {"y": getattr(g, op)(g.inputs["x"], axes=axes, keep=keep)},
              {"x": x})
    close(out["y"], getattr(np, op)(x, axis=tuple(axes), keepdims=keep), rtol=1e-5)


def test_integer_sum_keeps_its_dtype():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = run({"x": ((2, 3), "i32")}, lambda g: {"y": g.sum(g.inputs["x"], axes=[1], keep=False)}, {"x": x})
    assert out["y"].dtype == np.int32
    np.testing.assert_array_equal(out["y"], [3, 12])


# -- shape --------------------------------------------------------------------------------------


def test_shape_ops():
    x, y = f32(2, 3, 4), f32(2, 1, 4)

    def body(g):
        x, y = g.inputs["x"], g.inputs["y"]
        return {
            "reshape": g.reshape(x, shape=[6, 4]),
            "transpose": g.transpose(x, perm=[2, 0, 1]),
            "broadcast": g.broadcast(y, shape=[5, 2, 3, 4]),
            "slice": g.slice(x, axis=1, start=1, end=3),
            "pad": g.pad(x, axis=2, before=1, after=2),
            "concat": g.concat(x, y, x, axis=1),
            "squeeze": g.squeeze(y, axis=1),
            "expand_dims": g.expand_dims(x, axis=3),
        }

    out = run({"x": ((2, 3, 4), "f32"), "y": ((2, 1, 4), "f32")}, body, {"x": x, "y": y})
    close(out["reshape"], x.reshape(6, 4))
    close(out["transpose"], x.transpose(2, 0, 1))
    close(out["broadcast"], np.broadcast_to(y, (5, 2, 3, 4)))
    close(out["slice"], x[:, 1:3])
    close(out["pad"], np.pad(x, [(0, 0), (0, 0), (1, 2)]))
    close(out["concat"], np.concatenate([x, y, x], axis=1))
    close(out["squeeze"], y[:, 0])
    close(out["expand_dims"], x[..., None])
    assert all(v.flags.writeable for v in out.values())


# -- contract, index ----------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [((3, 4), (4, 2)), ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 5))])
def test_matmul(a, b):
    x, y = f32(*a), f32(*b)
    out = run({"a": (a, "f32"), "b": (b, "f32")}, lambda g: {"y": g.matmul(g.inputs["a"], g.inputs["b"])},
              {"a": x, "b": y})
    close(out["y"], np.matmul(x, y), rtol=1e-5)


def test_index_ops():
    x = f32(3, 4)
    idx = np.array([[0, 2], [2, 2]], dtype=np.int32)
    along = np.array([[0, 3, 3], [1, 1, 0], [2, 0, 0]], dtype=np.int64)
    upd = f32(3, 2, 2)

    def body(g):
        x, idx, along, upd = (g.inputs[k] for k in ("x", "idx", "along", "upd"))
        return {
            "take": g.take(x, idx, axis=1),
            "take_along": g.take_along(x, along, axis=1),
            "scatter_add": g.scatter_add(idx, upd, axis=1, dim=4),
            "scatter_add_along": g.scatter_add_along(along, g.take_along(x, along, axis=1), axis=1, dim=4),
            "one_hot": g.one_hot(idx, n=3),
            "iota": g.iota(shape=[2, 3], axis=1),
        }

    out = run({"x": ((3, 4), "f32"), "idx": ((2, 2), "i32"), "along": ((3, 3), "i64"), "upd": ((3, 2, 2), "f32")},
              body, {"x": x, "idx": idx, "along": along, "upd": upd})
    close(out["take"], np.take(x, idx, axis=1))
    close(out["take_along"], np.take_along_axis(x, along, axis=1))
    expected = np.zeros((3, 4), np.float32)
    np.add.at(expected, (slice(None), idx), upd)
    close(out["scatter_add"], expected)
    expected = np.zeros((3, 4), np.float32)
    np.add.at(expected, (np.arange(3)[:, None], along), np.take_along_axis(x, along, axis=1))
    close(out["scatter_add_along"], expected)
    close(out["one_hot"], np.eye(3, dtype=np.float32)[idx])
    np.testing.assert_array_equal(out["iota"], np.broadcast_to(np.arange(3, dtype=np.int32), (2, 3)))
    assert out["iota"].dtype == np.int32


def test_casts():
    x = np.array([1.7, -1.7, 0.0, 3.0], dtype=np.float32)

    def body(g):
        x = g.inputs["x"]
        return {"i32": g.cast(x, dtype="i32"), "i1": g.cast(x, dtype="i1"), "bf16": g.cast(x, dtype="bf16"),
                "back": g.cast(g.cast(x, dtype="i1"), dtype="f32")}

    out = run({"x": ((4,), "f32")}, body, {"x": x})
    np.testing.assert_array_equal(out["i32"], [1, -1, 0, 3])
    np.testing.assert_array_equal(out["i1"], [True, True, False, True])
    assert out["bf16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["back"], [1, 1, 0, 1])


def test_constants():
    out = run({}, lambda g: {"splat": g.const(0.5, [2, 2]), "list": g.const([[1, 2], [3, 4]], [2, 2], "i32"),
                             "scalar": g.const(8.0), "iota": g.iota(shape=[3], axis=0)}, {})
    assert out["scalar"].shape == ()
    np.testing.assert_array_equal(out["iota"], [0, 1, 2])
    close(out["splat"], np.full((2, 2), 0.5, np.float32))
    np.testing.assert_array_equal(out["list"], [[1, 2], [3, 4]])


# -- precision ----------------------------------------------------------------------------------


def test_bf16_computes_in_f32_and_rounds_once_per_op():
    a = f32(8, 16).astype(ml_dtypes.bfloat16)
    b = f32(16, 4).astype(ml_dtypes.bfloat16)
    out = run({"a": ((8, 16), "bf16"), "b": ((16, 4), "bf16")},
              lambda g: {"y": g.exp(g.matmul(g.inputs["a"], g.inputs["b"]))}, {"a": a, "b": b})
    product = (a.astype(np.float32) @ b.astype(np.float32)).astype(ml_dtypes.bfloat16)
    expected = np.exp(product.astype(np.float32)).astype(ml_dtypes.bfloat16)
    assert out["y"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["y"].astype(np.float32), expected.astype(np.float32))


def test_f64_mode_runs_every_float_in_float64():
    x = RNG.standard_normal((3,))
    out = run({"x": ((3,), "bf16")}, lambda g: {"y": g.cast(g.mul(g.inputs["x"], g.inputs["x"]), dtype="f32")},
              {"x": x}, float_mode="f64")
    assert out["y"].dtype == np.float64
    np.testing.assert_array_equal(out["y"], x * x)


def test_unknown_float_mode_is_rejected():
    with pytest.raises(ValueError, match="float_mode"):
        compile_graph(make_func({}, lambda g: {}), float_mode="f16")


# -- inputs, emits, buffers ---------------------------------------------------------------------


def test_input_errors_name_the_input():
    graph = compile_graph(make_func({"model.w": ((2, 3), "f32"), "tokens": ((4,), "i32")},
                                    lambda g: {"w": g.inputs["model.w"]}))
    ok = {"model.w": f32(2, 3), "tokens": np.zeros(4, np.int32)}
    with pytest.raises(GraphInputError, match="'model.w'.*missing"):
        graph({"tokens": ok["tokens"]})
    with pytest.raises(GraphInputError, match=r"'model.w' must have shape \[2, 3\], got \[3, 2\]"):
        graph({**ok, "model.w": f32(3, 2)})
    with pytest.raises(GraphInputError, match="'tokens' must be i32"):
        graph({**ok, "tokens": np.zeros(4, np.float32)})


def test_outputs_never_alias_inputs_or_each_other_across_calls():
    def body(g):
        e = g.exp(g.inputs["x"])
        total = g.sum(e, axes=[0, 1], keep=False)
        return {"same": g.reshape(g.inputs["x"], shape=[4]), "exp": e, "flat": g.reshape(e, shape=[4]),
                "spread": g.broadcast(total, shape=[2, 2])}

    graph = compile_graph(make_func({"x": ((2, 2), "f32")}, body))
    x = f32(2, 2)
    first = graph({"x": x})
    second = graph({"x": x + 1})
    assert not np.shares_memory(first.outputs["same"], x)
    assert not np.shares_memory(first.outputs["exp"], first.outputs["flat"])
    first.outputs["spread"] *= 2  # outputs are writeable arrays the caller owns
    close(first.outputs["exp"], np.exp(x))
    close(second.outputs["exp"], np.exp(x + 1))


def test_emits_are_recorded_by_name():
    def body(g):
        x = g.inputs["x"]
        total = g.sum(x, axes=[0], keep=False)
        g.create("graph.metric", [total], {"name": "train/total"})
        g.create("graph.counter", [g.const(12, [], "i32")], {"name": "tokens"})
        g.create("graph.observe", [g.exp(x)], {"name": "model.blocks.0.attn.probs"})
        return {"total": total}

    graph = compile_graph(make_func({"x": ((3,), "f32")}, body))
    x = np.array([0.0, 1.0, 2.0], np.float32)
    result = graph({"x": x})
    assert result.metrics == {"train/total": 3.0}
    assert isinstance(result.metrics["train/total"], float)
    np.testing.assert_array_equal(result.counters["tokens"], 12)
    close(result.observed["model.blocks.0.attn.probs"], np.exp(x))


def test_buffer_reuse_keeps_long_chains_correct():
    """A chain of elementwise ops and matmuls reuses buffers; results must match a direct numpy run."""
    n = 64

    def body(g):
        h = g.inputs["x"]
        for _ in range(6):
            h = g.tanh(g.add(g.matmul(h, g.inputs["w"]), h))
        side = g.exp(g.neg(h))
        return {"h": h, "mix": g.mul(side, g.sum(g.broadcast(g.sum(h, axes=[1], keep=True), shape=[n, n]),
                                                  axes=[], keep=False))}

    graph = compile_graph(make_func({"x": ((n, n), "f32"), "w": ((n, n), "f32")}, body))
    assert graph.buffered_values >= 18
    assert graph.buffer_bytes <= 3 * n * n * 4
    for seed in range(3):
        rng = np.random.default_rng(seed)
        x, w = rng.standard_normal((n, n), np.float32), 0.1 * rng.standard_normal((n, n), np.float32)
        h = x
        for _ in range(6):
            h = np.tanh(h @ w + h)
        out = graph({"x": x, "w": w}).outputs
        close(out["h"], h, rtol=1e-5)
        close(out["mix"], np.exp(-h) * h.sum(axis=1, keepdims=True), rtol=1e-5)


def test_in_place_update_over_a_transposed_view_of_itself():
    """z = yᵀ + c may reuse y's buffer while reading it transposed: numpy must see the overlap."""

    def body(g):
        y = g.exp(g.inputs["x"])
        z = g.add(g.transpose(y, perm=[1, 0]), g.inputs["c"])
        return {"m": g.neg(g.matmul(z, g.transpose(z, perm=[1, 0])))}

    graph = compile_graph(make_func({"x": ((64, 64), "f32"), "c": ((64, 64), "f32")}, body))
    x, c = f32(64, 64), f32(64, 64)
    z = np.exp(x).T + c
    close(graph({"x": x, "c": c}).outputs["m"], -(z @ z.T), rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_summed_pads_fuse_bit_identically(seed, monkeypatch):
    """add(add(pad(a), pad(b)), pad(c)) over disjoint ranges (slice gradients) runs as one step that
    writes each piece into its range: the same bits as the pads and adds, -0.0 turned +0.0 included."""
    import sexpgpu.passes.lower_cpu as lower_cpu

    rng = np.random.default_rng(seed)
    width = [int(w) for w in rng.integers(1, 4, size=3)]
    gap = int(rng.integers(0, 2))  # a range covered by no piece stays zero
    total = sum(width) + gap
    starts = [0, width[0], width[0] + width[1] + gap]
    order = [int(i) for i in rng.permutation(3)]
    xs = {f"x{i}": f32(2, 3, width[i]) for i in range(3)}
    xs["x0"][0, 0, 0] = -0.0

    def body(g):
        pads = [g.pad(g.inputs[f"x{i}"], axis=2, before=starts[i], after=total - starts[i] - width[i]) for i in order]
        inner = g.add(pads[0], pads[1])
        return {"sum": g.add(inner, pads[2]) if seed % 2 else g.add(pads[2], inner)}

    inputs = {name: ((2, 3, value.shape[2]), "f32") for name, value in xs.items()}
    func = make_func(inputs, body)
    fused = compile_graph(func)
    assert [op.name for op in fused.step_ops] == ["cpu.pad_sum"], "the pad-sum was not fused"
    got = fused(xs).outputs
    monkeypatch.setattr(lower_cpu, "cpu_patterns", lambda float_mode: [])
    want = compile_graph(func)(xs).outputs
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    assert np.signbit(got["sum"]).sum() == np.signbit(want["sum"]).sum()


@pytest.mark.parametrize("returned", [False, True])
def test_attention_matmuls_transposed_operands_and_stores(returned):
    """Stacked matmuls with a column-major right side (kᵀ, copied to a row-major scratch first) and
    a product stored in its transpose's layout (so merging the heads is a view): numpy's values,
    also when the transposed product escapes (then it is stored as usual)."""
    x, y, v = f32(2, 5, 3, 4), f32(2, 5, 3, 4), f32(2, 3, 5, 4)

    def body(g):
        q = g.transpose(g.inputs["x"], perm=[0, 2, 1, 3])
        k = g.transpose(g.inputs["y"], perm=[0, 2, 3, 1])
        s = g.matmul(q, k)
        heads = g.transpose(g.matmul(g.exp(s), g.inputs["v"]), perm=[0, 2, 1, 3])
        out = {"s": g.neg(s), "merged": g.reshape(heads, shape=[2, 5, 12])}
        return {**out, "heads": heads} if returned else out

    graph = compile_graph(make_func({"x": ((2, 5, 3, 4), "f32"), "y": ((2, 5, 3, 4), "f32"),
                                     "v": ((2, 3, 5, 4), "f32")}, body))
    q, k = x.astype(np.float64).transpose(0, 2, 1, 3), y.astype(np.float64).transpose(0, 2, 3, 1)
    s = q @ k
    heads = (np.exp(s) @ v).transpose(0, 2, 1, 3)
    s, heads = s.astype(np.float32), heads.astype(np.float32)
    for _ in range(2):  # the scratch and the reused buffers hold stale values on the second call
        got = graph({"x": x, "y": y, "v": v}).outputs
        close(got["s"], -s, rtol=1e-5)
        close(got["merged"], heads.reshape(2, 5, 12), rtol=1e-5)
        if returned:
            close(got["heads"], heads, rtol=1e-5)
