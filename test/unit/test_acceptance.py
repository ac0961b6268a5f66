"""Acceptance: every §4 primitive and prelude function, numerically against numpy.

Each case traces `(sum (* EXPR probe))` for a parameter `probe` of EXPR's shape, so
the gradient the train graph returns for `probe` is EXPR's value exactly. The inputs
`a` and `b` are f32 parameters given random values; `idx` is an i32 batch field.
The references are the normative meanings of language.md §4.
"""

import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

import sexpgpu

RNG = np.random.default_rng(0)
A = RNG.standard_normal((2, 3, 4)).astype(np.float32)
B = RNG.standard_normal((2, 3, 4)).astype(np.float32)
IDX = np.array([[0, 3, 1], [2, 2, 0]], dtype=np.int32)
ERF = np.vectorize(math.erf)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _log_softmax(x, axis):
    s = x - x.max(axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis, keepdims=True))


def run_expr(tmp_path, expr: str, out_shape, a=A, b=B, idx=IDX, extra: str = "", lets: str = "", seed: int = 0,
             overrides=None, with_params=False):
    """EXPR's value, from the gradient of `(sum (* EXPR probe))` with respect to `probe`."""
    shape = " ".join(str(d) for d in out_shape)
    src = f"""
    (defloader data :source (synthetic-tokens :vocab 4 :count 256 :seed 1)
      :fields ((idx [{idx.shape[1]}] i32)) :batch {idx.shape[0]})
    {extra}
    (defmodule probe-mod ()
      (let ((a (param a [{' '.join(map(str, a.shape))}] :init zeros))
            (b (param b [{' '.join(map(str, b.shape))}] :init zeros))
            (probe (param probe [{shape}] :init zeros))
            {lets})
        (fn (idx) (+ (sum (* (cast {expr} f32) probe)) (* 0.0 (sum a)) (* 0.0 (sum b))))))
    (defmodel model (probe-mod))
    (defn objective (batch) (model (get batch :idx)))
    (defoptimizer opt (sgd :lr 0.1))
    (defrun :steps 1 :loader data :objective objective :optimizer opt :seed {seed})
    """
    path = tmp_path / "probe.sx"
    path.write_text(textwrap.dedent(src))
    exp = sexpgpu.compile(str(path))
    params = exp.init_params()
    params.update({"model.a": a, "model.b": b})
    params.update(overrides or {})
    out = exp.run_graph("train", {**params, "idx": idx})
    return (out["grads"]["model.probe"], params) if with_params else out["grads"]["model.probe"]


CASES = [
    # unary
    ("(neg a)", lambda: -A),
    ("(exp a)", lambda: np.exp(A)),
    ("(log (abs a))", lambda: np.log(np.abs(A))),
    ("(sqrt (abs a))", lambda: np.sqrt(np.abs(A))),
    ("(rsqrt (+ (abs a) 0.5))", lambda: 1 / np.sqrt(np.abs(A) + 0.5)),
    ("(tanh a)", lambda: np.tanh(A)),
    ("(erf a)", lambda: ERF(A)),
    ("(abs a)", lambda: np.abs(A)),
    ("(recip (+ (abs a) 1.0))", lambda: 1 / (np.abs(A) + 1)),
    ("(sin a)", lambda: np.sin(A)),
    ("(cos a)", lambda: np.cos(A)),
    ("(- a)", lambda: -A),
    ("(/ (+ (abs a) 1.0))", lambda: 1 / (np.abs(A) + 1)),
    # binary, with broadcasting and scalars on either side
    ("(+ a b)", lambda: A + B),
    ("(- a b)", lambda: A - B),
    ("(* a b)", lambda: A * B),
    ("(/ a (+ (abs b) 1.0))", lambda: A / (np.abs(B) + 1)),
    ("(pow (abs a) 1.5)", lambda: np.abs(A) ** 1.5),
    ("(pow (abs a) (abs b))", lambda: np.abs(A) ** np.abs(B)),
    ("(maximum a b)", lambda: np.maximum(A, B)),
    ("(minimum a b)", lambda: np.minimum(A, B)),
    ("(maximum a 0.0)", lambda: np.maximum(A, 0)),
    ("(- 1.0 a)", lambda: 1 - A),
    ("(+ a (slice b -1 0 1))", lambda: A + B[..., 0:1]),
    ("(* a (sum b [0 1]))", lambda: A * B.sum((0, 1))),
    ("(+ a b a 2.0)", lambda: A + B + A + 2),
    # compare and select
    ("(> a b)", lambda: A > B),
    ("(>= a 0.0)", lambda: A >= 0),
    ("(< a b)", lambda: A < B),
    ("(<= a b)", lambda: A <= B),
    ("(= a a)", lambda: A == A),
    ("(!= a b)", lambda: A != B),
    ("(where (> a b) a b)", lambda: np.where(A > B, A, B)),
    ("(where (> a 0.0) 1.0 -1.0)", lambda: np.where(A > 0, 1.0, -1.0)),
    ("(where (> a 0.0) a 0.0)", lambda: np.where(A > 0, A, 0.0)),
]

REDUCE_CASES = [
    ("(sum a)", lambda: A.sum()),
    ("(sum a 1)", lambda: A.sum(1)),
    ("(sum a -1)", lambda: A.sum(-1)),
    ("(sum a [0 2])", lambda: A.sum((0, 2))),
    ("(sum a -1 :keep true)", lambda: A.sum(-1, keepdims=True)),
    ("(sum a [0 -1] :keep true)", lambda: A.sum((0, 2), keepdims=True)),
    ("(max a)", lambda: A.max()),
    ("(max a 0)", lambda: A.max(0)),
    ("(max a -2 :keep true)", lambda: A.max(-2, keepdims=True)),
    ("(min a [1 2])", lambda: A.min((1, 2))),
    ("(min a -1 :keep true)", lambda: A.min(-1, keepdims=True)),
    ("(mean a)", lambda: A.mean()),
    ("(mean a -1)", lambda: A.mean(-1)),
    ("(mean a [0 1] :keep true)", lambda: A.mean((0, 1), keepdims=True)),
    ("(var a -1)", lambda: A.var(-1)),
    ("(var a)", lambda: A.var()),
    ("(var a 1 :keep true)", lambda: A.var(1, keepdims=True)),
]

SHAPE_CASES = [
    ("(reshape a [6 4])", lambda: A.reshape(6, 4)),
    ("(reshape a [4 -1])", lambda: A.reshape(4, -1)),
    ("(reshape a [24])", lambda: A.reshape(24)),
    ("(transpose a 0 2)", lambda: A.transpose(2, 1, 0)),
    ("(transpose a -1 -2)", lambda: A.transpose(0, 2, 1)),
    ("(transpose a)", lambda: A.transpose(0, 2, 1)),
    ("(permute a [2 0 1])", lambda: A.transpose(2, 0, 1)),
    ("(permute a [-1 0 1])", lambda: A.transpose(2, 0, 1)),
    ("(broadcast-to (sum a 0) [5 3 4])", lambda: np.broadcast_to(A.sum(0), (5, 3, 4))),
    ("(broadcast-to (sum a 0 :keep true) [3 3 4])", lambda: np.broadcast_to(A.sum(0, keepdims=True), (3, 3, 4))),
    ("(slice a 2 1 3)", lambda: A[:, :, 1:3]),
    ("(slice a -1 1 3)", lambda: A[..., 1:3]),
    ("(slice a 1 -2 3)", lambda: A[:, -2:3]),
    ("(concat [a b] 0)", lambda: np.concatenate([A, B], 0)),
    ("(concat [a b a] -1)", lambda: np.concatenate([A, B, A], -1)),
    ("(squeeze (slice a 1 0 1) 1)", lambda: A[:, 0]),
    ("(squeeze (sum a -1 :keep true) -1)", lambda: A.sum(-1)),
    ("(expand-dims a 0)", lambda: A[None]),
    ("(expand-dims a -1)", lambda: A[..., None]),
    ("(expand-dims a 1)", lambda: A[:, None]),
    ("(matmul a (transpose b))", lambda: A @ B.transpose(0, 2, 1)),
    ("(matmul (transpose a) b)", lambda: A.transpose(0, 2, 1) @ B),
    ("(matmul (reshape a [6 4]) (transpose (reshape b [6 4]) 0 1))", lambda: A.reshape(6, 4) @ B.reshape(6, 4).T),
    ("(matmul a (slice (reshape b [6 4]) 0 0 4))", lambda: A @ B.reshape(6, 4)[:4]),
    ("(matmul (expand-dims a 0) (expand-dims (transpose b) 0))", lambda: (A @ B.transpose(0, 2, 1))[None]),
    ("(take (reshape a [6 4]) idx 0)", lambda: A.reshape(6, 4)[IDX]),
    ("(take a idx -1)", lambda: np.take(A, IDX, -1)),
    ("(take-along a (expand-dims idx -1) -1)", lambda: np.take_along_axis(A, IDX[..., None], -1)),
    ("(take-along (reshape a [6 4]) (reshape idx [6 1]) 1)",
     lambda: np.take_along_axis(A.reshape(6, 4), IDX.reshape(6, 1), 1)),
    ("(take-along a (broadcast-to (expand-dims (slice idx 1 0 2) 1) [2 3 2]) 2)",
     lambda: np.take_along_axis(A, np.broadcast_to(IDX[:, None, 0:2], (2, 3, 2)), 2)),
    ("(one-hot idx 4)", lambda: np.eye(4, dtype=np.float32)[IDX]),
    ("(iota [3 4] 0)", lambda: np.broadcast_to(np.arange(3)[:, None], (3, 4))),
    ("(iota [3 4] -1)", lambda: np.broadcast_to(np.arange(4)[None, :], (3, 4))),
    ("(cast (cast a i32) f32)", lambda: A.astype(np.int32).astype(np.float32)),
    ("(cast (> a 0.0) f32)", lambda: (A > 0).astype(np.float32)),
    ("(+ (cast idx f32) 0.5)", lambda: IDX + 0.5),
    ("(* idx 2)", lambda: IDX * 2),
    ("(+ idx 0.5)", lambda: IDX + 0.5),
    ("(* a (dim a 2) (numel b) (first (shape a)))", lambda: A * 4 * 24 * 2),
]

PRELUDE_CASES = [
    ("(softmax a -1)", lambda: _softmax(A, -1)),
    ("(softmax a 1)", lambda: _softmax(A, 1)),
    ("(log-softmax a -1)", lambda: _log_softmax(A, -1)),
    ("(log-softmax (* a 30.0) 0)", lambda: _log_softmax(A * 30, 0)),
    ("(gelu a)", lambda: A * 0.5 * (1 + ERF(A / np.sqrt(2)))),
    ("(gelu-tanh a)", lambda: 0.5 * A * (1 + np.tanh(np.sqrt(2 / np.pi) * (A + 0.044715 * A**3)))),
    ("(relu a)", lambda: np.maximum(A, 0)),
    ("(silu a)", lambda: A / (1 + np.exp(-A))),
    ("(cross-entropy a idx)", lambda: -np.take_along_axis(_log_softmax(A, -1), IDX[..., None], -1).mean()),
    ("(cross-entropy (reshape a [6 4]) (reshape idx [6]))",
     lambda: -np.take_along_axis(_log_softmax(A.reshape(6, 4), -1), IDX.reshape(6, 1), -1).mean()),
    ("(where (= (causal-mask 4) 0.0) 1.0 -1.0)", lambda: np.where(np.triu(np.ones((4, 4)), 1) > 0, -1.0, 1.0)),
    ("(split-heads (reshape a [2 2 6]) 3)", lambda: A.reshape(2, 2, 3, 2).transpose(0, 2, 1, 3)),
    ("(merge-heads (reshape a [2 2 3 2]))", lambda: A.reshape(2, 2, 3, 2).transpose(0, 2, 1, 3).reshape(2, 3, 4)),
    ("(merge-heads (split-heads a 2))", lambda: A),
]


def _expected(fn):
    return np.asarray(fn(), dtype=np.float64)


@pytest.mark.parametrize("expr,ref", CASES + REDUCE_CASES + SHAPE_CASES + PRELUDE_CASES)
def test_primitive_matches_numpy(tmp_path, expr, ref):
    want = _expected(ref)
    got = run_expr(tmp_path, expr, want.shape)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=expr)


def test_causal_mask_values(tmp_path):
    """0 on and below the diagonal, -inf above: the finite part, and where the -inf lies."""
    got = run_expr(tmp_path, "(where (< (causal-mask 5) -1e30) 1.0 (+ (causal-mask 5) 2.0))", (5, 5))
    np.testing.assert_array_equal(got, np.where(np.triu(np.ones((5, 5)), 1) > 0, 1.0, 2.0))


def test_bf16_cast_rounds(tmp_path):
    got = run_expr(tmp_path, "(cast (cast a bf16) f32)", A.shape)
    np.testing.assert_allclose(got, A, rtol=1e-2)


# -- modules: the meaning table of §4 --------------------------------------------------------


def _layernorm(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def test_linear_without_bias_and_std(tmp_path):
    lets = "(lin (sub lin (linear 4 5 :bias false :std 0.5)))"
    got, params = run_expr(tmp_path, "(lin a)", (2, 3, 5), lets=lets, with_params=True)
    assert "model.lin.bias" not in params
    w = params["model.lin.weight"]
    assert w.shape == (4, 5)
    np.testing.assert_allclose(got, A @ w, rtol=1e-5, atol=1e-6)


def test_linear_with_bias(tmp_path):
    lets = "(lin (sub lin (linear 4 5)))"
    bias = RNG.standard_normal(5).astype(np.float32)
    got, params = run_expr(tmp_path, "(lin a)", (2, 3, 5), lets=lets, with_params=True,
                           overrides={"model.lin.bias": bias})
    np.testing.assert_allclose(got, A @ params["model.lin.weight"] + bias, rtol=1e-5, atol=1e-6)


def test_embedding_takes_rows(tmp_path):
    got, params = run_expr(tmp_path, "(emb idx)", (2, 3, 6), lets="(emb (sub emb (embedding 4 6)))", with_params=True)
    np.testing.assert_allclose(got, params["model.emb.table"][IDX], rtol=1e-6)


@pytest.mark.parametrize("eps_form,eps", [("", 1e-5), (":eps 0.5", 0.5)])
def test_layernorm(tmp_path, eps_form, eps):
    w = RNG.standard_normal(4).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    small = (A * 0.01).astype(np.float32)  # small variance: eps matters
    got = run_expr(tmp_path, "(ln a)", A.shape, a=small, lets=f"(ln (sub ln (layernorm 4 {eps_form})))",
                   overrides={"model.ln.weight": w, "model.ln.bias": b})
    np.testing.assert_allclose(got, _layernorm(small.astype(np.float64), w, b, eps), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("eps_form,eps", [("", 1e-6), (":eps 0.1", 0.1)])
def test_rmsnorm(tmp_path, eps_form, eps):
    w = RNG.standard_normal(4).astype(np.float32)
    small = (A * 0.001).astype(np.float32)
    got = run_expr(tmp_path, "(rn a)", A.shape, a=small, lets=f"(rn (sub rn (rmsnorm 4 {eps_form})))",
                   overrides={"model.rn.weight": w})
    x = small.astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_mlp(tmp_path):
    got, p = run_expr(tmp_path, "(ff a)", A.shape, lets="(ff (sub ff (mlp 4 8)))", with_params=True,
                      overrides={"model.ff.fc.bias": RNG.standard_normal(8).astype(np.float32)})
    h = A @ p["model.ff.fc.weight"] + p["model.ff.fc.bias"]
    h = h * 0.5 * (1 + ERF(h / np.sqrt(2)))
    np.testing.assert_allclose(got, h @ p["model.ff.proj.weight"] + p["model.ff.proj.bias"], rtol=1e-4, atol=1e-6)


def test_attention(tmp_path):
    width, heads = 4, 2
    big = {k: (RNG.standard_normal(s) * 0.5).astype(np.float32) for k, s in
           [("model.at.qkv.weight", (4, 12)), ("model.at.qkv.bias", (12,)),
            ("model.at.proj.weight", (4, 4)), ("model.at.proj.bias", (4,))]}
    got = run_expr(tmp_path, "(at a)", A.shape, lets=f"(at (sub at (attention {width} {heads})))", overrides=big)
    x = A.astype(np.float64)
    qkv = x @ big["model.at.qkv.weight"] + big["model.at.qkv.bias"]
    b, t, d = 2, 3, width // heads

    def split(z):
        return z.reshape(b, t, heads, d).transpose(0, 2, 1, 3)

    q, k, v = split(qkv[..., :4]), split(qkv[..., 4:8]), split(qkv[..., 8:])
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    scores = scores + np.where(np.triu(np.ones((t, t)), 1) > 0, -np.inf, 0.0)
    out = (_softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, width)
    want = out @ big["model.at.proj.weight"] + big["model.at.proj.bias"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_defmodule_key_defaults_and_nesting(tmp_path):
    extra = """
    (defmodule scaler (width &key (factor 2.0) (offset (* factor 10)))
      (let ((w (param w [width] :init (constant factor))))
        (fn (x) (+ (* x w) offset))))
    (defmodule pair (width)
      (let ((s (sub-list s 2 (scaler width :factor 3.0))))
        (fn (x) ((nth s 1) ((first s) x)))))
    """
    got, p = run_expr(tmp_path, "(+ (pr a) (one a))", A.shape, extra=extra, with_params=True,
                      lets="(pr (sub pr (pair 4))) (one (sub one (scaler 4)))")
    assert {"model.pr.s.0.w", "model.pr.s.1.w", "model.one.w"} <= set(p)
    np.testing.assert_array_equal(p["model.pr.s.0.w"], np.full(4, 3.0, np.float32))
    want = ((A * 3 + 30) * 3 + 30) + (A * 2 + 20)
    np.testing.assert_allclose(got, want, rtol=1e-5)


# -- parameter inits -------------------------------------------------------------------------


INIT_SRC = """
(defloader data :source (synthetic-tokens :vocab 4 :count 64 :seed 1) :fields ((t [2] i32)) :batch 2)
(defmodule inits ()
  (let ((n (param n [200 100] :init (normal 0.3)))
        (d (param d [200 100]))
        (u (param u [200 100] :init (uniform -2 4)))
        (z (param z [3] :init zeros))
        (o (param o [3] :init ones))
        (c (param c [3] :init (constant 1.25))))
    (fn (t) (+ (sum n) (sum d) (sum u) (sum z) (sum o) (sum c) (* 0.0 (sum (cast t f32)))))))
(defmodel model (inits))
(defn objective (batch) (model (get batch :t)))
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 1 :loader data :objective objective :optimizer opt :seed SEED)
"""


def _init_params(tmp_path, seed):
    path = tmp_path / f"inits{seed}.sx"
    path.write_text(INIT_SRC.replace("SEED", str(seed)))
    return sexpgpu.compile(str(path)).init_params()


def test_init_statistics(tmp_path):
    p = _init_params(tmp_path, 1)
    assert abs(p["model.n"].mean()) < 0.01 and abs(p["model.n"].std() - 0.3) < 0.01
    assert abs(p["model.d"].std() - 0.02) < 0.001  # the default init is (normal 0.02)
    u = p["model.u"]
    assert u.min() >= -2 and u.max() < 4 and abs(u.mean() - 1.0) < 0.05
    assert abs(u.std() - 6 / math.sqrt(12)) < 0.05
    np.testing.assert_array_equal(p["model.z"], np.zeros(3))
    np.testing.assert_array_equal(p["model.o"], np.ones(3))
    np.testing.assert_array_equal(p["model.c"], np.full(3, 1.25))
    assert all(v.dtype == np.float32 for v in p.values())
    q = _init_params(tmp_path, 1)
    np.testing.assert_array_equal(p["model.n"], q["model.n"])
    r = _init_params(tmp_path, 2)
    assert not np.array_equal(p["model.n"], r["model.n"])


# -- knobs, variants, emits ------------------------------------------------------------------


KNOB_SRC = """
(defknobs (lr 0.01) (width 4) (scale 0.5) (on true) (label "x") (precision f32))
(defvariant wide :width 8 :scale 2.0)
(defloader data :source (synthetic-tokens :vocab 4 :count 64 :seed 1) :fields ((t [3] i32)) :batch 2)
(defmodule m () (let ((w (param w [width] :init ones))) (fn (x) (* (sum w) x))))
(defmodel model (m))
(defn prepare (batch)
  (counter static-count (* 2 (numel (get batch :t))))
  (counter dynamic-count (sum (get batch :t)))
  {:t (cast (get batch :t) f32)})
(defn objective (batch)
  (let ((loss (mean (model (* (get batch :t) (if on scale 0.0))))))
    (metric train/loss loss)
    (metric train/width (* 1.0 width))
    (metric train/label-len (+ 0.0 (len label)))
    loss))
(defn evaluate (batch) (metric val/x (mean (get batch :t))))
(defevaluation ev :loader data :every 1 :fn evaluate)
(defoptimizer opt (adamw :lr lr))
(defrun :steps 2 :loader data :objective objective :optimizer opt :prepare prepare
        :evaluations [ev] :precision precision)
"""


def test_knob_types_and_emits(tmp_path):
    path = tmp_path / "knobs.sx"
    path.write_text(KNOB_SRC)
    exp = sexpgpu.compile(str(path), variant="wide",
                          set={"scale": "3", "on": "true", "label": "hello", "precision": "bf16", "lr": 0.5})
    sel = exp.selection
    assert sel["width"] == (8, "variant") and sel["scale"][0] == 3.0 and sel["scale"][1] == "set"
    assert sel["label"] == ("hello", "set") and sel["lr"] == (0.5, "set")
    assert getattr(sel["precision"][0], "name", sel["precision"][0]) == "bf16" and sel["precision"][1] == "set"
    t = np.array([[1, 2, 3], [0, 1, 1]], np.int32)
    out = exp.run_graph("train", {**exp.init_params(), "t": t})
    assert out["counters"]["static-count"] == 12
    assert out["counters"]["dynamic-count"] == 8
    assert out["metrics"]["train/width"] == 8.0 and out["metrics"]["train/label-len"] == 5.0
    np.testing.assert_allclose(out["loss"], 8 * 3.0 * t.mean(), rtol=1e-2)  # bf16 compute
    ev = exp.run_graph("ev", {**exp.init_params(), "t": t})
    np.testing.assert_allclose(ev["val/x"], t.mean(), rtol=1e-2)
    assert exp.report()


# -- broken files: exit 1, a located diagnostic at the user's file, no traceback -------------

ERRORS = sorted((Path(__file__).resolve().parents[1] / "lit" / "acceptance" / "errors").glob("*.sx"))


@pytest.mark.parametrize("path", ERRORS, ids=[p.stem for p in ERRORS])
@pytest.mark.parametrize("verb", ["check", "explain"])
def test_broken_file_is_a_user_error(path, verb, capsys):
    from sexpgpu.tools.main import main

    try:
        rc = main([verb, str(path)])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 1, text
    assert "Traceback" not in text and "internal error" not in text.lower()
    first = next(line for line in text.splitlines() if ": error: " in line)
    assert first.split(":")[0].endswith(path.name), first  # located in the user's file, not the prelude
    assert "prelude.sx" not in first
