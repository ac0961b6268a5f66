"""`sexpgpu check FILE`: read, evaluate and verify every graph a run executes.

Runs `CHECK_PIPELINE`, the training pipeline's passes that can report on the
file (`passes/pipelines.py`), then the verifiers. Prints `FILE: ok (N parameters,
G graphs, S steps)` or the diagnostics; G counts the graphs a run executes after
the training pipeline (train variants, evaluations, update graphs). `--json`
prints the same facts as one document.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..diagnostics import display_path
from ..passes.manager import CompilationUnit, run_pipeline
from ..passes.pipelines import CHECK_PIPELINE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON document")


def check(path: str, variant: str | None, sets: list[str]) -> dict[str, object]:
    """The facts `check` reports; raises the first diagnostic as an SxError."""
    unit = run_pipeline(CompilationUnit(path=path, variant=variant, sets=list(sets)), CHECK_PIPELINE)
    unit.module.verify()
    experiment = unit.facts.experiment
    graphs = [op for op in unit.module.body.ops if op.name == "graph.func"]
    return {
        "file": display_path(path),
        "ok": True,
        "parameters": len(experiment.params),
        "elements": sum(p.numel for p in experiment.params.values()),
        "graphs": len(graphs),
        "steps": experiment.run.steps,
        "warnings": [
            {"message": message, "location": str(loc) if loc else None} for message, loc in experiment.warnings
        ],
    }


def run(args: argparse.Namespace) -> int:
    result = check(args.file, args.variant, args.set)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"{result['file']}: ok ({result['parameters']} parameters, {result['graphs']} graphs, {result['steps']} steps)")
    return 0
