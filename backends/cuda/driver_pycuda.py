"""`pycuda`: the device runtime over PyCUDA, used where pycuda is installed and `SEXPGPU_CUDA_DRIVER=pycuda`.

Like `pycuda.autoprimaryctx`, it retains the device's primary context and pushes it, so cuBLASLt
(and PyTorch, CuPy) share the context; it does so for the device `SEXPGPU_DEVICES` names, where
autoprimaryctx would pick one itself. Kernels still come from NVRTC (`module_from_buffer` loads the
CUBIN; PyCUDA's own compiler shells out to nvcc); launches are PyCUDA's prepared calls, packed from
the same parameter types as the other drivers. PyCUDA has no stream-capture API, so capture is
unavailable (`capture_unavailable` says so, and the lowering report with it).

The module imports without pycuda; opening the runtime without it is a one-line user error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .cublaslt import WORKSPACE_BYTES, CublasLt
from .lowering import NvrtcCompiler
from .runtime import (
    CapturedGraph,
    CaptureError,
    DeviceError,
    DeviceInfo,
    DeviceOutOfMemory,
    DeviceRuntime,
    DeviceSpan,
    DeviceUnavailable,
    Dim3,
    Event,
    Kernel,
    KernelLaunchError,
    KernelSource,
    LoadedModule,
    Stream,
    check_fits,
    declared_kernels,
    dim3,
    typed_arguments,
)

if TYPE_CHECKING:
    from .cublaslt import GemmSpec

DEVICE = "cuda"
NO_CAPTURE = "PyCUDA has no stream-capture API (SEXPGPU_CUDA_DRIVER=pycuda)"
#: CU_STREAM_NON_BLOCKING: the runtime's stream does not wait for the legacy default stream.
_NON_BLOCKING = 1


def load_pycuda() -> Any:
    """`pycuda.driver`; `DeviceUnavailable` in one line when pycuda or the driver library is missing."""
    try:
        import pycuda.driver as cuda
    except ImportError as err:
        if "libcuda" in str(err):
            raise DeviceUnavailable(DEVICE, "no CUDA driver (libcuda.so.1 not found), which pycuda needs") from None
        raise DeviceUnavailable(
            DEVICE, f"SEXPGPU_CUDA_DRIVER=pycuda, but pycuda is not installed ({err}); install it (pip install "
                    "pycuda builds it against a CUDA toolkit) or unset SEXPGPU_CUDA_DRIVER to use cuda-python") from None
    return cuda


def open_device(index: int) -> tuple[Any, Any]:
    """pycuda.driver and its Device `index` after cuInit; `DeviceUnavailable` saying why not."""
    cuda = load_pycuda()
    try:
        cuda.init()
    except cuda.Error as err:
        reason = str(err).strip()
        if "no CUDA-capable device" in reason:
            raise DeviceUnavailable(DEVICE, f"no CUDA GPU ({reason})") from None
        raise DeviceUnavailable(DEVICE, f"pycuda cannot initialize CUDA ({reason})") from None
    count = cuda.Device.count()
    if count == 0:
        raise DeviceUnavailable(DEVICE, "no CUDA GPU (the driver finds no device)")
    if not 0 <= index < count:
        raise DeviceUnavailable(DEVICE, f"there is no CUDA device {index}: this machine has {count} "
                                        f"(ids 0 to {count - 1}; SEXPGPU_DEVICES picks one)")
    return cuda, cuda.Device(index)


def probe(index: int = 0) -> str | None:
    """None when device `index` can open with pycuda; else why not, in one line."""
    try:
        open_device(index)
    except DeviceUnavailable as err:
        return err.reason
    return None


class PycudaStream(Stream):
    def __init__(self, runtime: PycudaRuntime, stream: Any) -> None:
        self.runtime = runtime
        self.pycuda = stream
        self.handle = int(stream.handle)

    def synchronize(self) -> None:
        self.runtime._waiting(self.pycuda.synchronize, "cuStreamSynchronize")

    def wait(self, event: Event) -> None:
        if not isinstance(event, PycudaEvent):
            raise DeviceError("a stream waiting for an event of another runtime")
        self.runtime._call(lambda: self.pycuda.wait_for_event(event.pycuda), "cuStreamWaitEvent")


class PycudaEvent(Event):
    def __init__(self, runtime: PycudaRuntime, event: Any) -> None:
        self.runtime = runtime
        self.pycuda = event

    def record(self, stream: Stream | None = None) -> None:
        self.runtime._call(lambda: self.pycuda.record(self.runtime._stream(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        self.runtime._waiting(self.pycuda.synchronize, "cuEventSynchronize")

    def elapsed_ms(self, start: Event) -> float:
        if not isinstance(start, PycudaEvent):
            raise DeviceError("elapsed time between events of different runtimes")
        return float(self.runtime._call(lambda: self.pycuda.time_since(start.pycuda), "cuEventElapsedTime"))


class PycudaRuntime(DeviceRuntime):
    """The device runtime on a GPU through PyCUDA (see the module docstring)."""

    capture_unavailable = NO_CAPTURE

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.cuda, device = open_device(index)
        self._context = device.retain_primary_context()
        self._context.push()
        free, total = self.cuda.mem_get_info()
        self.device = DeviceInfo(index, device.name(), total, free, tuple(device.compute_capability()), "pycuda")
        self.compiler = NvrtcCompiler(self.device.arch)
        self.default_stream = self.stream()
        self._allocations: dict[int, Any] = {}
        self._last_kernel: str | None = None
        self._cublas: CublasLt | None = None
        self._closed = False

    def _call(self, body: Callable[[], Any], call: str) -> Any:
        try:
            return body()
        except self.cuda.Error as err:
            raise DeviceError(f"{call} failed: {err}") from err

    def _waiting(self, body: Callable[[], Any], call: str) -> Any:
        """A call that waits for the device, where a kernel's fault surfaces: it names the last kernel."""
        try:
            return body()
        except self.cuda.Error as err:
            if self._last_kernel is None:
                raise DeviceError(f"{call} failed: {err}") from err
            raise KernelLaunchError(self._last_kernel, f"{call} failed: {err}; the driver reports a kernel's fault "
                                    "at the next call that waits, so it is this kernel or one launched shortly "
                                    "before it (CUDA_LAUNCH_BLOCKING=1 reports it at the faulting launch)") from err

    def _stream(self, stream: Stream | None) -> Any:
        return (stream or self.default_stream).pycuda

    def make_current(self) -> None:
        self._context.push()

    # memory ---------------------------------------------------------------------------------------

    def allocate(self, nbytes: int, what: str) -> DeviceSpan:
        try:
            allocation = self.cuda.mem_alloc(max(nbytes, 1))
        except self.cuda.MemoryError:
            raise DeviceOutOfMemory(what, nbytes, self.memory_info()[0], f"on {self.device.name}") from None
        except self.cuda.Error as err:
            raise DeviceError(f"cuMemAlloc failed: {err}") from err
        span = DeviceSpan(int(allocation), nbytes)
        self._allocations[span.address] = allocation
        return span

    def free(self, span: DeviceSpan) -> None:
        allocation = self._allocations.pop(span.address, None)
        if allocation is None:
            raise DeviceError(f"free of {span.address:#x}, which allocate did not return")
        self._call(allocation.free, "cuMemFree")

    def memory_info(self) -> tuple[int, int]:
        free, total = self._call(self.cuda.mem_get_info, "cuMemGetInfo")
        return int(free), int(total)

    def _pinned_block(self, nbytes: int) -> np.ndarray:
        # Its base is PyCUDA's HostAllocation, which frees the memory with the last array over it.
        return self._call(lambda: self.cuda.pagelocked_empty(nbytes, np.uint8), "cuMemHostAlloc")

    # transfers ------------------------------------------------------------------------------------

    def upload(self, dst: DeviceSpan | int, host: np.ndarray, stream: Stream | None = None) -> None:
        host = np.ascontiguousarray(host)
        check_fits(dst, host.nbytes, "upload")
        if host.nbytes:
            self._call(lambda: self.cuda.memcpy_htod_async(int(dst), host, self._stream(stream)), "cuMemcpyHtoDAsync")

    def download(self, src: DeviceSpan | int, dtype: Any, shape: int | Sequence[int],
                 stream: Stream | None = None) -> np.ndarray:
        out = np.empty(shape, dtype)
        check_fits(src, out.nbytes, "download")
        if out.nbytes:
            self._call(lambda: self.cuda.memcpy_dtoh_async(out, int(src), self._stream(stream)), "cuMemcpyDtoHAsync")
        (stream or self.default_stream).synchronize()
        return out

    def download_async(self, src: DeviceSpan | int, out: np.ndarray, stream: Stream | None = None) -> None:
        if not out.flags.c_contiguous:
            raise ValueError("download_async writes into a contiguous (pinned) array")
        check_fits(src, out.nbytes, "download")
        if out.nbytes:
            self._call(lambda: self.cuda.memcpy_dtoh_async(out, int(src), self._stream(stream)), "cuMemcpyDtoHAsync")

    def copy(self, dst: DeviceSpan | int, src: DeviceSpan | int, nbytes: int, stream: Stream | None = None) -> None:
        if nbytes:
            self._call(lambda: self.cuda.memcpy_dtod_async(int(dst), int(src), nbytes, self._stream(stream)),
                       "cuMemcpyDtoDAsync")

    def memset(self, dst: DeviceSpan | int, byte: int, nbytes: int, stream: Stream | None = None) -> None:
        if nbytes:
            self._call(lambda: self.cuda.memset_d8_async(int(dst), byte & 0xFF, nbytes, self._stream(stream)),
                       "cuMemsetD8Async")

    # code -----------------------------------------------------------------------------------------

    def load_module(self, source: KernelSource) -> LoadedModule:
        image = self.binary(source).image
        module = self._call(lambda: self.cuda.module_from_buffer(image), f"cuModuleLoadData ({source.name})")
        shared = self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES
        kernels = {}
        for name, params in declared_kernels(source.source).items():
            function = self._call(lambda name=name: module.get_function(name), f"cuModuleGetFunction ({name})")
            function.prepare("".join(p.struct_code for p in params))
            function.dynamic_shared_limit = function.get_attribute(shared)
            kernels[name] = Kernel(name, params, function)
        return LoadedModule(source.name, kernels, module)

    def launch(self, kernel: Kernel, grid: Dim3, block: Dim3, shared_bytes: int = 0, args: Sequence = (),
               stream: Stream | None = None) -> None:
        function = kernel.handle
        grid3, block3 = dim3(grid, "grid", kernel.name), dim3(block, "block", kernel.name)
        values = typed_arguments(kernel, args)
        try:
            if shared_bytes > function.dynamic_shared_limit:
                function.set_attribute(self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
                function.dynamic_shared_limit = shared_bytes
            function.prepared_async_call(grid3, block3, self._stream(stream), *values, shared_size=shared_bytes)
        except self.cuda.Error as err:
            raise KernelLaunchError(kernel.name, f"cuLaunchKernel failed: {err}") from err
        self._last_kernel = kernel.name

    def gemm(self, spec: GemmSpec, a: DeviceSpan | int, b: DeviceSpan | int, d: DeviceSpan | int,
             c: DeviceSpan | int | None = None, bias: DeviceSpan | int | None = None, alpha: float = 1.0,
             beta: float = 0.0, stream: Stream | None = None) -> None:
        if self._cublas is None:
            workspace = self.allocate(WORKSPACE_BYTES, "cuBLASLt's workspace")
            self._cublas = CublasLt(workspace.address, WORKSPACE_BYTES)
        self._cublas.matmul(spec, int(a), int(b), int(d), None if c is None else int(c),
                            None if bias is None else int(bias), alpha, beta,
                            stream=(stream or self.default_stream).handle)

    # ordering -------------------------------------------------------------------------------------

    def stream(self) -> Stream:
        return PycudaStream(self, self._call(lambda: self.cuda.Stream(_NON_BLOCKING), "cuStreamCreate"))

    def event(self) -> Event:
        return PycudaEvent(self, self._call(self.cuda.Event, "cuEventCreate"))

    # capture --------------------------------------------------------------------------------------

    def _begin_capture(self, stream: Stream) -> None:
        raise CaptureError(NO_CAPTURE)

    def _end_capture(self, stream: Stream) -> CapturedGraph:
        raise CaptureError(NO_CAPTURE)

    # lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            if self._cublas is not None:
                self._cublas.close()
            for allocation in self._allocations.values():
                allocation.free()
            self._allocations.clear()
            self.cuda.Context.pop()
