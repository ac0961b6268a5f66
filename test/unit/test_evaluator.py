"""The evaluator: semantics, errors with locations and trails, the extension points."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sexpgpu.frontend import calls
from sexpgpu.frontend.analysis import SPECIAL_FORMS, register_special_form
from sexpgpu.frontend.calls import BUILTINS, call_trail, register_builtin, user_location
from sexpgpu.frontend.data import TENSOR_OPS, Symbol, TensorLike
from sexpgpu.frontend.evaluator import Defined, Evaluator, eval_file_lines
from sexpgpu.frontend.printing import show

from sexpgpu.diagnostics import SxError


def run(text):
    return [show(v) for v in Evaluator().eval_text(text, "t.sx")]


def error_of(text):
    with pytest.raises(SxError) as err:
        Evaluator().eval_text(text, "t.sx")
    return err.value


def test_closures_are_lexical():
    assert run("(def k 10) (defn adder (n) (fn (x) (+ x n k))) ((adder 1) 2)")[-1] == "13"
    assert run("(let ((x 1)) (let ((f (fn () x)) (x 2)) (f)))")[-1] == "1"


def test_fold_is_left_to_right_and_deep():
    assert run("(fold (fn (acc x) (cons x acc)) nil '(1 2 3))")[-1] == "(3 2 1)"
    assert run("(fold (fn (acc x) (+ acc 1)) 0 (range 10000))")[-1] == "10000"


def test_user_recursion_depth_is_a_located_error():
    err = error_of("(defn f (n) (+ 1 (f n)))\n(f 1)")
    assert "nest too deeply" in err.message and str(err.loc) == "t.sx:1:18"
    assert [loc.short() for loc in err.trail] == ["t.sx:1", "t.sx:2"]
    assert run("(defn down (n) (if (= n 0) 0 (+ 1 (down (- n 1))))) (down 5000)")[-1] == "5000"


def test_values_and_defined_print():
    assert run("(values 1 2) (def x 3) (defmacro m () 1)") == ["#<values 1 2>", "x = 3", "m = #<macro m>"]


def test_printing_of_atoms():
    assert run('1e-10 0.0015 1e16 (- 0 inf) nan "a\\"b" :k nil true [1 {:a "x"}]') == [
        "1e-10", "0.0015", "1e16", "-inf", "nan", '"a\\"b"', ":k", "nil", "true", '[1 {:a "x"}]',
    ]


def test_integer_division_is_exact_or_float():
    assert run("(/ 6 3) (/ 7 2) (quot -7 2) (mod -7 2)") == ["2", "3.5", "-3", "1"]


def test_type_error_is_located_at_the_call_with_a_trail():
    err = error_of('(defn g (x)\n  (+ x "a"))\n(g 1)')
    assert str(err.loc) == "t.sx:2:3" and "expects numbers" in err.message
    assert [loc.short() for loc in err.trail] == ["t.sx:3"]


def test_unbound_symbol_suggests():
    assert error_of("(lenght [1])").message == "unbound symbol 'lenght'; did you mean 'len'?"


def test_key_errors_name_function_argument_and_caller():
    base = "(defn f (a &key vocab (layers 2)) a)\n"
    assert error_of(base + "(f 1 :layer 3)").message == "'f' has no keyword argument ':layer'; did you mean ':layers'?"
    assert str(error_of(base + "(f 1 :layer 3)").loc) == "t.sx:2:1"
    assert error_of(base + "(f 1)").message == "'f' requires the keyword argument ':vocab'"
    assert "odd number" in error_of(base + "(f 1 :vocab)").message


def test_require_once_and_cycle(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.sx").write_text('(require "b.sx")\n(def from-a 1)\n')
    (tmp_path / "lib" / "b.sx").write_text("(def from-b 1)\n")
    main = tmp_path / "main.sx"
    main.write_text('(require "lib/a.sx")\n(require "lib/b.sx")\n(+ from-a from-b)\n')
    assert eval_file_lines(str(main)) == ["nil", "nil", "2"]
    (tmp_path / "lib" / "b.sx").write_text('(require "a.sx")\n')
    err = pytest.raises(SxError, eval_file_lines, str(main)).value
    assert err.message == "require cycle: a.sx -> b.sx -> a.sx"


def test_builtin_extension_with_location_and_keywords():
    seen = {}

    def shaped(loc, x, axis=None, *, keep=False, weight_decay=0.0):
        seen["loc"] = loc
        return [x, axis, keep, weight_decay]

    register_builtin("shaped-test", shaped, loc=True, kwargs=True)
    try:
        out = run("(shaped-test 1 :keep true :weight-decay 0.5) (shaped-test 1 2)")
        assert out == ["(1 nil true 0.5)", "(1 2 false 0.0)"]
        assert str(seen["loc"]) == "t.sx:1:46"
        assert "did you mean ':keep'" in error_of("(shaped-test 1 :kep true)").message
    finally:
        del BUILTINS["shaped-test"]


def test_special_form_extension_gets_unevaluated_forms():
    def metric(env, args, loc):
        name, value = args
        return Defined(name.name, env.eval(value))

    register_special_form("metric-test", metric)
    try:
        assert run("(let ((x 2)) (metric-test train/loss (let ((y 3)) (* x y))))") == ["train/loss = 6"]
    finally:
        del SPECIAL_FORMS["metric-test"]


class FakeTensor(TensorLike):
    def __sx_repr__(self):
        return "#<tensor>"


def test_tensor_dispatch_and_user_location(tmp_path):
    recorded = []

    def add(loc, *args):
        recorded.append((user_location(loc), call_trail()))
        return FakeTensor()

    previous = TENSOR_OPS.get("+")
    TENSOR_OPS["+"] = add
    lib = tmp_path / "prelude.sx"
    lib.write_text("(defn plus1 (t)\n  (+ t 1))\n")
    user = tmp_path / "user.sx"
    user.write_text("(plus1 tensor)\n")
    try:
        session = Evaluator()
        session.globals["tensor"] = FakeTensor()
        session.load_prelude(str(lib))
        assert [show(v) for _, v in session.eval_file(str(user))] == ["#<tensor>"]
        where, trail = recorded[0]
        assert (where.file, where.line, where.col) == (str(user), 1, 1)
        assert (where.via.file, where.via.line) == (str(lib), 2)
        assert [loc.line for loc in trail] == [1]
    finally:
        # Restore the tracer's '+' (installed when the experiment layer is imported).
        if previous is None:
            del TENSOR_OPS["+"]
        else:
            TENSOR_OPS["+"] = previous
        calls.LIBRARY_FILES.difference_update({str(lib), os.path.abspath(lib)})


def test_dtype_names_evaluate_to_themselves():
    assert run("f32 (list bf16 none)") == ["f32", "(bf16 none)"]
    assert Evaluator().eval_text("i32")[0] == Symbol("i32")


def test_fold_over_100k_elements_needs_no_python_recursion():
    # Speed is measured by benchmarks/frontend.py, not asserted here.
    session = Evaluator()
    session.eval_text("(def xs (range 100000))")
    assert session.eval_text("(fold (fn (acc x) (+ acc x)) 0 xs)")[0] == 4999950000


# -- property: any program gives a value or an SxError --

heads = ["+", "-", "*", "/", "quot", "mod", "pow", "min", "max", "sqrt", "log", "<", "=", "not", "list", "cons",
         "first", "rest", "nth", "len", "map", "filter", "fold", "range", "concat", "apply", "str", "format", "get",
         "assoc", "keys", "contains?", "if", "when", "cond", "do", "let", "let*", "fn", "def", "and", "or", "set!",
         "quote", "quasiquote", "unquote", "values", "error", "assert", "macroexpand", "gensym", "nope", "x"]
small_atoms = st.one_of(st.integers(-3, 12).map(str), st.sampled_from(['"s"', ":k", "nil", "true", "1.5", "x", "inf"]))
programs = st.recursive(
    small_atoms,
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(heads), st.lists(inner, max_size=3)).map(lambda p: "(" + " ".join([p[0], *p[1]]) + ")"),
        st.lists(inner, max_size=3).map(lambda xs: "(" + " ".join(xs) + ")"),
        st.lists(inner, max_size=3).map(lambda xs: "[" + " ".join(xs) + "]"),
        inner.map(lambda x: "'" + x),
        inner.map(lambda x: "`" + x),
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.lists(programs, min_size=1, max_size=3), st.integers(0, 40), st.sampled_from(["", "(", ")", '"', "#_", ",@"]))
def test_random_programs_give_a_value_or_an_sx_error(forms, cut, noise):
    text = "(def x 1)\n" + "\n".join(forms)
    mutated = text[:cut] + noise + text[cut:]
    for source in (text, mutated):
        try:
            Evaluator().eval_text(source, "r.sx")
        except SxError:
            pass
