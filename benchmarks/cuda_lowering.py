"""The CUDA lowering on GPT-2 small: each pass's time and NVRTC's, cold and warm.

    python benchmarks/cuda_lowering.py [--example examples/gpt2-small.sx] [--arch sm_90 sm_80]

Runs the training pipeline, then `match-patterns`, `fuse`, `plan-buffers` and `emit-cuda` on
examples/gpt2-small.sx (12 layers, width 768, 12 heads, sequence 1024,
vocabulary 50304, bf16), and compiles the translation unit with NVRTC for
each architecture twice: into an empty kernel cache (cold) and again (warm).
Prints the seconds of each step, the kernels and launches, and the registers
of the largest kernel. The goal for the whole `explain --device cuda --target
sm_90` is under 10 s cold and under 2 s warm; torch.compile spends about 27 s
compiling this model's training step.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

from sexpgpu.dialects.core import tune_gc_for_large_ir
from sexpgpu.passes import load_all
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline
from sexpgpu.passes.pipelines import TRAINING_PIPELINE, cuda_lowering

from sexpgpu.targets import register_targets

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(ROOT / "examples" / "gpt2-small.sx"))
    parser.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"])
    args = parser.parse_args()
    tune_gc_for_large_ir()

    unit = CompilationUnit(path=args.example, text=Path(args.example).read_text())
    start = time.perf_counter()
    PassManager(parse_pipeline(TRAINING_PIPELINE)).run(unit)
    training = time.perf_counter() - start
    load_all()
    register_targets()
    # Lowered for the first architecture (its column reductions split for that device); one unit compiled for each.
    lowering = cuda_lowering(args.arch[0])
    manager = PassManager(parse_pipeline(lowering), timing=True, log=io.StringIO())
    manager.run(unit)
    module = unit.module
    source = next(op.attributes["text"] for op in module.body.ops if op.name == "kern.source")
    kernels = sum(op.name == "kern.kernel" for op in module.body.ops)
    print(f"{Path(args.example).name}: training pipeline {training:.2f} s; {lowering}")
    for name, seconds, before, after in manager.timings:
        print(f"  {name:14} {seconds:6.2f} s  {before:>6} -> {after:<6} ops")
    print(f"  {kernels} kernels in one translation unit of {len(source) // 1024} KiB")
    for graph, facts in unit.facts.lowering.graphs.items():
        print(f"  {graph:28} {facts['nodes']:>5} nodes, {facts['kernels']:>4} kernels per call "
              f"({facts['launches']} launches, {facts['gemms']} GEMMs), {len(facts['fused_groups'])} fused groups")

    from sexpgpu.backends.cuda.nvrtc import compile_cubin

    with tempfile.TemporaryDirectory() as cache:
        os.environ["SEXPGPU_CACHE"] = cache
        for arch in args.arch:
            start = time.perf_counter()
            cubin = compile_cubin(source, arch, name="gpt2-small")
            cold = time.perf_counter() - start
            start = time.perf_counter()
            compile_cubin(source, arch, name="gpt2-small")
            warm = time.perf_counter() - start
            largest = max(cubin.kernels.values(), key=lambda k: k.registers)
            print(f"  NVRTC {arch}: cold {cold:.2f} s, warm {warm * 1000:.1f} ms; "
                  f"{len(cubin.kernels)} kernels, {len(cubin.spilling())} spilling, "
                  f"most registers {largest.registers} ({largest.name})")


if __name__ == "__main__":
    main()
