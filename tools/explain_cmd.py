"""`sexpgpu explain FILE [selection] [--json]`: the target-independent account of one file.

It runs the training pipeline and then the `explain` dump pass, exactly what
`sexpgpu-opt FILE -p '<training pipeline>,explain'` runs, so the two print
the same report (see docs/verbs/explain.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..devices import require_available
from ..passes.manager import CompilationUnit, run_pipeline
from ..passes.pipelines import TRAINING_PIPELINE
from .common import add_device_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    add_device_flag(parser, "cpu: the device hole; cuda: the lowering report, which needs the CUDA executor")


def compile_unit(file: str, variant: str | None, sets: list[str], dump: str = "", out: TextIO | None = None) -> CompilationUnit:
    """The unit of `file` after the training pipeline, then the `dump` pass if one is named."""
    unit = CompilationUnit(path=file, variant=variant, sets=list(sets), out=out or sys.stdout)
    return run_pipeline(unit, f"{TRAINING_PIPELINE},{dump}" if dump else TRAINING_PIPELINE)


def run(args: argparse.Namespace) -> int:
    require_available(args.device, "explain")
    compile_unit(args.file, args.variant, args.set, "explain{json=true}" if args.json else "explain")
    return 0
