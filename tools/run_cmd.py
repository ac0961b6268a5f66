"""`sexpgpu run FILE`: train the experiment (see docs/verbs/run.md)."""

from __future__ import annotations

import argparse
import sys

from ..backends.training import train
from ..report.lowering_text import lowering_text
from .common import add_device_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    add_device_flag(parser, "where to train")
    parser.add_argument("--out", metavar="DIR", help="the run record directory (default: runs/<file-stem>-<time>)")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue from a run directory's latest checkpoint, or from one checkpoints/step-N")


def run(args: argparse.Namespace) -> int:
    result = train(args.file, variant=args.variant, sets=args.set, out=args.out, resume=args.resume,
                   device=args.device, lowering_text=lowering_text)
    if result.status == "diverged":
        print(f"error: training diverged at {result.message}", file=sys.stderr)
        return 1
    if result.status == "interrupted":
        return 130
    return 0
