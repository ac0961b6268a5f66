"""cuda-sim's speed: context switches, synchronisation points, and a softmax kernel's throughput.

    python benchmarks/cuda_sim.py [--switches 2000000] [--repeats 5]

Prints, each the median of `--repeats` runs:
- the cost of one context switch between two fibers with cuda-sim's
  hand-written switch, and with glibc's swapcontext, measured in this run by
  the same ping-pong loop compiled into one shared object (swapcontext saves
  and restores the signal mask with a system call each time);
- synchronisation points per second through the simulator's scheduler: a
  block of 1024 threads meeting at `__syncwarp` and at `__syncthreads` in a
  loop, under each schedule;
- an llm.c-style softmax (a block per row, warp shuffles and shared memory)
  on the simulator: milliseconds per launch and elements per second, next to
  numpy's softmax of the same rows.
The kernels are compiled (or found in the cache) before anything is timed.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from sexpgpu.backends.cuda.sim import SCHEDULES, SimDevice, compile_module
from sexpgpu.backends.cuda.sim.compiler import FLAGS, HEADER_PATH, host_compiler

SWITCH_BENCH = r"""
#include <time.h>
#include <ucontext.h>

static double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// cuda-sim's switch: the fiber is started as the runtime starts a kernel
// thread, with a "kernel" that switches straight back, forever.
static void* main_sp;
static void* fiber_sp;
static void bounce(void* const*) {
    for (;;) sexpgpu_sim_switch(&fiber_sp, main_sp);
}
extern "C" __attribute__((visibility("default"))) double fiber_switch_ns(long n) {
    alignas(16) static unsigned char stack[65536];
    static sexpgpu_sim::KernelInfo info{sexpgpu_sim::kAbiVersion, "bounce", bounce, 0, nullptr, 0};
    static sexpgpu_sim::LaunchRequest request{};
    static sexpgpu_sim::Thread fiber{};
    request.kernel = &info;
    sexpgpu_sim::g.req = &request;
    fiber_sp = sexpgpu_sim::prepare_stack(stack + sizeof stack, &fiber);
    double t0 = now();
    for (long i = 0; i < n; ++i) sexpgpu_sim_switch(&main_sp, fiber_sp);
    return (now() - t0) / (2.0 * n) * 1e9;
}

static ucontext_t main_context, fiber_context;
static void bounce_ucontext() {
    for (;;) swapcontext(&fiber_context, &main_context);
}
extern "C" __attribute__((visibility("default"))) double swapcontext_ns(long n) {
    static unsigned char stack[65536];
    getcontext(&fiber_context);
    fiber_context.uc_stack.ss_sp = stack;
    fiber_context.uc_stack.ss_size = sizeof stack;
    fiber_context.uc_link = nullptr;
    makecontext(&fiber_context, bounce_ucontext, 0);
    double t0 = now();
    for (long i = 0; i < n; ++i) swapcontext(&main_context, &fiber_context);
    return (now() - t0) / (2.0 * n) * 1e9;
}
"""

KERNELS = r"""
extern "C" __global__ void warp_syncs(int rounds) {
    for (int i = 0; i < rounds; ++i) __syncwarp();
}
extern "C" __global__ void block_syncs(int rounds) {
    for (int i = 0; i < rounds; ++i) __syncthreads();
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
extern "C" __global__ void softmax_rows(float* __restrict__ out, const float* __restrict__ inp, int C) {
    extern __shared__ float shared[];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* x = inp + (size_t)blockIdx.x * C;
    float* y = out + (size_t)blockIdx.x * C;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < C; i += blockDim.x) m = fmaxf(m, x[i]);
    m = warp_max(m);
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    m = -INFINITY;
    for (int i = 0; i < warps; ++i) m = fmaxf(m, shared[i]);
    float s = 0.0f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        float e = expf(x[i] - m);
        y[i] = e;
        s += e;
    }
    s = warp_sum(s);
    __syncthreads();
    if (lane == 0) shared[warp] = s;
    __syncthreads();
    s = 0.0f;
    for (int i = 0; i < warps; ++i) s += shared[i];
    float inv = 1.0f / s;
    for (int i = threadIdx.x; i < C; i += blockDim.x) y[i] *= inv;
}
"""


def median_of(repeats: int, run) -> float:
    return statistics.median(run() for _ in range(repeats))


def switch_costs(switches: int, repeats: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "switch_bench.cpp"
        source.write_text(SWITCH_BENCH)
        subprocess.run([host_compiler(), *FLAGS, "-include", str(HEADER_PATH), "-x", "c++", str(source),
                        "-o", str(Path(work) / "switch_bench.so")], check=True)
        library = ctypes.CDLL(str(Path(work) / "switch_bench.so"))
    for name in ("fiber_switch_ns", "swapcontext_ns"):
        getattr(library, name).restype = ctypes.c_double
        getattr(library, name).argtypes = (ctypes.c_long,)
    fiber = median_of(repeats, lambda: library.fiber_switch_ns(switches))
    glibc = median_of(repeats, lambda: library.swapcontext_ns(switches))
    return fiber, glibc


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switches", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    fiber, glibc = switch_costs(args.switches, args.repeats)
    print(f"context switch, cuda-sim fibers:  {fiber:7.1f} ns  ({1e3 / fiber:6.1f} M switches/s)")
    print(f"context switch, glibc swapcontext: {glibc:7.1f} ns  ({1e3 / glibc:6.1f} M switches/s)  "
          f"{glibc / fiber:.1f}x slower")

    dev = SimDevice()
    module = compile_module(KERNELS, "cuda_sim_bench.cu")
    rounds, threads = 200, 1024
    for schedule in SCHEDULES:
        for kernel in ("warp_syncs", "block_syncs"):
            seconds = median_of(args.repeats, lambda k=kernel, s=schedule: timed(
                lambda: dev.launch(module.kernel(k), 1, threads, 0, (rounds,), schedule=s)))
            print(f"{kernel:<11} {schedule:<15} {rounds * threads / seconds / 1e6:6.2f} M sync points/s "
                  f"({seconds / (rounds * threads) * 1e9:5.0f} ns each, 1024 threads)")

    for rows, cols, block in ((1024, 1024, 256), (64, 50304, 1024)):
        softmax_case(dev, module.kernel("softmax_rows"), rows, cols, block, args.repeats)


def softmax_case(dev: SimDevice, kernel, rows: int, cols: int, block: int, repeats: int) -> None:
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    dx, dy = dev.upload(x, "x"), dev.alloc(x.nbytes, "y")
    sim = median_of(repeats, lambda: timed(lambda: dev.launch(kernel, rows, block, block // 32 * 4, (dy, dx, cols))))

    def numpy_softmax():
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    reference = median_of(repeats, lambda: timed(numpy_softmax))
    print(f"softmax {rows}x{cols}, block {block}: {sim * 1e3:8.1f} ms per launch, "
          f"{rows * cols / sim / 1e6:6.1f} M elements/s (numpy: {reference * 1e3:6.1f} ms)")
    dev.free(dx)
    dev.free(dy)

if __name__ == "__main__":
    main()
