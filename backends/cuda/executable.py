"""A lowered graph on the device: what one call launches, and its capture after the tenth call.

`CudaExecutable(executor, plan, module)` is the `Executable` the CUDA
executor returns. A call:

1. takes the caller's arrays (inputs by name; `out` arrays for outputs);
2. decides where each value the graph returns or emits is written: into the
   caller's `out` array when that is safe — the array is not another input,
   or it is one the producing kernel reads element for element before
   writing it (an elementwise kernel through the identity map, the C of an
   accumulating GEMM) and nothing reads after — else into a slot of the
   executable, copied out at the end;
3. binds every step's operands to addresses (cached by the addresses of the
   call: the driver passes the same arrays every step) and launches them on
   the runtime's stream, or replays the captured graph;
4. copies each output not in `out`, and every emitted value, into one fresh
   block, so later calls leave them alone; the result's `metrics`,
   `counters` and `observed` download it the first time one is read, so a
   driver that reads a step's values at its end waits for the device once.

Capture: a graph of at least `CAPTURE_MIN_KERNELS` kernels a call is
captured (`runtime.capture()`) at the first call after `CAPTURE_AFTER_CALLS`
calls with the same addresses, and replayed from then on while they stay the
same. A device scalar among the inputs (the step) is copied from its pinned
mirror by the graph's first node, so a replay reads the value set before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from attrs import frozen

from ...diagnostics import SxError
from ...dialects.core import TensorType
from .graph_plan import GraphPlan, LaunchStep, Place, aligned, numpy_dtype
from .memory import Block, CudaArray
from .runtime import CapturedGraph, KernelLaunchError, LoadedModule, check_alignment

if TYPE_CHECKING:
    from .executor import CudaExecutor

#: Graphs launching at least this many kernels and GEMMs a call are captured (smaller ones gain
#: little from a graph launch: a few microseconds of launch overhead per kernel).
CAPTURE_MIN_KERNELS = 16
#: A graph is captured at its first call after this many calls with the same addresses.
CAPTURE_AFTER_CALLS = 10
#: Binding of one graph kept per distinct set of addresses (the driver uses one or two).
BINDINGS_KEPT = 4


@frozen
class InputSpec:
    """One `graph.input` of a compiled graph."""

    name: str
    role: str
    type: TensorType


class CudaResult:
    """What one call produced: outputs on the device, emitted values read back when first asked for."""

    def __init__(self, executor: CudaExecutor, outputs: dict[str, CudaArray], emits: Sequence[tuple[str, str, int, TensorType]],
                 block: Block | None) -> None:
        self.outputs = outputs
        self._executor = executor
        self._emits = emits
        self._block = block
        self._host: dict[str, dict[str, Any]] | None = None

    def _values(self) -> dict[str, dict[str, Any]]:
        if self._host is None:
            host: dict[str, dict[str, Any]] = {"metrics": {}, "counters": {}, "observed": {}}
            if self._emits:
                assert self._block is not None
                end = max(offset + t.nbytes for _, _, offset, t in self._emits)
                raw = self._executor.runtime.download(self._block.span, np.uint8, end)
                for collection, name, offset, t in self._emits:
                    value = raw[offset:offset + t.nbytes].view(numpy_dtype(t.dtype)).reshape(t.shape).copy()
                    host[collection][name] = float(value) if collection == "metrics" else value
            self._host = host
        return self._host

    @property
    def metrics(self) -> dict[str, float]:
        return self._values()["metrics"]

    @property
    def counters(self) -> dict[str, np.ndarray]:
        return self._values()["counters"]

    @property
    def observed(self) -> dict[str, np.ndarray]:
        return self._values()["observed"]


class Binding:
    """One graph's steps bound to the addresses of one set of arrays, and its capture."""

    def __init__(self, operations: list[tuple], slots: Block | None, external_addresses: list[int],
                 reads_scalars: list[Any]) -> None:
        self.operations = operations
        #: The executable's own memory for values not written into the caller's arrays.
        self.slots = slots
        self.external_addresses = external_addresses
        self.reads_scalars = reads_scalars
        self.calls = 0
        self.graph: CapturedGraph | None = None

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None


class CudaExecutable:
    """A `graph.func` lowered for the device (see the module docstring)."""

    def __init__(self, executor: CudaExecutor, plan: GraphPlan, module: LoadedModule, title: str) -> None:
        self.executor = executor
        self.runtime = executor.runtime
        self.plan = plan
        self.module = module
        self.name = plan.name
        #: The lowering report's row this graph counts in (`sexpgpu.report.graph_title`).
        self.title = title
        self.inputs = [InputSpec(name, role, t) for name, role, t in plan.input_types()]
        self._kernels = {step.function: module.function(step.function)
                         for step in plan.steps if isinstance(step, LaunchStep)}
        #: function name -> the model path of its first launch (a replay's error names it).
        self._paths: dict[str, str] = {}
        for step in plan.steps:
            if isinstance(step, LaunchStep):
                self._paths.setdefault(step.function, step.path)
        self._constants: list[CudaArray] = [executor.upload(value) for value in plan.constants]
        self._bindings: dict[tuple, Binding] = {}
        #: Whether calls are captured once warm (large enough, capture on, the driver able to).
        self.captures = executor.capture_enabled and plan.kernels_per_call >= CAPTURE_MIN_KERNELS

    @property
    def output_names(self) -> list[str]:
        return [output.name for output in self.plan.outputs]

    @property
    def arena_need(self) -> int:
        return self.plan.arena_need

    # -- a call ------------------------------------------------------------------------------------

    def __call__(self, inputs: Mapping[str, CudaArray], out: Mapping[str, CudaArray] | None = None) -> CudaResult:
        out = dict(out or {})
        arrays = [self._checked_input(spec, inputs) for spec in self.inputs]
        for name in out:
            if name not in self.output_names:
                raise ValueError(f"graph @{self.name} has no output {name!r}")
        arena = self.executor.activations(self)
        storage = self._external_storage(arrays, out)
        key = (arena.base, tuple(a.address for a in arrays), tuple(storage))
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bind(arena.base, arrays, storage)
            if len(self._bindings) >= BINDINGS_KEPT:
                self._bindings.pop(next(iter(self._bindings))).close()
            self._bindings[key] = binding
        self._run(binding)
        return self._finish(binding, arrays, out)

    def _checked_input(self, spec: InputSpec, inputs: Mapping[str, CudaArray]) -> CudaArray:
        if spec.name not in inputs:
            raise SxError(f"graph @{self.name} needs input {spec.name!r} ({spec.role}, {spec.type})")
        array = inputs[spec.name]
        if not isinstance(array, CudaArray):
            raise TypeError(f"input {spec.name!r} of @{self.name} is a {type(array).__name__}, not an array of "
                            "the CUDA executor (upload it first)")
        if array.shape != tuple(spec.type.shape) or array.dtype != spec.type.dtype:
            raise SxError(f"input {spec.name!r} of @{self.name} is {array.dtype}{list(array.shape)}, but the "
                          f"graph takes {spec.type}")
        return array

    def _external_storage(self, arrays: list[CudaArray], out: dict[str, CudaArray]) -> list[int | None]:
        """For each returned or emitted value the graph computes: the address of the caller's array to
        write it into, or None (the executable's slot)."""
        storage: list[int | None] = [None] * len(self.plan.externals)
        taken: set[int] = set()
        for output in self.plan.outputs:
            target = out.get(output.name)
            place = output.place
            if target is None or place.kind != "external" or place.offset or storage[place.index] is not None:
                continue
            external = self.plan.externals[place.index]
            if target.nbytes != external.type.nbytes or target.address in taken:
                continue
            if self._may_write_over(place.index, target, arrays):
                storage[place.index] = target.address
                taken.add(target.address)
        return storage

    def _may_write_over(self, index: int, target: CudaArray, arrays: list[CudaArray]) -> bool:
        """Whether external value `index` may be written straight into `target`, given the inputs."""
        external = self.plan.externals[index]
        low, high = target.address, target.address + target.nbytes
        for k, array in enumerate(arrays):
            if array.address >= high or array.address + array.nbytes <= low:
                continue
            if (array.address, array.nbytes) != (low, target.nbytes):
                return False
            if self.plan.last_read.get(k, -1) > external.producer or not external.reads_in_place.get(k, True):
                return False
        return True

    def _bind(self, arena_base: int, arrays: list[CudaArray], storage: list[int | None]) -> Binding:
        offsets, end = {}, 0
        for index, address in enumerate(storage):
            if address is None:
                offsets[index] = end
                end += aligned(self.plan.externals[index].type.nbytes)
        slots = self.executor.pool.take(end, f"the outputs of graph {self.name}") if end else None
        externals = [address if address is not None else slots.span.address + offsets[index]
                     for index, address in enumerate(storage)]
        bases = {"arena": [arena_base], "input": [a.address for a in arrays],
                 "const": [c.address for c in self._constants], "external": externals}

        def address(place: Place) -> int:
            return bases[place.kind][place.index] + place.offset

        def argument(value: Place | int | float) -> int | float:
            return address(value) if isinstance(value, Place) else value

        operations: list[tuple] = []
        for step in self.plan.steps:
            if isinstance(step, LaunchStep):
                arguments = tuple(argument(a) for a in step.arguments)
                check_alignment(self._kernels[step.function], arguments, step.alignment, step.path)
                operations.append(("launch", self._kernels[step.function], step.grid, step.block, step.shared,
                                   arguments, step.path))
            else:
                operations.append(("gemm", step.spec, address(step.a), address(step.b), address(step.d),
                                   None if step.c is None else address(step.c),
                                   None if step.bias is None else address(step.bias), step.alpha, step.beta,
                                   step.path))
        scalars = []
        for array in arrays:
            if array.scalars is not None and all(s is not array.scalars for s in scalars):
                scalars.append(array.scalars)
        return Binding(operations, slots, externals, scalars)

    def _run(self, binding: Binding) -> None:
        binding.calls += 1
        if binding.graph is None and self.captures and binding.calls > CAPTURE_AFTER_CALLS:
            with self.runtime.capture() as captured:
                for scalars in binding.reads_scalars:
                    scalars.update()
                self._enqueue(binding.operations)
            binding.graph = captured.graph
        if binding.graph is not None:
            try:
                binding.graph.launch()
            except KernelLaunchError as err:
                raise (err if err.model_path else err.at(self._paths.get(err.kernel, ""))) from None
        else:
            self._enqueue(binding.operations)

    def _enqueue(self, operations: list[tuple]) -> None:
        runtime = self.runtime
        for operation in operations:
            if operation[0] == "launch":
                _, kernel, grid, block, shared, args, path = operation
                runtime.launch_path = path
                try:
                    runtime.launch(kernel, grid, block, shared, args)
                except KernelLaunchError as err:  # this launch refused, or an earlier kernel's fault
                    raise (err.at(path) if err.kernel == kernel.name and not err.model_path else err) from None
            else:
                _, spec, a, b, d, c, bias, alpha, beta, _ = operation
                runtime.gemm(spec, a, b, d, c=c, bias=bias, alpha=alpha, beta=beta)

    def _finish(self, binding: Binding, arrays: list[CudaArray], out: dict[str, CudaArray]) -> CudaResult:
        """Copy outputs into the caller's arrays where they were not written there, and what a later
        call would overwrite into a fresh block."""
        runtime = self.runtime
        plan = self.plan
        bases = {"input": [a.address for a in arrays], "const": [c.address for c in self._constants],
                 "external": binding.external_addresses}

        def address(place: Place) -> int:
            if place.kind == "arena":
                raise AssertionError(f"@{self.name} returns a value in its arena")
            return bases[place.kind][place.index] + place.offset

        fresh: list[tuple[str, Place, TensorType]] = []
        outputs: dict[str, CudaArray] = {}
        for output in plan.outputs:
            target = out.get(output.name)
            if target is None:
                fresh.append(("output:" + output.name, output.place, output.type))
                continue
            if target.shape != tuple(output.type.shape) or target.dtype != output.type.dtype:
                raise ValueError(f"out array for {output.name!r} of @{self.name} is {target.dtype}"
                                 f"{list(target.shape)}, not {output.type}")
            source = address(output.place)
            if source != target.address:
                runtime.copy(target.address, source, target.nbytes)
            outputs[output.name] = target
        for emit in plan.emits:
            fresh.append((f"{emit.collection}:{emit.name}", emit.place, emit.type))
        block = None
        emits: list[tuple[str, str, int, TensorType]] = []
        if fresh:
            layout, end = [], 0
            for key, place, t in fresh:
                layout.append((key, place, t, end))
                end += aligned(t.nbytes)
            block = self.executor.pool.take(end, f"the results of graph {self.name}")
            for key, place, t, offset in layout:
                if t.nbytes:
                    runtime.copy(block.span.address + offset, address(place), t.nbytes)
                kind, _, name = key.partition(":")
                if kind == "output":
                    outputs[name] = CudaArray(block.span.address + offset, t.shape, t.dtype, block)
                else:
                    emits.append((kind, name, offset, t))
        return CudaResult(self.executor, outputs, emits, block)

    def close(self) -> None:
        for binding in self._bindings.values():
            binding.close()
        self._bindings.clear()
