"""`sexpgpu run FILE`: train the experiment (see docs/verbs/run.md), on one rank or several
(`--ranks N`, `SEXPGPU_DEVICES=0,1`, or a launcher's environment: docs/distributed.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..backends.training import train
from ..diagnostics import UsageError
from ..report.lowering_text import lowering_text
from .common import add_device_flag, add_ranks_flag, guarded, requested_ranks

if TYPE_CHECKING:
    from ..backends.distributed import Communicator


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
    add_ranks_flag(parser, "data-parallel ranks: start N processes (on cpu; on cuda, one per SEXPGPU_DEVICES id)")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="cpu-c: OpenMP and BLAS threads (default: $OMP_NUM_THREADS, else every core); "
                             "results do not depend on it")


def rank_arguments(args: argparse.Namespace, ranks: int, out: str) -> list[str]:
    """The command line each rank runs: this one, with the record directory every rank shares."""
    words = ["run", args.file, "--device", args.device, "--out", out, "--ranks", str(ranks)]
    if args.variant is not None:
        words += ["--variant", args.variant]
    for assignment in args.set:
        words += ["--set", assignment]
    if args.resume is not None:
        words += ["--resume", args.resume]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    return words


def run(args: argparse.Namespace) -> int:
    from ..backends.distributed import launcher_world, open_communicator

    ranks = requested_ranks(args)
    if ranks > 1 and launcher_world() is None:
        return start_ranks(args, ranks)
    world = open_communicator(args.device, gpu_world() if args.device == "cuda" else None)
    if args.ranks is not None and args.ranks != world.size:
        raise UsageError(f"--ranks {args.ranks}, but the launcher started {world.size} ranks")

    def body() -> int:
        result = train(args.file, variant=args.variant, sets=args.set, out=args.out, resume=args.resume,
                       device=args.device, lowering_text=lowering_text, world=world,
                       threads=args.threads)
        if result.status == "diverged":
            if world.is_root:
                print(f"error: training diverged at {result.message}", file=sys.stderr)
            return 1
        if result.status == "interrupted":
            return 130
        return 0

    if world.size == 1:
        return body()
    # A rank that fails alone would leave the others waiting in a collective: it prints its error
    # (the boundary's usual report), then ends them all.
    ended = False

    def rank_body() -> int:
        nonlocal ended
        code = body()
        ended = True
        return code

    code = guarded(rank_body)
    if not ended:
        print(f"error: rank {world.rank} of {world.size} failed (above); stopping the other ranks",
              file=sys.stderr, flush=True)
        world.abort(code)
    return code


def gpu_world() -> Callable[[int, int], Communicator]:
    """The communicator of GPU ranks a `torchrun`-style launcher started (NCCL's)."""
    from ..backends.cuda.nccl import NcclWorld

    return NcclWorld


def start_ranks(args: argparse.Namespace, ranks: int) -> int:
    """Check MPI and the experiment here (their errors print once), then start the ranks under mpiexec."""
    from pathlib import Path

    from ..backends.checkpoint import resolve_checkpoint
    from ..backends.distributed import import_mpi
    from ..backends.launch import launch_ranks
    from ..backends.ranks import local_microbatches
    from ..backends.training import TrainingPlan, default_out_dir, refuse_existing_record

    import_mpi(ranks)  # without the extra: one line naming it, before any work
    plan = TrainingPlan.compile(args.file, args.variant, args.set)
    local_microbatches(plan.microbatches, ranks, plan.run_op.loc)
    if args.out is not None:
        out = Path(args.out)
    elif args.resume is not None:
        out = resolve_checkpoint(Path(args.resume)).parent.parent
    else:
        out = default_out_dir(args.file)
    if args.resume is None:
        refuse_existing_record(out)
    return launch_ranks(rank_arguments(args, ranks, str(out)), ranks, out)
