"""match-patterns on GPT-2 small: how long recognising and replacing every pattern region takes.

    python benchmarks/match_patterns_gpt2.py [--repeat 3] [--layers 12]

Builds every training graph of examples/gpt.sx set to GPT-2 small (12 layers,
width 768, 12 heads, sequence 1024, vocabulary 50304, as
`benchmarks/check_gpt2.py` selects it) with the TRAINING_PIPELINE, then runs
match-patterns on a fresh copy each repeat and prints the best wall and CPU
time, the regions matched per graph, and how many distinct region structures
were evaluated (the rest were remembered). It counts against `explain
--device cuda`'s budget (under 10 s cold for the whole lowering and NVRTC).
"""

from __future__ import annotations

import argparse
import gc
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_gpt2 import gpt2_file, gpt2_sets  # noqa: E402
from sexpgpu.dialects.core import tune_gc_for_large_ir  # noqa: E402
from sexpgpu.dialects.parser import parse_module  # noqa: E402
from sexpgpu.dialects.printer import print_module  # noqa: E402
from sexpgpu.passes.manager import CompilationUnit, PassManager, parse_pipeline  # noqa: E402
from sexpgpu.passes.patterns import memo  # noqa: E402
from sexpgpu.passes.pipelines import TRAINING_PIPELINE  # noqa: E402

from sexpgpu.targets import register_targets  # noqa: E402

register_targets()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    tune_gc_for_large_ir()
    with tempfile.TemporaryDirectory() as tmp:
        path = gpt2_file(Path(tmp))
        unit = CompilationUnit(path=str(path), sets=gpt2_sets(args.layers))
        PassManager(parse_pipeline(TRAINING_PIPELINE)).run(unit)
        text = print_module(unit.module)
    evaluated = 0
    original = memo.MatchCache.forward

    def counting(self, region):
        nonlocal evaluated
        if ("forward", region.signature()) not in self.recipes:
            evaluated += 1
        return original(self, region)

    memo.MatchCache.forward = counting
    best_wall = best_cpu = float("inf")
    facts = {}
    for _ in range(args.repeat):
        unit = CompilationUnit(module=parse_module(text, "gpt2.sxir", verify=False))
        evaluated = 0
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        PassManager(parse_pipeline("match-patterns"), log=io.StringIO()).run(unit)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
        facts = unit.facts.lowering.patterns
    print(f"match-patterns on GPT-2 small ({args.layers} layers): {best_wall:.3f} s wall, {best_cpu:.3f} s cpu "
          f"(best of {args.repeat}); {evaluated} forward region structures evaluated")
    for graph, families in facts.items():
        if families:
            fired = ", ".join(f"{family} {entry['fired']}" for family, entry in families.items())
            fell = sum(len(entry["fell_back"]) for entry in families.values())
            print(f"  {graph:<20} {fired}; fell back {fell}")


if __name__ == "__main__":
    main()
