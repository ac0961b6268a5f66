"""The train graph's launches and their device-memory bytes, with and without `gemm-layouts`.

    python benchmarks/gemm_layouts.py [--example examples/gpt2-small.sx] [--graph train]

Runs the training pipeline, then the CUDA lowering up to `fuse` twice: without
`gemm-layouts` (`match-patterns,fuse`) and with it as `CUDA_LOWERING` runs it
(`gemm-layouts{transposes=false},match-patterns,gemm-layouts,fuse`).
For one call of the graph it prints the kernels it runs (launches and GEMMs), the GEMMs
by their transpose flags (nn, nt, tn, tt), and by kernel family the launches and the
bytes they move: each operand read once and each result written once, at its dtype's
width (a kernel that reads a buffer through a broadcast or gather counts the buffer,
not what it touches). Those are the tensors crossing launch boundaries; a GEMM counts
A, B, its bias or C, and D.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from sexpgpu.dialects.core import Operation, tune_gc_for_large_ir
from sexpgpu.passes import load_all
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline
from sexpgpu.passes.pipelines import TRAINING_PIPELINE

from sexpgpu.targets import register_targets

ROOT = Path(__file__).resolve().parents[1]
WIDTH = {"f32": 4, "bf16": 2, "i32": 4, "i64": 8, "i1": 1}


def _bytes(values) -> int:
    return sum(v.type.numel * WIDTH[v.type.dtype] for v in values)


def _family(op: Operation) -> str:
    """A launch's kernel family: its symbol without the hash and the sizes (`pointwise_cast`, `copy`, ...)."""
    if op.name == "kern.gemm":
        flags = "".join("t" if op.attributes[f"transpose_{s}"] else "n" for s in "ab")
        return f"gemm {flags}"
    symbol = op.attributes["kernel"].name
    return re.sub(r"(_[0-9a-f]{8}|_(bf16|f32)\b.*)$", "", symbol)


def account(module: Operation, graph: str) -> tuple[Counter, Counter]:
    """Per family: launches and bytes moved, for one call of `graph`."""
    func = next(op for op in module.body.ops if op.name == "graph.func" and op.attributes["sym_name"] == graph)
    launches: Counter = Counter()
    moved: Counter = Counter()
    for op in func.body.ops:
        if op.name in ("kern.launch", "kern.gemm"):
            family = _family(op)
            launches[family] += 1
            moved[family] += _bytes(op.operands) + _bytes(op.results)
    return launches, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(ROOT / "examples" / "gpt2-small.sx"))
    parser.add_argument("--variant", default=None)
    parser.add_argument("--graph", default="train")
    args = parser.parse_args()
    tune_gc_for_large_ir()
    unit = CompilationUnit(path=args.example, text=Path(args.example).read_text(), variant=args.variant)
    PassManager(parse_pipeline(TRAINING_PIPELINE)).run(unit)
    load_all()
    register_targets()
    results = {}
    for label, lowering in (("without", "match-patterns,fuse"),
                            ("with", "gemm-layouts{transposes=false},match-patterns,gemm-layouts,fuse")):
        lowered = CompilationUnit(module=unit.module.clone())
        PassManager(parse_pipeline(lowering)).run(lowered)
        results[label] = account(lowered.module, args.graph)
    print(f"{Path(args.example).name} {args.graph}: one call, without -> with gemm-layouts")
    families = sorted(set(results["without"][0]) | set(results["with"][0]))
    for family in families:
        (n0, b0), (n1, b1) = ((results[k][0][family], results[k][1][family]) for k in ("without", "with"))
        if (n0, b0) != (n1, b1) or family.startswith(("gemm", "copy", "pointwise_copy", "pointwise_cast")):
            print(f"  {family:40} {n0:>5} -> {n1:<5} launches  {b0 / 1e6:10.1f} -> {b1 / 1e6:<10.1f} MB")
    for label in ("without", "with"):
        launches, moved = results[label]
        print(f"  {label:8} gemm-layouts: {sum(launches.values()):>5} kernels, {sum(moved.values()) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
