"""cuda-sim, the simulated CUDA device: llm.c-style kernels against numpy, and every error it reports.

The kernels here are test kernels written by hand in the style `emit-cuda`
generates (block and warp reductions, dynamic shared memory, bf16 storage
with f32 math, 128-bit loads); they are compiled once per session into one
module, in a cache directory of the session's own.
"""

from __future__ import annotations

import shutil
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest
from sexpgpu.backends.cuda.sim import (
    HEADER_PATH,
    ROUND_ROBIN,
    SCHEDULES,
    WARP_AFTER_WARP,
    CompileError,
    KernelFault,
    LaunchError,
    ScheduleMismatch,
    SimDevice,
    SimError,
    bf16_bits,
    compile_module,
)
from sexpgpu.backends.cuda.sim.compiler import FLAGS, host_compiler

KERNELS = r"""
#ifndef SEXPGPU_SIM
#include <cuda_bf16.h>
#endif

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// One block per row; warp partials in dynamic shared memory (2 floats per warp).
extern "C" __global__ void __launch_bounds__(1024) softmax_rows(float* __restrict__ out, const float* __restrict__ inp,
                                                                 int N, int C) {
    extern __shared__ float shared[];
    int row = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warps = blockDim.x / 32;
    float* maxes = shared;
    float* sums = shared + warps;
    const float* x = inp + (size_t)row * C;
    float* y = out + (size_t)row * C;
    float m = -INFINITY;
    for (int i = tid; i < C; i += blockDim.x) m = fmaxf(m, x[i]);
    m = warp_max(m);
    if (lane == 0) maxes[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float v = maxes[0];
        for (int i = 1; i < warps; ++i) v = fmaxf(v, maxes[i]);
        maxes[0] = v;
    }
    __syncthreads();
    float offset = maxes[0];
    float s = 0.0f;
    for (int i = tid; i < C; i += blockDim.x) {
        float e = expf(x[i] - offset);
        y[i] = e;
        s += e;
    }
    s = warp_sum(s);
    if (lane == 0) sums[warp] = s;
    __syncthreads();
    if (tid == 0) {
        float v = 0.0f;
        for (int i = 0; i < warps; ++i) v += sums[i];
        sums[0] = v;
    }
    __syncthreads();
    float inv = 1.0f / sums[0];
    for (int i = tid; i < C; i += blockDim.x) y[i] *= inv;
}

// A warp per row, 128-bit loads (C % 4 == 0); warps past the last row exit.
extern "C" __global__ void layernorm_forward(float* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd, const float* __restrict__ inp,
                                             const float* __restrict__ weight, const float* __restrict__ bias,
                                             int N, int C) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const float4* x = reinterpret_cast<const float4*>(inp + (size_t)row * C);
    const float4* w = reinterpret_cast<const float4*>(weight);
    const float4* b = reinterpret_cast<const float4*>(bias);
    float4* y = reinterpret_cast<float4*>(out + (size_t)row * C);
    int C4 = C / 4;
    float sum = 0.0f;
    for (int i = lane; i < C4; i += 32) {
        float4 v = __ldcs(x + i);
        sum += v.x + v.y + v.z + v.w;
    }
    float m = warp_sum(sum) / C;
    float var = 0.0f;
    for (int i = lane; i < C4; i += 32) {
        float4 v = x[i];
        float a = v.x - m, c = v.y - m, d = v.z - m, e = v.w - m;
        var += a * a + c * c + d * d + e * e;
    }
    float s = rsqrtf(warp_sum(var) / C + 1e-5f);
    if (lane == 0) {
        __stcs(mean + row, m);
        __stcs(rstd + row, s);
    }
    for (int i = lane; i < C4; i += 32) {
        float4 v = x[i], wv = __ldg(w + i), bv = __ldg(b + i);
        y[i] = make_float4((v.x - m) * s * wv.x + bv.x, (v.y - m) * s * wv.y + bv.y,
                           (v.z - m) * s * wv.z + bv.z, (v.w - m) * s * wv.w + bv.w);
    }
}

extern "C" __global__ void bf16_round_trip(__nv_bfloat16* rn, __nv_bfloat16* plain, __nv_bfloat16* assigned,
                                           float* back, const float* in, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        rn[i] = __float2bfloat16_rn(in[i]);
        plain[i] = __float2bfloat16(in[i]);
        assigned[i] = in[i];
        back[i] = __bfloat162float(rn[i]);
    }
}

extern "C" __global__ void bf16_from_double(__nv_bfloat16* out, const double* in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __double2bfloat16(in[i]);
}

// llm.c's x128: eight bf16 through one 128-bit load and store, f32 math.
struct alignas(16) Pack8 { __nv_bfloat16 v[8]; };
extern "C" __global__ void bf16_scale_x128(__nv_bfloat16* out, const __nv_bfloat16* in, float scale, int n) {
    int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    int4 bits = __ldcs(reinterpret_cast<const int4*>(in + i));
    Pack8 p;
    memcpy(&p, &bits, sizeof p);
    #pragma unroll
    for (int k = 0; k < 8; ++k) p.v[k] = __float2bfloat16_rn(__bfloat162float(p.v[k]) * scale);
    __stcs(reinterpret_cast<int4*>(out + i), *reinterpret_cast<int4*>(&p));
}

extern "C" __global__ void bf16_arithmetic(__nv_bfloat16* out, const __nv_bfloat16* a, const __nv_bfloat16* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[4 * i + 0] = a[i] + b[i];
    out[4 * i + 1] = __hsub(a[i], b[i]);
    out[4 * i + 2] = a[i] * b[i];
    out[4 * i + 3] = __hdiv(a[i], b[i]);
}

extern "C" __global__ void atomics(int* hist, float* total, int* maxkey, unsigned int* maxval_bits,
                                   const int* keys, const float* vals, int n, int bins) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&hist[keys[i] % bins], 1);
    atomicAdd(total, vals[i]);
    atomicMax(maxkey, keys[i]);
    unsigned int old = *maxval_bits, assumed;
    do {
        assumed = old;
        if (__uint_as_float(assumed) >= vals[i]) break;
        old = atomicCAS(maxval_bits, assumed, __float_as_uint(vals[i]));
    } while (old != assumed);
}

// Each block reverses its chunk through dynamic shared memory (-1 where the mirror is past n).
extern "C" __global__ void reverse_chunks(float* out, const float* in, int n, int sync) {
    extern __shared__ __align__(16) unsigned char raw[];
    float* buf = reinterpret_cast<float*>(raw);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = i < n ? in[i] : -1.0f;
    if (sync) __syncthreads();
    if (i < n) out[i] = buf[blockDim.x - 1 - threadIdx.x];
}

extern "C" __global__ void warp_rotate(float* out, const float* in, int sync) {
    __shared__ float s[32];
    int lane = threadIdx.x;
    s[lane] = in[lane];
    if (sync) __syncwarp();
    out[lane] = s[(lane + 1) % 32];
}

extern "C" __global__ void warp_semantics(int* out) {
    int lane = threadIdx.x;
    out[0 * 32 + lane] = __shfl_down_sync(FULL_MASK, lane, 1);
    out[1 * 32 + lane] = __shfl_up_sync(FULL_MASK, lane, 3, 8);
    out[2 * 32 + lane] = __shfl_sync(FULL_MASK, lane, 35, 16);
    out[3 * 32 + lane] = __shfl_xor_sync(FULL_MASK, lane, 16, 16);
    out[4 * 32 + lane] = (int)__ballot_sync(FULL_MASK, lane % 3 == 0);
    out[5 * 32 + lane] = __any_sync(FULL_MASK, lane == 7) + 2 * __all_sync(FULL_MASK, lane < 40);
    out[6 * 32 + lane] = __reduce_add_sync(FULL_MASK, lane) + 1000 * __reduce_max_sync(FULL_MASK, 31 - lane);
    __syncwarp();
    out[7 * 32 + lane] = __syncthreads_count(lane % 4 == 0) + 100 * __syncthreads_or(lane == 5)
                         + 1000 * __syncthreads_and(lane < 31);
}

extern "C" __global__ void index_map(int* out) {
    int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int threads = blockDim.x * blockDim.y * blockDim.z;
    out[block * threads + thread] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z
                                    + 1000 * (blockIdx.x + 10 * blockIdx.y + 100 * blockIdx.z);
}

struct Pair { int a; float b; };
extern "C" __global__ void by_value(float* out, __nv_bfloat16 h, Pair p, double d, unsigned char flag, long long big) {
    out[0] = __bfloat162float(h);
    out[1] = p.a;
    out[2] = p.b;
    out[3] = (float)d;
    out[4] = flag;
    out[5] = (float)(big >> 40);
}

extern "C" __global__ void read_uninitialised(float* out) {
    __shared__ float s[64];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 1.0f;
}

extern "C" __global__ void write_at(float* p, int offset, float v) { p[offset] = v; }

extern "C" __global__ void say(int v) {
    if (threadIdx.x % 2 == 0) printf("block %d thread %d says %d\n", blockIdx.x, threadIdx.x, v);
}

extern "C" __global__ void exit_before_barrier(float* out, int n) {
    int t = threadIdx.x;
    if (t >= n) return;
    out[t] = t;
    __syncthreads();
}

extern "C" __global__ void exit_odd_threads(float* out) {
    if (threadIdx.x % 2) return;
    __syncthreads();
}

extern "C" __global__ void two_barriers_one_line(float* out) {
    if (threadIdx.x < 32) __syncthreads(); else __syncthreads();
}

extern "C" __global__ void shuffle_from_exited(float* out) {
    int lane = threadIdx.x;
    if (lane == 5) return;
    out[lane] = __shfl_down_sync(FULL_MASK, (float)lane, 1);
}

extern "C" __global__ void shuffle_partial_warp(float* out) {
    out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, 1.0f, 16);
}

extern "C" __global__ void shuffle_split_warp(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(FULL_MASK, v, 1);
    else v = __shfl_down_sync(FULL_MASK, v, 1);
    out[threadIdx.x] = v;
}

extern "C" __global__ void deep_stack(float* out, int n) {
    volatile float big[100000];
    for (int i = 0; i < n; ++i) big[i] = i;
    out[threadIdx.x] = big[n - 1];
}

extern "C" __global__ void wild_pointer(float* out) { out[threadIdx.x] = *(float*)16; }

extern "C" __global__ void checks(float* out) {
    assert(threadIdx.x < 3);
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void traps(int* out) {
    if (threadIdx.x == 7) __trap();
}

extern "C" __global__ void __launch_bounds__(64, 2) bounded(float* out) { out[threadIdx.x] = 0.0f; }
"""


def _site(kernel: str, call: str, nth: int = 0, column: bool = True) -> str:
    """Where the device places the `nth` `call` of `kernel` in KERNELS: file, line and the column of its parenthesis."""
    lines = KERNELS.splitlines()
    first = next(i for i, text in enumerate(lines) if f" {kernel}(" in text)
    found = [(i + 1, col + len(call) + 1) for i in range(first, len(lines))
             for col in range(len(lines[i])) if lines[i].startswith(call, col)]
    line, col = found[nth]
    return f"sim_tests.cu:{line}:{col}" if column else f"sim_tests.cu:{line}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sexpgpu-cache")


@pytest.fixture(scope="module")
def kernels(cache_dir):
    return compile_module(KERNELS, "sim_tests.cu", cache_dir)


@pytest.fixture
def dev():
    return SimDevice()


# --- kernels against numpy ---------------------------------------------------

@pytest.mark.parametrize(("rows", "cols", "block"), [(37, 77, 64), (5, 50257, 256), (3, 1, 32), (2, 4097, 1024)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_softmax_rows_matches_numpy(dev, kernels, rows, cols, block, schedule):
    rng = np.random.default_rng(rows * cols)
    x = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
    dx, dy = dev.upload(x, "x"), dev.alloc(x.nbytes, "y")
    warps = block // 32
    dev.launch(kernels.kernel("softmax_rows"), rows, block, 2 * warps * 4, (dy, dx, rows, cols), schedule=schedule)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(dev.download(dy, np.float32, x.shape), e / e.sum(axis=1, keepdims=True), rtol=1e-5,
                               atol=1e-7)


def test_softmax_has_no_race(dev, kernels):
    x = np.random.default_rng(1).standard_normal((9, 333)).astype(np.float32)
    dx, dy = dev.upload(x, "x"), dev.alloc(x.nbytes, "y")
    dev.compare_schedules(kernels.kernel("softmax_rows"), 9, 128, 2 * 4 * 4, (dy, dx, 9, 333))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_layernorm_forward_with_float4_loads(dev, kernels, schedule):
    rows, cols = 37, 772  # rows fill 9 blocks of 4 warps and a quarter; cols % 128 != 0
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3 + 1
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    dx, dw, db = dev.upload(x, "x"), dev.upload(w, "w"), dev.upload(b, "b")
    dy, dmean, drstd = dev.alloc(x.nbytes, "y"), dev.alloc(rows * 4, "mean"), dev.alloc(rows * 4, "rstd")
    dev.launch(kernels.kernel("layernorm_forward"), -(-rows // 4), 128, 0,
               (dy, dmean, drstd, dx, dw, db, rows, cols), schedule=schedule)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1)
    rstd = 1 / np.sqrt(x64.var(axis=1) + 1e-5)
    np.testing.assert_allclose(dev.download(dmean, np.float32), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dev.download(drstd, np.float32), rstd, rtol=1e-5)
    y = (x64 - mean[:, None]) * rstd[:, None] * w + b
    np.testing.assert_allclose(dev.download(dy, np.float32, x.shape), y, rtol=1e-5, atol=1e-5)


def _bf16_reference(values: np.ndarray) -> np.ndarray:
    """Round to nearest even (ml_dtypes), with CUDA's single NaN, 0x7fff."""
    with np.errstate(invalid="ignore"):
        bits = values.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
    bits[np.isnan(values)] = 0x7FFF
    return bits


def test_bf16_conversion_is_bit_exact(dev, kernels):
    sample = np.arange(0, 2**32, 997, dtype=np.uint64).astype(np.uint32)  # 4.3 million patterns
    low = np.arange(0, 2**16, dtype=np.uint32)
    edges = np.concatenate([
        low, low | 0x80000000,  # zeros and subnormals that round to bf16 subnormals, both signs
        (np.arange(0, 2**16, dtype=np.uint32) << 16) | 0x8000,  # every halfway tie, even and odd
        (np.arange(0, 2**16, dtype=np.uint32) << 16) | 0x8001,  # just above each tie
        (np.arange(0, 2**16, dtype=np.uint32) << 16) | 0x7FFF,  # just below each tie
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7F800001,
                  0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x00800000, 0x007FFFFF], dtype=np.uint32),
    ])
    values = np.concatenate([sample, edges]).view(np.float32)
    n = values.size
    din = dev.upload(values, "in")
    outs = [dev.alloc(n * 2, name) for name in ("rn", "plain", "assigned")]
    back = dev.alloc(n * 4, "back")
    dev.launch(kernels.kernel("bf16_round_trip"), 128, 256, 0, (*outs, back, din, n))
    expected = _bf16_reference(values)
    for buf in outs:
        got = dev.download(buf, np.uint16)
        wrong = np.flatnonzero(got != expected)
        assert wrong.size == 0, (f"{buf.name}: {wrong.size} patterns differ, e.g. {values.view(np.uint32)[wrong[0]]:#010x}"
                                 f" -> {got[wrong[0]]:#06x}, expected {expected[wrong[0]]:#06x}")
    np.testing.assert_array_equal(dev.download(back, np.uint32), expected.astype(np.uint32) << 16)


def test_double_to_bf16_rounds_once(dev, kernels):
    # Each is next to a bf16 tie that rounding through f32 would create.
    cases = {
        1 + 2**-8 + 2**-40: 0x3F81, 1 + 2**-8 - 2**-40: 0x3F80, 1 + 2**-8: 0x3F80, 1 + 3 * 2**-8: 0x3F82,
        -(1 + 2**-8 + 2**-40): 0xBF81, 2**-134 + 2**-160: 0x0001, 2**-134: 0x0000, 1e39: 0x7F80,
        -1e39: 0xFF80, float("nan"): 0x7FFF, -0.0: 0x8000, 3.0: 0x4040,
    }
    values = np.array(list(cases), dtype=np.float64)
    dv, dout = dev.upload(values, "in"), dev.alloc(values.size * 2, "out")
    dev.launch(kernels.kernel("bf16_from_double"), 1, 32, 0, (dout, dv, values.size))
    assert [hex(b) for b in dev.download(dout, np.uint16)] == [hex(b) for b in cases.values()]


def test_bf16_x128_loads_and_arithmetic(dev, kernels):
    rng = np.random.default_rng(3)
    n = 8 * 300
    a = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    b = (rng.standard_normal(n) + 3).astype(ml_dtypes.bfloat16)
    da, db = dev.upload(a, "a"), dev.upload(b, "b")
    scaled, arith = dev.alloc(n * 2, "scaled"), dev.alloc(4 * n * 2, "arith")
    dev.launch(kernels.kernel("bf16_scale_x128"), 3, 128, 0, (scaled, da, 0.3, n))
    expected = (a.astype(np.float32) * np.float32(0.3)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(dev.download(scaled, np.uint16), expected.view(np.uint16))
    dev.launch(kernels.kernel("bf16_arithmetic"), -(-n // 256), 256, 0, (arith, da, db, n))
    af, bf = a.astype(np.float32), b.astype(np.float32)
    expected = np.stack([af + bf, af - bf, af * bf, af / bf], axis=1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(dev.download(arith, np.uint16).reshape(n, 4), expected.view(np.uint16))


def test_atomics(dev, kernels):
    rng = np.random.default_rng(5)
    n, bins = 1000, 7
    keys = rng.integers(0, 10_000, n).astype(np.int32)
    vals = rng.random(n).astype(np.float32)
    hist, total = dev.upload(np.zeros(bins, np.int32), "hist"), dev.upload(np.zeros(1, np.float32), "total")
    maxkey, maxval = dev.upload(np.full(1, -1, np.int32), "maxkey"), dev.upload(np.zeros(1, np.float32), "maxval")
    dev.launch(kernels.kernel("atomics"), -(-n // 96), 96, 0,
               (hist, total, maxkey, maxval, dev.upload(keys), dev.upload(vals), n, bins))
    np.testing.assert_array_equal(dev.download(hist, np.int32), np.bincount(keys % bins, minlength=bins))
    np.testing.assert_allclose(dev.download(total, np.float32), [vals.astype(np.float64).sum()], rtol=1e-5)
    assert dev.download(maxkey, np.int32)[0] == keys.max()
    assert dev.download(maxval, np.float32)[0] == vals.max()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dynamic_shared_memory(dev, kernels, schedule):
    n, block = 1001, 128
    x = np.arange(n, dtype=np.float32)
    dx, dy = dev.upload(x, "x"), dev.alloc(x.nbytes, "y")
    dev.launch(kernels.kernel("reverse_chunks"), -(-n // block), block, block * 4, (dy, dx, n, 1), schedule=schedule)
    padded = np.concatenate([x, np.full(-n % block, -1, np.float32)]).reshape(-1, block)
    np.testing.assert_array_equal(dev.download(dy, np.float32), padded[:, ::-1].reshape(-1)[:n])


def test_warp_intrinsics_follow_cuda(dev, kernels):
    out = dev.alloc(8 * 32 * 4, "out")
    dev.launch(kernels.kernel("warp_semantics"), 1, 32, 0, (out,))
    got = dev.download(out, np.int32, (8, 32))
    lane = np.arange(32)
    np.testing.assert_array_equal(got[0], np.minimum(lane + 1, 31))  # past the end: its own value
    np.testing.assert_array_equal(got[1], np.where(lane % 8 >= 3, lane - 3, lane))  # within segments of 8
    np.testing.assert_array_equal(got[2], (lane & ~15) + 35 % 16)  # source lane modulo the width
    np.testing.assert_array_equal(got[3], np.where(lane < 16, lane, lane - 16))  # later segments: its own value
    assert set(got[4].view(np.uint32)) == {sum(1 << i for i in range(0, 32, 3))}
    np.testing.assert_array_equal(got[5], 3)
    np.testing.assert_array_equal(got[6], sum(range(32)) + 1000 * 31)
    np.testing.assert_array_equal(got[7], 8 + 100 + 0)


def test_threads_and_blocks_in_three_dimensions(dev, kernels):
    grid, block = (3, 2, 2), (5, 4, 3)  # 60 threads: the second warp is partial
    out = dev.alloc(12 * 60 * 4, "out")
    dev.launch(kernels.kernel("index_map"), grid, block, 0, (out,))
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(d) for d in (2, 2, 3, 3, 4, 5)), indexing="ij")
    expected = tx + 10 * ty + 100 * tz + 1000 * (bx + 10 * by + 100 * bz)
    np.testing.assert_array_equal(dev.download(out, np.int32), expected.reshape(-1))


def test_arguments_by_value(dev, kernels):
    out = dev.alloc(6 * 4, "out")
    dev.launch(kernels.kernel("by_value"), 1, 1, 0, (out, 1.5, struct.pack("<if", 7, 2.25), 0.5, 1, 3 << 40))
    np.testing.assert_array_equal(dev.download(out, np.float32), [1.5, 7, 2.25, 0.5, 1, 3])
    assert [p.kind for p in kernels.kernel("by_value").params] == [
        "pointer", "bfloat16", "bytes", "float", "unsigned", "signed"]


def test_uninitialised_memory_reads_as_nan(dev, kernels):
    out = dev.alloc(2 * 64 * 4, "out")
    assert np.isnan(dev.download(out, np.float32)).all()  # fresh device memory
    dev.launch(kernels.kernel("read_uninitialised"), 2, 64, 0, (out,))
    assert np.isnan(dev.download(out, np.float32)).all()  # shared memory, in every block


def test_printf(dev, kernels, capfd):
    dev.launch(kernels.kernel("say"), 2, 4, 0, (42,))
    assert capfd.readouterr().out.splitlines() == [
        "block 0 thread 0 says 42", "block 0 thread 2 says 42", "block 1 thread 0 says 42", "block 1 thread 2 says 42"]


def test_memory_helpers(dev):
    a = dev.upload(np.arange(10, dtype=np.int32), "a")
    b = dev.alloc(40, "b")
    dev.copy(b, a.ptr + 8, 32)
    dev.memset(b.ptr + 32, 0xFF, 8)
    np.testing.assert_array_equal(dev.download(b, np.int32), [2, 3, 4, 5, 6, 7, 8, 9, -1, -1])
    dev.write(a.ptr + 4, np.array([77], np.int32))
    assert dev.download(a.ptr, np.int32, 3).tolist() == [0, 77, 2]
    assert a.ptr % 256 == 0 and dev.find(a.ptr + 40) == (a, 40) and int(a) == a.ptr
    with pytest.raises(LaunchError, match="outside buffer b of 40 bytes"):
        dev.copy(b.ptr + 8, a, 40)
    dev.free(a)
    assert dev.find(a.ptr) is None


# --- races ---------------------------------------------------------------------

def test_missing_syncthreads_shows_as_a_schedule_difference(dev, kernels):
    n, block = 512, 128
    dx, dy = dev.upload(np.arange(n, dtype=np.float32), "x"), dev.alloc(n * 4, "y")
    dev.compare_schedules(kernels.kernel("reverse_chunks"), 4, block, block * 4, (dy, dx, n, 1))
    with pytest.raises(ScheduleMismatch, match=r"kernel reverse_chunks gives different results .*buffer y differs"):
        dev.compare_schedules(kernels.kernel("reverse_chunks"), 4, block, block * 4, (dy, dx, n, 0))


def test_missing_syncwarp_shows_as_a_schedule_difference(dev, kernels):
    dx, dy = dev.upload(np.arange(32, dtype=np.float32), "x"), dev.alloc(32 * 4, "y")
    dev.compare_schedules(kernels.kernel("warp_rotate"), 1, 32, 0, (dy, dx, 1))
    np.testing.assert_array_equal(dev.download(dy, np.float32), (np.arange(32) + 1) % 32)
    with pytest.raises(ScheduleMismatch, match="warp_rotate"):
        dev.compare_schedules(kernels.kernel("warp_rotate"), 1, 32, 0, (dy, dx, 0))


# --- what the device reports ---------------------------------------------------

def _fault(dev, kernel, grid, block, shared, args, schedule=ROUND_ROBIN) -> str:
    with pytest.raises(KernelFault) as caught:
        dev.launch(kernel, grid, block, shared, args, schedule=schedule)
    return str(caught.value)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_exit_before_a_barrier_is_divergence(dev, kernels, schedule):
    out = dev.alloc(256, "out")
    message = _fault(dev, kernels.kernel("exit_before_barrier"), 3, 64, 0, (out, 40), schedule)
    block = "(0,0,0)" if schedule == ROUND_ROBIN else "(2,0,0)"
    assert message == (f"kernel exit_before_barrier, block {block}: __syncthreads divergence, not every thread of "
                       "the block reaches the same barrier: threads 0-39 wait at __syncthreads "
                       f"({_site('exit_before_barrier', '__syncthreads')}); threads 40-63 have exited")


def test_a_long_divergence_report_is_cut_short(dev, kernels):
    message = _fault(dev, kernels.kernel("exit_odd_threads"), 1, 1024, 0, (dev.alloc(4),))
    assert message.startswith("kernel exit_odd_threads, block (0,0,0): __syncthreads divergence, not every thread "
                              "of the block reaches the same barrier: threads 0, 2, 4, 6, ")
    assert len(message) == 4095


def test_two_barriers_on_one_line_are_told_apart(dev, kernels):
    message = _fault(dev, kernels.kernel("two_barriers_one_line"), 1, 64, 0, (dev.alloc(4),))
    first, second = (_site("two_barriers_one_line", "__syncthreads", nth) for nth in (0, 1))
    assert first.rsplit(":", 1)[0] == second.rsplit(":", 1)[0]
    assert message.endswith(f"the threads of the block wait at different barriers: threads 0-31 wait at "
                            f"__syncthreads ({first}); threads 32-63 wait at __syncthreads ({second})")


def test_shuffle_from_an_exited_lane(dev, kernels):
    message = _fault(dev, kernels.kernel("shuffle_from_exited"), 1, 32, 0, (dev.alloc(128),))
    assert message == ("kernel shuffle_from_exited, block (0,0,0): thread 4 (warp 0, lane 4) reads lane 5 through "
                       f"__shfl_down_sync ({_site('shuffle_from_exited', '__shfl_down_sync')}), but lane 5 has exited")


def test_shuffle_from_a_lane_past_the_block(dev, kernels):
    message = _fault(dev, kernels.kernel("shuffle_partial_warp"), 1, 48, 0, (dev.alloc(256),))
    assert "thread 32 (warp 1, lane 0) reads lane 16 through __shfl_xor_sync" in message
    assert message.endswith("but lane 16 does not exist (the block's last warp is partial)")


def test_lanes_at_different_shuffles(dev, kernels):
    message = _fault(dev, kernels.kernel("shuffle_split_warp"), 1, 32, 0, (dev.alloc(128),))
    xor, down = _site("shuffle_split_warp", "__shfl_xor_sync"), _site("shuffle_split_warp", "__shfl_down_sync")
    assert f"warp divergence in warp 0: lanes 0x0000ffff wait at __shfl_xor_sync ({xor})" in message
    assert message.endswith(f"thread 16 (lane 16) arrives at __shfl_down_sync ({down})")


@pytest.mark.parametrize("offset", [256, -1])
def test_canary_overwrite_names_kernel_and_buffer(dev, kernels, offset):
    target = dev.alloc(1024, "activations")
    dev.alloc(64, "bystander")
    message = _fault(dev, kernels.kernel("write_at"), 1, 1, 0, (target, offset, 1.0))
    side = "after its end (offsets 1024 to" if offset > 0 else "before its start (offsets -4 to -1)"
    assert message.startswith(f"kernel write_at wrote outside its buffers: buffer activations (1024 bytes at "
                              f"{target.ptr:#x}): ")
    assert side in message and "bystander" not in message
    dev.check_canaries()  # mended after the report


def test_dynamic_shared_memory_overflow(dev, kernels):
    x, y = dev.upload(np.ones(64, np.float32)), dev.alloc(256)
    message = _fault(dev, kernels.kernel("reverse_chunks"), 1, 64, 100, (y, x, 64, 1))
    assert message == ("kernel reverse_chunks, block (0,0,0): wrote past the end of its 100 bytes of dynamic shared "
                       "memory (at byte 100)")


def test_crashes_are_reported_and_the_process_goes_on(kernels):
    dev = SimDevice(stack_kib=64)
    out = dev.alloc(1024, "out")
    assert _fault(dev, kernels.kernel("deep_stack"), 1, 4, 0, (out, 100000)) == (
        "kernel deep_stack, block (0,0,0): thread 0 overflowed its 64 KiB stack (make the simulator's stacks larger)")
    assert _fault(dev, kernels.kernel("wild_pointer"), 1, 4, 0, (out,)).endswith(
        "thread 0: invalid memory access at address 0x10")
    assert _fault(dev, kernels.kernel("checks"), 2, 8, 0, (out,)) == (
        f"kernel checks, block (0,0,0): thread 3: assertion `threadIdx.x < 3` failed "
        f"({_site('checks', 'assert', column=False)})")
    assert _fault(dev, kernels.kernel("traps"), 1, 8, 0, (out,)) == (
        f"kernel traps, block (0,0,0): thread 7: __trap() ({_site('traps', '__trap')})")
    big = SimDevice(stack_kib=512)
    big.launch(kernels.kernel("deep_stack"), 1, 4, 0, (big.alloc(16), 100000))


def test_launch_errors(dev, kernels):
    out = dev.alloc(1024, "out")
    softmax = kernels.kernel("softmax_rows")
    cases = [
        ((softmax, 1, 32, 8, (out, out, 1)), "takes 4 arguments, not 3"),
        ((softmax, 1, 32, 8, (out, out, 1.5, 1)), r"argument 3 \(int N\): expected an integer, got 1.5"),
        ((softmax, 1, 32, 8, (out, 12345, 1, 1)), r"argument 2 \(const float\* __restrict__ inp\): 0x3039 is in no"),
        ((softmax, 1, 32, 8, (out, out, 2**40, 1)), "does not fit"),
        ((softmax, 1, 2048, 8, (out, out, 1, 1)), "block dimension x is 2048; it must be 1 to 1024"),
        ((softmax, 1, (32, 32, 2), 8, (out, out, 1, 1)), "a block of 2048 threads is more than CUDA's 1024"),
        ((softmax, 0, 32, 8, (out, out, 1, 1)), "grid dimension x is 0"),
        ((softmax, 1, 32, 10**6, (out, out, 1, 1)), "1000000 bytes of dynamic shared memory"),
        ((kernels.kernel("bounded"), 1, 128, 0, (out,)), r"__launch_bounds__\(64\) but launched with 128 threads"),
    ]
    for call, pattern in cases:
        with pytest.raises(LaunchError, match=pattern):
            dev.launch(*call)
    with pytest.raises(LaunchError, match="unknown schedule 'fast'"):
        dev.launch(kernels.kernel("say"), 1, 1, 0, (1,), schedule="fast")
    with pytest.raises(SimError, match="sim_tests.cu has no kernel named softmax"):
        kernels.kernel("softmax")


# --- compilation ---------------------------------------------------------------

def test_kernel_signatures(kernels):
    layernorm = kernels.kernel("layernorm_forward")
    assert layernorm.signature() == (
        "layernorm_forward(float* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd, "
        "const float* __restrict__ inp, const float* __restrict__ weight, const float* __restrict__ bias, int N, int C)")
    assert kernels.kernel("softmax_rows").max_threads == 1024
    assert kernels.kernel("bounded").max_threads == 64
    assert kernels.kernel("layernorm_forward").max_threads == 0


def test_compile_error_is_internal_with_file_and_line(cache_dir):
    source = 'extern "C" __global__ void broken(float* x) {\n    x[0] = not_declared;\n}\n'
    with pytest.raises(CompileError) as caught:
        compile_module(source, "broken.cu", cache_dir)
    message = str(caught.value)
    assert message.startswith("internal error: the host compiler rejected broken.cu for cuda-sim")
    assert "broken.cu:2:12: ‘not_declared’ was not declared in this scope\n      x[0] = not_declared;" in message
    assert "--- compiler log ---" in message and caught.value.log in message


def test_cache_is_keyed_by_source(tmp_path):
    source = 'extern "C" __global__ void one(int* p) { p[threadIdx.x] = %d; }\n'
    first = compile_module(source % 1, "one.cu", tmp_path)
    again = compile_module(source % 1, "one.cu", tmp_path)
    other = compile_module(source % 2, "one.cu", tmp_path)
    assert again is first and other.path != first.path
    assert sorted(p.name for p in (tmp_path / "cuda-sim").iterdir()) == sorted([first.path.name, other.path.name])


def test_the_plain_command_line_compiles_a_cuda_source(tmp_path):
    """g++ -include cuda_sim.h compiles the source NVRTC would, unchanged."""
    (tmp_path / "src.cu").write_text(KERNELS)
    done = subprocess.run([host_compiler(), *FLAGS, "-include", str(HEADER_PATH), "-x", "c++", "src.cu", "-o", "k.so"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


AARCH64_DRIVER = r"""extern "C" __global__ void block_sum(float* out, const float* in, int n) {
    __shared__ float partial[32];
    int t = threadIdx.x;
    float v = 0.0f;
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x) v += in[i];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (t % 32 == 0) partial[t / 32] = v;
    __syncthreads();
    if (t < 32) {
        v = t < (int)(blockDim.x / 32) ? partial[t] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (t == 0) atomicAdd(out, v);
    }
}
extern "C" __global__ void diverge(float* out, const float* in, int n) {
    if ((int)threadIdx.x >= n) return;
    __syncthreads();
}
extern "C" __global__ void deep(float* out, const float* in, int n) {
    volatile float big[200000];
    for (int i = 0; i < n; ++i) big[i] = i;
    out[0] = big[n - 1];
}
extern "C" __global__ void rounding(float* out, const float* in, int n) {
    out[threadIdx.x] = in[0] / in[1];  // depends on the rounding mode the fiber starts with
}
SEXPGPU_SIM_EXPORT_KERNEL(block_sum)
SEXPGPU_SIM_EXPORT_KERNEL(diverge)
SEXPGPU_SIM_EXPORT_KERNEL(deep)
SEXPGPU_SIM_EXPORT_KERNEL(rounding)
#include <sys/mman.h>
#include <fenv.h>
int main() {
    const size_t page = 4096, stride = 64 * 1024 + page, count = 1024;
    unsigned char* stacks = (unsigned char*)mmap(nullptr, stride * count, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    for (size_t i = 0; i < count; ++i) mprotect(stacks + i * stride, page, PROT_NONE);
    static float in[10000];
    for (int i = 0; i < 10000; ++i) in[i] = (float)(i % 7);
    float out = 0;
    void* args[3]; float* outp = &out; const float* inp = in; int n = 10000;
    args[0] = &outp; args[1] = &inp; args[2] = &n;
    char err[4096];
    int failures = 0;
    for (int sched = 0; sched < 2; ++sched) {
        out = 0;
        sexpgpu_sim::LaunchRequest req{sexpgpu_sim_kernel_block_sum(), args, {7, 1, 1}, {256, 1, 1}, 0, sched, stacks, stride, page, count};
        int rc = sexpgpu_sim_launch(&req, err, sizeof err);
        double want = 0; for (int i = 0; i < 10000; ++i) want += in[i];
        printf("block_sum schedule %d: rc=%d out=%g want=%g\n", sched, rc, out, want);
        failures += rc != 0 || out != want;
    }
    n = 40;
    sexpgpu_sim::LaunchRequest d{sexpgpu_sim_kernel_diverge(), args, {1, 1, 1}, {64, 1, 1}, 0, 0, stacks, stride, page, count};
    int rc = sexpgpu_sim_launch(&d, err, sizeof err);
    printf("diverge: rc=%d %s\n", rc, err); failures += rc != 1;
    n = 200000;
    sexpgpu_sim::LaunchRequest o{sexpgpu_sim_kernel_deep(), args, {1, 1, 1}, {4, 1, 1}, 0, 0, stacks, stride, page, count};
    rc = sexpgpu_sim_launch(&o, err, sizeof err);
    printf("deep: rc=%d %s\n", rc, err); failures += rc != 1 || !strstr(err, "overflowed");
    // The caller runs with another rounding mode; fibers start with round-to-nearest.
    float res[32]; float* resp = res; in[0] = 1.0f; in[1] = 3.0f; args[0] = &resp;
    fesetround(FE_UPWARD);
    sexpgpu_sim::LaunchRequest r{sexpgpu_sim_kernel_rounding(), args, {1, 1, 1}, {32, 1, 1}, 0, 1, stacks, stride, page, count};
    rc = sexpgpu_sim_launch(&r, err, sizeof err);
    int mode_after = fegetround();
    fesetround(FE_TONEAREST);
    volatile float a = 1.0f, b = 3.0f; float nearest = a / b;
    printf("rounding: rc=%d fiber %a nearest %a caller mode restored %d\n", rc, res[0], nearest, mode_after == FE_UPWARD);
    failures += rc != 0 || res[0] != nearest || mode_after != FE_UPWARD;
    printf("%s\n", failures ? "FAILED" : "ALL OK");
    return failures != 0;
}
"""


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs an aarch64 machine: a cross g++ (g++-aarch64-linux-gnu) and qemu-user")
def test_aarch64_fibers(tmp_path):
    """The aarch64 context switch: barriers, shuffles, both schedules, the stack guard, the FP control register."""
    (tmp_path / "driver.cpp").write_text(AARCH64_DRIVER)
    flags = [f for f in FLAGS if f != "-shared"] + ["--param=stack-clash-protection-guard-size=12"]
    subprocess.run(["aarch64-linux-gnu-g++", *flags, "-include", str(HEADER_PATH), "-x", "c++", "driver.cpp",
                    "-o", "driver", "-lm"], cwd=tmp_path, check=True)
    done = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", "./driver"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.endswith("ALL OK\n"), done.stdout + done.stderr


def test_bf16_bits_for_by_value_arguments():
    assert [bf16_bits(v) for v in (1.0, 1 + 2**-8, 1 + 3 * 2**-8, float("nan"), -float("inf"))] == [
        0x3F80, 0x3F80, 0x3F82, 0x7FFF, 0xFF80]


def test_schedule_names():
    assert SCHEDULES == (ROUND_ROBIN, WARP_AFTER_WARP) == ("round-robin", "warp-after-warp")
