"""plan-memory: the peak-activation bound, exact on a hand-computed graph."""

from __future__ import annotations

from _graph_helpers import make_module
from sexpgpu.dialects import exp, graph  # noqa: F401  (registers the ops)
from sexpgpu.dialects.core import Builder, Operation, Region, TensorType, Value
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

from sexpgpu.diagnostics import Location


def small_train(kind: str = "train", accumulate: bool = False) -> Operation:
    """The graph of the docstring table below; op i sits on line 10 + i of m.sx.

    point  value                     bytes  live (points)
    0      x  input batch  2x3 f32     24   0..2
    1      w  input param  3x4 f32     48   param
    2      xb cast x       2x3 bf16    12   2..4
    3      wb cast w       3x4 bf16    24   3..4
    4      h  matmul       2x4 bf16    16   4..5
    5      r  tanh         2x4 bf16    16   5..6
    6      rf cast r       2x4 f32     32   6..7
    7      s  sum          f32          4   7..9 (returned)
    8      gw mul w, w     3x4 f32     48   grad/w
    9      return s, gw
    live bytes per point: 24 24 36 36 52 32 48 36 4 4 -> peak 52
    """
    func = Operation.create(
        "graph.func", attributes={"sym_name": kind, "kind": kind}, regions=[Region.with_block()]
    )
    b = Builder(func.body)
    line = [10]

    def at() -> Location:
        loc = Location("m.sx", line[0], 1)
        line[0] += 1
        return loc

    def inp(name: str, role: str, shape: tuple[int, ...]) -> Value:
        t = TensorType(shape, "f32")
        return b.create("graph.input", (), {"name": name, "role": role}, result_types=[t], loc=at()).result

    x = inp("x", "batch", (2, 3))
    w = inp("w", "param", (3, 4))
    xb = b.value("graph.cast", x, dtype="bf16", loc=at())
    wb = b.value("graph.cast", w, dtype="bf16", loc=at())
    h = b.value("graph.matmul", xb, wb, loc=at())
    r = b.value("graph.tanh", h, loc=at())
    rf = b.value("graph.cast", r, dtype="f32", loc=at())
    s = b.value("graph.sum", rf, axes=[0, 1], keep=False, loc=at())
    gw = b.value("graph.mul", w, w, loc=at())
    if accumulate:
        gw = b.value("graph.add", gw, inp("grad/w", "grad", (3, 4)), loc=at())
    b.create("graph.return", [s, gw], {"names": ["loss", "grad/w"]}, loc=at())
    func.verify()
    return func


def plan(*funcs: Operation) -> dict:
    unit = CompilationUnit(module=make_module(*funcs))
    run_pipeline(unit, "plan-memory")
    return unit.facts.memory


def test_peak_params_and_grads_are_exact() -> None:
    facts = plan(small_train())["train"]
    assert facts["peak_bytes"] == 52
    assert facts["param_bytes"] == 48
    assert facts["grad_bytes"] == 48


def test_largest_values_by_elements_in_schedule_order() -> None:
    largest = plan(small_train())["train"]["largest"]
    assert [(v["op"], v["elements"]) for v in largest] == [
        ("input", 12), ("cast", 12), ("mul", 12), ("matmul", 8), ("tanh", 8), ("cast", 8),
        ("input", 6), ("cast", 6), ("sum", 1),
    ]  # fmt: skip
    assert largest[1] == {"op": "cast", "shape": [3, 4], "dtype": "bf16", "elements": 12, "loc": "m.sx:13"}


def test_accumulating_grad_inputs_count_as_grads_and_other_kinds_are_skipped() -> None:
    update = small_train()
    update.attributes.update(sym_name="update/default/w", kind="update")
    facts = plan(small_train("train_accumulating", accumulate=True), update)
    assert list(facts) == ["train_accumulating"]
    acc = facts["train_accumulating"]
    # grad input (48) and returned sum (48) are grads; mul w, w (48) is now an activation live at points 8..10
    assert acc["grad_bytes"] == 96
    assert acc["peak_bytes"] == 52
