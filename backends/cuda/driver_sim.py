"""`cuda-sim`: the device runtime over the simulated device of `sim/`, so CI runs the executor's device code.

Modules are the same CUDA C the GPU runs, compiled by the host C++ compiler (`SimDevice.compile`);
memory is the simulator's numpy-backed buffers with their canaries (an arena is one buffer, so a
write past an arena's end is caught; one between two pieces of an arena is not); GEMMs are numpy
with f32 accumulation, rounded once to the output dtype (bf16 to nearest even, through ml_dtypes).

Everything runs synchronously on the calling thread, in the order it is enqueued, whatever the
stream; events record the host's clock. Capture records instead of running: a launch, copy, memset,
upload or GEMM enqueued on a capturing stream is kept, with its arguments, and each launch of the
graph runs the kept list again, reading memory (and the pinned host memory a captured upload reads)
as it is then. What CUDA refuses during capture the simulator refuses too: allocating, synchronizing,
downloading, uploading from pageable memory.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

from .compiler import KernelCompiler
from .cublaslt import BIAS_EPILOGUES
from .runtime import (
    CapturedGraph,
    CaptureError,
    DeviceError,
    DeviceInfo,
    DeviceOutOfMemory,
    DeviceRuntime,
    DeviceSpan,
    Dim3,
    Event,
    Kernel,
    KernelLaunchError,
    KernelSource,
    LoadedModule,
    Stream,
    check_fits,
    dim3,
    param_type,
    typed_arguments,
)
from .sim import ROUND_ROBIN, DeviceBuffer, SimDevice, SimError, SimModule, compile_module

if TYPE_CHECKING:
    from .cublaslt import GemmSpec

#: What the simulated device reports as its compute capability: the architecture the executor
#: compiles for on an H100/H200, so the same code path picks the same kernels.
SIM_COMPUTE_CAPABILITY = (9, 0)
GEMM_DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}


class SimStream(Stream):
    """A stream of the simulated device: work runs as it is enqueued."""

    handle = 0

    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime = runtime

    def synchronize(self) -> None:
        if self.runtime.capturing(self) is not None:
            raise CaptureError("synchronizing a capturing stream is not allowed (CUDA invalidates the capture)")

    def wait(self, event: Event) -> None:
        pass  # work runs as it is enqueued: whatever the event marks has run


class SimEvent(Event):
    """An event of the simulated device: the host's clock when it was recorded."""

    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime = runtime
        self.time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        if self.runtime.capturing(stream) is not None:
            raise CaptureError("an event recorded inside capture times nothing; record events around a "
                               "graph's launch")
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, start: Event) -> float:
        if not isinstance(start, SimEvent) or start.time is None or self.time is None:
            raise DeviceError("elapsed time between events that were not both recorded")
        return (self.time - start.time) * 1000.0


class SimGraph(CapturedGraph):
    """The work captured on a simulated stream, replayed in order on each launch."""

    def __init__(self, runtime: SimRuntime, operations: list[Callable[[], None]]) -> None:
        super().__init__()
        self.runtime = runtime
        self.operations: list[Callable[[], None]] | None = operations

    def _launch(self, stream: Stream | None) -> None:
        if self.operations is None:
            raise CaptureError("launch of a captured graph that was closed")
        self.runtime._enqueue(stream, self._replay)

    def _replay(self) -> None:
        for operation in self.operations or ():
            operation()

    def close(self) -> None:
        self.operations = None


class HostCompiler(KernelCompiler):
    """The host C++ compiler against `cuda_sim.h`, to a shared object cuda-sim loads (`sim.compile_module`,
    disk-cached in `cache_dir`, default the simulator's): cuda-sim's compiler. It tells the report no
    register or spill figures (a GPU's are NVRTC's)."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir

    def compile(self, source: str, name: str) -> SimModule:
        return compile_module(source, f"{name}.cu", self.cache_dir)


class SimRuntime(DeviceRuntime):
    """The device runtime on `cuda-sim`.

    `memory_bytes` is the simulated device's memory (default: half the host's), so an arena too
    large for it fails as on a GPU; `schedule` is the simulator's thread order for every launch;
    `cache_dir` is where compiled modules are kept (default: the simulator's).
    """

    def __init__(self, index: int = 0, *, memory_bytes: int | None = None, schedule: str = ROUND_ROBIN,
                 cache_dir: Path | None = None) -> None:
        super().__init__()
        self.sim = SimDevice()
        self.schedule = schedule
        self.compiler = HostCompiler(cache_dir)
        total = memory_bytes if memory_bytes is not None else _host_memory() // 2
        self.device = DeviceInfo(index, "cuda-sim (a simulated CUDA device on the host CPU)", total, total,
                                 SIM_COMPUTE_CAPABILITY, "cuda-sim")
        self.default_stream = SimStream(self)
        self._buffers: dict[int, DeviceBuffer] = {}
        self._operations: dict[int, list[Callable[[], None]]] = {}

    # memory ---------------------------------------------------------------------------------------

    def allocate(self, nbytes: int, what: str) -> DeviceSpan:
        self._check_not_capturing(f"allocating {what}")
        free, _ = self.memory_info()
        if nbytes > free:
            raise DeviceOutOfMemory(what, nbytes, free, f"on {self.device.name}")
        buffer = self.sim.alloc(nbytes, what)
        self._buffers[buffer.ptr] = buffer
        return DeviceSpan(buffer.ptr, nbytes)

    def free(self, span: DeviceSpan) -> None:
        self._check_not_capturing("freeing device memory")
        buffer = self._buffers.pop(span.address, None)
        if buffer is None:
            raise DeviceError(f"free of {span.address:#x}, which allocate did not return")
        self.sim.free(buffer)

    def memory_info(self) -> tuple[int, int]:
        used = sum(buffer.nbytes for buffer in self._buffers.values())
        return self.device.total_memory - used, self.device.total_memory

    def _pinned_block(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    # transfers ------------------------------------------------------------------------------------

    def upload(self, dst: DeviceSpan | int, host: np.ndarray, stream: Stream | None = None) -> None:
        self._check_capturable_host(host, stream, "an upload")
        check_fits(dst, host.nbytes, "upload")
        self._enqueue(stream, lambda: self.sim.write(int(dst), host))

    def download(self, src: DeviceSpan | int, dtype: Any, shape: int | Sequence[int],
                 stream: Stream | None = None) -> np.ndarray:
        self._check_not_capturing("a download (it waits for the device)")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        check_fits(src, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, "download")
        return self.sim.download(int(src), dtype, shape)

    def download_async(self, src: DeviceSpan | int, out: np.ndarray, stream: Stream | None = None) -> None:
        self._check_capturable_host(out, stream, "a download")
        check_fits(src, out.nbytes, "download")

        def run() -> None:
            out.reshape(-1).view(np.uint8)[:] = self.sim.download(int(src), np.uint8, out.nbytes)

        self._enqueue(stream, run)

    def copy(self, dst: DeviceSpan | int, src: DeviceSpan | int, nbytes: int, stream: Stream | None = None) -> None:
        self._enqueue(stream, lambda: self.sim.copy(int(dst), int(src), nbytes))

    def memset(self, dst: DeviceSpan | int, byte: int, nbytes: int, stream: Stream | None = None) -> None:
        self._enqueue(stream, lambda: self.sim.memset(int(dst), byte, nbytes))

    # code -----------------------------------------------------------------------------------------

    def load_module(self, source: KernelSource) -> LoadedModule:
        module = self.binary(source)
        kernels = {}
        for name, compiled in module.kernels.items():
            params = []
            for p in compiled.params:
                try:
                    declared = param_type(p.type, p.name)
                except ValueError as err:
                    raise DeviceError(f"kernel {name}: {err}") from None
                if (declared.kind, declared.size) != (p.kind, p.size):
                    raise DeviceError(f"kernel {name}, parameter {p.type} {p.name}: read from the source as "
                                      f"{declared.kind} of {declared.size} bytes, but the compiler makes it "
                                      f"{p.kind} of {p.size}")
                params.append(declared)
            kernels[name] = Kernel(name, tuple(params), compiled)
        return LoadedModule(source.name, kernels, module)

    def launch(self, kernel: Kernel, grid: Dim3, block: Dim3, shared_bytes: int = 0, args: Sequence = (),
               stream: Stream | None = None) -> None:
        # Checked as the GPU drivers check them, when enqueued (so at capture, not at a replay); the
        # simulator checks them again, and that every pointer lies in one of its buffers.
        args = tuple(args)
        typed_arguments(kernel, args)
        grid, block = dim3(grid, "grid", kernel.name), dim3(block, "block", kernel.name)

        def run() -> None:
            try:
                self.sim.launch(kernel.handle, grid, block, shared_bytes, args, schedule=self.schedule)
            except SimError as err:
                raise KernelLaunchError(kernel.name, _without_kernel_name(str(err), kernel.name)) from err

        self._enqueue(stream, run)

    def gemm(self, spec: GemmSpec, a: DeviceSpan | int, b: DeviceSpan | int, d: DeviceSpan | int,
             c: DeviceSpan | int | None = None, bias: DeviceSpan | int | None = None, alpha: float = 1.0,
             beta: float = 0.0, stream: Stream | None = None) -> None:
        if (spec.epilogue in BIAS_EPILOGUES) != (bias is not None):
            raise ValueError(f"epilogue {spec.epilogue!r} {'needs' if bias is None else 'takes no'} bias pointer")
        addresses = (int(a), int(b), int(d), int(d if c is None else c), None if bias is None else int(bias))
        self._enqueue(stream, lambda: simulate_gemm(self.sim, spec, *addresses, alpha=alpha, beta=beta))

    # ordering -------------------------------------------------------------------------------------

    def stream(self) -> Stream:
        return SimStream(self)

    def event(self) -> Event:
        return SimEvent(self)

    def _enqueue(self, stream: Stream | None, operation: Callable[[], None]) -> None:
        """Run `operation` now, or keep it when `stream` is capturing."""
        if self.capturing(stream) is not None:
            self._operations[id(stream or self.default_stream)].append(operation)
        else:
            operation()

    # capture --------------------------------------------------------------------------------------

    def _begin_capture(self, stream: Stream) -> None:
        self._operations[id(stream)] = []

    def _end_capture(self, stream: Stream) -> CapturedGraph:
        return SimGraph(self, self._operations.pop(id(stream)))

    # lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        for buffer in list(self._buffers.values()):
            self.sim.free(buffer)
        self._buffers.clear()


def simulate_gemm(memory: SimDevice, spec: GemmSpec, a: int, b: int, d: int, c: int, bias: int | None,
                  alpha: float = 1.0, beta: float = 0.0) -> None:
    """What cuBLASLt computes for `spec` (see GemmSpec), in numpy: inputs widened to f32, products
    accumulated in f32, then alpha, beta · C (read only when beta is not 0), the bias, GELU (cuBLASLt's
    tanh form), and one rounding to the output dtype; a bias-gradient epilogue writes its sum over k."""
    in_dtype, out_dtype = GEMM_DTYPES[spec.dtype], GEMM_DTYPES[spec.output_dtype]
    op_a = _read_matrix(memory, a, in_dtype, spec.a_stored, spec.row_length_a, spec.batch, spec.batch_stride_a)
    op_b = _read_matrix(memory, b, in_dtype, spec.b_stored, spec.row_length_b, spec.batch, spec.batch_stride_b)
    if spec.transpose_a:
        op_a = op_a.transpose(0, 2, 1)
    if spec.transpose_b:
        op_b = op_b.transpose(0, 2, 1)
    result = np.matmul(op_a, op_b) * np.float32(alpha)
    if beta != 0:
        result += np.float32(beta) * _read_matrix(memory, c, out_dtype, (spec.m, spec.n), spec.row_length_c,
                                                  spec.batch, spec.batch_stride_c)
    if spec.epilogue in ("bias", "gelu-bias"):
        result += memory.download(bias, out_dtype, spec.n).astype(np.float32)
    if spec.epilogue in ("gelu", "gelu-bias"):
        result = _gelu_tanh(result)
    _write_matrix(memory, d, result.astype(out_dtype), spec.row_length_c, spec.batch_stride_c)
    if spec.epilogue == "bias-grad-a":
        memory.write(bias, op_a[0].sum(axis=1, dtype=np.float32).astype(out_dtype))
    elif spec.epilogue == "bias-grad-b":
        memory.write(bias, op_b[0].sum(axis=0, dtype=np.float32).astype(out_dtype))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def _strided_count(rows: int, cols: int, ld: int, batch: int, stride: int) -> int:
    """Elements from a strided batch's first element to its last."""
    return (batch - 1) * stride + (rows - 1) * ld + cols


def _read_matrix(memory: SimDevice, address: int, dtype: np.dtype, stored: tuple[int, int], ld: int, batch: int,
                 stride: int) -> np.ndarray:
    """The [batch, rows, cols] matrices at `address` (row length `ld`, batches `stride` apart) as f32."""
    rows, cols = stored
    stride = stride if batch > 1 else 0
    flat = memory.download(address, dtype, _strided_count(rows, cols, ld, batch, stride))
    size = dtype.itemsize
    return as_strided(flat, (batch, rows, cols), (stride * size, ld * size, size)).astype(np.float32)


def _write_matrix(memory: SimDevice, address: int, values: np.ndarray, ld: int, stride: int) -> None:
    """Write [batch, rows, cols] `values` at `address` with row length `ld`, batches `stride` apart,
    leaving the elements between rows (padding, or another matrix's) as they are."""
    batch, rows, cols = values.shape
    stride = stride if batch > 1 else 0
    if batch > 1 and stride < (rows - 1) * ld + cols:
        raise ValueError(f"output batches {stride} elements apart overlap (each spans {rows} rows of {ld})")
    flat = memory.download(address, values.dtype, _strided_count(rows, cols, ld, batch, stride))
    size = values.dtype.itemsize
    as_strided(flat, (batch, rows, cols), (stride * size, ld * size, size))[...] = values
    memory.write(address, flat)



def _without_kernel_name(message: str, kernel: str) -> str:
    """The simulator's message without the `kernel NAME` it starts with (KernelLaunchError names it)."""
    return re.sub(rf"^kernel {re.escape(kernel)}(?:[,:] ?| )", "", message)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 16 << 30
