"""The executor interface: the registry, the cpu executor's array operations, and a training
driver that knows nothing but the interface (it trains bit-identically on an executor whose
arrays are not numpy arrays)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sexpgpu.backends.executor as executor_registry
from _plans import training_plan
from attrs import define
from sexpgpu.backends.devices import open_device, require_available
from sexpgpu.backends.executor import (
    Executable,
    ExecutorUnavailable,
    open_executor,
    register_executor,
    unavailable_reason,
)
from sexpgpu.backends.interpreter import InterpreterExecutor
from sexpgpu.backends.training import Trainer
from sexpgpu.dialects.core import Operation

from sexpgpu.diagnostics import SxError, UsageError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny-gpt.sx")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the executor registry, thrown away after the test."""
    require_available("cpu", "test")  # the built-in executors registered before the copy
    monkeypatch.setattr(executor_registry, "_EXECUTORS", dict(executor_registry._EXECUTORS))


# -- the registry ---------------------------------------------------------------------------------


def test_open_executor_passes_options_to_the_registered_factory(registry):
    register_executor("test-f64", lambda **options: InterpreterExecutor(float_mode="f64", **options))
    executor = open_executor("test-f64")
    assert isinstance(executor, InterpreterExecutor) and executor.float_mode == "f64"
    assert open_executor("cpu", float_mode="f64").zeros((2,), "f32").dtype == np.float64


def test_a_device_registers_once(registry):
    with pytest.raises(ValueError, match="already registered"):
        register_executor("cpu", InterpreterExecutor)


def test_unregistered_and_unprobed_devices_say_why_they_cannot_open(registry):
    assert unavailable_reason("cpu") is None
    assert unavailable_reason("tpu") == "is not available in this build"
    register_executor("gpu-test", InterpreterExecutor, probe=lambda: "no driver was found (libfake.so)")
    assert unavailable_reason("gpu-test") == "cannot open here: no driver was found (libfake.so)"
    with pytest.raises(ExecutorUnavailable, match=r"^the GPU-TEST executor cannot open here: no driver was found"):
        open_executor("gpu-test")


def test_the_cuda_refusal_is_the_registry_answer(registry, monkeypatch):
    """No executor registered for cuda: the refusal; one registered whose probe fails: the probe's
    line; one whose probe passes: no refusal (nothing in devices.py refuses cuda by itself)."""
    del executor_registry._EXECUTORS["cuda"]  # as in a build without backends/cuda
    with pytest.raises(SxError) as refused:
        require_available("cuda", "run")
    assert refused.value.message == ("the CUDA executor is not available in this build, so run --device cuda "
                                     "cannot run; use --device cpu (or unset SEXPGPU_DEVICE)")
    probe_answer: list[str | None] = ["no CUDA driver (libcuda.so.1 not found)"]
    register_executor("cuda", InterpreterExecutor, probe=lambda: probe_answer[0])
    with pytest.raises(SxError) as refused:
        require_available("cuda", "explain")
    assert refused.value.message.startswith(
        "the CUDA executor cannot open here: no CUDA driver (libcuda.so.1 not found), so explain --device cuda")
    probe_answer[0] = None
    assert isinstance(open_device("cuda", "run"), InterpreterExecutor)


def test_an_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="--device must be cpu, cpu-c, cuda or cuda-sim, not tpu"):
        require_available("tpu", "run")


# -- the cpu executor's array operations ---------------------------------------------------------


def test_cpu_array_operations():
    ex = open_executor("cpu")
    assert ex.device == "cpu"
    zeros = ex.zeros((2, 3), "bf16")
    assert zeros.shape == (2, 3) and str(zeros.dtype) == "bfloat16" and not zeros.astype(np.float32).any()
    host = np.arange(6, dtype=np.int32)
    uploaded = ex.upload(host)
    host[0] = 99
    assert uploaded[0] == 0, "upload copies"
    flat = ex.zeros((10,), "f32")
    view = ex.view(flat, 4, (2, 3))
    ex.copy(ex.upload(np.ones((2, 3), np.float32)), view)
    assert ex.download(flat).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        ex.copy(ex.upload(np.ones(3, np.float32)), view)


# -- a driver that knows only the interface ---------------------------------------------------------


class Boxed:
    """An array the driver cannot compute on: no arithmetic, no numpy conversion."""

    __slots__ = ("inner",)
    # numpy refuses it (instead of making an object array) and so do its ufuncs.
    __array__ = None
    __array_ufunc__ = None

    def __init__(self, inner: np.ndarray) -> None:
        self.inner = inner


@define
class BoxedResult:
    outputs: dict[str, Boxed]
    metrics: dict[str, Any]
    counters: dict[str, np.ndarray]
    observed: dict[str, np.ndarray]


class BoxedGraph:
    """An interpreter graph behind boxed arrays, counting its calls."""

    def __init__(self, graph: Executable, calls: list[str]) -> None:
        self._graph = graph
        self._calls = calls
        self.name = graph.name
        self.inputs = graph.inputs

    @property
    def output_names(self) -> list[str]:
        return self._graph.output_names

    def __call__(self, inputs: Mapping[str, Boxed], out: Mapping[str, Boxed] | None = None) -> BoxedResult:
        self._calls.append(self.name)
        result = self._graph({name: value.inner for name, value in inputs.items()},
                             {name: value.inner for name, value in (out or {}).items()})
        return BoxedResult({name: Boxed(value) for name, value in result.outputs.items()},
                           dict(result.metrics), dict(result.counters), dict(result.observed))


class BoxedExecutor(InterpreterExecutor):
    """The interpreter, with every array boxed: what a device whose arrays live elsewhere looks like."""

    device = "boxed"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def compile(self, func: Operation) -> BoxedGraph:
        return BoxedGraph(super().compile(func), self.calls)

    def zeros(self, shape: Sequence[int], dtype: str) -> Boxed:
        return Boxed(super().zeros(shape, dtype))

    def upload(self, host: np.ndarray) -> Boxed:
        return Boxed(super().upload(host))

    def download(self, array: Boxed) -> np.ndarray:
        return array.inner.copy()

    def copy(self, source: Boxed, target: Boxed) -> None:
        super().copy(source.inner, target.inner)

    def view(self, flat: Boxed, offset: int, shape: Sequence[int]) -> Boxed:
        return Boxed(super().view(flat.inner, offset, shape))

    def write(self, target: Boxed, host: np.ndarray) -> None:
        super().write(target.inner, host)


def test_boxed_arrays_refuse_numpy():
    boxed = Boxed(np.zeros(2, np.float32))
    for compute in (lambda: np.asarray(boxed), lambda: np.multiply(boxed, np.float32(0.5)), lambda: float(boxed),
                    lambda: np.copyto(np.zeros(2), boxed)):
        with pytest.raises(TypeError):
            compute()
    with pytest.raises(TypeError):
        boxed *= np.float32(0.5)


def _losses(record: Path) -> list[tuple[str, Any, Any]]:
    events = [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]
    return [(e["type"], e.get("loss"), e.get("metrics") or e.get("values")) for e in events
            if e["type"] in ("step", "eval", "diagnostic")]


@pytest.mark.parametrize(("sets", "flat"), [(["microbatches=2"], True), (["precision=bf16"], True),
                                           (["microbatches=2"], False)])
def test_the_driver_trains_bit_identically_on_an_executor_of_boxed_arrays(tmp_path, sets, flat):
    """tiny-gpt: one group, updated and clipped over flat arrays (or, not flat, parameter by
    parameter), with 2 microbatches the gradients scaled by the clip graph; an evaluation, a diagnostic, checkpoints;
    then a resume from step 2 on the boxed executor."""
    plan = training_plan(TINY, "smoke", [*sets, "steps=4", "eval-every=2", "diagnose-every=2", "checkpoint-every=2"],
                         flat)
    boxed = BoxedExecutor()
    on_cpu = Trainer(plan, tmp_path / "cpu", None, reporter_stream=io.StringIO())
    on_boxes = Trainer(plan, tmp_path / "boxed", None, reporter_stream=io.StringIO(), executor=boxed)
    assert bool(on_boxes.flat_groups) == flat
    assert on_cpu.run().status == on_boxes.run().status == "done"
    assert _losses(tmp_path / "boxed") == _losses(tmp_path / "cpu")
    assert ("clip/all/flat" if flat else "clip/all") in boxed.calls
    for path, value in on_cpu.params.items():
        assert np.array_equal(boxed.download(on_boxes.params[path]), value), path

    resumed = Trainer(plan, tmp_path / "boxed", tmp_path / "boxed" / "checkpoints" / "step-2",
                      reporter_stream=io.StringIO(), executor=BoxedExecutor())
    assert resumed.start_step == 2
    for step in (3, 4):
        resumed.train_step(step)
    for path, value in on_cpu.params.items():
        assert np.array_equal(resumed.executor.download(resumed.params[path]), value), path


class StackingExecutor(BoxedExecutor):
    """A boxed executor that stacks microbatches, choosing the smallest degree above 1 it is offered, and
    records every graph it compiles."""

    stacks_microbatches = True

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[Operation] = []
        self.offered: dict[int, list[str]] = {}

    def compile(self, func: Operation) -> BoxedGraph:
        self.compiled.append(func)
        return super().compile(func)

    def stacking(self, microbatches: int, variants: Mapping[int, Sequence[Operation]]) -> int:
        self.offered = {k: [str(f.attributes["sym_name"]) for f in funcs] for k, funcs in variants.items()}
        return min(variants)


def test_every_graph_the_driver_runs_is_one_the_compiler_made_and_stacking_picks_a_variant(tmp_path):
    """tiny-gpt with 4 microbatches on an executor that stacks: the plan holds the stacking variants (degrees 4
    and 2, the smaller with its accumulating twin), the executor picks one without calling back, and every
    graph compiled — the flat update, the flat clip and the stacked graphs included — is a graph
    of the plan's module, which the driver leaves as compiled."""
    from sexpgpu.backends.training import TrainingPlan
    from sexpgpu.dialects.printer import print_module

    plan = TrainingPlan.compile(TINY, "smoke", ["microbatches=4", "steps=3"], stacking=True)
    before = print_module(plan.module)
    executor = StackingExecutor()
    trainer = Trainer(plan, tmp_path / "run", None, reporter_stream=io.StringIO(), executor=executor)
    assert executor.offered == {4: ["train_stacked/4"], 2: ["train_stacked/2", "train_stacked_accumulating/2"]}
    assert trainer.stack == 2
    assert trainer.run().status == "done"
    assert executor.calls[:2] == ["train_stacked/2", "train_stacked_accumulating/2"]
    assert {"update/default/*", "clip/all/flat"} <= set(executor.calls)
    assert all(func.parent is plan.module.body for func in executor.compiled)
    assert print_module(plan.module) == before
    # A device that does not stack gets no variants, and the checkpoint fingerprint does not depend on them.
    unstacked = TrainingPlan.compile(TINY, "smoke", ["microbatches=4", "steps=3"])
    assert not any("train_stacked" in name for name in unstacked.graphs)
    assert unstacked.fingerprint == plan.fingerprint


def test_training_steps_count_from_one(tmp_path):
    """Step 0 is refused before any graph runs: AdamW's bias correction divides by 1 - beta^0 = 0, so it would
    leave every parameter NaN (benchmarks/cpu_train.py once warmed up with it)."""
    plan = training_plan(TINY, "smoke", [], False)
    trainer = Trainer(plan, tmp_path / "run", None, reporter_stream=io.StringIO())
    before = {path: value.copy() for path, value in trainer.params.items()}
    with pytest.raises(ValueError, match="training steps count from 1, not 0"):
        trainer.train_step(0)
    for path, value in trainer.params.items():
        assert np.array_equal(value, before[path]), path
    loss = trainer.train_step(1)[0]
    assert np.isfinite(loss) and all(np.isfinite(value).all() for value in trainer.params.values())
