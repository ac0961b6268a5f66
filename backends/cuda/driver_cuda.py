"""`cuda`: the device runtime over cuda-python's driver API (`cuda.bindings.driver`), the default driver.

The device's PRIMARY context (`cuDevicePrimaryCtxRetain`) is made current, so cuBLAS(Lt), PyTorch
and CuPy in the same process share it (they all use the primary context) and pointers pass freely
between them. Work goes on a non-blocking stream of the runtime's own (the legacy default stream
cannot be captured). Every call's CUresult is checked:

- no driver, no GPU, no such device id: `DeviceUnavailable`, one line (exit 1);
- out of memory on an allocation: `DeviceOutOfMemory` with the bytes asked and the bytes free;
- a failed cuLaunchKernel: `KernelLaunchError` naming the kernel;
- a fault a kernel causes while it runs (`CUDA_ERROR_ILLEGAL_ADDRESS` and its kin) is sticky: the
  driver reports it at whatever call comes next and at every call after, so whichever call reports
  it (a launch of another kernel, a copy, a synchronization), it is a `KernelLaunchError` naming
  the last kernel launched and its model path (the executor tells the runtime each launch's);
- out of memory at any other call (loading a module, instantiating a graph): `DeviceOutOfMemory`,
  a user error naming the call;
- anything else: `DeviceError` with the call and the CUresult's name and text.

The module imports without cuda-python or a driver; opening the runtime needs both.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from attrs import frozen

from ..executor import OutOfDeviceMemory
from .cublaslt import WORKSPACE_BYTES, CublasLt
from .errors import CudaToolchainMissing
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
    ParamType,
    Stream,
    check_fits,
    declared_kernels,
    dim3,
    pack_arguments,
)

if TYPE_CHECKING:
    from .cublaslt import GemmSpec

DEVICE = "cuda"
#: Faults of a running kernel, the ones cuda.h documents as leaving "the process in an inconsistent
#: state" where "any further CUDA work will return the same error": sticky, so the call that reports
#: one is whichever came after the fault, and the kernel to blame is the last one launched.
#: (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES is not among them: a launch refused for its own shape.)
KERNEL_FAULTS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_TENSOR_MEMORY_LEAK",
})
#: Results that mean there is no usable GPU here.
NO_DEVICE = frozenset({"CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA_ERROR_DEVICE_NOT_LICENSED"})
#: Results that mean the installed driver does not fit (too old, or a mismatched kernel module).
DRIVER_MISMATCH = frozenset({"CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
                             "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"})
CAPTURE_ERRORS = frozenset({"CUDA_ERROR_CAPTURED_EVENT"})
#: The dynamic shared memory a kernel may use without opting in (static shared memory counts too).
DEFAULT_DYNAMIC_SHARED = 48 * 1024


@functools.cache
def load_driver() -> Any:
    """`cuda.bindings.driver`; `CudaToolchainMissing` (one line naming the install command) without it."""
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise CudaToolchainMissing(f"cuda-python is not installed ({err})", "running on a CUDA GPU") from None
    return driver


# --- CUresult -> errors (pure: tested with fake results) -----------------------------------------------------


def result_name(result: Any) -> str:
    """A CUresult's enumerator name (`CUDA_ERROR_OUT_OF_MEMORY`), or its number for an unknown one."""
    return getattr(result, "name", None) or f"CUresult {int(result)}"


def describe(result: Any) -> str | None:
    """The driver's text for a CUresult (`out of memory`), or None when the driver cannot say."""
    try:
        err, text = load_driver().cuGetErrorString(result)
    except Exception:  # no driver library, or not a CUresult
        return None
    return text.decode(errors="replace") if int(err) == 0 and text else None


@frozen
class LastLaunch:
    """The last kernel launched (or replayed in a captured graph): the one a sticky fault is blamed on."""

    kernel: str
    model_path: str | None = None
    #: The kernels of the captured graph it is the last of, when the launch was a graph's replay.
    graph_kernels: int = 0

    def blame(self, failed: str) -> KernelLaunchError:
        where = (f"the last of the {self.graph_kernels} kernels of a replayed captured graph, so it is one of them "
                 "(SEXPGPU_CAPTURE=off and CUDA_LAUNCH_BLOCKING=1 name the one)" if self.graph_kernels else
                 "the last kernel launched, so it is this kernel or one launched shortly before it "
                 "(CUDA_LAUNCH_BLOCKING=1 reports it at the faulting launch)")
        return KernelLaunchError(self.kernel, f"{failed}; a kernel's fault is reported by whatever call comes "
                                              f"next, and this is {where}", self.model_path)


def translate(result: Any, call: str, *, kernel: str | None = None, last: LastLaunch | None = None) -> Exception:
    """The error to raise for a failed `call` that returned `result`.

    `kernel` is the kernel a launch call was launching; `last` the last launch before the call, which a
    sticky fault (`KERNEL_FAULTS`) is blamed on whatever the call was.
    """
    name = result_name(result)
    text = describe(result)
    failed = f"{call} failed: {name}" + (f" ({text})" if text else "")
    if name in KERNEL_FAULTS:
        return (last or LastLaunch("(none launched yet)")).blame(failed)
    if name in NO_DEVICE:
        return DeviceUnavailable(DEVICE, f"no CUDA GPU ({name}{': ' + text if text else ''})")
    if name in DRIVER_MISMATCH:
        return DeviceUnavailable(DEVICE, f"the CUDA driver does not fit cuda-python ({name}{': ' + text if text else ''})")
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return DriverOutOfMemory(call, name)
    if kernel is not None:
        return KernelLaunchError(kernel, failed)
    if name.startswith("CUDA_ERROR_STREAM_CAPTURE") or name in CAPTURE_ERRORS:
        return CaptureError(failed)
    if name == "CUDA_ERROR_NO_BINARY_FOR_GPU":
        return DeviceError(f"{failed}: the module was compiled for another architecture than the device's")
    return DeviceError(failed)


class DriverOutOfMemory(OutOfDeviceMemory):
    """Device memory ran out in a call other than an allocation (a module's load, a graph's
    instantiation, a stream's creation): a user error, as an allocation's is."""

    def __init__(self, call: str, name: str) -> None:
        if call.startswith("cuMemHostAlloc"):
            super().__init__(f"out of page-locked host memory: {call} failed ({name})")
        else:
            super().__init__(f"out of device memory: {call} failed ({name}); the model or the batch is too large "
                             "for the memory left on the device")


def check(result: tuple, call: str, *, kernel: str | None = None, last: LastLaunch | None = None) -> Any:
    """The values a cuda-python call returned after its CUresult (None, one value, or a tuple); the
    translated error when the CUresult is not CUDA_SUCCESS."""
    err, *values = result
    if int(err) != 0:
        raise translate(err, call, kernel=kernel, last=last)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _driver_library_reason(err: Exception) -> str:
    """Why cuda-python could not use the driver library, for the one-line error."""
    message = str(err)
    if "dlopen" in message and "libcuda" in message:
        return "no CUDA driver (libcuda.so.1 not found)"
    return f"no usable CUDA driver ({message})"


def open_device(index: int) -> tuple[Any, Any]:
    """The driver module and device `index` after cuInit; `DeviceUnavailable` saying why not."""
    driver = load_driver()
    try:
        result = driver.cuInit(0)
    except RuntimeError as err:  # cuda-python loads libcuda.so.1 at the first call
        raise DeviceUnavailable(DEVICE, _driver_library_reason(err)) from None
    check(result, "cuInit")
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        raise DeviceUnavailable(DEVICE, "no CUDA GPU (the driver finds no device)")
    if not 0 <= index < count:
        raise DeviceUnavailable(DEVICE, f"there is no CUDA device {index}: this machine has {count} "
                                        f"(ids 0 to {count - 1}; SEXPGPU_DEVICES picks one)")
    return driver, check(driver.cuDeviceGet(index), "cuDeviceGet")


def probe(index: int = 0) -> str | None:
    """None when device `index` can open with this driver; else why not, in one line."""
    try:
        open_device(index)
    except DeviceUnavailable as err:
        return err.reason
    except CudaToolchainMissing as err:
        return err.message
    return None


# --- the runtime ---------------------------------------------------------------------------------------------


class CudaStream(Stream):
    def __init__(self, runtime: CudaRuntime, cu_stream: Any) -> None:
        self.runtime = runtime
        self.cu = cu_stream
        self.handle = int(cu_stream)
        self._finalizer = weakref.finalize(self, runtime.driver.cuStreamDestroy, cu_stream)

    def synchronize(self) -> None:
        self.runtime._check(self.runtime.driver.cuStreamSynchronize(self.cu), "cuStreamSynchronize")

    def wait(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise DeviceError("a stream waiting for an event of another runtime")
        self.runtime._check(self.runtime.driver.cuStreamWaitEvent(self.cu, event.cu, 0), "cuStreamWaitEvent")


class CudaEvent(Event):
    def __init__(self, runtime: CudaRuntime, cu_event: Any) -> None:
        self.runtime = runtime
        self.cu = cu_event
        weakref.finalize(self, runtime.driver.cuEventDestroy, cu_event)

    def record(self, stream: Stream | None = None) -> None:
        self.runtime._check(self.runtime.driver.cuEventRecord(self.cu, self.runtime._stream(stream).cu), "cuEventRecord")

    def synchronize(self) -> None:
        self.runtime._check(self.runtime.driver.cuEventSynchronize(self.cu), "cuEventSynchronize")

    def elapsed_ms(self, start: Event) -> float:
        if not isinstance(start, CudaEvent):
            raise DeviceError("elapsed time between events of different runtimes")
        return float(self.runtime._check(self.runtime.driver.cuEventElapsedTime(start.cu, self.cu), "cuEventElapsedTime"))


class CudaGraph(CapturedGraph):
    """A captured CUDA graph and its executable instance."""

    def __init__(self, runtime: CudaRuntime, graph: Any, instance: Any, launches: list[LastLaunch]) -> None:
        super().__init__()
        self.runtime = runtime
        self.graph = graph
        self.instance = instance
        #: What a fault after a replay is blamed on: the graph's last kernel, saying it is the graph's.
        self.last = (LastLaunch(launches[-1].kernel, launches[-1].model_path, len(launches)) if launches
                     else None)

    def _launch(self, stream: Stream | None) -> None:
        if self.instance is None:
            raise CaptureError("launch of a captured graph that was closed")
        self.runtime._check(self.runtime.driver.cuGraphLaunch(self.instance, self.runtime._stream(stream).cu),
                            "cuGraphLaunch")
        if self.last is not None:
            self.runtime._last = self.last

    def close(self) -> None:
        if self.instance is not None:
            self.runtime._check(self.runtime.driver.cuGraphExecDestroy(self.instance), "cuGraphExecDestroy")
            self.runtime._check(self.runtime.driver.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.instance = self.graph = None


class CudaFunction:
    """A CUfunction and the dynamic shared memory it is currently allowed."""

    def __init__(self, cu_function: Any, dynamic_shared_limit: int) -> None:
        self.cu = cu_function
        self.dynamic_shared_limit = dynamic_shared_limit


class PinnedMemory:
    """Page-locked host memory from cuMemHostAlloc, seen by numpy through the array interface; freed
    (cuMemFreeHost) when the last array over it is gone."""

    def __init__(self, driver: Any, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
        weakref.finalize(self, driver.cuMemFreeHost, address)


class CudaRuntime(DeviceRuntime):
    """The device runtime on a GPU through cuda-python's driver API (see the module docstring)."""

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        # Every field a method reads is set before the first call that may read it (`stream` checks its
        # result through `_check`, which reads `_last`).
        self._allocations: dict[int, int] = {}
        self._last: LastLaunch | None = None
        self._captured: list[LastLaunch] = []
        self._cublas: CublasLt | None = None
        self._closed = False
        self.driver, self._device = open_device(index)
        d = self.driver
        self._context = check(d.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        attribute = d.CUdevice_attribute
        name = check(d.cuDeviceGetName(256, self._device), "cuDeviceGetName")
        capability = (check(d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._device),
                            "cuDeviceGetAttribute"),
                      check(d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._device),
                            "cuDeviceGetAttribute"))
        free, total = check(d.cuMemGetInfo(), "cuMemGetInfo")
        self.device = DeviceInfo(index, name.split(b"\0", 1)[0].decode(errors="replace"), total, free, capability,
                                 "cuda-python")
        self.compiler = NvrtcCompiler(self.device.arch)
        self.default_stream = self.stream()

    def _check(self, result: tuple, call: str, kernel: str | None = None) -> Any:
        return check(result, call, kernel=kernel, last=self._last)

    def _stream(self, stream: Stream | None) -> CudaStream:
        return stream or self.default_stream

    def make_current(self) -> None:
        self._check(self.driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    # memory ---------------------------------------------------------------------------------------

    def allocate(self, nbytes: int, what: str) -> DeviceSpan:
        self._check_not_capturing(f"allocating {what}")
        err, pointer = self.driver.cuMemAlloc(max(nbytes, 1))
        if result_name(err) == "CUDA_ERROR_OUT_OF_MEMORY":
            raise DeviceOutOfMemory(what, nbytes, self.memory_info()[0], f"on {self.device.name}")
        self._check((err,), "cuMemAlloc")
        span = DeviceSpan(int(pointer), nbytes)
        self._allocations[span.address] = nbytes
        return span

    def free(self, span: DeviceSpan) -> None:
        self._check_not_capturing("freeing device memory")
        if self._allocations.pop(span.address, None) is None:
            raise DeviceError(f"free of {span.address:#x}, which allocate did not return")
        self._check(self.driver.cuMemFree(span.address), "cuMemFree")

    def memory_info(self) -> tuple[int, int]:
        return self._check(self.driver.cuMemGetInfo(), "cuMemGetInfo")

    def _pinned_block(self, nbytes: int) -> np.ndarray:
        address = self._check(self.driver.cuMemHostAlloc(nbytes, self.driver.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc")
        return np.asarray(PinnedMemory(self.driver, int(address), nbytes))

    # transfers ------------------------------------------------------------------------------------

    def upload(self, dst: DeviceSpan | int, host: np.ndarray, stream: Stream | None = None) -> None:
        host = np.ascontiguousarray(host)
        self._check_capturable_host(host, stream, "an upload")
        check_fits(dst, host.nbytes, "upload")
        if host.nbytes:
            self._check(self.driver.cuMemcpyHtoDAsync(int(dst), host.ctypes.data, host.nbytes, self._stream(stream).cu),
                        "cuMemcpyHtoDAsync")

    def download(self, src: DeviceSpan | int, dtype: Any, shape: int | Sequence[int],
                 stream: Stream | None = None) -> np.ndarray:
        self._check_not_capturing("a download (it waits for the device)")
        out = np.empty(shape, dtype)
        check_fits(src, out.nbytes, "download")
        if out.nbytes:
            self._check(self.driver.cuMemcpyDtoHAsync(out.ctypes.data, int(src), out.nbytes, self._stream(stream).cu),
                        "cuMemcpyDtoHAsync")
        self._stream(stream).synchronize()
        return out

    def download_async(self, src: DeviceSpan | int, out: np.ndarray, stream: Stream | None = None) -> None:
        if not out.flags.c_contiguous:
            raise ValueError("download_async writes into a contiguous (pinned) array")
        self._check_capturable_host(out, stream, "a download")
        check_fits(src, out.nbytes, "download")
        if out.nbytes:
            self._check(self.driver.cuMemcpyDtoHAsync(out.ctypes.data, int(src), out.nbytes, self._stream(stream).cu),
                        "cuMemcpyDtoHAsync")

    def copy(self, dst: DeviceSpan | int, src: DeviceSpan | int, nbytes: int, stream: Stream | None = None) -> None:
        if nbytes:
            self._check(self.driver.cuMemcpyDtoDAsync(int(dst), int(src), nbytes, self._stream(stream).cu),
                        "cuMemcpyDtoDAsync")

    def memset(self, dst: DeviceSpan | int, byte: int, nbytes: int, stream: Stream | None = None) -> None:
        if nbytes:
            self._check(self.driver.cuMemsetD8Async(int(dst), byte & 0xFF, nbytes, self._stream(stream).cu),
                        "cuMemsetD8Async")

    # code -----------------------------------------------------------------------------------------

    def load_module(self, source: KernelSource) -> LoadedModule:
        d = self.driver
        image = self.binary(source).image
        module = self._check(d.cuModuleLoadData(image), f"cuModuleLoadData ({source.name}, {self.device.arch})")
        kernels = {}
        for name, params in declared_kernels(source.source).items():
            function = self._check(d.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction ({name})", name)
            self._check_parameters(name, function, params)
            limit = self._check(d.cuFuncGetAttribute(
                d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, function), "cuFuncGetAttribute", name)
            kernels[name] = Kernel(name, params, CudaFunction(function, limit))
        return LoadedModule(source.name, kernels, module)

    def _check_parameters(self, name: str, function: Any, params: tuple[ParamType, ...]) -> None:
        """The sizes the CUBIN gives the parameters must be those the source's declarations gave them."""
        get_info = self.driver.cuFuncGetParamInfo
        try:
            sizes = [self._check(get_info(function, i), "cuFuncGetParamInfo", name)[1] for i in range(len(params))]
            extra, _, _ = get_info(function, len(params))
        except RuntimeError:  # a driver older than 12.4 has no cuFuncGetParamInfo
            return
        for param, size in zip(params, sizes):
            if size != param.size:
                raise KernelLaunchError(name, f"parameter {param.declared} {param.name} is {size} bytes in the "
                                              f"CUBIN but {param.size} as the runtime reads its declaration")
        if int(extra) == 0:
            raise KernelLaunchError(name, f"the CUBIN's kernel takes more than the {len(params)} parameters "
                                          "its source declares")

    def launch(self, kernel: Kernel, grid: Dim3, block: Dim3, shared_bytes: int = 0, args: Sequence = (),
               stream: Stream | None = None) -> None:
        function: CudaFunction = kernel.handle
        grid3, block3 = dim3(grid, "grid", kernel.name), dim3(block, "block", kernel.name)
        d = self.driver
        if shared_bytes > function.dynamic_shared_limit:
            self._check(d.cuFuncSetAttribute(function.cu, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             shared_bytes), "cuFuncSetAttribute", kernel.name)
            function.dynamic_shared_limit = shared_bytes
        # `packed` owns the argument values and the pointer array; it lives until the call returns, by
        # which time the driver has copied the values (into the graph, when capturing).
        packed = pack_arguments(kernel, args)
        launched = LastLaunch(kernel.name, self.launch_path)
        if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":  # the launch waits, so reports this kernel's own fault
            self._last = launched
        result = d.cuLaunchKernel(function.cu, *grid3, *block3, shared_bytes, self._stream(stream).cu,
                                  packed.address, 0)
        self._check(result, "cuLaunchKernel", kernel.name)
        self._last = launched
        if self._captures:
            self._captured.append(launched)

    def gemm(self, spec: GemmSpec, a: DeviceSpan | int, b: DeviceSpan | int, d: DeviceSpan | int,
             c: DeviceSpan | int | None = None, bias: DeviceSpan | int | None = None, alpha: float = 1.0,
             beta: float = 0.0, stream: Stream | None = None) -> None:
        if self._cublas is None:
            self._check_not_capturing("the first GEMM (it creates cuBLASLt's handle and workspace)")
            workspace = self.allocate(WORKSPACE_BYTES, "cuBLASLt's workspace")
            self._cublas = CublasLt(workspace.address, WORKSPACE_BYTES)
        self._cublas.matmul(spec, int(a), int(b), int(d), None if c is None else int(c),
                            None if bias is None else int(bias), alpha, beta, stream=self._stream(stream).handle)

    # ordering -------------------------------------------------------------------------------------

    def stream(self) -> Stream:
        d = self.driver
        return CudaStream(self, self._check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))

    def event(self) -> Event:
        d = self.driver
        return CudaEvent(self, self._check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate"))

    # capture --------------------------------------------------------------------------------------

    def _begin_capture(self, stream: Stream) -> None:
        # Thread-local: only this thread's unsafe calls (allocations, synchronizations) break the capture.
        mode = self.driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check(self.driver.cuStreamBeginCapture(self._stream(stream).cu, mode), "cuStreamBeginCapture")
        self._captured = []

    def _end_capture(self, stream: Stream) -> CapturedGraph:
        launches, self._captured = self._captured, []
        graph = self._check(self.driver.cuStreamEndCapture(self._stream(stream).cu), "cuStreamEndCapture")
        instance = self._check(self.driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return CudaGraph(self, graph, instance, launches)

    # lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:  # after a kernel's fault the context is unusable, but it is still ours to release
            if self._cublas is not None:
                self._cublas.close()
            for address in self._allocations:
                self.driver.cuMemFree(address)
            self._allocations.clear()
            self.default_stream._finalizer()
            self.driver.cuDevicePrimaryCtxRelease(self._device)
