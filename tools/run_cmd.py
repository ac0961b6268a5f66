"""`sexpgpu run FILE`: train the experiment (see docs/verbs/run.md)."""

from __future__ import annotations

import argparse
import sys

from ..backends.training import train
from .common import add_device_flag


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    add_device_flag(parser, "where to train")
    parser.add_argument("--out", metavar="DIR", help="the run record directory (default: runs/<file-stem>-<time>)")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue from a run directory's latest checkpoint, or from one checkpoints/step-N")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="cpu-c: OpenMP and BLAS threads (default: $OMP_NUM_THREADS, else every core); "
                             "results do not depend on it")


def run(args: argparse.Namespace) -> int:
    result = train(args.file, variant=args.variant, sets=args.set, out=args.out, resume=args.resume,
                   device=args.device, threads=args.threads)
    if result.status == "diverged":
        print(f"error: training diverged at {result.message}", file=sys.stderr)
        return 1
    if result.status == "interrupted":
        return 130
    return 0
