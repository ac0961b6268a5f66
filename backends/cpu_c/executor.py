"""The `cpu-c` executor: the `kern` plan of the CUDA lowering rendered as C, compiled by the host compiler.

What it does with a graph (docs/backends.md, "cpu-c"):

- `compile(func)` runs `CPU_C_LOWERING` (`match-patterns`, `fuse`, `plan-buffers`: the target-independent
  passes of the CUDA lowering) on a copy of the module holding `func` — once per module, so the experiment's
  graphs share one translation unit, one compile and one loaded object — renders it (`render.py`),
  compiles it (`compiler.py`, cached on disk) and returns a `CpuCExecutable`: one call of it is one call of
  the graph's C function. A graph not inside a module (the driver's flat update, clip and scaling graphs) is
  lowered on its own.
- arrays are numpy arrays in host memory, as the interpreter's (`cpu`), so checkpoints, `download` and
  resuming across `cpu` and `cpu-c` need nothing more; the activations live in one arena (`plan-buffers`'
  offsets), large enough for every graph compiled so far.
- threads: `threads` (from `--threads` or `OMP_NUM_THREADS`; all cores otherwise) for OpenMP and for
  OpenBLAS alike. Every reduction's order is fixed by the sizes alone, so results do not depend on it.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...diagnostics import SxError, UsageError
from ...dialects.core import Operation, TensorType, enclosing_module, module_holding
from ...dialects.graph import graph_funcs, input_name, input_role, is_derived, return_names
from ...passes.lowering_report import DeviceFacts, LoweringFacts, lowering_document
from ...passes.manager import CompilationUnit, run_pipeline
from ...passes.pipelines import CPU_C_LOWERING
from ..executor import CompiledAhead, Executable, Executor
from ..interpreter.executor import HostArrays
from .blas import numpy_blas
from .compiler import CCompileError, compile_shared, host_compiler, host_cpu
from .render import GraphLayout, Named, Place, aligned, numpy_dtype, render_module

#: Bindings of one graph kept per distinct set of arrays (the driver uses one or two).
BINDINGS_KEPT = 4
#: The share of the host's available memory a stacked train graph's activations may take.
STACKING_MEMORY_SHARE = 0.25
_ERROR_LINE = re.compile(r"unit(\d+)\.c:(\d+):\d+: error")


def available_memory() -> int:
    """Bytes of memory the host has available now (physical pages not in use; 1 GiB where it does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 30


def thread_count(threads: int | None = None) -> int:
    """`threads`, else `$OMP_NUM_THREADS`, else every core; a usage error unless a positive integer."""
    if threads is None:
        configured = os.environ.get("OMP_NUM_THREADS", "").strip()
        if not configured:
            return os.cpu_count() or 1
        try:
            threads = int(configured.split(",")[0])
        except ValueError:
            raise UsageError(f"OMP_NUM_THREADS must be a positive integer, not {configured!r}") from None
    if threads < 1:
        raise UsageError(f"--threads must be a positive integer, not {threads}")
    return threads


class LoweredModule:
    """A module after the cpu-c lowering: its graphs' layouts, its facts, its loaded shared object."""

    def __init__(self, module: Operation, facts: dict[str, Any], library: ctypes.CDLL, layouts: dict[str, GraphLayout],
                 files: int, from_cache: bool) -> None:
        self.module = module
        #: The translation units its C was compiled from.
        self.files = files
        self.facts = facts
        self.library = library
        self.layouts = layouts
        self.from_cache = from_cache
        self.graphs = {str(f.attributes["sym_name"]): f for f in graph_funcs(module)}


class CpuCExecutor(HostArrays, Executor):
    """Runs graphs as compiled C on the host's cores; see the module docstring."""

    device = "cpu-c"
    lowering_pipeline = CPU_C_LOWERING
    stacks_microbatches = True

    def __init__(self, threads: int | None = None, profiled: bool = False) -> None:
        self.threads = thread_count(threads)
        #: Whether the C adds up each step's seconds (`profile()`; benchmarks/cpu_train.py prints them).
        self.profiled = profiled
        blas = numpy_blas()
        assert blas is not None, "the cpu-c probe checks for numpy's OpenBLAS"
        self.blas = blas
        #: id(module) -> (the module, kept so the id stays its own; its lowering)
        self._modules: dict[int, tuple[Operation, LoweredModule]] = {}
        self.executables: list[CpuCExecutable] = []
        self.experiment: LoweredModule | None = None
        #: Every module lowered, in order.
        self.lowerings: list[LoweredModule] = []
        self._arena = np.zeros(0, np.uint8)
        self._workspace = np.zeros(0, np.uint8)
        #: The stacked graphs `stacking` lowered and chose.
        self._ahead = CompiledAhead()
        #: The stacking degree `stacking` chose (None before it was asked).
        self.stack: int | None = None

    # -- compiling -------------------------------------------------------------------------------------

    def compile(self, func: Operation) -> Executable:
        ahead = self._ahead.get(func)
        if ahead is not None:
            return ahead
        name = str(func.attributes["sym_name"])
        module = enclosing_module(func)
        lowered = self._lowered(module) if module is not None and not is_derived(func) else None
        if lowered is None or name not in lowered.layouts:
            # Alone: the graphs the run pipeline derived for the driver (`derived`), and update graphs the lowering merged into their group's (which
            # a run calls only for a parameter outside every flat group), lowered and compiled when first called.
            return DeferredExecutable(self, func)
        return self._executable(lowered, name)

    def stacking(self, microbatches: int, variants: Mapping[int, Sequence[Operation]]) -> int:
        """The largest degree k among `variants` whose `train_stacked/<k>` activations (its arena) take at
        most `STACKING_MEMORY_SHARE` of the memory the host has available: one call then runs k microbatches
        (as the CUDA executor stacks by device memory), each copy's GEMMs one microbatch tall. The chosen
        degree's graphs (the stacked one and its accumulating twin) are lowered together, and compiled once
        it fits."""
        budget = available_memory() * STACKING_MEMORY_SHARE
        for k in sorted(variants, reverse=True):
            if k <= 1 or microbatches % k:
                continue
            stacked, *rest = variants[k]
            module = module_holding([stacked, *rest])
            unit = self._planned(module)
            name = str(stacked.attributes["sym_name"])
            arena = next(int(f.attributes.get("arena_bytes", 0)) for f in graph_funcs(module)
                         if str(f.attributes["sym_name"]) == name)
            if arena > budget:  # known from the plan: no C compiled for a degree that does not fit
                continue
            lowered = self._load(module, unit)
            for func in (stacked, *rest):
                self._ahead.keep(func, self._executable(lowered, str(func.attributes["sym_name"])))
            self.stack = k
            return k
        self.stack = 1
        return 1

    def compile_alone(self, func: Operation) -> CpuCExecutable:
        """A graph lowered, compiled and loaded on its own (in a module of its own)."""
        return self._executable(self._lower(module_holding([func])), str(func.attributes["sym_name"]))

    def _executable(self, lowered: LoweredModule, name: str) -> CpuCExecutable:
        layout = lowered.layouts[name]
        self._arena = _grown(self._arena, layout.arena_bytes)
        self._workspace = _grown(self._workspace, layout.workspace_bytes)
        function = getattr(lowered.library, layout.function)
        function.argtypes = [ctypes.c_void_p]
        function.restype = None
        executable = CpuCExecutable(self, layout, function)
        self.executables.append(executable)
        return executable

    def _lowered(self, module: Operation) -> LoweredModule:
        known = self._modules.get(id(module))
        if known is not None and known[0] is module:
            return known[1]
        # The experiment's graphs, lowered together once; a derived graph is lowered alone when first called
        # (as the CUDA executor does), so the report counts each kernel once.
        lowered = self._lower(module_holding([op for op in module.body.ops
                                              if not (op.name == "graph.func" and is_derived(op))]))
        self._modules[id(module)] = (module, lowered)
        if self.experiment is None and any(op.name == "exp.run" for op in module.body.ops):
            self.experiment = lowered
        return lowered

    def _lower(self, module: Operation) -> LoweredModule:
        """Lower a module (a copy: the pipeline rewrites it), render, compile and load it."""
        return self._load(module, self._planned(module))

    @classmethod
    def _planned(cls, module: Operation) -> CompilationUnit:
        """The module after `CPU_C_LOWERING`, in place: its kern plan and arenas, nothing compiled yet."""
        # match-patterns and fuse plan with the cpu-c target (the CUDA target's answers where a CPU task does
        # not differ from a block); the C renderer reads that plan and ignores its launch shapes.
        from . import target  # noqa: F401  (registers it)

        return run_pipeline(CompilationUnit(module=module), cls.lowering_pipeline)

    def _load(self, module: Operation, unit: CompilationUnit) -> LoweredModule:
        """A lowered module rendered as C, compiled (or found in the cache) and loaded."""
        rendered = render_module(module, self.profiled)
        try:
            library, from_cache = compile_shared(rendered.units)
        except CCompileError as err:
            match = _ERROR_LINE.search(err.log)
            located = rendered.kernel_at(int(match.group(1)), int(match.group(2))) if match else None
            if located is not None and located[0]:
                raise err.at(f"@{located[0]}", located[1]) from None
            raise
        library.sx_set_blas.argtypes = [ctypes.c_void_p] * 3
        library.sx_set_blas(self.blas.sgemm, self.blas.get_threads, self.blas.set_threads)
        library.sx_set_threads.argtypes = [ctypes.c_int]
        library.sx_set_threads(self.threads)
        lowered = LoweredModule(module, unit.facts, library, rendered.graphs, len(rendered.units), from_cache)
        self.lowerings.append(lowered)
        return lowered

    def profile(self) -> dict[str, float]:
        """Seconds spent so far in each kind of step (by its label) of every graph compiled, when profiled."""
        totals: dict[str, float] = {}
        for lowered in self.lowerings:
            lowered.library.sx_profile.restype = ctypes.c_void_p
            counters = ctypes.cast(lowered.library.sx_profile(), ctypes.POINTER(ctypes.c_double))
            for layout in lowered.layouts.values():
                for i, label in enumerate(layout.labels):
                    totals[label] = totals.get(label, 0.0) + counters[layout.profile_start + i]
        return totals

    # -- arrays ----------------------------------------------------------------------------------------

    def zeros(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        return np.zeros(tuple(shape), numpy_dtype(dtype))

    # -- the report --------------------------------------------------------------------------------------

    def lowering_facts(self) -> LoweringFacts | None:
        """The lowering document of the experiment's graphs as this executor lowered them, with the host's
        facts; None before any was compiled."""
        if self.experiment is None:
            return None
        compiler = host_compiler()
        words = compiler.version.split() if compiler is not None else ["?"]
        compiled = {"compiler": f"{words[0]} {words[-1]}",
                    "kernels": sum(1 for op in self.experiment.module.body.ops if op.name == "kern.kernel"),
                    "functions": len(self.experiment.layouts), "files": self.experiment.files,
                    "from_cache": self.experiment.from_cache}
        document = lowering_document(self.experiment.module, self.experiment.facts, host_cpu().split(" ")[0],
                                     self.device, compiled=compiled,
                                     launches=os.environ.get("SEXPGPU_EXPLAIN") == "kernels")
        document["capture"]["off"] = "nothing to capture: each call of a graph is one call of its C function"
        facts = DeviceFacts(name=f"{host_cpu().split(' ', 1)[-1].rsplit(' ', 1)[0]}, {self.threads} threads",
                            total_memory=None, free_memory=None, stacking=self.stack, captured=frozenset(),
                            capture_off=document["capture"]["off"])
        return LoweringFacts(document, facts)


class DeferredExecutable:
    """A graph compiled on its own when first called (`CpuCExecutor.compile`)."""

    def __init__(self, executor: CpuCExecutor, func: Operation) -> None:
        self.executor = executor
        self.func = func
        self.name = str(func.attributes["sym_name"])
        self.inputs = [_Input(input_name(op), input_role(op), op.result.type)
                       for op in func.body.ops if op.name == "graph.input"]
        self.output_names = next(return_names(op) for op in func.body.ops if op.name == "graph.return")
        self._compiled: CpuCExecutable | None = None

    def __call__(self, inputs: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None) -> CpuCResult:
        if self._compiled is None:
            self._compiled = self.executor.compile_alone(self.func)
        return self._compiled(inputs, out)


class CpuCResult:
    """What one call produced: outputs and emitted values as numpy arrays."""

    def __init__(self, outputs: dict[str, np.ndarray], metrics: dict[str, float], counters: dict[str, np.ndarray],
                 observed: dict[str, np.ndarray]) -> None:
        self.outputs = outputs
        self.metrics = metrics
        self.counters = counters
        self.observed = observed


class CpuCExecutable:
    """A `graph.func` lowered and compiled for the host: one C function over its operands' addresses."""

    def __init__(self, executor: CpuCExecutor, layout: GraphLayout, function: Any) -> None:
        self.executor = executor
        self.layout = layout
        self.function = function
        self.name = layout.name
        self.inputs = [_Input(name, role, t) for name, role, t in layout.input_types()]
        self._constants = [np.ascontiguousarray(c) for c in layout.constants]
        #: The executable's own arrays for the values it returns or emits, unless written into `out`.
        self._slots = [np.zeros(e.type.shape, numpy_dtype(e.type.dtype)) for e in layout.externals]
        self._bindings: dict[tuple, _Binding] = {}
        self._output_set = frozenset(self.output_names)

    @property
    def output_names(self) -> list[str]:
        return [output.name for output in self.layout.outputs]

    def __call__(self, inputs: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None) -> CpuCResult:
        out = dict(out or {})
        arrays = [self._checked_input(spec, inputs) for spec in self.inputs]
        executor = self.executor
        # The same array objects as an earlier call (a training step's are): its binding. Keyed by identity,
        # which the binding's references to them keep unique; reading an array's address costs more.
        key = (id(executor._arena), id(executor._workspace), *map(id, arrays),
               *(id(out.get(name)) for name in self.output_names))
        for name in out.keys() - self._output_set:
            raise ValueError(f"graph @{self.name} has no output {name!r}")
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bind(arrays, out)
            if len(self._bindings) >= BINDINGS_KEPT:
                self._bindings.pop(next(iter(self._bindings)))
            self._bindings[key] = binding
        self.function(binding.bases)
        return self._finish(binding, out)

    def _bind(self, arrays: list[np.ndarray], out: dict[str, np.ndarray]) -> _Binding:
        storage = self._external_storage(arrays, out)
        executor = self.executor
        addresses = (executor._arena.ctypes.data, executor._workspace.ctypes.data,
                     *(a.ctypes.data for a in arrays), *(c.ctypes.data for c in self._constants),
                     *(s.ctypes.data for s in storage))
        outputs = []
        for output in self.layout.outputs:
            value = self._value(output, arrays, storage)
            target = out.get(output.name)
            if target is not None and (target.shape != value.shape or target.dtype != value.dtype):
                raise ValueError(f"out array for {output.name!r} of @{self.name} is {target.dtype}"
                                 f"{list(target.shape)}, not {output.type}")
            written = target is not None and target.ctypes.data == value.ctypes.data
            outputs.append((output.name, value, written))
        emits = [(emit, self._value(emit, arrays, storage)) for emit in self.layout.emits]
        kept = (executor._arena, executor._workspace, arrays, out)
        return _Binding((ctypes.c_void_p * len(addresses))(*addresses), outputs, emits, kept)

    def _checked_input(self, spec: _Input, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        if spec.name not in inputs:
            raise SxError(f"graph @{self.name} needs input {spec.name!r} ({spec.role}, {spec.type})")
        array = inputs[spec.name]
        if not isinstance(array, np.ndarray):
            raise TypeError(f"input {spec.name!r} of @{self.name} is a {type(array).__name__}, not an array")
        if array.shape != tuple(spec.type.shape) or array.dtype != numpy_dtype(spec.type.dtype):
            raise SxError(f"input {spec.name!r} of @{self.name} is {array.dtype}{list(array.shape)}, but the "
                          f"graph takes {spec.type}")
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)

    def _external_storage(self, arrays: list[np.ndarray], out: dict[str, np.ndarray]) -> list[np.ndarray]:
        """For each returned or emitted value: the caller's array to write it into where that is safe, else
        the executable's slot."""
        storage: list[np.ndarray | None] = [None] * len(self.layout.externals)
        taken: set[int] = set()
        for output in self.layout.outputs:
            target = out.get(output.name)
            place = output.place
            if target is None or place.kind != "external" or place.offset or storage[place.index] is not None:
                continue
            if (not target.flags.c_contiguous or target.dtype != self._slots[place.index].dtype
                    or target.shape != self._slots[place.index].shape or target.ctypes.data in taken):
                continue
            if self._may_write_over(place.index, target, arrays):
                storage[place.index] = target
                taken.add(target.ctypes.data)
        return [s if s is not None else self._slots[k] for k, s in enumerate(storage)]

    def _may_write_over(self, index: int, target: np.ndarray, arrays: list[np.ndarray]) -> bool:
        """Whether external value `index` may be written straight into `target`, given the inputs."""
        external = self.layout.externals[index]
        low, high = target.ctypes.data, target.ctypes.data + target.nbytes
        for k, array in enumerate(arrays):
            start = array.ctypes.data
            if start >= high or start + array.nbytes <= low:
                continue
            if (start, array.nbytes) != (low, target.nbytes):
                return False
            if self.layout.last_read.get(k, -1) > external.producer or not external.reads_in_place.get(k, True):
                return False
        return True

    def _finish(self, binding: _Binding, out: dict[str, np.ndarray]) -> CpuCResult:
        """Outputs into the caller's arrays where they were not written there; fresh copies of the rest."""
        outputs: dict[str, np.ndarray] = {}
        for name, value, written in binding.outputs:
            target = out.get(name)
            if target is None:
                outputs[name] = value.copy()
                continue
            if not written:
                np.copyto(target, value)
            outputs[name] = target
        emitted: dict[str, dict[str, Any]] = {"metrics": {}, "counters": {}, "observed": {}}
        for emit, value in binding.emits:
            emitted[emit.collection][emit.name] = float(value) if emit.collection == "metrics" else value.copy()
        return CpuCResult(outputs, emitted["metrics"], emitted["counters"], emitted["observed"])

    def _value(self, named: Named, arrays: list[np.ndarray], storage: list[np.ndarray]) -> np.ndarray:
        """The array holding a returned or emitted value after a call (a view, not a copy)."""
        place: Place = named.place
        if place.kind == "arena":
            raise AssertionError(f"@{self.name} returns a value in its arena")
        whole = {"input": arrays, "const": self._constants, "external": storage}[place.kind][place.index]
        dtype = numpy_dtype(named.type.dtype)
        raw = whole.reshape(-1).view(np.uint8)[place.offset:place.offset + named.type.numel * dtype.itemsize]
        return raw.view(dtype).reshape(named.type.shape)


class _Binding:
    """A graph's call with given arrays: the base addresses the C takes, each output's value (a view) and
    whether it is written straight into the caller's array, each emit's value; `kept` holds the arrays the
    binding's key names by identity, so that identity is not reused while the binding is."""

    def __init__(self, bases: Any, outputs: list[tuple[str, np.ndarray, bool]], emits: list[tuple[Named, np.ndarray]],
                 kept: tuple) -> None:
        self.bases = bases
        self.outputs = outputs
        self.emits = emits
        self.kept = kept


class _Input:
    def __init__(self, name: str, role: str, type: TensorType) -> None:
        self.name = name
        self.role = role
        self.type = type


def _grown(array: np.ndarray, nbytes: int) -> np.ndarray:
    return array if array.nbytes >= nbytes else np.zeros(aligned(nbytes), np.uint8)


def open_cpu_c_executor(**options: Any) -> CpuCExecutor:
    threads, profiled = options.pop("threads", None), options.pop("profiled", False)
    if options:
        print(f"note: cpu-c ignores the options {', '.join(sorted(options))}", file=sys.stderr)
    return CpuCExecutor(threads, profiled)
