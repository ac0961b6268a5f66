"""`sexpgpu eval FILE`: every top-level form's value, one line each (see docs/verbs/eval.md)."""

from __future__ import annotations

import argparse
import sys

from ..frontend.evaluator import eval_file_lines


def run(args: argparse.Namespace) -> int:
    def print_line(line: str) -> None:
        sys.stdout.write(line + "\n")

    eval_file_lines(args.file, variant=args.variant, sets=args.set, on_line=print_line)
    return 0
