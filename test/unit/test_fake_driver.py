"""The real `CudaRuntime`, the CUDA executor, its executables, capture and cuBLASLt's call sequence, run over a
recording fake of cuda-python's driver module and of libcublasLt (`fake_cuda_driver.py`), so the code only a
GPU runs is exercised on every submission: opening, allocating, uploading, launching NVRTC-compiled
kernels, GEMMs, capturing and replaying, downloading, closing, and whole training steps of
`examples/gpt.sx --variant smoke`. The fake enforces what a GPU enforces and cuda-sim does not (capture
rules, host buffers of asynchronous copies, aligned kernel arguments); every test ends with no breach.

A kernel cannot run on the fake: launches are recorded with their decoded arguments, so a training step's
values are whatever the copies and memsets left (zeros); what is checked is the calls and their order.
"""

from __future__ import annotations

import io
from pathlib import Path

import fake_cuda_driver
import numpy as np
import pytest
from fake_cuda_driver import R, check_signature
from sexpgpu.backends.cuda import driver_cuda
from sexpgpu.backends.cuda.cublaslt import GemmSpec
from sexpgpu.backends.cuda.executor import CudaExecutor
from sexpgpu.backends.cuda.nvrtc import compile_cubin
from sexpgpu.backends.cuda.runtime import (
    CaptureError,
    DeviceOutOfMemory,
    DeviceScalars,
    KernelLaunchError,
    KernelSource,
    PinnedStaging,
    check_alignment,
)
from sexpgpu.backends.training import Trainer, TrainingPlan
from sexpgpu.tools.common import guarded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

KERNELS = r"""
extern "C" __global__ void scale(float* __restrict__ y, const float* __restrict__ x, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i];
}
extern "C" __global__ void fill4(float4* out, float value, int groups) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < groups) out[i] = make_float4(value, value, value, value);
}
"""
#: The alignment each test kernel's accesses assume (fill4 stores 16 bytes at a time).
ALIGNMENTS = {"scale": 4, "fill4": 16}
#: Calls a capture must not contain (they wait, allocate, free, or touch pageable host memory).
UNSAFE = {"cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemFreeHost", "cuStreamSynchronize", "cuEventSynchronize",
          "cuCtxSynchronize", "cuModuleLoadData"}


@pytest.fixture
def fake(monkeypatch):
    driver = fake_cuda_driver.install(monkeypatch, kernel_alignment=lambda name: ALIGNMENTS.get(name, 4))
    yield driver
    assert driver.violations == []


@pytest.fixture(scope="module")
def cubin():
    return compile_cubin(KERNELS, "sm_90", name="fake_driver_tests")


def loaded(runtime, cubin):
    return runtime.load_module(KernelSource("fake_driver_tests", KERNELS, cubin))


def capture_windows(names: list[str]) -> list[list[str]]:
    """The calls between each cuStreamBeginCapture and its cuStreamEndCapture."""
    windows, current = [], None
    for name in names:
        if name == "cuStreamBeginCapture":
            current = []
        elif name == "cuStreamEndCapture":
            windows.append(current)
            current = None
        elif current is not None:
            current.append(name)
    return windows


# --- the fake itself ------------------------------------------------------------------------------------


def test_signatures_are_cuda_pythons():
    check_signature("cuMemAlloc", (256,))
    check_signature("cuMemcpyHtoDAsync", (0x7F0000000000, 0x1000, 16, fake_cuda_driver.REAL.CUstream(0x10)))
    for name, args, message in [
        ("cuMemAlloc", (256.0,), "bytesize must be a size_t"),
        ("cuMemAlloc", (-1,), "bytesize must be a size_t"),
        ("cuModuleGetFunction", (fake_cuda_driver.REAL.CUmodule(1), "scale"), "name must be bytes"),
        ("cuStreamSynchronize", (16,), "hStream must be CUstream"),
        ("cuStreamBeginCapture", (fake_cuda_driver.REAL.CUstream(1), 1), "mode must be CUstreamCaptureMode"),
        ("cuLaunchKernel", (fake_cuda_driver.REAL.CUfunction(1), 1.5, 1, 1, 1, 1, 1, 0,
                            fake_cuda_driver.REAL.CUstream(1), 0, 0), "gridDimX must be a unsigned int"),
        ("cuMemGetInfo", (1,), "takes 0 arguments, not 1"),
    ]:
        with pytest.raises(TypeError, match=message):
            check_signature(name, args)


def test_the_fake_catches_what_a_gpu_refuses(monkeypatch):
    fake = fake_cuda_driver.install(monkeypatch)
    d = driver_cuda.load_driver()
    _, stream = d.cuStreamCreate(0)
    _, device = d.cuMemAlloc(1024)
    _, host = d.cuMemHostAlloc(1024, 0)
    pinned = (np.ctypeslib.as_array((fake_cuda_driver.ctypes.c_uint8 * 1024).from_address(host)))
    d.cuMemcpyHtoDAsync(int(device), host, 1024, stream)
    pinned[0] = 7  # before the copy is known to have run
    d.cuStreamSynchronize(stream)
    assert fake.violations[-1].startswith("the host buffer of cuMemcpyHtoDAsync")
    mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    d.cuStreamBeginCapture(stream, mode)
    assert d.cuMemAlloc(16)[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert d.cuStreamEndCapture(stream)[0] == R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    page = np.zeros(16, np.uint8)
    d.cuStreamBeginCapture(stream, mode)
    assert d.cuMemcpyHtoDAsync(int(device), page.ctypes.data, 16, stream)[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    d.cuStreamEndCapture(stream)
    assert d.cuMemcpyDtoDAsync(int(device) + 1000, int(device), 100, stream)[0] == R.CUDA_ERROR_INVALID_VALUE
    assert [v.split(" ")[0] for v in fake.violations[1:]] == ["cuMemAlloc", "cuMemcpyHtoDAsync", "cuMemcpyDtoDAsync:"]


# --- the runtime ----------------------------------------------------------------------------------------


def test_open_allocate_upload_launch_gemm_capture_replay_download_close(fake, cubin):
    runtime = driver_cuda.CudaRuntime(0)
    assert runtime.device.describe().startswith("NVIDIA H200 (device 0, sm_90, 141.00 GiB")
    module = loaded(runtime, cubin)
    arena = runtime.arena(1 << 20, "the test arena")
    x, y = arena.allocate(4096, "x"), arena.allocate(4096, "y")
    data = np.arange(1024, dtype=np.float32)
    runtime.upload(x, data)
    runtime.launch(module.function("scale"), 4, 256, 0, (y, x, 2.0, 1024))
    launch = fake.launches()[-1]
    assert (launch.kernel, launch.values[:2], launch.values[3]) == ("scale", (y.address, x.address), 1024)
    runtime.copy(y, x, 4096)
    np.testing.assert_array_equal(runtime.download(y, np.float32, 1024), data)  # the fake keeps device bytes
    spec = GemmSpec(m=16, n=32, k=8, epilogue="bias")
    a, b, d, bias = (arena.allocate(n * 4, name) for n, name in ((16 * 8, "a"), (8 * 32, "b"), (16 * 32, "d"),
                                                                  (32, "bias")))
    runtime.gemm(spec, a, b, d, bias=bias)
    scalars = DeviceScalars(runtime, arena, {"a": np.float32})
    with runtime.capture() as captured:
        scalars.update()
        runtime.launch(module.function("scale"), 4, 256, 0, (y, x, 3.0, 1024))
        runtime.gemm(spec, a, b, d, bias=bias)
    for step in range(3):
        scalars.set(a=float(step))
        captured.graph.launch()
    runtime.synchronize()
    captured.graph.close()
    runtime.close()
    names = fake.names()
    assert names[:4] == ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert names[-1] == "cuDevicePrimaryCtxRelease" and fake.primary_retained == 0
    assert fake.allocations == {}
    [window] = capture_windows(names)
    assert window == ["cuMemcpyHtoDAsync", "cuLaunchKernel", "cublasLtMatmulDescSetAttribute", "cublasLtMatmul"]
    assert names.count("cuGraphLaunch") == 3
    heuristic = names.index("cublasLtMatmulAlgoGetHeuristic")
    assert names.index("cublasLtCreate") < heuristic < names.index("cublasLtMatmul")
    assert [c.name for c in fake.calls if c.name.startswith("cublasLt") and "Destroy" in c.name][-1] == "cublasLtDestroy"


def test_async_uploads_and_device_scalars_keep_their_host_buffers_until_the_device_read_them(fake):
    runtime = driver_cuda.CudaRuntime(0)
    arena = runtime.arena(1 << 20, "arena")
    staging = PinnedStaging(runtime, 4096)
    target = arena.allocate(4096, "batch")
    for value in range(6):  # more uploads than staging buffers: each reuse waits for the copy that read it
        staging.upload(target, np.full(1024, value, np.float32))
    scalars = DeviceScalars(runtime, arena, {"step": np.int32})
    with runtime.capture() as captured:
        scalars.update()
    for step in range(4):  # set waits for the replay whose copy reads the mirror
        scalars.set(step=step)
        captured.graph.launch()
    np.testing.assert_array_equal(runtime.download(target, np.float32, 1024), np.full(1024, 5, np.float32))
    assert runtime.download(scalars.span, np.int32, 1)[0] == 3
    runtime.close()


def test_a_misaligned_kernel_argument_is_refused_where_it_is_bound_and_caught_by_the_fake(monkeypatch, cubin):
    fake = fake_cuda_driver.install(monkeypatch, kernel_alignment=ALIGNMENTS.get)
    runtime = driver_cuda.CudaRuntime(0)
    fill4 = loaded(runtime, cubin).function("fill4")
    block = runtime.allocate(4096, "out")
    with pytest.raises(KernelLaunchError, match=r"kernel fill4 \(model path model.head\): argument 1 \(float4\* out\) "
                                                r"is 0x[0-9a-f]+, not 16-byte aligned"):
        check_alignment(fill4, (block.address + 4, 1.0, 8), 16, "model.head")
    runtime.launch(fill4, 1, 32, 0, (block.address + 4, 1.0, 8))  # what the check keeps from the device
    assert fake.violations == [f"argument 1 of fill4 is {block.address + 4:#x}, not 16-byte aligned"]
    runtime.close()


def test_stream_capture_refuses_what_cuda_refuses_before_the_driver_sees_it(fake):
    runtime = driver_cuda.CudaRuntime(0)
    with pytest.raises(CaptureError, match="allocating x is not allowed while a stream is capturing"):
        with runtime.capture():
            runtime.allocate(16, "x")
    target = runtime.allocate(16, "y")
    with pytest.raises(CaptureError, match="an upload inside capture must use pinned host memory"):
        with runtime.capture():
            runtime.upload(target, np.zeros(4, np.float32))
    runtime.close()


# --- errors as the user sees them ----------------------------------------------------------------------


def call_after_the_fault(kind: str, runtime, module, block) -> None:
    if kind == "launch":
        runtime.launch(module.function("fill4"), 1, 256, 0, (block, 0.0, 256))
    elif kind == "copy":
        runtime.copy(block, block, 16)
    elif kind == "download":
        runtime.download(block, np.float32, 4)
    elif kind == "synchronize":
        runtime.synchronize()
    else:
        runtime.event().record()


def test_a_kernels_fault_names_that_kernel_whichever_call_reports_it(fake, cubin):
    """The driver reports a fault at the next call, whatever it is; every call after returns it too."""
    for next_call in ("launch", "copy", "download", "synchronize", "event"):
        runtime = driver_cuda.CudaRuntime(0)
        module = loaded(runtime, cubin)
        block = runtime.allocate(4096, "block")
        runtime.launch_path = "model.blocks.0.mlp"
        fake.fault("scale")
        runtime.launch(module.function("scale"), 4, 256, 0, (block, block, 2.0, 1024))
        runtime.launch_path = "model.head"
        with pytest.raises(KernelLaunchError) as raised:
            call_after_the_fault(next_call, runtime, module, block)
        assert str(raised.value).startswith("kernel scale (model path model.blocks.0.mlp): ")
        assert "failed: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered); a kernel's fault is " \
               "reported by whatever call comes next, and this is the last kernel launched" in str(raised.value)
        with pytest.raises(KernelLaunchError, match="kernel scale"):
            runtime.close()  # its wait reports the fault again; what it holds is released all the same
        assert fake.names()[-1] == "cuDevicePrimaryCtxRelease"
        fake.sticky = None


@pytest.mark.parametrize(("call", "kind", "line"), [
    ("cuMemAlloc", DeviceOutOfMemory, "error: out of device memory: the test block needs 4.00 KiB (4096 bytes), but "
                                      "only 141.00 GiB (151397597184 bytes) are free on NVIDIA H200"),
    ("cuModuleLoadData", driver_cuda.DriverOutOfMemory,
     "error: out of device memory: cuModuleLoadData (fake_driver_tests, sm_90) failed (CUDA_ERROR_OUT_OF_MEMORY); "
     "the model or the batch is too large for the memory left on the device"),
    ("cuMemHostAlloc", driver_cuda.DriverOutOfMemory,
     "error: out of page-locked host memory: cuMemHostAlloc failed (CUDA_ERROR_OUT_OF_MEMORY)"),
    ("cuGraphInstantiate", driver_cuda.DriverOutOfMemory,
     "error: out of device memory: cuGraphInstantiate failed (CUDA_ERROR_OUT_OF_MEMORY); the model or the batch is "
     "too large for the memory left on the device"),
    ("cuStreamCreate", driver_cuda.DriverOutOfMemory,
     "error: out of device memory: cuStreamCreate failed (CUDA_ERROR_OUT_OF_MEMORY); the model or the batch is too "
     "large for the memory left on the device"),
], ids=["cuMemAlloc", "cuModuleLoadData", "cuMemHostAlloc", "cuGraphInstantiate", "cuStreamCreate"])
def test_out_of_memory_at_each_call_site_is_one_user_error_line(fake, cubin, capsys, call, kind, line):
    runtime = driver_cuda.CudaRuntime(0)
    fake.fail(call, R.CUDA_ERROR_OUT_OF_MEMORY)

    def work():
        loaded(runtime, cubin)
        runtime.allocate(4096, "the test block")
        runtime.pinned(16, np.uint8)
        runtime.stream()
        with runtime.capture():
            pass

    with pytest.raises(kind):
        work()
    fake.fail(call, R.CUDA_ERROR_OUT_OF_MEMORY)
    assert guarded(work) == 1
    assert capsys.readouterr().err.splitlines() == [line]
    runtime.close()


def test_the_first_fix_runtime_opens_at_all(fake):
    """`CudaRuntime.__init__` creates its stream through `_check`, which reads fields set in `__init__`: they must
    be set before (an AttributeError here, on every GPU, was the first defect)."""
    runtime = driver_cuda.CudaRuntime(0)
    assert fake.names().count("cuStreamCreate") == 1
    runtime.close()


# --- a training step through the real runtime -----------------------------------------------------------


def record_alignments(monkeypatch, fake) -> None:
    """Let the fake check each kernel's arguments against the alignment emit-cuda recorded for it, in every
    module the executor lowers (the experiment's, and the driver's flat update and clip graphs)."""
    alignments: dict[str, int] = {}
    lower = CudaExecutor._lower

    def recording(self, module, name):
        lowered = lower(self, module, name)
        for op in lowered.module.body.ops:
            if op.name == "kern.kernel":
                alignments[op.attributes["function"]] = int(op.attributes["alignment"])
        return lowered

    monkeypatch.setattr(CudaExecutor, "_lower", recording)
    fake.kernel_alignment = alignments.__getitem__


def test_training_steps_of_the_spec_gpt_through_the_real_runtime(fake, monkeypatch, tmp_path):
    """examples/gpt.sx --variant smoke, 12 steps: every graph lowered, NVRTC-compiled for sm_90, loaded, its
    kernels launched and GEMMs run through CudaRuntime and CublasLt over the fakes, captured after ten calls
    and replayed, the parameters read back at the end; the calls obey the capture and lifetime rules."""
    record_alignments(monkeypatch, fake)
    runtime = driver_cuda.CudaRuntime(0)
    executor = CudaExecutor("cuda", runtime=runtime)
    plan = TrainingPlan.compile(str(EXAMPLES / "gpt.sx"), "smoke", {"steps": 12})
    trainer = Trainer(plan, tmp_path / "run", None, io.StringIO(), False, executor)
    result = trainer.run()
    assert result.status == "done" and result.step == 12
    names = fake.names()
    windows = capture_windows(names)
    assert windows, "no graph was captured"
    for window in windows:
        assert not UNSAFE & set(window), window
        assert {"cuLaunchKernel", "cublasLtMatmul"} <= set(window)
    assert names.count("cuGraphLaunch") >= 2
    assert names.count("cuModuleLoadData") >= 1
    assert len(fake.launches()) > 100
    # Every call succeeded but the one probe per kernel past its last parameter (the runtime's check that the
    # CUBIN's kernel takes no more parameters than its source declares).
    failed = [c for c in fake.calls if c.result != fake_cuda_driver.SUCCESS]
    assert {c.name for c in failed} == {"cuFuncGetParamInfo"}
    assert all(c.args[1] == len(fake.functions[int(c.args[0])][1]) for c in failed)
    runtime.close()
    assert fake.names()[-1] == "cuDevicePrimaryCtxRelease"
