"""match-patterns' kernels on cuda-sim, against the interpreter.

Each case compiles a small training step twice: as autodiff leaves it (the
reference, run by the interpreter) and through match-patterns. The lowered
step runs op by op: its graph ops with the interpreter's kernels, each
`kern.launch` on cuda-sim through the program its `kern.kernel` names
(`backends/cuda/render/pattern_kernels.py`), so every replaced region's kernel
reads what the graph computed before it and the graph reads what it wrote.
The loss, every gradient and every emitted value (the attention's observed
probabilities, a kernel's output) must agree with the reference:
f32 within 1e-5 relative, bf16 (the policy's casts absorbed into the kernels)
within 2e-2, per element with a floor of the tolerance times the result's
largest magnitude. Sizes are awkward on purpose: 37 rows (not a multiple of
32), rows of 7, 33 and 768, vocabularies of 50257 and 50304, attention heads
of dimension 33 over 37 positions with the causal mask's -inf.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from attrs import frozen
from sexpgpu.backends.cuda.render.pattern_kernels import kernel_program, step_binding
from sexpgpu.backends.cuda.render.prelude import translation_unit
from sexpgpu.backends.cuda.sim import SimDevice
from sexpgpu.backends.interpreter.compiler import compile_graph
from sexpgpu.backends.interpreter.dtypes import DtypePolicy
from sexpgpu.backends.interpreter.kernels import kernel_for
from sexpgpu.dialects.core import Operation
from sexpgpu.dialects.graph import emit_collection, emit_name, input_name, return_names
from sexpgpu.dialects.kern import find_kernel
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline

GRAPHS = "evaluate,autodiff,insert-casts,canonicalize,cse,dce"
NUMPY = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32, "i64": np.int64}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}


@frozen
class Case:
    id: str
    fields: str
    batch: int
    model: str
    objective: str
    precision: str
    families: frozenset[str]


EXPERIMENT = """(defloader data
  :source (npy-file "points.npy")
  :fields ({fields})
  :batch {batch})
(defmodule net ()
  {model})
(defmodel model (net))
(defn objective (batch) {objective})
(defoptimizer opt (sgd :lr 0.1))
(defrun :steps 1 :loader data :objective objective :optimizer opt :precision {precision})
"""


def case(id: str, fields: str, batch: int, model: str, objective: str, families: set[str],
         precision: str = "f32") -> Case:
    return Case(id, fields, batch, model, objective, precision, frozenset(families))


def linear_then(width: int, out: int, body: str) -> str:
    return f"""(let ((lin (sub lin (linear {width} {out})))
        (w (param w [{out}] :init (normal 1.0)))
        (b (param b [{out}] :init (normal 1.0))))
    (fn (x) (let ((x (lin x))) {body})))"""


TARGET = "(mean (* (model (get batch :x)) (get batch :target)))"
CROSS_ENTROPY = "(cross-entropy (model (get batch :x)) (get batch :t))"
ATTENTION = """(let ((attn (sub attn (attention 66 2))))
    (fn (x) (attn x)))"""

CASES = [
    case("softmax f32 37x33", "(x [33] f32) (target [33] f32)", 37, linear_then(33, 33, "(softmax x -1)"), TARGET,
         {"softmax", "softmax_backward"}),
    case("log-softmax f32 37x7 unshifted", "(x [7] f32) (target [7] f32)", 37,
         linear_then(7, 7, "(- x (log (sum (exp x) -1 :keep true)))"), TARGET, {"log_softmax", "log_softmax_backward"}),
    case("layernorm f32 37x768", "(x [768] f32) (target [768] f32)", 37,
         linear_then(768, 768, "(let* ((m (mean x -1 :keep true)) (c (- x m))) "
                               "(+ (* c (rsqrt (+ (mean (* c c) -1 :keep true) 1e-5)) w) b))"),
         TARGET, {"layernorm", "layernorm_backward"}),
    case("rmsnorm f32 37x33 divided", "(x [33] f32) (target [33] f32)", 37,
         linear_then(33, 33, "(/ (* x w) (sqrt (+ (/ (sum (* x x) -1 :keep true) 33) 1e-6)))"), TARGET,
         {"rmsnorm", "rmsnorm_backward"}),
    # The rmsnorm's backward is no family here: it reads the forward's broadcast scale, recomputed from the
    # rmsnorm kernel's input next to the kernel.
    case("layernorm then rmsnorm by hand f32 37x33, a backward reading recomputed values",
         "(x [33] f32) (target [33] f32)", 37,
         linear_then(33, 33, "(let* ((d (- x (mean x -1 :keep true))) "
                             "(n (/ d (sqrt (+ (mean (* d d) -1 :keep true) 1e-5))))) "
                             "(* n (rsqrt (+ (mean (* n n) -1 :keep true) 1e-6))))"),
         TARGET, {"layernorm", "layernorm_backward", "rmsnorm"}),
    case("cross-entropy f32 3x50257", "(x [8] f32) (t [] i32)", 3, linear_then(8, 50257, "x"), CROSS_ENTROPY,
         {"cross_entropy_forward", "cross_entropy_backward"}),
    case("cross-entropy f32 5x50304 one-hot sum", "(x [8] f32) (t [] i32)", 5, linear_then(8, 50304, "x"),
         "(let ((y (model (get batch :x)))) (neg (mean (sum (* (one-hot (get batch :t) 50304) (log-softmax y -1)) -1))))",
         {"cross_entropy_forward", "cross_entropy_backward"}),
    case("attention softmax f32 head dimension 33, 37 positions", "(x [37 66] f32) (target [37 66] f32)", 2, ATTENTION,
         TARGET, {"softmax", "softmax_backward"}),
    case("layernorm and cross-entropy bf16 37x33", "(x [33] f32) (t [] i32)", 37,
         """(let ((lin (sub lin (linear 33 33))) (norm (sub norm (layernorm 33))) (head (sub head (linear 33 33))))
    (fn (x) (head (norm (lin x)))))""", CROSS_ENTROPY,
         {"layernorm", "layernorm_backward", "cross_entropy_forward", "cross_entropy_backward"}, precision="bf16"),
]


def train_graph(path: Path, pipeline: str) -> Operation:
    unit = CompilationUnit(path=str(path))
    PassManager(parse_pipeline(pipeline)).run(unit)
    return next(op for op in unit.module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == "train")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[Operation, Operation]]:
    """Each case's train graph as autodiff leaves it and after match-patterns."""
    graphs = {}
    for c in CASES:
        path = tmp_path_factory.mktemp("sim") / "experiment.sx"
        path.write_text(EXPERIMENT.format(fields=c.fields, batch=c.batch, model=c.model, objective=c.objective,
                                          precision=c.precision))
        # As the lowerings run it: casts moved before the views matmuls read first, so a norm whose readers
        # all cast (the weight gradient's Xᵀ too) writes the cast's dtype.
        lowered = train_graph(path, GRAPHS + ",gemm-layouts{transposes=false},match-patterns")
        graphs[c.id] = (train_graph(path, GRAPHS), lowered)
    return graphs


@pytest.fixture(scope="module")
def device() -> SimDevice:
    return SimDevice()


@pytest.fixture(scope="module")
def module(device, compiled):
    """Every launched kernel of every case in one translation unit, compiled once."""
    kernels = [step_binding(find_kernel(op))[0] for _, lowered in compiled.values() for op in launches(lowered)]
    return device.compile(translation_unit(kernels), "match_patterns_sim.cu")


def launches(func: Operation) -> list[Operation]:
    return [op for op in func.regions[0].blocks[0].ops if op.name == "kern.launch"]


def random_inputs(func: Operation, rng: np.random.Generator) -> dict[str, np.ndarray]:
    inputs = {}
    for op in func.regions[0].blocks[0].ops:
        if op.name != "graph.input":
            continue
        t = op.result.type
        if t.dtype in ("i32", "i64"):
            inputs[input_name(op)] = rng.integers(0, 7, t.shape).astype(NUMPY[t.dtype])
        else:
            inputs[input_name(op)] = (rng.standard_normal(t.shape) * 0.5).astype(NUMPY[t.dtype])
    return inputs


def run_lowered(func: Operation, inputs: Mapping[str, np.ndarray], device: SimDevice, module) -> dict[str, np.ndarray]:
    """The graph op by op: graph ops by the interpreter's kernels, launches on cuda-sim; outputs and metrics."""
    policy = DtypePolicy()
    values: dict = {}
    results: dict[str, np.ndarray] = {}
    for op in func.regions[0].blocks[0].ops:
        if op.name == "graph.input":
            values[op.result] = np.asarray(inputs[input_name(op)])
        elif op.name == "graph.const":
            values[op.result] = np.full(op.result.type.shape, op.attributes["value"],
                                        policy.storage(op.result.type.dtype))
        elif op.name == "graph.iota":
            shape, axis = op.result.type.shape, op.attributes["axis"]
            positions = np.arange(shape[axis], dtype=np.int32).reshape([-1 if i == axis else 1 for i in range(len(shape))])
            values[op.result] = np.broadcast_to(positions, shape)
        elif op.name == "kern.launch":
            for result, array in zip(op.results, launch_on_sim(op, [values[v] for v in op.operands], device, module)):
                values[result] = array
        elif op.name == "graph.return":
            results |= {name: values[v] for name, v in zip(return_names(op), op.operands)}
        elif op.name in ("graph.metric", "graph.counter", "graph.observe"):
            results[f"{emit_collection(op)}/{emit_name(op)}"] = values[op.operands[0]]
        else:
            values[op.result] = np.asarray(kernel_for(op, policy).fn(*(values[v] for v in op.operands)))
    return results


def launch_on_sim(op: Operation, operands: list[np.ndarray], device: SimDevice, module) -> list[np.ndarray]:
    """One step of a pattern kernel's program, bound as emit-cuda binds it (`in<k>`, `out<k>`, sizes)."""
    kernel = find_kernel(op)
    source, arguments = step_binding(kernel)
    buffers = {f"in{k}": device.upload(np.ascontiguousarray(array, dtype=NUMPY[t.dtype]), f"in{k}")
               for k, (array, t) in enumerate(zip(operands, kernel.attributes["inputs"]))}
    outputs = kernel.attributes["outputs"]
    buffers |= {f"out{k}": device.alloc(max(t.nbytes, 1), f"out{k}") for k, t in enumerate(outputs)}
    try:
        shape = source.launch(kernel_program(kernel).all_sizes({"rows": kernel.attributes["rows"]}))
        device.launch(module.kernel(source.name), shape.grid, shape.block, shape.shared_bytes,
                      [buffers[a] if isinstance(a, str) else a for a in arguments])
        return [device.download(buffers[f"out{k}"], NUMPY[t.dtype], t.shape) for k, t in enumerate(outputs)]
    finally:
        for buffer in buffers.values():
            device.free(buffer)


def assert_close(name: str, got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, name
    floor = float(np.abs(want).max(initial=0.0))
    error = np.abs(got - want)
    bound = tolerance * (np.abs(want) + floor)
    assert np.all(error <= bound), (f"{name}: {int((error > bound).sum())} of {error.size} elements off, worst "
                                    f"{float((error - bound).max())} over the bound")


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_kernels_against_the_interpreter(c: Case, compiled, device, module) -> None:
    reference, lowered = compiled[c.id]
    fired = {find_kernel(op).attributes.get("family") or f"cross_entropy_{find_kernel(op).attributes['direction']}"
             for op in launches(lowered)}
    assert fired == c.families
    inputs = random_inputs(reference, np.random.default_rng(7))
    want = compile_graph(reference)(inputs)
    got = run_lowered(lowered, inputs, device, module)
    expected = dict(want.outputs)
    for collection in ("metrics", "counters", "observed"):
        expected |= {f"{collection}/{name}": v for name, v in getattr(want, collection).items()}
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close(f"{c.id}: {name}", got[name], value, TOLERANCE[c.precision])
