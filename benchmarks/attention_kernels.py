"""The fused attention kernels (backends/cuda/render/attention.py) at GPT-2-small sizes: a roofline model, and
forward+backward TFLOP/s against torch's scaled_dot_product_attention where there is a GPU.

The model: B=4, H=12, T=1024, d=64, 12 layers, 8 microbatches, bf16 storage, causal. For each launch of
one layer's microbatch it prints the device-memory bytes (every operand read once and every result written
once: the tiles a block re-reads come from L2, which holds a head's K and V, 256 KiB), the FLOPs the kernel
executes (block-granular causal skipping: the diagonal block is computed whole, then masked) and the useful
ones (FlashAttention-2's convention: forward 4*B*H*T^2*d, halved when causal; backward 2.5 times that; the
backward here executes 3.5 times, as dK/dV and dQ each recompute S and dP instead of adding dQ atomically),
its arithmetic intensity and its modelled time on an H200: max(bytes / 4.8 TB/s, FLOPs / peak), the peak
being the tensor cores' 989 TFLOP/s (dense bf16) for the products made by wmma (every bf16 kernel but
`delta` at d=64) and the CUDA cores' 67 TFLOP/s (f32 FMA) for the rest (the H200 of the step estimate's
table, `passes/roofline.GPUS`, with its datasheet source). Then the step's totals (12 layers x 8 microbatches), and for scale
the bytes an unfused path cannot avoid: the T x T scores, probabilities, their gradient and dS each
written once and read once in bf16 (the materialised lowering measured in issue 17 moves about 18 such
passes, some in f32).

With `--gpu` (and where torch with CUDA and the CUDA runtime are present) it also times forward+backward
on the device: these kernels, compiled by NVRTC and launched through sexpgpu's runtime, and
torch.nn.functional.scaled_dot_product_attention (is_causal=True, bf16, torch's choice of backend) on the
same GPU and shapes, and prints each one's TFLOP/s by the useful-FLOP convention (FlashAttention-2 reaches
about 230 causal TFLOP/s on an H100 at this size). `--json PATH` writes every figure.

Run: python benchmarks/attention_kernels.py [--gpu] [--json PATH] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from sexpgpu.backends.cuda.render.attention import (
    DKDV_ONE_PASS_HEAD_DIM,
    HEADS,
    PACKED,
    WMMA_SIDE,
    WMMA_WARPS,
    attention_backward,
    attention_forward,
    tensor_cores_fit,
)
from sexpgpu.backends.cuda.render.kernel_source import KernelProgram
from sexpgpu.passes.roofline import GPUS

BATCH, HEADS_COUNT, SEQ, HEAD_DIM, LAYERS, MICROBATCHES = 4, 12, 1024, 64, 12, 8
#: The GPU the model times (its figures and their datasheet sources: `passes/roofline.GPUS`).
GPU = GPUS["h200"]
BANDWIDTH = GPU.bandwidth
TENSOR_PEAK = GPU.bf16_peak
FMA_PEAK = GPU.f32_peak
BF16, F32 = 2, 4


def causal_pairs(seq: int, block: int) -> int:
    """(query, key) pairs a causal kernel computes when it stops at the diagonal block of `block` rows."""
    return sum(min(seq, q0 + block) * min(block, seq - q0) for q0 in range(0, seq, block))


def launches(program_forward: KernelProgram, program_backward: KernelProgram) -> list[dict[str, object]]:
    """Each launch of one layer's microbatch: bytes, executed and useful FLOPs, the peak it runs at."""
    b, h, t, d = BATCH, HEADS_COUNT, SEQ, HEAD_DIM
    tensor = b * t * h * d * BF16
    stat = b * h * t * F32
    cores = tensor_cores_fit(d, "bf16")
    block = WMMA_SIDE * WMMA_WARPS if cores else 32
    pairs = causal_pairs(t, block) * b * h
    useful_forward = 4 * b * h * t * t * d / 2
    peak = TENSOR_PEAK if cores else FMA_PEAK
    # dkdv makes S^T and dP^T once per pass over the queries, then dV and dK: 2 FLOPs a pair and feature each.
    passes = 1 if d <= DKDV_ONE_PASS_HEAD_DIM or not cores else 2
    return [
        {"launch": "forward", "kernel": program_forward.steps[0].kernel.name, "bytes": 4 * tensor + stat,
         "flops": 4 * pairs * d, "useful": useful_forward, "peak": peak},
        {"launch": "backward delta", "kernel": program_backward.steps[0].kernel.name, "bytes": 2 * tensor + stat,
         "flops": 2 * b * h * t * d, "useful": 0.0, "peak": FMA_PEAK},
        {"launch": "backward dk dv", "kernel": program_backward.steps[1].kernel.name,
         "bytes": 6 * tensor + 2 * stat, "flops": 2 * (2 * passes + 2) * pairs * d, "useful": 1.5 * useful_forward,
         "peak": peak},
        {"launch": "backward dq", "kernel": program_backward.steps[2].kernel.name, "bytes": 5 * tensor + 2 * stat,
         "flops": 6 * pairs * d, "useful": 1.0 * useful_forward, "peak": peak},
    ]


def model() -> dict[str, object]:
    scale = 1.0 / math.sqrt(HEAD_DIM)
    forward = attention_forward(HEAD_DIM, causal=True, scale=scale, dtype="bf16", layout=PACKED)
    backward = attention_backward(HEAD_DIM, causal=True, scale=scale, dtype="bf16", layout=PACKED)
    rows = launches(forward, backward)
    per_step = LAYERS * MICROBATCHES
    print(f"GPT-2 small attention: B={BATCH} H={HEADS_COUNT} T={SEQ} d={HEAD_DIM}, {LAYERS} layers x "
          f"{MICROBATCHES} microbatches, bf16, causal, packed layout; {GPU.name} {BANDWIDTH / 1e12:.1f} TB/s, "
          f"{TENSOR_PEAK / 1e12:.0f} TFLOP/s tensor, {FMA_PEAK / 1e12:.0f} TFLOP/s FMA\n")
    print(f"{'launch':16} {'MB':>8} {'GFLOP exec':>11} {'GFLOP useful':>13} {'FLOP/B':>8} {'peak':>6} {'us':>8}")
    total_bytes = total_flops = total_useful = total_time = 0.0
    for row in rows:
        seconds = max(row["bytes"] / BANDWIDTH, row["flops"] / row["peak"])
        row["intensity"] = row["flops"] / row["bytes"]
        row["modelled_us"] = seconds * 1e6
        total_bytes += row["bytes"]
        total_flops += row["flops"]
        total_useful += row["useful"]
        total_time += seconds
        print(f"{row['launch']:16} {row['bytes'] / 1e6:8.2f} {row['flops'] / 1e9:11.2f} {row['useful'] / 1e9:13.2f} "
              f"{row['intensity']:8.0f} {row['peak'] / 1e12:6.0f} {seconds * 1e6:8.1f}")
    unfused = 8 * BATCH * HEADS_COUNT * SEQ * SEQ * BF16
    print(f"\nper step ({per_step} layer-microbatches): {total_bytes * per_step / 1e9:.2f} GB, "
          f"{total_flops * per_step / 1e12:.2f} TFLOP executed ({total_useful * per_step / 1e12:.2f} useful), "
          f"modelled {total_time * per_step * 1e3:.2f} ms")
    print(f"unfused floor for comparison: {unfused * per_step / 1e9:.1f} GB of T x T traffic per step "
          f"({unfused * per_step / BANDWIDTH * 1e3:.1f} ms at full bandwidth)")
    return {"launches": rows, "step_bytes": total_bytes * per_step, "step_flops": total_flops * per_step,
            "step_useful_flops": total_useful * per_step, "step_modelled_ms": total_time * per_step * 1e3,
            "unfused_floor_bytes": unfused * per_step}


def gpu_unavailable() -> str | None:
    """Why the GPU part cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from sexpgpu.backends.cuda.selection import runtime_unavailable
    return runtime_unavailable("cuda")


def time_ours(repeats: int) -> float:
    """Seconds per forward+backward of these kernels on the GPU (heads layout, bf16, causal)."""
    from sexpgpu.backends.cuda.render.prelude import translation_unit
    from sexpgpu.backends.cuda.runtime import KernelSource
    from sexpgpu.backends.cuda.selection import open_runtime

    scale = 1.0 / math.sqrt(HEAD_DIM)
    programs = [attention_forward(HEAD_DIM, causal=True, scale=scale, dtype="bf16", layout=HEADS),
                attention_backward(HEAD_DIM, causal=True, scale=scale, dtype="bf16", layout=HEADS)]
    runtime = open_runtime("cuda")
    try:
        module = runtime.load_module(KernelSource("attention_bench", translation_unit(
            k for p in programs for k in p.kernels)))
        rng = np.random.default_rng(0)
        tensor = BATCH * HEADS_COUNT * SEQ * HEAD_DIM
        spans = {}
        for name in ("q", "k", "v", "do"):
            spans[name] = runtime.allocate(tensor * BF16, name)
            runtime.upload(spans[name], rng.standard_normal(tensor).astype(ml_dtypes.bfloat16))
        for name in ("o", "dq", "dk", "dv"):
            spans[name] = runtime.allocate(tensor * BF16, name)
        for name in ("lse", "delta"):
            spans[name] = runtime.allocate(BATCH * HEADS_COUNT * SEQ * F32, name)
        values = spans | {"batch": BATCH, "heads": HEADS_COUNT, "seq": SEQ}
        bound = [launch for p in programs for launch in p.launches(values)]
        kernels = [module.function(launch.kernel.name) for launch in bound]

        def step() -> None:
            for kernel, launch in zip(kernels, bound):
                runtime.launch(kernel, launch.shape.grid, launch.shape.block, launch.shape.shared_bytes,
                               launch.arguments)

        step()
        runtime.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        runtime.synchronize()
        return (time.perf_counter() - start) / repeats
    finally:
        runtime.close()


def time_torch(repeats: int) -> tuple[float, str]:
    """Seconds per forward+backward of scaled_dot_product_attention, and the torch version."""
    import torch
    import torch.nn.functional as F

    shape = (BATCH, HEADS_COUNT, SEQ, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, torch.__version__


def gpu(repeats: int) -> dict[str, object]:
    useful = 4 * BATCH * HEADS_COUNT * SEQ * SEQ * HEAD_DIM / 2 * (1 + 2.5)
    ours = time_ours(repeats)
    theirs, version = time_torch(repeats)
    print(f"\nGPU forward+backward, B={BATCH} H={HEADS_COUNT} T={SEQ} d={HEAD_DIM} bf16 causal, {repeats} repeats:")
    print(f"  sexpgpu fused attention   {ours * 1e3:8.3f} ms  {useful / ours / 1e12:7.1f} TFLOP/s")
    print(f"  torch {version} SDPA  {theirs * 1e3:8.3f} ms  {useful / theirs / 1e12:7.1f} TFLOP/s")
    return {"ours_ms": ours * 1e3, "ours_tflops": useful / ours / 1e12, "torch_ms": theirs * 1e3,
            "torch_tflops": useful / theirs / 1e12, "torch_version": version}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also time forward+backward on the GPU")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    figures: dict[str, object] = {"model": model()}
    if args.gpu:
        reason = gpu_unavailable()
        if reason:
            print(f"\nGPU part not run: {reason}")
            figures["gpu"] = {"skipped": reason}
        else:
            figures["gpu"] = gpu(args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
