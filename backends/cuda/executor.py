"""The CUDA executor: graphs lowered to CUDA kernels and cuBLASLt GEMMs, run through the device runtime.

Registered as `cuda` (a GPU through `SEXPGPU_CUDA_DRIVER`'s driver) and
`cuda-sim` (the simulated device; the same code, so CI runs it). What it does
with a graph (docs/cuda.md, "Running on the device"):

- `compile(func)` runs the CUDA lowering for the device's architecture
  (`passes.pipelines.cuda_lowering`: match-patterns, fuse, plan-buffers,
  emit-cuda) on a copy (`Operation.clone`)
  of the experiment's graphs in the module holding `func` — once per module,
  so they share one translation unit, one NVRTC compile and one loaded
  module — compiles the unit with the runtime's compiler (NVRTC CUBIN for the
  device's architecture; the host C++ compiler on cuda-sim) and returns a
  `CudaExecutable` (`executable.py`) that launches the graph's kernels and
  GEMMs in order. A graph the run pipeline derived for the driver (a group's
  flat update, a flat clip, the gradient scaling: `derived`), or one in no
  module, is lowered on its own, once. No graph is lowered twice.
- arrays (`zeros`, `upload`, views) are device memory from a caching pool
  (`memory.py`), so the parameters, gradients and optimizer states live on
  the device for the whole run; uploads of up to `STAGING_BYTES` go through
  pinned staging buffers (`PinnedStaging`), so the host copies a batch while
  the device still runs what came before.
- `stacking` chooses among the stacking variants the compiler made (`stack-variants`) the largest
  whose activations fit: each degree's graphs lowered together, largest degree first, until one fits.
- `lowering_facts()` is what the lowering report says of the experiment's graphs: the lowering document
  (`passes/lowering_report.py`) of what this executor lowered, with the chosen `train stacked` row, and the
  device's facts; the layer above renders them (`sexpgpu.report.lowering_text`, as `explain` does).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...dialects.core import Operation, enclosing_module, module_holding
from ...dialects.exp import graph_title
from ...dialects.graph import graph_funcs, is_derived
from ...passes.lowering_report import DeviceFacts, LoweringFacts, lowering_document
from ...passes.manager import CompilationUnit, UnitFacts
from ...passes.pipelines import CUDA_LOWERING
from ..distributed import CollectivesPlan, Communicator, DeviceCollectives
from ..executor import CompiledAhead, DeviceArray, Executable, Executor
from .executable import CudaExecutable
from .graph_plan import GraphPlan, numpy_dtype
from .lowering import compile_module, lower, module_source
from .memory import ActivationArena, CudaArray, DevicePool
from .runtime import DeviceRuntime, DeviceScalars, KernelSource, LoadedModule, PinnedStaging
from .selection import open_runtime, switch_setting

#: Uploads up to this size go through pinned staging buffers (two of them); larger ones are copied
#: from pageable memory (initial parameters, a checkpoint's tensors: once per run).
STAGING_BYTES = 8 << 20
#: Device memory left free when choosing the stacking degree: cuBLASLt's workspace (32 MiB) and room
#: for the driver's own allocations.
RESERVED_BYTES = 256 << 20
#: What `--device cuda-sim` says once on standard error.
SIMULATOR_NOTE = ("note: cuda-sim is a simulated CUDA device for tests: the CUDA code runs on the CPU, "
                  "thousands of times slower than a GPU; use it for tiny runs (docs/cuda.md, cuda-sim)")


def capture_setting() -> bool:
    """`SEXPGPU_CAPTURE`: `0`/`off` turns graph capture off (default on where the driver has it)."""
    return switch_setting("SEXPGPU_CAPTURE")


class LoweredModule:
    """A module after the CUDA lowering: its graphs by name, its facts, its kernels loaded on the device."""

    def __init__(self, module: Operation, facts: UnitFacts, loaded: LoadedModule, binary: Any) -> None:
        self.module = module
        self.facts = facts
        self.loaded = loaded
        #: What the runtime's compiler made of the module's kernels (NVRTC's CUBIN; cuda-sim's shared object).
        self.binary = binary
        self.graphs = {str(f.attributes["sym_name"]): f for f in graph_funcs(module)}


class CudaExecutor(Executor):
    """Runs graphs on a CUDA device (or cuda-sim) through `DeviceRuntime`; see the module docstring."""

    stacks_microbatches = True
    lowering_pipeline = CUDA_LOWERING

    def __init__(self, device: str = "cuda", runtime: DeviceRuntime | None = None, capture: bool | None = None,
                 **runtime_options: Any) -> None:
        self.device = device
        self.runtime = runtime if runtime is not None else open_runtime(device, **runtime_options)
        #: Why graphs are not captured, in words (None: they are, once large enough and warm).
        self.capture_off: str | None = self.runtime.capture_unavailable
        wanted = capture_setting() if capture is None else capture
        if self.capture_off is None and not wanted:
            self.capture_off = "turned off (SEXPGPU_CAPTURE=off)"
        self.capture_enabled = self.capture_off is None
        self.pool = DevicePool(self.runtime)
        self.arena = ActivationArena(self.runtime, self.pool)
        self._staging: PinnedStaging | None = None
        #: id(module) -> (the module, kept so the id stays its own; its lowering)
        self._modules: dict[int, tuple[Operation, LoweredModule]] = {}
        self.executables: list[CudaExecutable] = []
        #: The lowering of the experiment's module (the first module compiled from), for the report.
        self.experiment: LoweredModule | None = None
        #: The graphs compiled ahead (the stacking degree chosen).
        self._ahead = CompiledAhead()
        #: The stacking degree the last `stacking` call chose, and what it chose among.
        self.stacked: tuple[int, list[int]] | None = None
        #: The lowering of the chosen `train_stacked` graphs (rows of the report).
        self.stacked_lowering: LoweredModule | None = None

    # -- compiling ---------------------------------------------------------------------------------

    def compile(self, func: Operation) -> Executable:
        ahead = self._ahead.get(func)
        if ahead is not None:
            return ahead
        name = str(func.attributes["sym_name"])
        module = enclosing_module(func)
        lowered = self._lowered(module) if module is not None and not is_derived(func) else None
        if lowered is None or name not in lowered.graphs:
            # Alone: the graphs derived for the driver, and update graphs the lowering merged into their group's.
            lowered = self._lower(module_holding([func]), name)
        return self._executable(func, lowered)

    def _executable(self, func: Operation, lowered: LoweredModule) -> CudaExecutable:
        # The report's row of a driver's graph is that of the graph it stands for (a flat clip, a group's update).
        title = graph_title(func).removesuffix("/flat")
        executable = CudaExecutable(self, GraphPlan(lowered.graphs[str(func.attributes["sym_name"])]), lowered.loaded,
                                    title)
        self.executables.append(executable)
        return executable

    def _lowered(self, module: Operation) -> LoweredModule:
        """The lowering of the experiment's graphs in `module` (those not derived for the driver), made once."""
        known = self._modules.get(id(module))
        if known is not None and known[0] is module:
            return known[1]
        experiment = [op for op in module.body.ops if not (op.name == "graph.func" and is_derived(op))]
        lowered = self._lower(module_holding(experiment), _module_name(module))
        self._modules[id(module)] = (module, lowered)
        if self.experiment is None and any(op.name == "exp.run" for op in module.body.ops):
            self.experiment = lowered
        return lowered

    def _lower(self, module: Operation, name: str) -> LoweredModule:
        """Lower a module (a copy: the pipeline rewrites it) and load its kernels on the device."""
        unit = lower(CompilationUnit(module=module), arch=self.runtime.device.arch)
        identifier = _identifier(name)
        binary = compile_module(self.runtime.compiler, module, identifier)
        loaded = self.runtime.load_module(KernelSource(identifier, module_source(module), binary))
        return LoweredModule(module, unit.facts, loaded, binary)

    def activations(self, executable: CudaExecutable):
        """The activation arena, large enough for every graph compiled so far."""
        need = max(self.executables, key=lambda e: e.arena_need)
        return self.arena.ensure(max(need.arena_need, executable.arena_need, 1), need.name)

    # -- arrays ------------------------------------------------------------------------------------

    def _new(self, shape: Sequence[int], dtype: str, what: str) -> CudaArray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
        block = self.pool.take(nbytes, what)
        return CudaArray(block.span.address, shape, dtype, block)

    def zeros(self, shape: Sequence[int], dtype: str) -> CudaArray:
        array = self._new(shape, dtype, f"an array of {dtype}{list(shape)}")
        self.runtime.memset(array.address, 0, array.nbytes)
        return array

    def upload(self, host: np.ndarray) -> CudaArray:
        host = np.asarray(host)
        array = self._new(host.shape, _ir_dtype(host.dtype), f"an array of {host.dtype}{list(host.shape)}")
        self._copy_in(array, host)
        return array

    def write(self, target: CudaArray, host: np.ndarray) -> None:
        host = np.asarray(host, numpy_dtype(target.dtype))
        if tuple(host.shape) != target.shape:
            raise ValueError(f"write of a {list(host.shape)} array into a {target.dtype}{list(target.shape)} one")
        if target.scalars is not None:
            target.scalars.set(value=host.item())
            target.scalars.update()
        else:
            self._copy_in(target, host)

    def scalar(self, dtype: str) -> CudaArray:
        """A device scalar (the step): set by `write` through a pinned mirror, and copied from it by the
        first node of a captured graph that reads it, so a replay reads the value written before it."""
        scalars = DeviceScalars(self.runtime, self.runtime.arena(256, "a device scalar"),
                                {"value": numpy_dtype(dtype)}, name="a device scalar")
        return CudaArray(scalars.address("value"), (), dtype, scalars, scalars)

    def _copy_in(self, target: CudaArray, host: np.ndarray) -> None:
        data = np.ascontiguousarray(host)
        if data.nbytes <= STAGING_BYTES:
            if self._staging is None:
                self._staging = PinnedStaging(self.runtime, STAGING_BYTES)
            self._staging.upload(target.span, data)
        else:
            self.runtime.upload(target.span, data)

    def download(self, array: CudaArray) -> np.ndarray:
        return self.runtime.download(array.span, numpy_dtype(array.dtype), array.shape)

    def copy(self, source: CudaArray, target: CudaArray) -> None:
        if source.shape != target.shape or source.dtype != target.dtype:
            raise ValueError(f"copy of a {source.dtype}{list(source.shape)} array into a "
                             f"{target.dtype}{list(target.shape)} one")
        self.runtime.copy(target.address, source.address, source.nbytes)

    def view(self, flat: CudaArray, offset: int, shape: Sequence[int]) -> CudaArray:
        itemsize = numpy_dtype(flat.dtype).itemsize
        view = CudaArray(flat.address + offset * itemsize, shape, flat.dtype, flat.owner)
        if offset < 0 or offset * itemsize + view.nbytes > flat.nbytes:
            raise ValueError(f"a view of {list(view.shape)} at element {offset} is outside {flat!r}")
        return view

    # -- the run -----------------------------------------------------------------------------------

    def stacking(self, microbatches: int, variants: Mapping[int, Sequence[Operation]]) -> int:
        """The largest divisor k of `microbatches` among the variants whose `train_stacked/<k>` graph has its
        activations fit in the device memory left (besides the arrays allocated so far and a reserve). Each
        degree tried has its graphs lowered together, once; those of the degree chosen are what `compile`
        then returns for them."""
        candidates = [k for k in range(microbatches, 0, -1) if microbatches % k == 0]
        free, _ = self.runtime.memory_info()
        budget = free + self.pool.kept + self.arena.capacity - RESERVED_BYTES
        chosen = 1
        for k in candidates[:-1]:
            if k not in variants:
                continue
            stacked, *rest = variants[k]
            lowered = self._lower(module_holding([stacked, *rest]), f"train_stacked_{k}")
            executable = self._executable(stacked, lowered)
            if executable.arena_need <= budget:
                self._ahead.keep(stacked, executable)
                for func in rest:
                    self._ahead.keep(func, self._executable(func, lowered))
                self.stacked_lowering = lowered
                chosen = k
                break
            self.executables.remove(executable)
        self.stacked = (chosen, candidates)
        return chosen

    def lowering_facts(self) -> LoweringFacts | None:
        """The lowering document (`passes.lowering_report`) of the experiment's graphs as this executor lowered
        them, with the chosen `train stacked` row, and what the opened device tells; None before any was
        compiled."""
        if self.experiment is None:
            return None
        arch = self.runtime.device.arch
        compiled = self.runtime.compiler.compiled_facts(self.experiment.module, self.experiment.binary)
        document = lowering_document(self.experiment.module, self.experiment.facts, arch, self.device,
                                     compiled=compiled, launches=os.environ.get("SEXPGPU_EXPLAIN") == "kernels")
        if self.stacked_lowering is not None:
            _add_stacked_rows(document, self.experiment.module, self.stacked_lowering, arch, self.device)
        document["stacking"]["planned"] = self.stacked[0] if self.stacked is not None else None
        return LoweringFacts(document, self.device_facts())

    def device_facts(self) -> DeviceFacts:
        """What only the opened device tells the report: its name, memory, the stacking chosen, the graphs
        captured once warm (by the symbols of the experiment's graphs they run)."""
        info = self.runtime.device
        free, total = self.runtime.memory_info()
        titles = {e.title for e in self.executables if e.captures}
        modules = [m for m in (self.experiment, self.stacked_lowering) if m is not None]
        captured = frozenset(name for m in modules for name, func in m.graphs.items() if graph_title(func) in titles)
        return DeviceFacts(name=info.name, total_memory=total, free_memory=free,
                           stacking=self.stacked[0] if self.stacked is not None else None,
                           captured=captured, capture_off=self.capture_off)

    def synchronize(self) -> None:
        self.runtime.synchronize()

    def collectives(self, world: Communicator) -> DeviceCollectives | None:
        """NCCL over the ranks of `world` on a GPU (docs/distributed.md, "NCCL and host staging"); None
        (host staging through MPI) on cuda-sim, with `SEXPGPU_NCCL=off`, without the NCCL library, or
        where two ranks share a GPU, which NCCL refuses. Ranks of a torchrun-style launch (`NcclWorld`)
        already share a communicator."""
        from .nccl import NcclCollectives, NcclWorld, nccl_refused, open_nccl_collectives

        if isinstance(world, NcclWorld):
            return NcclCollectives(self.runtime, world.comm)
        if world.size == 1 or nccl_refused(self.device) is not None:
            return None
        places = world.broadcast(world.gather((socket.gethostname(), self.runtime.device.index)))
        if len(set(places)) < len(places):
            if world.is_root:
                print("note: several ranks share a GPU, which NCCL refuses; they reduce through MPI by host staging",
                      file=sys.stderr)
            return None
        return open_nccl_collectives(self.runtime, world)

    def planned_collectives(self, ranks: int) -> CollectivesPlan:
        from .nccl import planned_collectives

        return planned_collectives(self.device, ranks)


def _add_stacked_rows(document: dict[str, Any], experiment: Operation, stacked: LoweredModule, arch: str,
                      device: str) -> None:
    """Put the `train stacked` row of the stacked graphs' lowering into the experiment's document, in its
    kind's place. The row is that of `train_stacked/<k>` (its accumulating twin launches the same
    kernels, adding into the gradients so far), read from a module holding it and the experiment's run."""
    kept = [op for op in stacked.module.body.ops if op.name != "graph.func" or op.attributes.get("accumulating") is not True]
    run = next(op for op in experiment.body.ops if op.name == "exp.run")
    rows = lowering_document(module_holding([*kept, run]), stacked.facts, arch, device)["rows"]
    order = [row["name"] for row in document["rows"]]
    place = order.index("train accumulating") + 1 if "train accumulating" in order else 1
    document["rows"][place:place] = [row for row in rows if row["kind"] == "train_stacked"]
    largest = max(document["rows"], key=lambda row: row["arena_bytes"])
    document["memory"]["largest_arena"] = {"row": largest["name"], "bytes": largest["arena_bytes"]}


def _module_name(module: Operation) -> str:
    run = next((op for op in module.body.ops if op.name == "exp.run"), None)
    if run is not None and run.loc is not None:
        return os.path.splitext(os.path.basename(run.loc.file))[0] or "module"
    return "module"


def _identifier(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_") or "graph"


def _ir_dtype(dtype: np.dtype) -> str:
    from ...dialects.graph_semantics import numpy_dtypes

    for name, scalar in numpy_dtypes().items():
        if np.dtype(scalar) == dtype:
            return name
    raise ValueError(f"the CUDA executor stores no {dtype} arrays")


def open_cuda_executor(device: str, **options: Any) -> CudaExecutor:
    """The factory registered for `cuda` and `cuda-sim`; `cuda-sim` says what it is on standard error."""
    if device == "cuda-sim":
        print(SIMULATOR_NOTE, file=sys.stderr)
    return CudaExecutor(device, **options)


__all__ = ["CudaExecutor", "DeviceArray", "open_cuda_executor"]
