"""Every input is handled inside the evaluator: bad arguments, values over the bounds, deep
nesting, Ctrl-C, a small address space. Each is a located `SxError`, never a Python exception.

The seeded tests call every builtin, and compile experiments with every option, with values
drawn from a pool of the awkward (nil, nan, huge ints, tensors, functions, nested data...).
"""

import math
import os
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
from sexpgpu.dialects.core import TensorType
from sexpgpu.frontend import limits, tracer
from sexpgpu.frontend.calls import Builtin, invoke
from sexpgpu.frontend.data import Keyword, SxList, SxVector, Symbol
from sexpgpu.frontend.deep import run_deep
from sexpgpu.frontend.evaluator import Evaluator
from sexpgpu.frontend.printing import show
from sexpgpu.frontend.reader import read_text
from sexpgpu.frontend.tracer import Trace, tracing
from sexpgpu.tools.check_cmd import check
from sexpgpu.tools.main import main as sexpgpu_main
from test_evaluator import error_of, run

from sexpgpu.diagnostics import Location, SxError

LOC = Location("t.sx", 1, 1)


# -- every builtin, every argument -------------------------------------------------------------


def _value_pool(session, trace):
    with tracing(trace):
        tensors = [
            trace.input("batch", "x", TensorType((2, 3), "f32")),
            trace.input("batch", "i", TensorType((2,), "i32")),
            trace.input("batch", "b", TensorType((2, 3), "i1")),
        ]
    made = session.eval_text(
        '(list (fn (x) x) (fn (a b) a) (normal 0.1) zeros (synthetic-tokens :vocab 16 :count 10)'
        ' (linear-warmup 0.1 :warmup 2) (group "x" :lr 0.1) (adamw :lr 0.1) (every 2) (grads "x")'
        ' [(group "m.*" :lr 0.2)] (list 1 2) [0.9 0.99] {:a 1} {})'
    )[0]
    return [
        0, 1, -1, 2, 3, 10**400, -(10**30), 2**40, 1.5, -0.0, -0.5, math.inf, math.nan, 1e308, 1e-8,
        True, False, None, "s", "", Keyword("a"), Symbol("f32"), Symbol("x"), SxList(),
        SxVector(), SxVector([-3]), SxVector([2, 3]), SxVector([SxVector([1])]), SxVector(tensors[:1] * 2),
        SxList(tensors[:1]), session.globals["+"], *tensors, *made,
    ]


_KEYWORDS = [
    Keyword(k)
    for k in "vocab count lr groups warmup steps floor betas eps weight-decay momentum clip keep axis dtype seed "
    "branch nesterov peak".split()
]


def _calls(rng, pool, count):
    yield ()
    for value in pool:
        yield (value,)
    for _ in range(count):
        args = [rng.choice(pool) for _ in range(rng.choice([1, 2, 2, 3, 4, 5]))]
        for _ in range(rng.choice([0, 0, 1, 2])):
            args += [rng.choice(_KEYWORDS), rng.choice(pool)]
        yield tuple(args)


def test_every_builtin_takes_any_arguments_with_a_located_error_at_worst():
    def body():
        session = Evaluator()
        trace = Trace("t", "train")
        pool = _value_pool(session, trace)
        rng = random.Random(13)
        failures = {}
        for name, fn in sorted(session.globals.items()):
            if not isinstance(fn, Builtin):
                continue
            for args in _calls(rng, pool, 60):
                for traced in (False, True):
                    try:
                        if traced:
                            with tracing(trace):
                                invoke(fn, list(args), LOC)
                        else:
                            invoke(fn, list(args), LOC)
                    except SxError as err:
                        assert err.loc is not None, (name, err.message)
                    except Exception as e:  # noqa: BLE001  (what the test looks for)
                        failures.setdefault((name, type(e).__name__), [show(a)[:40] for a in args])
        return failures

    assert run_deep(body) == {}


_TEMPLATE = """(defknobs (lr 0.01) (seq 4))
(defloader data :source (synthetic-tokens :vocab 16 :count 256 :seed 1) :fields ((tokens [(+ seq 1)] i32)) :batch {batch})
(defmodule net () (let ((w (param w [3] :init {init}))) (fn (x) (* x (sum w)))))
(defmodel model (net))
(defn objective (batch) (mean (model (cast (get batch :tokens) f32))))
(defoptimizer opt ({optimizer} :lr {lr} {option} {value}))
(defrun :steps {steps} :loader data :objective objective :optimizer opt)
"""

_VALUES = [
    "0", "1", "-1", "0.5", "1.0", "-0.0", "2", "(pow 10 400)", "(- inf inf)", "inf", "nil", "true", '"s"', ":k",
    "[0.9 0.99]", "[0.9]", "[1.5 0.9]", "[nan 0.9]", "(fn (x) x)", "{:a 1}", "lr", "(linear-warmup lr :warmup 5)",
    "(cosine lr :steps 10 :floor 0.1)", "(warmup-cosine lr :warmup 20 :steps 3)", "(cosine lr :steps 0)",
    '[(group "model.*" :lr 0.1)]', '[(group "model.*" :lr -1)]', '(group "model.*")', "(constant 0.1)",
    "(constant nan)", "(normal 0.02)", "zeros", "(uniform 1 nan)", "1e-8", "(* 2 lr)", "9223372036854775808",
]
_OPTIONS = [":betas", ":eps", ":weight-decay", ":momentum", ":nesterov", ":clip", ":groups", ":lr", ":peak", ":steps"]


def _experiment(rng):
    """The template with one or two of its slots given an awkward value; valid otherwise."""
    slots = {"optimizer": "adamw", "lr": "lr", "option": ":eps", "value": "1e-8", "init": "ones", "batch": "2",
             "steps": "2"}
    for slot in rng.sample(sorted(slots), rng.choice([1, 1, 2])):
        if slot == "optimizer":
            slots[slot] = "sgd"
        elif slot == "option":
            slots[slot] = rng.choice(_OPTIONS)
        else:
            slots[slot] = rng.choice(_VALUES)
    return _TEMPLATE.format(**slots)


def test_experiment_options_take_any_value_with_a_located_error_at_worst(tmp_path, capsys):
    """What `check` accepts, `explain` and `diff` report on too."""
    rng = random.Random(7)
    path = tmp_path / "fuzz.sx"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(200):
        text = _experiment(rng)
        path.write_text(text)
        try:
            check(str(path), None, [])
        except SxError as err:
            assert err.loc is not None, (text, err.message)
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        assert sexpgpu_main(["explain", str(path)]) == 0, (text, capsys.readouterr().err)
        assert sexpgpu_main(["diff", str(path), str(path), "--set", "lr=0.5"]) == 0, (text, capsys.readouterr().err)
    assert outcomes["ok"] > 20 and outcomes["error"] > 20, outcomes


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("(get {:a 1} [1 2])", "'get': a map key must be"),
        ("{(list 1) 2}", "a map key must be a keyword, string, symbol, number or nil, got (1) (a list)"),
        ("(assoc {:a 1} {:b 2} 3)", "'assoc': a map key must be"),
        ("(contains? {:a 1} [1])", "'contains?': a map key must be"),
        ("{false 0}", "got false (a boolean)"),
    ],
)
def test_map_keys_are_atoms(code, message):
    assert message in error_of(code).message


def test_map_keys_compare_as_equal_does():
    assert run('(get {1 :one "a" :a nil :nil} 1.0) (get {1 :one nil :nil} nil) (get {\'s 2} \'s)') == [
        ":one", ":nil", "2",
    ]


@pytest.mark.parametrize(
    "code",
    [
        "(def big (* 9 (pow 10 4299))) (* big big)",
        "(def big (* 9 (pow 10 4299))) (+ big big)",
        "(def big (* 9 (pow 10 4299))) (- (- big) big)",
        "(def big (* 9 (pow 10 4299))) (* 1 2 big big)",
        "(pow 2 20000)",
        "(pow -7 100000000000)",
        "(apply * (range 1 3000))",
    ],
)
def test_integers_are_bounded(code):
    assert "(integers have at most 4300)" in error_of(code).message


def test_integers_up_to_the_bound_are_exact():
    assert run("(len (str (* 9 (pow 10 4299))))")[-1] == "4300"
    assert run("(- (* 9 (pow 10 4299)) (* 9 (pow 10 4299)))")[-1] == "0"


# -- depth ---------------------------------------------------------------------------------------


def test_data_nested_any_depth_prints_and_compares_with_a_located_error():
    values = Evaluator().eval_text("(fold (fn (acc x) (list acc)) nil (range 200000))", "t.sx")
    text = show(values[0])
    assert text.startswith("((((") and len(text) == 2 * 200000 + 3
    err = error_of("(def deep (fold (fn (acc x) (list acc)) nil (range 200000)))\n(= deep deep)")
    assert err.message == "'=': the data nests too deeply" and str(err.loc) == "t.sx:2:1"


def test_a_graph_has_at_most_max_graph_ops(monkeypatch, tmp_path):
    monkeypatch.setattr(tracer, "MAX_GRAPH_OPS", 40)
    path = tmp_path / "ops.sx"
    path.write_text(_TEMPLATE.format(optimizer="sgd", lr="0.1", option="", value="", init="ones", batch=2, steps=2)
                    .replace("(* x (sum w))", "(fold (fn (h i) (+ h 1.0)) (* x (sum w)) (range 100))"))
    with pytest.raises(SxError) as err:
        check(str(path), None, [])
    assert err.value.message.startswith("graph 'train' has more than 40 ops")
    assert err.value.loc.line == 3


def test_reading_a_one_megabyte_string_takes_megabytes():
    text = '(def s "' + "x" * 1_000_000 + '")'
    tracemalloc.start()
    try:
        read_text(text, "big.sx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 1e6:.0f} MB"


# -- the evaluation thread -----------------------------------------------------------------------


#: Forms that print a line each as they finish, then a recursion 2,000 calls deep (about 8,000
#: Python frames) that computes for ever at the bottom.
_INTERRUPTED = """(defn spin (n) (if (> n 0) (do (spin (- n 1)) (spin (- n 1))) 0))
(defn deep (n) (if (> n 0) (+ 1 (deep (- n 1))) (spin 100)))
(def a (spin 8))
(def b (spin 8))
(deep 2000)
"""
#: Lines `eval` prints before the endless form.
_LINES_BEFORE_DEEP = 4


def _sexpgpu(*args):
    return [sys.executable, "-m", "sexpgpu.tools.main", *args]


def _interrupt(path, point, rng):
    """Run `eval` of `path`, send SIGINT at `point`, and return (status, stderr) once it ends."""
    # Python ignores SIGINT where it was ignored when it started (as in a background job): reset it.
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *_sexpgpu("eval", str(path))[1:]], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Both pipes are drained by threads through their file objects to the end: `communicate` after a
    # `readline` reads the descriptor behind the object's buffer and loses what it held, cut mid-line.
    err_lines, out_lines = [], queue.Queue()
    language_imported = threading.Event()

    def drain_stderr():
        for line in proc.stderr:
            err_lines.append(line)
            if "sexpgpu.frontend" in line:
                language_imported.set()
        language_imported.set()

    def drain_stdout():
        for line in proc.stdout:
            out_lines.put(line)
        out_lines.put("")

    drains = [threading.Thread(target=drain, daemon=True) for drain in (drain_stderr, drain_stdout)]
    for drain in drains:
        drain.start()
    try:
        if point == "starting":
            # The language is imported once the command runs (`-X importtime` says when): then the
            # file is read, the evaluation thread starts and the first form runs, in the next moment.
            assert language_imported.wait(60)
            time.sleep(rng.uniform(0, 0.5))
        else:
            lines = _LINES_BEFORE_DEEP if point == "deep" else point
            for _ in range(lines):
                assert out_lines.get(timeout=60)
            if point == "deep":
                time.sleep(rng.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # a hang fails here, not a slow machine
        for drain in drains:
            drain.join(60)
    finally:
        proc.kill()
    return proc.returncode, "".join(line for line in err_lines if not line.startswith("import time:"))


def test_ctrl_c_reaches_the_caller_of_run_deep_once_the_thread_has_unwound():
    """In process, with Python's own SIGINT handler: the interrupt stops the evaluation thread 3,000
    frames deep, and the caller gets it only once the thread has unwound, under its own recursion
    limit (lowering the process's limit under a deep thread can abort the process)."""
    deep = threading.Event()
    unwound = []

    def down(n):
        if n == 0:
            deep.set()
            # Spins until interrupted; a bounded spin, so a lost interrupt fails the test instead of hanging.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pass
            return 0
        return down(n - 1) + 1

    def body():
        try:
            return down(3000)
        finally:
            unwound.append(sys.getrecursionlimit())

    def interrupt_when_deep():
        assert deep.wait(60)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    limit = sys.getrecursionlimit()
    # Python's own handler, whatever an earlier test of the session left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_when_deep, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_deep(body)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert unwound and unwound[0] > limit and sys.getrecursionlimit() == limit, (unwound, limit)


def test_an_evaluation_leaves_no_asynchronous_exception_pending():
    """The evaluation thread drops an interrupt it did not take by taking a stand-in, so the interpreter's
    note of a pending asynchronous exception is cleared: a profiler runs after an evaluation (with the
    note left set, CPython 3.11's cProfile loops for ever on a function's first instruction)."""
    code = ("import cProfile\n"
            "from sexpgpu.frontend.evaluator import Evaluator\n"
            "evaluator = Evaluator()\n"
            "profile = cProfile.Profile()\n"
            "print(profile.runcall(evaluator.eval_text, '(+ 1 2)'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[3]", done.stderr


def test_ctrl_c_at_any_point_of_a_run_ends_it_interrupted_under_load(tmp_path):
    """Ctrl-C before the first form, between forms and deep in a recursion, with a busy process
    beside: every time exit 130, "interrupted", no traceback, no abort."""
    path = tmp_path / "endless.sx"
    path.write_text(_INTERRUPTED)
    points = [(point, random.Random(f"{point}-{n}")) for n in range(2) for point in ["starting", 1, 2, 3, "deep"]]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with ThreadPoolExecutor(3) as pool:  # three commands at a time: the load is theirs too
            outcomes = list(pool.map(lambda p: (p[0], *_interrupt(path, *p)), points))
    finally:
        busy.kill()
    wrong = [o for o in outcomes if o[1] != 130 or o[2].strip() != "interrupted"]
    assert not wrong, wrong


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_the_evaluator_runs_under_a_virtual_memory_limit(tmp_path):
    path = tmp_path / "small.sx"
    path.write_text("(defn down (n) (if (= n 0) 0 (+ 1 (down (- n 1)))))\n(down 500)\n")

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (900 << 20, 900 << 20))  # under the 1 GiB stack it asks for first

    done = subprocess.run(_sexpgpu("eval", str(path)), capture_output=True, text=True, preexec_fn=limited,
                          timeout=120, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "500"


def test_the_bounds_are_documented():
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "language.md"), encoding="utf-8").read()
    for bound in (limits.MAX_INT_DIGITS, limits.MAX_ITEMS, limits.MAX_NESTING, limits.MAX_PARAMS):
        assert f"{bound:,}" in text, bound
