"""Training on `cpu-c` (the kern plan compiled as C) against the interpreter (`cpu`), the reference.

Each example's training steps run on both devices from the same parameters and batches and must give the
interpreter's losses and metrics: f32 within 1e-5 relative over 20 steps, bf16 within 2e-2. The C's
results do not depend on the thread count (bit for bit), a run resumes across `cpu` and `cpu-c` both
ways, a missing compiler is one line (exit 1), generated C the compiler rejects is an internal error naming
the kernel and its model path, and `explain --device cpu-c` prints the lowering report.

The C is cached under a temporary `SEXPGPU_CACHE`, shared by the module's tests, so each distinct module is
compiled once here.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from sexpgpu.backends.checkpoint import list_checkpoints
from sexpgpu.backends.cpu_c.compiler import missing_compiler
from sexpgpu.backends.devices import open_device
from sexpgpu.backends.events import read_events
from sexpgpu.backends.training import Trainer, TrainingPlan, train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="no C compiler with OpenMP on this machine")


@pytest.fixture(autouse=True, scope="module")
def c_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("c-cache")
    previous = os.environ.get("SEXPGPU_CACHE")
    os.environ["SEXPGPU_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("SEXPGPU_CACHE", None)
    else:
        os.environ["SEXPGPU_CACHE"] = previous


def trained(device: str, example: str, variant: str | None, sets: list[str], steps: int,
            threads: int | None = None, stacking: bool = False
            ) -> tuple[list[float], list[dict[str, float]], dict[str, np.ndarray]]:
    """Losses and metrics of `steps` training steps of an example on `device`, and the parameters after
    (with `stacking`, compiled with the stacking variants, which cpu-c may run: `sexpgpu run` compiles so)."""
    plan = TrainingPlan.compile(str(EXAMPLES / example), variant, sets, stacking=stacking)
    options = {"threads": threads} if threads is not None else {}
    trainer = Trainer(plan, Path("/nonexistent-record"), None, executor=open_device(device, "test", **options))
    assert trainer.stack == (4 if stacking else 1), trainer.stack
    losses, metrics = [], []
    for step in range(1, steps + 1):
        loss, step_metrics, _, _ = trainer.train_step(step)
        losses.append(loss)
        metrics.append(step_metrics)
    params = {path: np.array(trainer.executor.download(value)) for path, value in trainer.params.items()}
    return losses, metrics, params


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


CASES = [
    pytest.param("tiny-gpt.sx", "smoke", [], 1e-5, id="tiny-gpt-f32"),
    pytest.param("tiny-gpt.sx", "smoke", ["precision=bf16"], 2e-2, id="tiny-gpt-bf16"),
    pytest.param("mlp-classifier.sx", "smoke", [], 1e-5, id="mlp-classifier"),
    pytest.param("gpt.sx", "smoke", [], 1e-5, id="spec-gpt-f32"),
]


@pytest.mark.parametrize("example, variant, sets, tolerance", CASES)
def test_training_matches_the_interpreter(example, variant, sets, tolerance):
    reference_losses, reference_metrics, _ = trained("cpu", example, variant, sets, 20)
    losses, metrics, _ = trained("cpu-c", example, variant, sets, 20)
    for step, (want, got) in enumerate(zip(reference_losses, losses), 1):
        assert relative(want, got) <= tolerance, f"step {step}: loss {got} on cpu-c, {want} on cpu"
    for step, (want, got) in enumerate(zip(reference_metrics, metrics), 1):
        assert want.keys() == got.keys()
        for name in want:
            assert relative(want[name], got[name]) <= tolerance, f"step {step}: {name} {got[name]} vs {want[name]}"


RMSNORM_NET = """
(defloader data :source (npy-file "points.npz") :fields ((x [5 16] f32) (target [5 16] f32)) :batch 2)
(defmodule net ()
  (let ((lin (sub lin (linear 16 16)))
        (norm (sub norm (rmsnorm 16))))
    (fn (x) (norm (lin x)))))
(defmodel model (net))
(defn objective (batch) (mean (* (model (get batch :x)) (get batch :target))))
(defoptimizer opt (adamw :lr 0.01))
(defrun :steps 4 :loader data :objective objective :optimizer opt)
"""


def test_a_norm_with_fewer_rows_than_partial_rows_trains_as_the_interpreter(tmp_path, monkeypatch):
    # 10 rows a call and 16 planned partial rows of the weight's gradient: the partial rows no row falls in
    # must be zero, the others start from their first row's value. The arena starts as NaNs, so a partial
    # row the kernel leaves as it found it shows.
    from sexpgpu.backends.cpu_c import executor as cpu_c_executor

    monkeypatch.setattr(cpu_c_executor, "_grown", lambda array, nbytes: array if array.nbytes >= nbytes
                        else np.full(cpu_c_executor.aligned(nbytes), 0xFF, np.uint8))
    points = np.random.default_rng(5).standard_normal((2, 8, 5, 16)).astype(np.float32)
    np.savez(tmp_path / "points.npz", x=points[0], target=points[1])
    (tmp_path / "net.sx").write_text(RMSNORM_NET)
    runs = {}
    for device in ("cpu", "cpu-c"):
        plan = TrainingPlan.compile(str(tmp_path / "net.sx"), None, [])
        trainer = Trainer(plan, Path("/nonexistent-record"), None, executor=open_device(device, "test"))
        runs[device] = [trainer.train_step(step)[0] for step in range(1, 5)]
    for step, (want, got) in enumerate(zip(runs["cpu"], runs["cpu-c"]), 1):
        assert relative(want, got) <= 1e-5, f"step {step}: loss {got} on cpu-c, {want} on cpu"


ODD_NET = """
(defloader data :source (npy-file "points.npz") :fields ((x [5 17] f32) (target [5 301] f32)) :batch 3)
(defmodule net ()
  (let ((lin (sub lin (linear 17 301)))
        (shift (param shift [5 301] :init (normal 0.1))))
    (fn (x) (+ (lin x) shift))))
(defmodel model (net))
(defn objective (batch) (mean (* (model (get batch :x)) (get batch :target))))
(defoptimizer opt (sgd :lr 0.1 :clip 0.001))
(defrun :steps 4 :loader data :objective objective :optimizer opt)
"""


def test_sums_over_odd_sizes_train_as_the_interpreter(tmp_path):
    # The weight's 17 x 301 = 5117 elements are a full chunk of the clip's norm and one of 1021 (63 vectors
    # of lanes and 13 more), and the clip scales every SGD step by that norm; `shift`'s gradient sums the
    # batch over two kept axes read as one flat run, and so does the bias's over 5 x 301 rows.
    points = np.random.default_rng(7).standard_normal((3, 6, 5, 301)).astype(np.float32)
    np.savez(tmp_path / "points.npz", x=points[0, :, :, :17], target=points[1])
    (tmp_path / "net.sx").write_text(ODD_NET)
    runs = {}
    for device in ("cpu", "cpu-c"):
        plan = TrainingPlan.compile(str(tmp_path / "net.sx"), None, [])
        trainer = Trainer(plan, Path("/nonexistent-record"), None, executor=open_device(device, "test"))
        first = {path: np.array(trainer.executor.download(value)) for path, value in trainer.params.items()}
        losses = [trainer.train_step(step)[0] for step in range(1, 5)]
        # The steps are small beside the parameters, so the test compares what they moved.
        runs[device] = losses, {path: np.array(trainer.executor.download(value)) - first[path]
                                for path, value in trainer.params.items()}
    for step, (want, got) in enumerate(zip(runs["cpu"][0], runs["cpu-c"][0]), 1):
        assert relative(want, got) <= 1e-5, f"step {step}: loss {got} on cpu-c, {want} on cpu"
    for path, want in runs["cpu"][1].items():
        np.testing.assert_allclose(runs["cpu-c"][1][path], want, rtol=1e-4, atol=1e-9, err_msg=path)


def test_stacked_microbatches_train_as_the_interpreter():
    # The spec GPT's 4 microbatches in one call of @train_stacked/4: the interpreter's losses.
    sets = ["layers=1"]
    reference_losses, reference_metrics, _ = trained("cpu", "gpt.sx", "smoke", sets, 8)
    losses, metrics, _ = trained("cpu-c", "gpt.sx", "smoke", sets, 8, stacking=True)
    for step, (want, got) in enumerate(zip(reference_losses, losses), 1):
        assert relative(want, got) <= 1e-5, f"step {step}: loss {got} stacked on cpu-c, {want} on cpu"
    assert reference_metrics[-1].keys() == metrics[-1].keys()


def test_stacked_activations_that_do_not_fit_keep_one_microbatch_a_call(monkeypatch):
    from sexpgpu.backends.cpu_c import executor as cpu_c_executor

    monkeypatch.setattr(cpu_c_executor, "STACKING_MEMORY_SHARE", 0.0)
    plan = TrainingPlan.compile(str(EXAMPLES / "gpt.sx"), "smoke", ["layers=1"], stacking=True)
    executor = open_device("cpu-c", "test")
    trainer = Trainer(plan, Path("/nonexistent-record"), None, executor=executor)
    assert trainer.stack == executor.stack == 1
    # Known from the plan: no stacked graph was compiled.
    assert not [name for lowered in executor.lowerings for name in lowered.layouts if "stacked" in name]


def test_results_do_not_depend_on_the_thread_count():
    # Width 128 and 260 tokens a microbatch: the projections' GEMMs and their weight gradients are large
    # enough to be cut into blocks that the threads share (render.py, `sx_gemm`).
    sets = ["layers=1"]
    one = trained("cpu-c", "gpt.sx", "smoke", sets, 3, threads=1)
    two = trained("cpu-c", "gpt.sx", "smoke", sets, 3, threads=2)
    assert one[0] == two[0]
    for path in one[2]:
        assert np.array_equal(one[2][path], two[2][path]), path


@pytest.mark.parametrize("first, then", [("cpu", "cpu-c"), ("cpu-c", "cpu")])
def test_a_run_resumes_across_devices(tmp_path, first, then):
    example = str(EXAMPLES / "tiny-gpt.sx")
    sets = ["steps=6", "checkpoint-every=3", "eval-every=100", "diagnose-every=3"]
    whole = train(example, variant="smoke", sets=sets, out=tmp_path / "whole", device=first, stream=io.StringIO(),
                  interactive=False)
    assert whole.status == "done"
    assert [step for step, _ in list_checkpoints(tmp_path / "whole")] == [3, 6]
    resumed = train(example, variant="smoke", sets=sets, resume=tmp_path / "whole" / "checkpoints" / "step-3",
                    out=tmp_path / "resumed", device=then, stream=io.StringIO(), interactive=False)
    assert resumed.status == "done"
    want = {e["step"]: e["loss"] for e in read_events(tmp_path / "whole" / "events.jsonl") if e["type"] == "step"}
    got = {e["step"]: e["loss"] for e in read_events(tmp_path / "resumed" / "events.jsonl") if e["type"] == "step"}
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert relative(want[step], got[step]) <= 1e-5, f"step {step}: {got[step]} resumed on {then}, {want[step]}"


def sexpgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sexpgpu", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_no_compiler_is_one_line(tmp_path):
    done = sexpgpu("run", "examples/tiny-gpt.sx", "--variant", "smoke", "--device", "cpu-c", "--out", str(tmp_path / "r"),
                   env={"CC": str(tmp_path / "no-such-cc")})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no C compiler with OpenMP found" in lines[0] and "apt-get install gcc" in lines[0]


def test_rejected_c_is_an_internal_error_naming_the_kernel(monkeypatch):
    from sexpgpu.backends.cpu_c import render
    from sexpgpu.backends.cpu_c.compiler import CCompileError

    real = render.kernel_code

    def broken(kernel):
        code = real(kernel)
        if kernel.attributes["kind"] == "attention" and kernel.attributes["direction"] == "forward":
            code = code.replace("{\n", "{\n    this is not C;\n", 1)
        return code

    monkeypatch.setattr(render, "kernel_code", broken)
    plan = TrainingPlan.compile(str(EXAMPLES / "tiny-gpt.sx"), "smoke", [])
    with pytest.raises(CCompileError) as caught:
        Trainer(plan, Path("/nonexistent-record"), None, executor=open_device("cpu-c", "test"))
    message = str(caught.value)
    assert "rejected the generated kernel @attention_forward_f32_d8" in message
    assert "(model path model.blocks.0.attn)" in message
    assert "this is not C" in message


def test_explain_prints_the_lowering_report():
    done = sexpgpu("explain", "examples/tiny-gpt.sx", "--variant", "smoke", "--device", "cpu-c")
    assert done.returncode == 0, done.stderr
    report = done.stdout[done.stdout.index("lowering: cpu-c"):]
    assert "row programs" in report and "cross-entropy tail" in report and "GEMMs" in report
    assert re.search(r"graph functions in [0-9]+ C files? by", report)


def test_explain_json_follows_the_schema():
    import json

    import jsonschema

    done = sexpgpu("explain", "examples/tiny-gpt.sx", "--variant", "smoke", "--device", "cpu-c", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    schema = json.loads((ROOT / "sexpgpu" / "schemas" / "explain.schema.json").read_text())
    jsonschema.validate(document, schema)
    assert document["device"]["executor"] == "cpu-c"
    assert document["device"]["compiled"]["kernels"] > 0


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--threads", "2"], "error: --threads sets the threads of --device cpu-c, not of --device cpu"),
    (["--device", "cpu-c", "--threads", "0"], "argument --threads: '0' is not a positive integer"),
])
def test_threads_usage_errors(tmp_path, args, message):
    done = sexpgpu("run", "examples/tiny-gpt.sx", "--variant", "smoke", "--out", str(tmp_path / "r"), *args)
    assert done.returncode == 2
    assert message in done.stderr
