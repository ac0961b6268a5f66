"""The launches and device-memory bytes of one GPT-2 small training step as the CUDA lowering plans it.

    python benchmarks/step_launches.py [--stack 8] [--file examples/gpt2-small.sx] [--variant V] [--kinds 16]

Runs the training pipeline and the run's graphs on the experiment, stacks
`--stack` microbatches a call (`stack{k}`; a run on an H200 stacks all 8 of
GPT-2 small's), then `match-patterns` and `fuse`, and counts what one step
launches: the stacked train graph once per `microbatches / stack` calls
(the first plain, the rest accumulating), every other graph the driver runs
each step (clip, optimizer updates) once. For each launch (`kern.launch`, a
pattern step, `kern.gemm`) its bytes are those of its operands and results,
each counted whole: a crude model (a gather counts its whole table, an
in-place operand twice), the same before and after a change, enough to see
which launches a change removes. Prints the per-step totals, then the launch
kinds (the kernel's name without its hash) with the most bytes.

No GPU and no NVRTC needed; about a minute on a 2-core machine for 8 stacked
microbatches (the lowering of a 26,000-node graph).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from sexpgpu.dialects.core import Operation, Value, tune_gc_for_large_ir
from sexpgpu.dialects.graph import func_kind, graph_funcs, is_derived, is_input
from sexpgpu.dialects.traits import Trait, has_trait
from sexpgpu.passes.manager import CompilationUnit, run_pipeline
from sexpgpu.passes.pipelines import RUN_GRAPHS, TRAINING_PIPELINE

from sexpgpu.targets import register_targets

ROOT = Path(__file__).resolve().parents[1]
_HASH = re.compile(r"_[0-9a-f]{8}$")


def launches(func: Operation) -> list[tuple[str, int]]:
    """Each launch of one call of `func`: its kind (a kernel's name without its hash, `gemm`; marked when it
    reads a parameter) and its bytes."""
    found = []
    for op in func.body.ops:
        if op.name not in ("kern.launch", "kern.gemm"):
            continue
        moved = sum(v.type.nbytes for v in op.operands) + sum(r.type.nbytes for r in op.results)
        kind = "gemm" if op.name == "kern.gemm" else _HASH.sub("", op.attributes["kernel"].name)
        if any(_reads_parameter(v) for v in op.operands):
            kind += " (of a parameter)"
        found.append((kind, moved))
    return found


def _reads_parameter(value: Value) -> bool:
    """Whether `value` is a parameter input, or a view of one."""
    op = value.op
    while op is not None and has_trait(op, Trait.SHAPE) and op.operands:
        op = op.operands[0].op
    return op is not None and is_input(op, "param")


def step_calls(module: Operation, stack: int, microbatches: int) -> list[tuple[Operation, int]]:
    """The graphs one step runs and how often: the stacked train graph (or train, then train
    accumulating) and the driver's graphs (clips, updates over flat arrays, any other derived graph)."""
    funcs = {str(f.attributes["sym_name"]): f for f in graph_funcs(module)}
    calls = microbatches // stack
    if stack > 1:
        step = [(funcs["train_stacked"], 1)]
        if calls > 1:
            raise SystemExit("--stack must be the microbatch count (one stacked call a step)")
    else:
        step = [(funcs["train"], 1), (funcs["train_accumulating"], microbatches - 1)]
    flat = {str(m["path"]) for f in graph_funcs(module) if is_derived(f) and func_kind(f) == "update"
            for m in f.attributes["members"]}
    for func in graph_funcs(module):
        kind = func_kind(func)
        # `fuse` merges a group's member graphs into a flat one of its own, which the driver does not run.
        param = func.attributes.get("param")
        if kind == "update" and (is_derived(func) or (param is not None and str(param) not in flat)):
            step.append((func, 1))
        elif kind == "clip" and (is_derived(func) or f"{func.attributes['sym_name']}/flat" not in funcs):
            step.append((func, 1))
        elif kind not in ("update", "clip") and is_derived(func) and not kind.startswith("train"):
            step.append((func, 1))  # another graph the driver runs each step (a gradient scaling)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", default=str(ROOT / "examples" / "gpt2-small.sx"))
    parser.add_argument("--variant", default=None)
    parser.add_argument("--stack", type=int, default=8)
    parser.add_argument("--kinds", type=int, default=16)
    args = parser.parse_args()
    tune_gc_for_large_ir()
    register_targets()
    unit = run_pipeline(CompilationUnit(path=args.file, variant=args.variant), f"{TRAINING_PIPELINE},{RUN_GRAPHS}")
    run = next(op.attributes for op in unit.module.body.ops if op.name == "exp.run")
    microbatches = int(run["microbatches"])
    stacking = f"stack{{k={args.stack}}}," if args.stack > 1 else ""
    run_pipeline(unit, f"{stacking}match-patterns,fuse")
    total_launches, total_bytes = 0, 0
    kinds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    print(f"{Path(args.file).name}: {microbatches} microbatches, {args.stack} a call")
    for func, times in step_calls(unit.module, args.stack, microbatches):
        listed = launches(func)
        moved = sum(b for _, b in listed)
        print(f"  {func.attributes['sym_name']:<28} x{times:<2} {len(listed):>5} launches  {moved / 1e9:8.3f} GB a call")
        total_launches += times * len(listed)
        total_bytes += times * moved
        for kind, nbytes in listed:
            kinds[kind] += times * nbytes
            counts[kind] += times
    print(f"step: {total_launches} launches, {total_bytes / 1e9:.2f} GB (operands and results counted whole)")
    print("launch kinds with the most bytes a step:")
    for kind, nbytes in kinds.most_common(args.kinds):
        print(f"  {kind:<52} {counts[kind]:>5} launches  {nbytes / 1e9:8.3f} GB")


if __name__ == "__main__":
    main()
