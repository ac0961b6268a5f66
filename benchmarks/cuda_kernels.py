"""emit-cuda's kernel templates at GPT-2-small sizes: registers and spills, NVRTC and g++ compile times.

The selection is what a GPT-2-small training step (12 layers, width 768, 12 heads, sequence 1024,
vocabulary 50304, batch 8) asks of the templates, in f32 and in bf16 storage: layernorm forward and
backward, attention softmax forward and backward over rows of 1024, the cross-entropy tail, the
embedding's gather and scatter-add. For each kernel it prints ptxas's registers, spills and barriers
for sm_80 and sm_90; then NVRTC's time for the whole selection as one module (cold: an empty cache;
warm: the cache that run filled), cuda-sim's g++ time for the same source, and cuda-sim's time for
one launch of each family at a reduced size (the simulator proves semantics, not speed).

Run: python benchmarks/cuda_kernels.py
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from sexpgpu.backends.cuda.nvrtc import compile_cubin, nvrtc_toolchain
from sexpgpu.backends.cuda.render import templates as t
from sexpgpu.backends.cuda.render.prelude import translation_unit
from sexpgpu.backends.cuda.sim import SimDevice

WIDTH, SEQUENCE, VOCAB = 768, 1024, 50304


def selection() -> dict[str, object]:
    programs = {}
    for dtype in ("f32", "bf16"):
        programs |= {
            f"layernorm {dtype}": t.layernorm(WIDTH, dtype=dtype),
            f"layernorm_backward {dtype}": t.layernorm_backward(WIDTH, dtype=dtype),
            f"softmax {dtype}": t.softmax(SEQUENCE, dtype=dtype),
            f"softmax_backward {dtype}": t.softmax_backward(SEQUENCE, dtype=dtype),
            f"cross_entropy_forward {dtype}": t.cross_entropy_forward(VOCAB, reduction="mean", dtype=dtype),
            f"cross_entropy_backward {dtype}": t.cross_entropy_backward(VOCAB, mean=True, dtype=dtype),
            f"gather {dtype}": t.gather(WIDTH, dtype=dtype),
            f"scatter_add {dtype}": t.scatter_add(WIDTH, dtype=dtype),
        }
    return programs


def main() -> None:
    programs = selection()
    kernels = {k.name: k for p in programs.values() for k in p.kernels}
    source = translation_unit(kernels.values())
    print(nvrtc_toolchain().describe())
    print(f"{len(programs)} families, {len(kernels)} kernels, {len(source.splitlines())} lines of CUDA C\n")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SEXPGPU_CACHE"] = cache
        cubins = {}
        for arch in ("sm_80", "sm_90"):
            start = time.perf_counter()
            cubins[arch] = compile_cubin(source, arch, name="gpt2_small_templates")
            cold = time.perf_counter() - start
            start = time.perf_counter()
            compile_cubin(source, arch, name="gpt2_small_templates")
            print(f"NVRTC {arch}: {cold:.2f} s cold, {1000 * (time.perf_counter() - start):.1f} ms warm")
        print(f"\n{'kernel':<72} {'sm_80 regs':>10} {'sm_90 regs':>10} {'spills':>7} {'barriers':>8}")
        for name in kernels:
            a, b = cubins["sm_80"].kernels[name], cubins["sm_90"].kernels[name]
            spills = a.spill_stores + a.spill_loads + b.spill_stores + b.spill_loads
            print(f"{name:<72} {a.registers:>10} {b.registers:>10} {spills:>7} {b.barriers:>8}")
        start = time.perf_counter()
        device = SimDevice()
        module = device.compile(source, "gpt2_small_templates.cu", cache_dir=None)
        print(f"\ncuda-sim g++: {time.perf_counter() - start:.2f} s cold")
        simulate(device, module)


def simulate(device: SimDevice, module) -> None:
    """One launch sequence of each bf16 family at 64 rows (the simulator's speed, for test sizing)."""
    rows, table_rows = 64, 1000
    rng = np.random.default_rng(0)
    print(f"\ncuda-sim, {rows} rows (or positions, into {table_rows} table rows) of each bf16 family, both schedules:")
    for label, program in selection().items():
        if not label.endswith("bf16"):
            continue
        cols = VOCAB if label.startswith("cross_entropy") else SEQUENCE if label.startswith("softmax") else WIDTH
        sizes = {"rows": rows, "positions": rows, "table_rows": table_rows, "out_rows": table_rows}
        sizes = {n: sizes[n] for n in program.sizes}
        values: dict[str, object] = dict(sizes)
        for p in program.params:
            if p.role == "scalar":
                continue
            if p.name in ("targets", "indices"):
                values[p.name] = device.upload(rng.integers(0, min(cols, table_rows), rows).astype(np.int32))
            else:  # room for any operand of the family; small values whatever the dtype reads them as
                words = max(rows * cols, table_rows * WIDTH)
                values[p.name] = device.upload(rng.standard_normal(words).astype(np.float32) * 1e-3, p.name)
        start = time.perf_counter()
        threads = 0
        for bound in program.launches(values):
            kernel = module.kernel(bound.kernel.name)
            device.compare_schedules(kernel, bound.shape.grid, bound.shape.block, bound.shape.shared_bytes,
                                     bound.arguments)
            threads += int(np.prod(bound.shape.grid) * np.prod(bound.shape.block))
        elapsed = time.perf_counter() - start
        print(f"  {label:<28} {elapsed * 1000:8.1f} ms  ({threads} threads a schedule)")
        for value in values.values():
            if not isinstance(value, int):
                device.free(value)


if __name__ == "__main__":
    main()
