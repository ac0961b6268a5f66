"""`sexpgpu ir FILE [selection] [--compact]`: the whole experiment as a JSON document.

The training pipeline, then the `ir-json` dump pass, which streams the
document to standard output op by op (see docs/verbs/ir.md).
"""

from __future__ import annotations

import argparse

from .explain_cmd import compile_unit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    parser.add_argument("--compact", action="store_true", help="one line, no indentation")


def run(args: argparse.Namespace) -> int:
    compile_unit(args.file, args.variant, args.set, "ir-json{compact=true}" if args.compact else "ir-json")
    return 0
