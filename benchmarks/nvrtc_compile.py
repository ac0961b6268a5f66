"""NVRTC compile times: one typical kernel, ~50 kernels as one module or as one module each, and the warm cache.

The kernels are in the style emit-cuda writes for a transformer's training step: fused bf16 pointwise
groups with 128-bit loads, warp-per-row softmax, block layernorm, a cross-entropy row and an AdamW
update, each with its own constants so that ptxas compiles every one. Each cold figure compiles into
an empty cache; the warm ones read the caches those runs filled. A module per kernel is timed
serially and on a thread pool (NVRTC releases the GIL while it compiles).

Run: python benchmarks/nvrtc_compile.py [--arch sm_90] [--kernels 50]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sexpgpu.backends.cuda.nvrtc import DEFAULT_OPTIONS, compile_cubin, nvrtc_toolchain

PRELUDE = "#include <cuda_bf16.h>\n#define SX_NEG_INF __int_as_float(0xff800000u)\n"

#: Bodies of fused pointwise groups, f32 math on (a, b) with a constant c.
POINTWISE_BODIES = [
    "0.5f * a * (1.f + tanhf(0.7978845608f * (a + 0.044715f * a * a * a))) * b + c",
    "a / (1.f + expf(-a)) * b * c",
    "fmaxf(a, 0.f) * b + c * a",
    "a + b * c",
    "(a - c) * rsqrtf(b * b + 1e-5f)",
]

POINTWISE = r"""
extern "C" __global__ void fused_{i}(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ y,
                                     __nv_bfloat16* __restrict__ out, int n) {{
    const float c = {c}f;
    const int first = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (first + 8 <= n) {{
        const uint4 xv = *reinterpret_cast<const uint4*>(x + first);
        const uint4 yv = *reinterpret_cast<const uint4*>(y + first);
        uint4 ov;
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
        const __nv_bfloat162* yp = reinterpret_cast<const __nv_bfloat162*>(&yv);
        __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&ov);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {{
            const float2 av = __bfloat1622float2(xp[j]), bv = __bfloat1622float2(yp[j]);
            float a = av.x, b = bv.x;
            const float lo = {body};
            a = av.y; b = bv.y;
            const float hi = {body};
            op[j] = __floats2bfloat162_rn(lo, hi);
        }}
        *reinterpret_cast<uint4*>(out + first) = ov;
    }} else {{
        for (int j = first; j < n; ++j) {{
            const float a = __bfloat162float(x[j]), b = __bfloat162float(y[j]);
            out[j] = __float2bfloat16({body});
        }}
    }}
}}
"""

SOFTMAX = r"""
extern "C" __global__ void softmax_{i}(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
                                       int rows, int cols) {{
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const __nv_bfloat16* xr = x + (size_t)row * cols;
    float m = SX_NEG_INF, s = 0.f;
    for (int i = lane; i < cols; i += 32) {{
        const float v = __bfloat162float(xr[i]) * {c}f;
        const float next = fmaxf(m, v);
        s = s * expf(m - next) + expf(v - next);
        m = next;
    }}
    for (int o = 16; o > 0; o >>= 1) {{
        const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
        const float next = fmaxf(m, om);
        s = s * expf(m - next) + os * expf(om - next);
        m = next;
    }}
    for (int i = lane; i < cols; i += 32)
        y[(size_t)row * cols + i] = __float2bfloat16(expf(__bfloat162float(xr[i]) * {c}f - m) / s);
}}
"""

LAYERNORM = r"""
extern "C" __global__ void layernorm_{i}(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ b, __nv_bfloat16* __restrict__ y,
                                         float* __restrict__ stats, int cols) {{
    __shared__ float partial[2][32];
    const size_t row = blockIdx.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float sum = 0.f, squares = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {{
        const float v = __bfloat162float(x[row * cols + i]);
        sum += v; squares += v * v;
    }}
    for (int o = 16; o > 0; o >>= 1) {{
        sum += __shfl_xor_sync(0xffffffffu, sum, o); squares += __shfl_xor_sync(0xffffffffu, squares, o);
    }}
    if (lane == 0) {{ partial[0][warp] = sum; partial[1][warp] = squares; }}
    __syncthreads();
    sum = lane < warps ? partial[0][lane] : 0.f; squares = lane < warps ? partial[1][lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {{
        sum += __shfl_xor_sync(0xffffffffu, sum, o); squares += __shfl_xor_sync(0xffffffffu, squares, o);
    }}
    const float mean = sum / cols, rstd = rsqrtf(squares / cols - mean * mean + {c}f);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {{
        const float n = (__bfloat162float(x[row * cols + i]) - mean) * rstd;
        y[row * cols + i] = __float2bfloat16(n * __bfloat162float(w[i]) + __bfloat162float(b[i]));
    }}
    if (threadIdx.x == 0) {{ stats[2 * row] = mean; stats[2 * row + 1] = rstd; }}
}}
"""

CROSS_ENTROPY = r"""
extern "C" __global__ void cross_entropy_{i}(const __nv_bfloat16* __restrict__ logits, const int* __restrict__ targets,
                                             float* __restrict__ losses, __nv_bfloat16* __restrict__ dlogits,
                                             int vocab, float scale) {{
    __shared__ float partial[2][32];
    const size_t row = blockIdx.x;
    const __nv_bfloat16* lr = logits + row * vocab;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float m = SX_NEG_INF, s = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {{
        const float v = __bfloat162float(lr[i]), next = fmaxf(m, v);
        s = s * expf(m - next) + expf(v - next); m = next;
    }}
    for (int o = 16; o > 0; o >>= 1) {{
        const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
        const float next = fmaxf(m, om); s = s * expf(m - next) + os * expf(om - next); m = next;
    }}
    if (lane == 0) {{ partial[0][warp] = m; partial[1][warp] = s; }}
    __syncthreads();
    m = lane < warps ? partial[0][lane] : SX_NEG_INF; s = lane < warps ? partial[1][lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {{
        const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
        const float next = fmaxf(m, om); s = s * expf(m - next) + os * expf(om - next); m = next;
    }}
    const int target = targets[row];
    if (threadIdx.x == 0) losses[row] = (logf(s) + m - __bfloat162float(lr[target])) * {c}f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        dlogits[row * vocab + i] = __float2bfloat16((expf(__bfloat162float(lr[i]) - m) / s - (i == target)) * scale);
}}
"""

ADAMW = r"""
extern "C" __global__ void adamw_{i}(float4* __restrict__ p, const float4* __restrict__ g, float4* __restrict__ m,
                                     float4* __restrict__ v, int n4, const float* __restrict__ lr_step) {{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float lr = lr_step[0], t = lr_step[1];
    const float c1 = 1.f - powf(0.9f, t), c2 = 1.f - powf(0.95f, t);
    float4 pv = p[i], mv = m[i], vv = v[i];
    const float4 gv = g[i];
    float* ps = &pv.x; float* ms = &mv.x; float* vs = &vv.x; const float* gs = &gv.x;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {{
        ms[j] = 0.9f * ms[j] + 0.1f * gs[j];
        vs[j] = 0.95f * vs[j] + 0.05f * gs[j] * gs[j];
        ps[j] -= lr * ((ms[j] / c1) / (sqrtf(vs[j] / c2) + 1e-8f) + {c}f * ps[j]);
    }}
    p[i] = pv; m[i] = mv; v[i] = vv;
}}
"""


def generated_kernels(count: int) -> list[str]:
    """`count` kernel sources, each its own `extern "C"` kernel: mostly fused groups, as a step has."""
    kernels = []
    for i in range(count):
        c = f"{1.0 + i / 64:.6f}"
        kind = i % 10
        if kind < 5:
            kernels.append(POINTWISE.format(i=i, c=c, body=POINTWISE_BODIES[(i // 10 + kind) % len(POINTWISE_BODIES)]))
        else:
            template = {5: SOFTMAX, 6: LAYERNORM, 7: CROSS_ENTROPY, 8: ADAMW, 9: SOFTMAX}[kind]
            kernels.append(template.format(i=i, c=c))
    return kernels


def timed(action: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--kernels", type=int, default=50)
    args = parser.parse_args()
    kernels = generated_kernels(args.kernels)
    workers = os.cpu_count() or 1

    def each(kernel: str) -> object:
        return compile_cubin(PRELUDE + kernel, args.arch, name="kernel")

    with tempfile.TemporaryDirectory() as caches:
        def empty_cache(name: str) -> None:
            os.environ["SEXPGPU_CACHE"] = os.path.join(caches, name)

        empty_cache("first")
        located, toolchain = timed(nvrtc_toolchain)
        print(f"{toolchain.describe()}\n{workers} CPU cores, arch {args.arch}, {len(kernels)} kernels")
        print(f"locate NVRTC and its headers               {located * 1e3:8.1f} ms")
        first, _ = timed(lambda: compile_cubin(PRELUDE + kernels[0], args.arch, name="first"))
        print(f"first compile in the process (one kernel)  {first:8.2f} s   (loads NVRTC's builtins)")
        typical, module = timed(lambda: compile_cubin(PRELUDE + kernels[1], args.arch, name="typical"))
        [resources] = module.kernels.values()
        print(f"a typical kernel, cold                     {typical:8.2f} s   "
              f"({resources.name}: {resources.registers} registers, {resources.spill_stores} B spilled)")

        one_source = PRELUDE + "".join(kernels)
        empty_cache("one")
        one, module = timed(lambda: compile_cubin(one_source, args.arch, name="step"))
        assert len(module.kernels) == len(kernels) and not module.spilling()
        print(f"{len(kernels)} kernels as one module, cold           {one:8.2f} s")
        empty_cache("split")
        split_options = (*DEFAULT_OPTIONS, f"--split-compile={workers}")
        split, _ = timed(lambda: compile_cubin(one_source, args.arch, split_options, name="step"))
        print(f"  the same with --split-compile={workers:<2}          {split:8.2f} s")
        empty_cache("serial")
        serial, _ = timed(lambda: [each(k) for k in kernels])
        print(f"one module per kernel, serial, cold        {serial:8.2f} s")
        empty_cache("threads")
        with ThreadPoolExecutor(workers) as pool:
            pooled, _ = timed(lambda: list(pool.map(each, kernels)))
        print(f"one module per kernel, {workers:<2} threads, cold   {pooled:8.2f} s")

        empty_cache("one")
        warm_one, module = timed(lambda: compile_cubin(one_source, args.arch, name="step"))
        assert module.from_cache
        print(f"one module, warm cache                     {warm_one * 1e3:8.1f} ms")
        empty_cache("serial")
        warm_each, modules = timed(lambda: [each(k) for k in kernels])
        assert all(m.from_cache for m in modules)
        print(f"one module per kernel, warm cache          {warm_each * 1e3:8.1f} ms")

    fastest = min(("one module", one), ("one module, split compile", split), ("a module per kernel, threads", pooled),
                  key=lambda pair: pair[1])
    print(f"fastest cold: {fastest[0]}; one module costs {one / len(kernels) * 1e3:.0f} ms a kernel, "
          f"a module per kernel {serial / len(kernels) * 1e3:.0f} ms serially")


if __name__ == "__main__":
    main()
