"""A GPU behind the calls the kernel harnesses make of the simulator, so the same cases prove both.

The kernel-family tests (test_cuda_kernels.py) and the lowering harness
(cuda_lowering_harness.py) drive cuda-sim's `SimDevice` directly: compile,
upload, alloc, launch, compare_schedules, download, free, check_canaries.
`GpuDevice` answers the same calls on a GPU through the device runtime
(`open_runtime("cuda")`: cuda-python's driver API, or PyCUDA where
`SEXPGPU_CUDA_DRIVER=pycuda`), with the same inputs and tolerances:

- `compile` loads the translation unit compiled by NVRTC for the device's
  architecture;
- a new allocation is filled with 0xFF bytes (NaN as f32 and bf16, -1 as an
  integer), so an output element no kernel writes fails the comparison, as the
  simulator's poison pattern makes it fail there;
- `compare_schedules` launches once: the two schedules stand in for the
  hardware's, which runs its own;
- every launch is followed by a synchronize, so a kernel's fault is reported
  at that kernel (a fault ends the context: the device check runs these tests
  in a process of their own).

`GPU` marks a test or a fixture parameter that needs the GPU: `gpu`, and skipped
with the probe's reason where there is none.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sexpgpu.backends.cuda.runtime import DeviceRuntime, DeviceSpan, Kernel, KernelSource, LoadedModule
from sexpgpu.backends.cuda.selection import open_runtime, runtime_unavailable

GPU_REASON = runtime_unavailable("cuda")
GPU = [pytest.mark.gpu, pytest.mark.skipif(GPU_REASON is not None, reason=f"no GPU: {GPU_REASON}")]
#: The byte fresh allocations are filled with.
POISON = 0xFF


class GpuModule:
    """A loaded module, kernels by name as `SimModule.kernel` gives them."""

    def __init__(self, loaded: LoadedModule) -> None:
        self.loaded = loaded

    def kernel(self, name: str) -> Kernel:
        return self.loaded.function(name)


class GpuDevice:
    """`SimDevice`'s calls on a GPU (see the module docstring)."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime

    @classmethod
    def open(cls) -> GpuDevice:
        return cls(open_runtime("cuda"))

    def compile(self, source: str, filename: str = "kernels.cu") -> GpuModule:
        return GpuModule(self.runtime.load_module(KernelSource(Path(filename).stem, source)))

    def alloc(self, nbytes: int, name: str | None = None) -> DeviceSpan:
        span = self.runtime.allocate(nbytes, name or "a test buffer")
        if nbytes:
            self.runtime.memset(span, POISON, nbytes)
        return span

    def upload(self, array: np.ndarray, name: str | None = None) -> DeviceSpan:
        data = np.ascontiguousarray(array)
        span = self.runtime.allocate(data.nbytes, name or "a test buffer")
        self.runtime.upload(span, data)
        return span

    def download(self, span: DeviceSpan, dtype: Any = np.uint8, shape: int | Sequence[int] | None = None) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.runtime.download(span, dtype, span.nbytes // dtype.itemsize if shape is None else shape)

    def free(self, span: DeviceSpan) -> None:
        self.runtime.synchronize()
        self.runtime.free(span)

    def launch(self, kernel: Kernel, grid: Any, block: Any, shared_bytes: int = 0, args: Sequence = ()) -> None:
        self.runtime.launch(kernel, grid, block, shared_bytes, args)
        self.runtime.synchronize()

    def compare_schedules(self, kernel: Kernel, grid: Any, block: Any, shared_bytes: int = 0, args: Sequence = (),
                          *, buffers: Sequence[DeviceSpan] | None = None) -> None:
        self.launch(kernel, grid, block, shared_bytes, args)

    def check_canaries(self) -> None:
        """A GPU has no canaries; waiting for it reports a fault of the last launch."""
        self.runtime.synchronize()

    def close(self) -> None:
        self.runtime.close()


@functools.cache
def shared_gpu() -> GpuDevice:
    """One GPU device for a whole pytest session (the plugin below)."""
    return GpuDevice.open()


@pytest.fixture(name="device", scope="module", params=["cuda-sim", pytest.param("cuda", marks=GPU)])
def sim_or_gpu_device(request: pytest.FixtureRequest) -> Any:
    """The kernel tests' `device`: cuda-sim everywhere, and the GPU where there is one (marked `gpu`)."""
    if request.param == "cuda-sim":
        from sexpgpu.backends.cuda.sim import SimDevice

        yield SimDevice()
        return
    gpu = GpuDevice.open()
    yield gpu
    gpu.close()


def pytest_configure(config: pytest.Config) -> None:
    """`pytest -p gpu_device`: the lowering harness's runner (cuda_lowering_harness.SimRunner) launches its
    kernels on the GPU instead of cuda-sim. The device check runs test_cuda_lowering.py's cuda-sim tests
    so: every kernel of the lowered examples and lit graphs against the interpreter, on the GPU."""
    import cuda_lowering_harness

    construct = cuda_lowering_harness.SimRunner.__init__

    def on_the_gpu(self: Any, module: Any, device: Any = None) -> None:
        construct(self, module, device if device is not None else shared_gpu())

    cuda_lowering_harness.SimRunner.__init__ = on_the_gpu
