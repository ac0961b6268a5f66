"""The device runtime: one interface, three drivers.

Most tests take the `runtime` fixture, which is `cuda-sim` everywhere and, on a machine with a GPU,
also `cuda` (cuda-python's driver API; marked `gpu`, skipped where there is no GPU): the same
assertions prove the simulator and the GPU. The kernels are written here, in the style `emit-cuda`
generates; on `cuda` they are compiled by NVRTC. Without a GPU, the `cuda` driver's pure parts are
tested directly (argument packing, CUresult translation, opening without a driver), and so is the
PyCUDA driver's selection when pycuda is absent.
"""

from __future__ import annotations

import ctypes
import enum
import struct
import subprocess
import sys
import textwrap
import time
import types

import ml_dtypes
import numpy as np
import pytest
from fake_cuda_driver import cubin_parameters
from sexpgpu.backends.cuda import driver_cuda, driver_pycuda, selection
from sexpgpu.backends.cuda.cublaslt import GemmSpec
from sexpgpu.backends.cuda.driver_sim import SimRuntime
from sexpgpu.backends.cuda.runtime import (
    ALIGNMENT,
    CaptureError,
    DeviceError,
    DeviceOutOfMemory,
    DeviceScalars,
    DeviceSpan,
    DeviceUnavailable,
    Kernel,
    KernelLaunchError,
    KernelSource,
    PinnedStaging,
    declared_kernels,
    pack_arguments,
    param_type,
)
from sexpgpu.backends.cuda.selection import open_runtime, runtime_unavailable
from sexpgpu.tools.common import guarded

KERNELS = r"""
#ifndef SEXPGPU_SIM
#include <cuda_bf16.h>
#endif

// y = a * x + b over n elements (a grid-stride loop).
extern "C" __global__ void affine(float* __restrict__ y, const float* __restrict__ x, float a, float b, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i] + b;
}

// One SGD step whose learning rate and step number are device scalars: w -= lr * step * g.
extern "C" __global__ void sgd_step(float* w, const float* g, const float* lr, const int* step, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] -= lr[0] * (float)step[0] * g[i];
}

// bf16 storage, f32 math.
extern "C" __global__ void scale_bf16(__nv_bfloat16* out, const __nv_bfloat16* x, __nv_bfloat16 s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(__bfloat162float(x[i]) * __bfloat162float(s));
}

// Every kind of scalar the runtime passes, written back as doubles.
extern "C" __global__ void scalars(double* out, signed char c, unsigned char uc, short s, unsigned short us, int i,
                                   unsigned u, long long ll, unsigned long long ull, float f, double d,
                                   __nv_bfloat16 h) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = c; out[1] = uc; out[2] = s; out[3] = us; out[4] = i; out[5] = u;
        out[6] = (double)ll; out[7] = (double)ull; out[8] = f; out[9] = d; out[10] = __bfloat162float(h);
    }
}

// Each block reverses its slice of `per_block` floats through dynamic shared memory.
extern "C" __global__ void reverse_blocks(float* out, const float* x, int per_block) {
    extern __shared__ float tile[];
    const float* in = x + (long long)blockIdx.x * per_block;
    for (int i = threadIdx.x; i < per_block; i += blockDim.x) tile[i] = in[i];
    __syncthreads();
    for (int i = threadIdx.x; i < per_block; i += blockDim.x)
        out[(long long)blockIdx.x * per_block + i] = tile[per_block - 1 - i];
}

// A write one element past the end of `out`.
extern "C" __global__ void write_past(float* out, int n) {
    if (threadIdx.x == 0) out[n] = 1.0f;
}
"""

CUDA_REASON = driver_cuda.probe(0)
GPU = [pytest.mark.gpu, pytest.mark.skipif(CUDA_REASON is not None, reason=f"no GPU: {CUDA_REASON}")]
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sexpgpu-cache")


@pytest.fixture(scope="module", params=["cuda-sim", pytest.param("cuda", marks=GPU)])
def runtime(request, cache_dir):
    opened = SimRuntime(memory_bytes=256 << 20, cache_dir=cache_dir) if request.param == "cuda-sim" \
        else driver_cuda.CudaRuntime(0)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def module(runtime):
    return runtime.load_module(KernelSource("runtime_tests", KERNELS))


@pytest.fixture
def arena(runtime):
    made = runtime.arena(16 << 20, "the test arena")
    yield made
    runtime.synchronize()
    made.release()


def put(runtime, arena, array, what="x"):
    span = arena.allocate(array.nbytes, what)
    runtime.upload(span, array)
    return span


def get(runtime, span, like):
    return runtime.download(span, like.dtype, like.shape)


# --- the arena --------------------------------------------------------------------------------------


def test_arena_pieces_are_aligned_and_packed(runtime, arena):
    assert arena.base % ALIGNMENT == 0
    sizes = [1, 255, 256, 257, 0, 4096]
    spans = [arena.allocate(n, f"piece {i}") for i, n in enumerate(sizes)]
    assert [s.address - arena.base for s in spans] == [0, 256, 512, 768, 1280, 1280]
    assert all(s.address % ALIGNMENT == 0 for s in spans)
    assert [s.nbytes for s in spans] == sizes
    assert arena.used == 1280 + 4096
    assert arena.at(512, 256) == spans[2]
    assert arena.offset_of(spans[3]) == 768
    with pytest.raises(ValueError, match="outside a span"):
        arena.at(arena.capacity - 4, 8)
    arena.reset()
    assert arena.allocate(8, "again").address == arena.base


def test_a_full_arena_says_what_asked_for_how_much(runtime):
    small = runtime.arena(1000, "the activation arena of graph train")
    assert small.capacity == 1024
    small.allocate(600, "logits")
    with pytest.raises(DeviceOutOfMemory) as full:
        small.allocate(512, "probabilities")
    assert (full.value.requested, full.value.available) == (512, 1024 - 768)
    assert str(full.value) == ("out of device memory: probabilities needs 512 B (512 bytes), but only 256 B "
                               "(256 bytes) are free in the activation arena of graph train of 1.0 KiB")
    small.release()


def test_a_device_out_of_memory_is_a_one_line_user_error(cache_dir, capsys):
    runtime = SimRuntime(memory_bytes=64 << 20, cache_dir=cache_dir)
    runtime.arena(40 << 20, "the persistent arena")

    def too_much() -> int:
        runtime.arena(30 << 20, "the activation arena of graph train")
        return 0

    assert guarded(too_much) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line == ("error: out of device memory: the activation arena of graph train needs 30.0 MiB (31457280 "
                    "bytes), but only 24.0 MiB (25165824 bytes) are free on cuda-sim (a simulated CUDA device "
                    "on the host CPU)")
    assert runtime.memory_info() == (24 << 20, 64 << 20)
    runtime.close()


# --- transfers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32], ids=["f32", "bf16", "i32"])
def test_uploads_and_downloads_round_trip(runtime, arena, dtype):
    rng = np.random.default_rng(1)
    host = (rng.standard_normal((37, 5)) * 1000).astype(dtype)
    span = put(runtime, arena, host)
    np.testing.assert_array_equal(get(runtime, span, host), host)
    # through pinned staging (batches), and back into a pinned buffer
    staging = PinnedStaging(runtime, host.nbytes, slots=2)
    other = arena.allocate(host.nbytes, "y")
    for scale in (1, 2, 3):  # more uploads than slots: each slot is reused after its copy ran
        staging.upload(other, (host * scale).astype(dtype))
        pinned = runtime.pinned(host.shape, dtype)
        assert runtime.is_pinned(pinned) and not runtime.is_pinned(host)
        runtime.download_async(other, pinned)
        done = runtime.event()
        done.record()
        done.synchronize()
        np.testing.assert_array_equal(pinned, (host * scale).astype(dtype))


def test_copy_and_memset(runtime, arena):
    host = np.arange(64, dtype=np.float32)
    source = put(runtime, arena, host)
    target = arena.allocate(host.nbytes, "target")
    runtime.memset(target, 0, host.nbytes)
    runtime.copy(target.at(16, 64), source.at(0, 64), 64)
    expected = np.zeros_like(host)
    expected[4:20] = host[:16]
    np.testing.assert_array_equal(get(runtime, target, host), expected)
    runtime.memset(target, 0xFF, 4)
    assert get(runtime, target, host[:1]).view(np.uint32)[0] == 0xFFFFFFFF


def test_a_transfer_must_fit_its_span(runtime, arena):
    span = arena.allocate(16, "small")
    with pytest.raises(ValueError, match="upload of 32 bytes into a span of 16"):
        runtime.upload(span, np.zeros(8, np.float32))


# --- launches -------------------------------------------------------------------------------------------


def test_kernels_are_typed_by_their_declarations(module):
    assert module.function("affine").signature() == \
        "affine(float* __restrict__ y, const float* __restrict__ x, float a, float b, int n)"
    kinds = [(p.kind, p.size) for p in module.function("scalars").params]
    assert kinds == [("pointer", 8), ("signed", 1), ("unsigned", 1), ("signed", 2), ("unsigned", 2), ("signed", 4),
                     ("unsigned", 4), ("signed", 8), ("unsigned", 8), ("float", 4), ("float", 8), ("bfloat16", 2)]
    with pytest.raises(DeviceError, match="module runtime_tests has no kernel named afine .its kernels: affine"):
        module.function("afine")


def test_launch_runs_a_kernel(runtime, arena, module):
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    xs, ys = put(runtime, arena, x), arena.allocate(x.nbytes, "y")
    runtime.launch(module.function("affine"), grid=3, block=128, args=(ys, xs, 2.5, -1.0, x.size))
    # NVRTC contracts a * x + b into one FMA, the simulator never does: the last bit may differ.
    np.testing.assert_allclose(get(runtime, ys, x), np.float32(2.5) * x + np.float32(-1.0), rtol=1e-6, atol=1e-6)


def test_bf16_kernel_arguments_round_to_nearest_even(runtime, arena, module):
    x = np.arange(-8, 8, dtype=np.float32).astype(BF16)
    xs, ys = put(runtime, arena, x), arena.allocate(x.nbytes, "y")
    runtime.launch(module.function("scale_bf16"), 1, 32, 0, (ys, xs, 1.0 / 3.0, x.size))
    third = np.float32(1.0 / 3.0).astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(get(runtime, ys, x), (x.astype(np.float32) * third).astype(BF16))


def test_every_scalar_kind_reaches_the_kernel(runtime, arena, module):
    out = arena.allocate(11 * 8, "out")
    values = (-128, 255, -32768, 65535, -2**31, 2**32 - 1, -2**63, 2**64 - 1, 1.5, 1e300, 0.1)
    runtime.launch(module.function("scalars"), 1, 32, 0, (out, *values))
    got = runtime.download(out, np.float64, 11)
    expected = [float(v) for v in values[:10]] + [float(np.float32(0.1).astype(BF16))]
    assert got.tolist() == expected


def test_dynamic_shared_memory_beyond_48_kib(runtime, arena, module):
    per_block = 16384  # 64 KiB of floats per block: a GPU needs the kernel's opt-in
    x = np.arange(2 * per_block, dtype=np.float32)
    xs, ys = put(runtime, arena, x), arena.allocate(x.nbytes, "y")
    runtime.launch(module.function("reverse_blocks"), 2, 256, per_block * 4, (ys, xs, per_block))
    np.testing.assert_array_equal(get(runtime, ys, x), x.reshape(2, -1)[:, ::-1].reshape(-1))


def test_wrong_arguments_name_the_kernel(runtime, arena, module):
    affine = module.function("affine")
    span = arena.allocate(64, "y")
    cases = {
        (span, span, 1.0, 2.0): "affine(float* __restrict__ y, const float* __restrict__ x, float a, float b, int n) "
                                "takes 5 arguments, not 4",
        (span, span, 1.0, 2.0, 3.5): "argument 5 (int n): expected an integer, got 3.5",
        (span, span, 1.0, 2.0, 2**31): "argument 5 (int n): 2147483648 does not fit",
        (span, span, True, 2.0, 1): "argument 3 (float a): expected a number, got bool",
        (span, "x", 1.0, 2.0, 1): "argument 2 (const float* __restrict__ x): expected an address, got str",
    }
    for args, message in cases.items():
        with pytest.raises(KernelLaunchError) as refused:
            runtime.launch(affine, 1, 32, 0, args)
        assert str(refused.value) == f"kernel affine: {message}"
        assert str(refused.value.at("model.blocks.0.mlp")) == f"kernel affine (model path model.blocks.0.mlp): {message}"


def test_a_faulting_kernel_is_a_launch_error_naming_it(cache_dir):
    runtime = SimRuntime(cache_dir=cache_dir)
    kernel = runtime.load_module(KernelSource("runtime_tests", KERNELS)).function("write_past")
    tight = runtime.arena(256, "the activation arena of graph train")
    with pytest.raises(KernelLaunchError) as fault:
        runtime.launch(kernel, 1, 32, 0, (tight.base, 64))
    assert fault.value.kernel == "write_past"
    assert str(fault.value).startswith("kernel write_past: wrote outside its buffers: buffer the activation arena "
                                       "of graph train (256 bytes at")
    runtime.close()


# --- GEMMs ----------------------------------------------------------------------------------------------

GEMMS = {
    "NN f32": GemmSpec(24, 40, 56),
    "NT f32": GemmSpec(24, 40, 56, transpose_b=True),
    "TN f32": GemmSpec(24, 40, 56, transpose_a=True),
    "TT f32": GemmSpec(17, 9, 33, transpose_a=True, transpose_b=True),
    "NN bf16": GemmSpec(32, 48, 64, dtype="bf16"),
    "NT bf16": GemmSpec(32, 48, 64, dtype="bf16", transpose_b=True),
    "TN bf16 -> f32": GemmSpec(32, 48, 64, dtype="bf16", out_dtype="f32", transpose_a=True),
    "batched NN bf16": GemmSpec(16, 24, 32, dtype="bf16", batch=4),
    "batched NT f32": GemmSpec(16, 24, 32, transpose_b=True, batch=3),
    "batched, B shared": GemmSpec(16, 24, 32, batch=3, stride_b=0),
    "padded rows": GemmSpec(10, 12, 14, lda=20, ldb=16, ldc=32),
    "bias bf16": GemmSpec(32, 48, 64, dtype="bf16", epilogue="bias"),
    "gelu-bias f32": GemmSpec(16, 24, 40, epilogue="gelu-bias"),
    "bias-grad-b f32": GemmSpec(32, 24, 64, transpose_a=True, epilogue="bias-grad-b"),
    "bias-grad-a bf16": GemmSpec(24, 32, 48, dtype="bf16", epilogue="bias-grad-a"),
}
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16}


def _stored(rng, spec, rows, cols, ld, stride, dtype):
    """Random matrices as stored (row length `ld`, batches `stride` apart) and their [batch, rows, cols] values."""
    stride = stride if spec.batch > 1 else 0
    flat = rng.standard_normal((spec.batch - 1) * stride + (rows - 1) * ld + cols).astype(dtype)
    size = flat.dtype.itemsize
    values = np.lib.stride_tricks.as_strided(flat, (spec.batch, rows, cols), (stride * size, ld * size, size))
    return flat, values.astype(np.float64)


#: Every product with beta 0 (D is not read) and beta 1 (D accumulates), but a bias gradient, which is one
#: product and never accumulates.
GEMM_CASES = [pytest.param(spec, beta, id=f"{name}, beta {beta:g}") for name, spec in GEMMS.items()
              for beta in (0.0, 1.0) if not (beta and spec.epilogue.startswith("bias-grad"))]


@pytest.mark.parametrize("spec, beta", GEMM_CASES)
def test_gemm_against_float64(runtime, arena, spec, beta):
    rng = np.random.default_rng(7)
    in_type, out_type = DTYPES[spec.dtype], DTYPES[spec.output_dtype]
    a_flat, a = _stored(rng, spec, *spec.a_stored, spec.row_length_a, spec.batch_stride_a, in_type)
    b_flat, b = _stored(rng, spec, *spec.b_stored, spec.row_length_b, spec.batch_stride_b, in_type)
    d_flat, c = _stored(rng, spec, spec.m, spec.n, spec.row_length_c, spec.batch_stride_c, out_type)
    a_span, b_span = put(runtime, arena, a_flat, "a"), put(runtime, arena, b_flat, "b")
    d_span = arena.allocate(d_flat.nbytes, "d")  # beta 0: D starts as garbage (NaN on cuda-sim), never read
    if beta:
        runtime.upload(d_span, d_flat)
    bias_values = rng.standard_normal(max(spec.m, spec.n)).astype(out_type)
    bias = put(runtime, arena, bias_values, "bias") if spec.epilogue != "none" else None
    runtime.gemm(spec, a_span, b_span, d_span, bias=bias, alpha=0.5, beta=beta)

    op_a = a.transpose(0, 2, 1) if spec.transpose_a else a
    op_b = b.transpose(0, 2, 1) if spec.transpose_b else b
    expected = 0.5 * (op_a @ op_b) + beta * c
    if spec.epilogue in ("bias", "gelu-bias"):
        expected += bias_values[: spec.n].astype(np.float64)
    if spec.epilogue == "gelu-bias":
        expected = 0.5 * expected * (1 + np.tanh(np.sqrt(2 / np.pi) * (expected + 0.044715 * expected**3)))
    tolerance = 2e-2 if "bf16" in (spec.dtype, spec.output_dtype) else 1e-5
    got_flat = get(runtime, d_span, d_flat)
    size = got_flat.dtype.itemsize
    stride = spec.batch_stride_c if spec.batch > 1 else 0
    got = np.lib.stride_tricks.as_strided(got_flat, expected.shape, (stride * size, spec.row_length_c * size, size))
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tolerance, atol=tolerance * scale)
    if spec.epilogue.startswith("bias-grad"):
        summed = op_b[0].sum(axis=0) if spec.epilogue == "bias-grad-b" else op_a[0].sum(axis=1)
        got_bias = runtime.download(bias, out_type, summed.size).astype(np.float64)
        np.testing.assert_allclose(got_bias, summed, rtol=tolerance, atol=tolerance * np.abs(summed).max())


def test_gemm_bias_pointer_must_match_the_epilogue(runtime, arena):
    span = arena.allocate(4096, "m")
    with pytest.raises(ValueError, match="epilogue 'bias' needs bias pointer"):
        runtime.gemm(GEMMS["bias bf16"], span, span, span)


# --- events ----------------------------------------------------------------------------------------------


def test_events_time_the_work_between_them(runtime, arena, module):
    x = np.ones(1 << 16, np.float32)
    xs, ys = put(runtime, arena, x), arena.allocate(x.nbytes, "y")
    start, end = runtime.event(), runtime.event()
    start.record()
    runtime.launch(module.function("affine"), 64, 256, 0, (ys, xs, 1.0, 1.0, x.size))
    end.record()
    end.synchronize()
    assert end.elapsed_ms(start) > 0
    streamed = runtime.stream()
    start.record(streamed)
    runtime.launch(module.function("affine"), 64, 256, 0, (ys, xs, 1.0, 2.0, x.size), stream=streamed)
    end.record(streamed)
    streamed.synchronize()
    assert end.elapsed_ms(start) > 0
    np.testing.assert_array_equal(runtime.download(ys, np.float32, x.size, stream=streamed), x + 2)


def test_events_measure_host_time_on_the_simulator(cache_dir):
    runtime = SimRuntime(cache_dir=cache_dir)
    start, end = runtime.event(), runtime.event()
    with pytest.raises(DeviceError, match="not both recorded"):
        end.elapsed_ms(start)
    start.record()
    time.sleep(0.02)
    end.record()
    assert 15 <= end.elapsed_ms(start) < 1000
    runtime.close()


def test_device_spans_are_addresses():
    span = DeviceSpan(0x1000, 512)
    assert int(span) == 0x1000 and span.at(256, 128) == DeviceSpan(0x1100, 128)
    assert np.uint64(span) == 0x1000


# --- capture ---------------------------------------------------------------------------------------------


def _step(runtime, module, buffers, scalars):
    """A step's worth of work: memset, launches, a copy, a GEMM, an update read through device scalars."""
    x, y, z, w, g, a, b, d = buffers
    runtime.memset(y, 0, y.nbytes)
    runtime.launch(module.function("affine"), 2, 128, 0, (y, x, 0.5, 1.0, 256))
    runtime.copy(z, y, y.nbytes)
    runtime.launch(module.function("affine"), 2, 128, 0, (z, z, 2.0, 0.25, 256))
    runtime.gemm(GemmSpec(16, 16, 16), z, a, d, alpha=1.0, beta=1.0)
    scalars.update()
    runtime.launch(module.function("sgd_step"), 1, 256, 0, (w, g, scalars.address("lr"), scalars.address("step"), 256))


def _state(runtime, buffers):
    return [runtime.download(span, np.float32, span.nbytes // 4) for span in buffers]


def test_capture_replays_what_eager_launches_do(runtime, arena, module):
    rng = np.random.default_rng(3)
    initial = [rng.standard_normal(256).astype(np.float32) for _ in range(8)]
    buffers = [put(runtime, arena, values, f"buffer {i}") for i, values in enumerate(initial)]
    scalars = DeviceScalars(runtime, arena, {"lr": np.float32, "step": np.int32})
    scalars.set(lr=0.125, step=1)
    eager = []
    for _ in range(2):
        _step(runtime, module, buffers, scalars)
        eager.append(_state(runtime, buffers))
    assert not np.array_equal(eager[0][3], eager[1][3])  # the update applied twice

    for span, values in zip(buffers, initial):
        runtime.upload(span, values)
    with runtime.capture() as captured:
        _step(runtime, module, buffers, scalars)
    assert runtime.capturing() is None
    for got, values in zip(_state(runtime, buffers), initial):  # capturing ran nothing
        np.testing.assert_array_equal(got, values)
    for expected in eager:
        captured.graph.launch()
        for got, want in zip(_state(runtime, buffers), expected):
            np.testing.assert_array_equal(got, want)
    captured.graph.close()


def test_a_captured_kernel_reads_device_scalars_updated_between_replays(runtime, arena, module):
    w0, g = np.full(256, 10.0, np.float32), np.arange(256, dtype=np.float32)
    w, gs = put(runtime, arena, w0, "w"), put(runtime, arena, g, "g")
    scalars = DeviceScalars(runtime, arena, {"step": np.int32, "lr": np.float32})
    sgd = module.function("sgd_step")
    with runtime.capture() as captured:
        scalars.update()
        runtime.launch(sgd, 1, 256, 0, (w, gs, scalars.address("lr"), scalars.address("step"), 256))
    expected = w0.copy()
    for step, lr in ((1, 0.5), (2, 0.25), (3, 0.0625)):
        scalars.set(step=step, lr=lr)
        assert scalars.value("step") == step
        captured.graph.launch()
        expected -= np.float32(lr) * np.float32(step) * g
        np.testing.assert_array_equal(runtime.download(w, np.float32, 256), expected)
        np.testing.assert_array_equal(runtime.download(scalars.address("lr"), np.float32, 1), [lr])
    captured.graph.close()


def test_what_capture_refuses(runtime, arena, module):
    span = arena.allocate(1024, "x")
    pageable = np.zeros(256, np.float32)
    refusals = {
        "allocating the activation arena": lambda: runtime.arena(1024, "the activation arena"),
        "a download": lambda: runtime.download(span, np.float32, 256),
        "an upload inside capture must use pinned host memory": lambda: runtime.upload(span, pageable),
        "the stream is already capturing": lambda: runtime.begin_capture(),
    }
    for message, refused in refusals.items():
        runtime.begin_capture()
        runtime.memset(span, 0, 16)  # something to capture: the capture stays valid, the refusal is the runtime's
        try:
            with pytest.raises(CaptureError, match=message):
                refused()
        finally:
            runtime.end_capture().close()
    with pytest.raises(RuntimeError, match="inside"), runtime.capture():
        runtime.memset(span, 0, 16)
        raise RuntimeError("inside")
    assert runtime.capturing() is None
    with pytest.raises(CaptureError, match="not capturing"):
        runtime.end_capture()


def test_the_simulator_refuses_synchronizing_inside_capture(cache_dir):
    runtime = SimRuntime(cache_dir=cache_dir)
    with pytest.raises(CaptureError, match="synchronizing a capturing stream"), runtime.capture():
        runtime.synchronize()
    with pytest.raises(CaptureError, match="an event recorded inside capture"), runtime.capture():
        runtime.event().record()
    runtime.close()


def test_a_driver_without_capture_says_so(cache_dir):
    assert driver_pycuda.PycudaRuntime.capture_unavailable == "PyCUDA has no stream-capture API " \
                                                                "(SEXPGPU_CUDA_DRIVER=pycuda)"
    runtime = SimRuntime(cache_dir=cache_dir)
    runtime.capture_unavailable = driver_pycuda.NO_CAPTURE
    with pytest.raises(CaptureError, match="stream capture is unavailable: PyCUDA has no stream-capture API"):
        runtime.begin_capture()
    runtime.close()


# --- the cuda driver's pure parts ---------------------------------------------------------------------------

SCALARS_KERNEL = Kernel("scalars", declared_kernels(KERNELS)["scalars"], None)


def test_arguments_are_packed_as_cuLaunchKernel_reads_them():
    values = (0x7F00DEADBE00, -128, 255, -32768, 65535, -2**31, 2**32 - 1, -2**63, 2**64 - 1, 1.5, 1e300, 0.1)
    packed = pack_arguments(SCALARS_KERNEL, values)
    assert len(packed) == 12
    # The parameter buffer is laid out as a C struct of the same members would be.
    ctype = {("pointer", 8): ctypes.c_void_p, ("signed", 1): ctypes.c_int8, ("unsigned", 1): ctypes.c_uint8,
             ("signed", 2): ctypes.c_int16, ("unsigned", 2): ctypes.c_uint16, ("signed", 4): ctypes.c_int32,
             ("unsigned", 4): ctypes.c_uint32, ("signed", 8): ctypes.c_int64, ("unsigned", 8): ctypes.c_uint64,
             ("float", 4): ctypes.c_float, ("float", 8): ctypes.c_double, ("bfloat16", 2): ctypes.c_uint16}
    layout = type("Layout", (ctypes.Structure,),
                  {"_fields_": [(p.name, ctype[p.kind, p.size]) for p in SCALARS_KERNEL.params]})
    assert list(packed.offsets) == [getattr(layout, p.name).offset for p in SCALARS_KERNEL.params]
    # kernelParams[i] points at argument i, aligned to its size.
    read = []
    for i, param in enumerate(SCALARS_KERNEL.params):
        address = packed.pointers[i]
        assert address == ctypes.addressof(packed.storage) + packed.offsets[i]
        assert address % param.size == 0
        read.append(struct.unpack("<" + param.struct_code, ctypes.string_at(address, param.size))[0])
    bf16_bits = int(np.float32(0.1).astype(BF16).view(np.uint16))
    assert read == [*values[:9], 1.5, 1e300, bf16_bits]
    assert packed.address == ctypes.addressof(packed.pointers)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_packing_matches_the_parameter_layout_nvrtc_compiles(arch):
    """What cuLaunchKernel copies from kernelParams[i] is the CUBIN's size of parameter i: the sizes the
    runtime reads from the declarations must be those, and its packed buffer is laid out as the CUBIN's."""
    from sexpgpu.backends.cuda.nvrtc import compile_cubin

    layouts = cubin_parameters(compile_cubin(KERNELS, arch, name="runtime_tests", use_cache=False).image)
    declared = declared_kernels(KERNELS)
    assert sorted(layouts) == sorted(declared)
    for name, params in declared.items():
        packed = pack_arguments(Kernel(name, params, None), [0 if p.kind != "float" else 0.0 for p in params])
        assert layouts[name] == list(zip(packed.offsets, (p.size for p in params))), name


def test_declared_types_the_runtime_cannot_pass():
    assert param_type("const __nv_bfloat16* __restrict__", "x").kind == "pointer"
    assert param_type("unsigned long long", "n") == param_type("unsigned long long", "n")
    assert (param_type("size_t", "n").kind, param_type("size_t", "n").size) == ("unsigned", 8)
    with pytest.raises(ValueError, match="parameter v has type float4; the runtime passes pointers and arithmetic"):
        param_type("float4", "v")
    with pytest.raises(DeviceError, match="kernel bad: parameter v has type float4"):
        declared_kernels('extern "C" __global__ void bad(float4 v) {}')


class FakeResult(enum.IntEnum):
    """Stands for cuda-python's CUresult (an IntEnum too) where no driver is loaded."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_INSUFFICIENT_DRIVER = 35


def test_cuda_results_become_errors():
    assert driver_cuda.check((FakeResult.CUDA_SUCCESS,), "cuCtxSetCurrent") is None
    assert driver_cuda.check((FakeResult.CUDA_SUCCESS, 7), "cuDeviceGetCount") == 7
    assert driver_cuda.check((FakeResult.CUDA_SUCCESS, 5, 9), "cuMemGetInfo") == (5, 9)
    cases = [
        ((FakeResult.CUDA_ERROR_INVALID_VALUE, None), "cuMemcpyDtoDAsync", {}, DeviceError,
         "cuMemcpyDtoDAsync failed: CUDA_ERROR_INVALID_VALUE"),
        ((FakeResult.CUDA_ERROR_INVALID_VALUE,), "cuLaunchKernel", {"kernel": "fused_3"}, KernelLaunchError,
         "kernel fused_3: cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"),
        ((FakeResult.CUDA_ERROR_ILLEGAL_ADDRESS,), "cuStreamSynchronize",
         {"last": driver_cuda.LastLaunch("softmax_2", "model.blocks.0.attn")},
         KernelLaunchError, "kernel softmax_2 (model path model.blocks.0.attn): cuStreamSynchronize failed: "
         "CUDA_ERROR_ILLEGAL_ADDRESS; a kernel's fault is reported by whatever call comes next, and this is the "
         "last kernel launched, so it is this kernel or one launched shortly before it (CUDA_LAUNCH_BLOCKING=1 "
         "reports it at the faulting launch)"),
        ((FakeResult.CUDA_ERROR_ILLEGAL_ADDRESS,), "cuLaunchKernel",
         {"kernel": "fused_4", "last": driver_cuda.LastLaunch("fill_3", "model.head", graph_kernels=40)},
         KernelLaunchError, "kernel fill_3 (model path model.head): cuLaunchKernel failed: "
         "CUDA_ERROR_ILLEGAL_ADDRESS; a kernel's fault is reported by whatever call comes next, and this is the "
         "last of the 40 kernels of a replayed captured graph, so it is one of them (SEXPGPU_CAPTURE=off and "
         "CUDA_LAUNCH_BLOCKING=1 name the one)"),
        ((FakeResult.CUDA_ERROR_OUT_OF_MEMORY,), "cuModuleLoadData (train, sm_90)", {}, driver_cuda.DriverOutOfMemory,
         "out of device memory: cuModuleLoadData (train, sm_90) failed (CUDA_ERROR_OUT_OF_MEMORY); the model or "
         "the batch is too large for the memory left on the device"),
        ((FakeResult.CUDA_ERROR_NO_DEVICE,), "cuInit", {}, DeviceUnavailable,
         "the cuda device cannot open: no CUDA GPU (CUDA_ERROR_NO_DEVICE)"),
        ((FakeResult.CUDA_ERROR_INSUFFICIENT_DRIVER,), "cuInit", {}, DeviceUnavailable,
         "the cuda device cannot open: the CUDA driver does not fit cuda-python (CUDA_ERROR_INSUFFICIENT_DRIVER)"),
        ((FakeResult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,), "cuStreamEndCapture", {}, CaptureError,
         "cuStreamEndCapture failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
        ((FakeResult.CUDA_ERROR_NO_BINARY_FOR_GPU,), "cuModuleLoadData", {}, DeviceError,
         "cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU: the module was compiled for another "
         "architecture than the device's"),
    ]
    for result, call, context, kind, message in cases:
        with pytest.raises(kind) as raised:
            driver_cuda.check(result, call, **context)
        assert type(raised.value) is kind
        assert str(raised.value) == message
    assert driver_cuda.result_name(3) == "CUresult 3"


class FakeDriver:
    """cuda.bindings.driver as far as opening a device goes."""

    def __init__(self, init, count=1):
        self._init, self._count = init, count

    def cuInit(self, flags):  # noqa: N802 - the driver's name
        if isinstance(self._init, Exception):
            raise self._init
        return (self._init,)

    def cuDeviceGetCount(self):  # noqa: N802
        return FakeResult.CUDA_SUCCESS, self._count

    def cuDeviceGet(self, index):  # noqa: N802
        return FakeResult.CUDA_SUCCESS, index


@pytest.mark.parametrize("driver, devices, line", [
    (FakeDriver(RuntimeError("Failed to dlopen libcuda.so.1")), "0",
     "error: the cuda device cannot open: no CUDA driver (libcuda.so.1 not found)"),
    (FakeDriver(FakeResult.CUDA_ERROR_NO_DEVICE), "0",
     "error: the cuda device cannot open: no CUDA GPU (CUDA_ERROR_NO_DEVICE)"),
    (FakeDriver(FakeResult.CUDA_SUCCESS, count=0), "0",
     "error: the cuda device cannot open: no CUDA GPU (the driver finds no device)"),
    (FakeDriver(FakeResult.CUDA_SUCCESS, count=2), "3",
     "error: the cuda device cannot open: there is no CUDA device 3: this machine has 2 (ids 0 to 1; "
     "SEXPGPU_DEVICES picks one)"),
], ids=["no driver", "no GPU", "no device", "no such id"])
def test_opening_cuda_where_it_cannot_open_is_one_line(monkeypatch, capsys, driver, devices, line):
    monkeypatch.setattr(driver_cuda, "load_driver", lambda: driver)
    monkeypatch.setenv("SEXPGPU_DEVICES", devices)
    monkeypatch.delenv("SEXPGPU_CUDA_DRIVER", raising=False)
    assert guarded(lambda: open_runtime("cuda")) == 1
    assert capsys.readouterr().err.splitlines() == [line]
    assert runtime_unavailable("cuda") == line.removeprefix("error: the cuda device cannot open: ")


def test_without_the_cuda_extra_one_line_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # makes the import fail
    monkeypatch.delattr(sys.modules["cuda.bindings"], "driver", raising=False)
    monkeypatch.delenv("SEXPGPU_CUDA_DRIVER", raising=False)
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    driver_cuda.load_driver.cache_clear()
    try:
        assert guarded(lambda: open_runtime("cuda")) == 1
        assert runtime_unavailable("cuda").startswith("cuda-python is not installed")
    finally:
        driver_cuda.load_driver.cache_clear()
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: cuda-python is not installed (")
    assert line.endswith("which running on a CUDA GPU needs; install the CUDA toolchain with pip install "
                         "'sexpgpu[cuda]' (in a checkout: pip install -e '.[cuda]')")


# --- the PyCUDA driver's selection ---------------------------------------------------------------------------


def test_pycuda_asked_for_but_absent_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    monkeypatch.setenv("SEXPGPU_CUDA_DRIVER", "pycuda")
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    assert guarded(lambda: open_runtime("cuda")) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the cuda device cannot open: SEXPGPU_CUDA_DRIVER=pycuda, but pycuda is not "
                           "installed (")
    assert line.endswith("install it (pip install pycuda builds it against a CUDA toolkit) or unset "
                         "SEXPGPU_CUDA_DRIVER to use cuda-python")
    assert runtime_unavailable("cuda").startswith("SEXPGPU_CUDA_DRIVER=pycuda, but pycuda is not installed")


class FakePycuda(types.ModuleType):
    """pycuda.driver as far as cuInit goes: it fails with `failure`, as PyCUDA reports it."""

    class Error(Exception):
        pass

    def __init__(self, failure: str) -> None:
        super().__init__("pycuda.driver")
        self._failure = failure

    def init(self) -> None:
        raise self.Error(self._failure)


class LibcudaMissing:
    """An import finder standing for a pycuda whose extension cannot load libcuda.so.1."""

    def find_spec(self, name, path=None, target=None):
        if name == "pycuda" or name.startswith("pycuda."):
            raise ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
        return None


@pytest.mark.parametrize("failure, reason", [
    (None, "no CUDA driver (libcuda.so.1 not found), which pycuda needs"),
    ("cuInit failed: no CUDA-capable device is detected",
     "no CUDA GPU (cuInit failed: no CUDA-capable device is detected)"),
    ("cuInit failed: unknown error", "pycuda cannot initialize CUDA (cuInit failed: unknown error)"),
], ids=["no driver", "no GPU", "other"])
def test_pycuda_where_cuda_cannot_start_is_one_line(monkeypatch, capsys, failure, reason):
    for name in [n for n in sys.modules if n == "pycuda" or n.startswith("pycuda.")]:
        monkeypatch.delitem(sys.modules, name)
    if failure is None:
        monkeypatch.setattr(sys, "meta_path", [LibcudaMissing(), *sys.meta_path])
    else:
        fake = FakePycuda(failure)
        monkeypatch.setitem(sys.modules, "pycuda", types.SimpleNamespace(driver=fake))
        monkeypatch.setitem(sys.modules, "pycuda.driver", fake)
    monkeypatch.setenv("SEXPGPU_CUDA_DRIVER", "pycuda")
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    assert guarded(lambda: open_runtime("cuda")) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: the cuda device cannot open: {reason}"]


# --- selection ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, driver, devices, reason", [
    ("cuda", None, "0,1", "SEXPGPU_DEVICES=0,1 asks for 2 ranks, a process each: `sexpgpu run` starts them "
                          "(docs/distributed.md)"),
    ("cuda-sim", None, "0, 1, 2, 3", "SEXPGPU_DEVICES=0, 1, 2, 3 asks for 4 ranks, a process each: `sexpgpu run` "
                                     "starts them (docs/distributed.md)"),
    ("cuda", None, "gpu0", "SEXPGPU_DEVICES=gpu0 is not a device id (0, 1, ...)"),
    ("cuda-sim", None, "1", "SEXPGPU_DEVICES=1, but the simulated device is device 0 alone"),
    ("cuda", "cupy", "0", "SEXPGPU_CUDA_DRIVER=cupy names no CUDA driver; use cuda-python or pycuda (the default "
                          "is cuda-python)"),
])
def test_selection_refuses_in_one_line(monkeypatch, capsys, device, driver, devices, reason):
    monkeypatch.setenv("SEXPGPU_DEVICES", devices)
    if driver:
        monkeypatch.setenv("SEXPGPU_CUDA_DRIVER", driver)
    else:
        monkeypatch.delenv("SEXPGPU_CUDA_DRIVER", raising=False)
    assert guarded(lambda: open_runtime(device)) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: the {device} device cannot open: {reason}"]
    assert runtime_unavailable(device) == reason


def test_cuda_sim_opens_whatever_the_cuda_driver(monkeypatch, cache_dir):
    monkeypatch.setenv("SEXPGPU_CUDA_DRIVER", "pycuda")
    monkeypatch.setenv("SEXPGPU_DEVICES", "0")
    assert runtime_unavailable("cuda-sim") is None
    with open_runtime("cuda-sim", memory_bytes=1 << 20, cache_dir=cache_dir) as runtime:
        assert isinstance(runtime, SimRuntime)
        assert runtime.device.arch == "sm_90"
        assert runtime.device.describe() == ("cuda-sim (a simulated CUDA device on the host CPU) (device 0, sm_90, "
                                             "1.0 MiB, driver cuda-sim)")
    assert selection.requested_driver("cuda-sim") == "cuda-sim"


@pytest.mark.parametrize("size, nbytes", [
    ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("300 mib", 300 << 20), ("4096", 4096), ("2k", 2048), ("1TiB", 1 << 40),
])
def test_sexpgpu_sim_memory_sizes_the_simulated_device(monkeypatch, cache_dir, size, nbytes):
    monkeypatch.setenv("SEXPGPU_SIM_MEMORY", size)
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    assert selection.requested_sim_memory() == nbytes
    with open_runtime("cuda-sim", cache_dir=cache_dir) as runtime:
        assert runtime.memory_info() == (nbytes, nbytes)


@pytest.mark.parametrize("size", ["64x", "-1", "0", "0.1", "MiB", "1e9", "64 MB"])
def test_a_bad_sexpgpu_sim_memory_is_a_usage_error(monkeypatch, capsys, size):
    monkeypatch.setenv("SEXPGPU_SIM_MEMORY", size)
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    assert guarded(lambda: runtime_unavailable("cuda-sim")) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: SEXPGPU_SIM_MEMORY={size} is not a memory size; give a positive number of bytes, or one with "
        "KiB, MiB, GiB or TiB (64MiB, 1.5GiB)"]
    assert guarded(lambda: open_runtime("cuda-sim")) == 2


# --- on a GPU only ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"no GPU: {CUDA_REASON}")
def test_the_cuda_device_reports_itself():
    with driver_cuda.CudaRuntime(0) as runtime:
        info = runtime.device
        assert info.driver == "cuda-python" and info.name and info.compute_capability >= (8, 0)
        free, total = runtime.memory_info()
        assert total == info.total_memory and 0 < free <= total
        assert runtime.capture_unavailable is None


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"no GPU: {CUDA_REASON}")
def test_a_kernel_fault_on_the_gpu_names_the_kernel():
    # In a process of its own: a fault leaves the process's context unusable.
    script = textwrap.dedent(f"""
        from sexpgpu.backends.cuda.driver_cuda import CudaRuntime
        from sexpgpu.backends.cuda.runtime import KernelSource, KernelLaunchError
        runtime = CudaRuntime(0)
        kernel = runtime.load_module(KernelSource("fault", {KERNELS!r})).function("write_past")
        runtime.launch(kernel, 1, 32, 0, (0x10, 0))
        try:
            runtime.synchronize()
        except KernelLaunchError as err:
            print(err.kernel, err.message.split(";")[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("write_past cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"), done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"no GPU: {CUDA_REASON}")
def test_pycuda_runs_the_same_kernels_and_gemms(cache_dir):
    """The PyCUDA driver (pycuda must be installed on the GPU machine: the device check carries its wheel)."""
    pycuda_runtime = driver_pycuda.PycudaRuntime(0)
    assert pycuda_runtime.capture_unavailable == driver_pycuda.NO_CAPTURE
    rng = np.random.default_rng(5)
    x = rng.standard_normal(4096).astype(np.float32)
    spec = GEMMS["NT bf16"]
    a = rng.standard_normal(spec.a_stored).astype(BF16)
    b = rng.standard_normal(spec.b_stored).astype(BF16)
    results = []
    for runtime in (pycuda_runtime, SimRuntime(cache_dir=cache_dir)):
        arena = runtime.arena(1 << 20, "arena")
        module = runtime.load_module(KernelSource("runtime_tests", KERNELS))
        xs, ys = put(runtime, arena, x), arena.allocate(x.nbytes, "y")
        runtime.launch(module.function("affine"), 16, 256, 0, (ys, xs, 3.0, 0.5, x.size))
        d = arena.allocate(spec.m * spec.n * 2, "d")
        runtime.gemm(spec, put(runtime, arena, a, "a"), put(runtime, arena, b, "b"), d)
        results.append((runtime.download(ys, np.float32, x.size),
                        runtime.download(d, BF16, (spec.m, spec.n)).astype(np.float64)))
        start, end = runtime.event(), runtime.event()
        start.record()
        end.record()
        end.synchronize()
        assert end.elapsed_ms(start) >= 0
        runtime.close()
    (gpu_y, gpu_d), (sim_y, sim_d) = results
    np.testing.assert_allclose(gpu_y, sim_y, rtol=1e-6, atol=1e-6)  # FMA on the GPU, none on cuda-sim
    np.testing.assert_allclose(gpu_d, sim_d, rtol=2e-2, atol=2e-2 * np.abs(sim_d).max())
