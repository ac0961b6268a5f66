"""Runs a lowered graph kernel by kernel on cuda-sim against the interpreter's values of the same ops.

Every op result of the original graph gets a unique name hint; `fuse` gives
each launch result (and each GEMM's result) the hint of the value it
replaces, so every kernel output is compared with the interpreter's value of
that very op. Each kernel then reads the interpreter's values of its
operands (not the simulator's results of earlier kernels), so an error shows
at the kernel that made it instead of compounding down the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from sexpgpu.backends.cuda.sim import SimDevice
from sexpgpu.backends.devices import open_device
from sexpgpu.dialects.core import Operation, Value
from sexpgpu.dialects.kern import find_kernel
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module
from sexpgpu.passes.manager import CompilationUnit, run_pipeline

NUMPY = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32, "i64": np.int64, "i1": np.bool_}
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}


def hint_values(module: Operation) -> None:
    """A unique name hint on every op result of every graph (`v<n>`)."""
    for func in (op for op in module.body.ops if op.name == "graph.func"):
        for n, op in enumerate(op for op in func.body.ops if op.results):
            for k, r in enumerate(op.results):
                r.name_hint = f"v{n}_{k}"


def copies(module: Operation) -> tuple[Operation, Operation]:
    """The module hinted, printed and parsed twice: a reference and one to lower."""
    hint_values(module)
    text = print_module(module)
    return parse_module(text, "reference.sxir"), parse_module(text, "lowered.sxir")


def lower(module: Operation, pipeline: str = "gemm-layouts,fuse,emit-cuda") -> CompilationUnit:
    return run_pipeline(CompilationUnit(module=module), pipeline)


def graph(module: Operation, name: str) -> Operation:
    return next(op for op in module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == name)


def random_inputs(func: Operation, rng: np.random.Generator, index_bound: int = 7) -> dict[str, np.ndarray]:
    """Random values for a graph's inputs: floats around 0, indices in [0, index_bound), the step 3."""
    inputs = {}
    for op in func.body.ops:
        if op.name != "graph.input":
            continue
        t = op.result.type
        if op.attributes["role"] == "step":
            value = np.full(t.shape, 3, NUMPY[t.dtype])
        elif op.attributes["role"] == "state":
            value = np.abs(rng.standard_normal(t.shape) * 0.5).astype(NUMPY[t.dtype])
        elif t.dtype in ("i32", "i64"):
            value = rng.integers(0, index_bound, size=t.shape).astype(NUMPY[t.dtype])
        elif t.dtype == "i1":
            value = rng.random(t.shape) < 0.5
        else:
            value = (rng.standard_normal(t.shape) * 0.5).astype(NUMPY[t.dtype])
        inputs[op.attributes["name"]] = value
    return inputs


def reference_values(func: Operation, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The interpreter's value of every op result of `func` (a copy returning all of them), by hint."""
    ret = func.body.last_op
    values = [r for op in func.body.ops if op is not ret and op.name != "graph.input" for r in op.results]
    names = [v.name_hint for v in values]
    ret.drop_operands()
    replacement = Operation.create("graph.return", values, [], {"names": names})
    func.body.insert_before(replacement, ret)
    ret.erase()
    executor = open_device("cpu", "test")
    result = executor.compile(func)({k: executor.upload(v) for k, v in inputs.items()})
    return {k: np.array(executor.download(v)) for k, v in result.outputs.items()}


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str, scale: float = 0.0) -> float:
    """`got` equals `want` to the dtype's tolerance relative to the larger of `want`'s largest
    magnitude and `scale` (the kernel's inputs' largest magnitude: a sum that cancels to nearly
    zero is as exact as its terms, not as its result); NaNs and infinities in the same places.
    Returns the relative error."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    special = ~np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN in different places"
    assert np.array_equal(got[special & ~np.isnan(want)], want[special & ~np.isnan(want)]), f"{what}: infinities"
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(want[finite]).max()), scale, 1e-30)
    error = float(np.abs(got[finite] - want[finite]).max()) / scale
    assert error <= TOLERANCE.get(dtype, 0.0), f"{what}: relative error {error:.3g} over {TOLERANCE.get(dtype, 0)}"
    return error


def _precision(dtypes: Any) -> str:
    """The tolerance a kernel is held to: bf16's when it reads, computes or writes any bf16."""
    return "bf16" if "bf16" in set(dtypes) else "f32"


def _magnitude(arrays: Any) -> float:
    """The largest finite magnitude among float arrays."""
    largest = 0.0
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
            values = np.abs(np.asarray(a, np.float64))
            values = values[np.isfinite(values)]
            if values.size:
                largest = max(largest, float(values.max()))
    return largest


class SimRunner:
    """Runs the launches and GEMMs of a lowered graph on a SimDevice."""

    def __init__(self, module: Operation, device: SimDevice | None = None) -> None:
        self.device = device or SimDevice()
        source = next(op for op in module.body.ops if op.name == "kern.source").attributes["text"]
        self.sim_module = self.device.compile(source, "lowered.cu")
        #: kernel symbol -> (kernel op, number of launches compared)
        self.launched: dict[str, int] = {}
        self.errors: dict[str, float] = {}

    def run(self, func: Operation, inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> dict:
        """Run `func` (lowered), comparing every kernel and GEMM result with `reference` (by hint);
        returns the graph's outputs and metrics as the simulator computed them."""
        env: dict[Value, np.ndarray] = {}
        outputs: dict[str, np.ndarray] = {}
        for op in func.body.ops:
            name = op.name
            if name == "graph.input":
                env[op.result] = np.asarray(inputs[op.attributes["name"]])
            elif name == "graph.const":
                t = op.result.type
                env[op.result] = np.broadcast_to(np.array(op.attributes["value"], NUMPY[t.dtype]), t.shape)
            elif name in ("graph.reshape", "graph.squeeze", "graph.expand_dims"):
                env[op.result] = np.asarray(env[op.operands[0]]).reshape(op.result.type.shape)
            elif name == "graph.transpose":
                env[op.result] = np.transpose(env[op.operands[0]], op.attributes["perm"])
            elif name == "kern.gemm":
                env[op.result] = self._gemm(op, [env[v] for v in op.operands])
                scale = _magnitude(env[v] for v in op.operands)
                precision = _precision(v.type.dtype for v in [*op.operands, *op.results])
            elif name == "kern.launch":
                results = self._launch(op, [env[v] for v in op.operands])
                scale = _magnitude(env[v] for v in op.operands)
                kernel = find_kernel(op)
                body = [r.type.dtype for inner in kernel.walk() for r in inner.results]
                precision = _precision([*(v.type.dtype for v in [*op.operands, *op.results]), *body])
                for r, value in zip(op.results, results):
                    env[r] = value
            elif name == "graph.return":
                for key, v in zip(op.attributes["names"], op.operands):
                    outputs[key] = env[v]
                continue
            elif name in ("graph.metric", "graph.counter", "graph.observe"):
                outputs[f"{name}:{op.attributes['name']}"] = env[op.operands[0]]
                continue
            else:
                raise AssertionError(f"a lowered graph holds '{name}'")
            for r in op.results:
                want = reference.get(r.name_hint) if r.name_hint else None
                if want is not None and want.size == r.type.numel:
                    want = want.reshape(r.type.shape)  # a GEMM's rows are the product's batch and rows
                if want is not None and name in ("kern.launch", "kern.gemm", "graph.reshape"):
                    what = f"{func.attributes['sym_name']}: {op.attributes.get('kernel', name)} -> {r.name_hint}"
                    if r.type.dtype in TOLERANCE:
                        self.errors[what] = assert_close(env[r], want, precision, what, scale)
                    else:
                        assert np.array_equal(np.asarray(env[r]), want), what
                    env[r] = np.asarray(want).astype(NUMPY[r.type.dtype])
                    if name == "graph.reshape":  # kernels read the buffer the reshape views
                        source = op.operands[0]
                        env[source] = env[r].reshape(source.type.shape)
        return outputs

    def _gemm(self, op: Operation, operands: list[np.ndarray]) -> np.ndarray:
        """cuBLASLt's product as the simulated device runtime computes it: f32 accumulation, one rounding."""
        a, b = (np.asarray(x, np.float32) for x in operands[:2])
        if op.attributes["transpose_a"]:
            a = np.swapaxes(a, -1, -2)
        if op.attributes["transpose_b"]:
            b = np.swapaxes(b, -1, -2)
        d = np.matmul(a, b)
        rest = operands[2:]
        if op.attributes["epilogue"] == "bias":
            d = d + np.asarray(rest.pop(0), np.float32)
        if op.attributes["beta"]:
            d = d + op.attributes["beta"] * np.asarray(rest.pop(0), np.float32)
        return d.astype(NUMPY[op.result.type.dtype])

    def _launch(self, op: Operation, operands: list[np.ndarray]) -> list[np.ndarray]:
        kernel = find_kernel(op)
        attrs = kernel.attributes
        dev = self.device
        buffers = {f"in{k}": dev.upload(np.ascontiguousarray(x, NUMPY[t.dtype]), f"in{k}")
                   for k, (x, t) in enumerate(zip(operands, attrs["inputs"]))}
        for k, t in enumerate(attrs["outputs"]):
            buffers[f"out{k}"] = dev.alloc(t.nbytes, f"out{k}")
        args: list[Any] = [buffers[a] if isinstance(a, str) else a for a in attrs["arguments"]]
        # Both schedules from the same memory: a kernel whose threads race gives two answers.
        dev.compare_schedules(self.sim_module.kernel(attrs["function"]), tuple(attrs["grid"]),
                              tuple(attrs["block"]), attrs["shared"], args)
        results = [dev.download(buffers[f"out{k}"], NUMPY[t.dtype], t.shape) for k, t in enumerate(attrs["outputs"])]
        for buf in buffers.values():
            dev.free(buf)
        self.launched[attrs["sym_name"]] = self.launched.get(attrs["sym_name"], 0) + 1
        return results
