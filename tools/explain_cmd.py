"""`sexpgpu explain FILE [selection] [--json] [--device cpu|cpu-c|cuda|cuda-sim [--target ARCH]]`: what the compiler made of a file.

It runs the training pipeline and then the `explain` dump pass, exactly what
`sexpgpu-opt FILE -p '<training pipeline>,explain'` runs, so the two print
the same report (see docs/verbs/explain.md). With `--device cuda` the report
ends with the lowering report instead of the device hole: the CUDA lowering
of every graph a step runs, its kernels compiled by NVRTC for the device's
architecture, or for `--target` without opening a device (docs/cuda.md,
"The lowering report"). Without `--target` it opens the device (`cuda`, or the
simulated `cuda-sim`) and prepares the run as `run` does before its first step
(every graph compiled, the parameters, gradients and states allocated, the
stacking chosen), so the report says what that device chose; it reads no data.
`--gpu NAME` (h200, h100, a100) adds the roofline estimate of a training step on that
GPU (`passes/roofline.py`): each row's modelled time and the step's (docs/cuda.md, "The
step estimate").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, TextIO

from ..backends.devices import open_device, require_available
from ..diagnostics import SxError, UsageError
from ..passes.lowering_report import without_launches
from ..passes.manager import CompilationUnit, run_pipeline
from ..passes.pipelines import CUDA_LOWERING, TRAINING_PIPELINE, run_graphs
from ..passes.roofline import GPUS, Gpu, estimate, stacking_on, unknown_gpu_message
from ..report.document import build_document, ranks_document
from ..report.explain_text import render_text
from .common import add_device_flag, add_ranks_flag, requested_ranks

if TYPE_CHECKING:
    from ..backends.distributed import CollectivesPlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the experiment (.sx)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    add_device_flag(parser, "cpu: the device hole; cpu-c, cuda, cuda-sim: the lowering report, which opens the device "
                            "unless --target")
    parser.add_argument("--target", metavar="ARCH",
                        help="with --device cuda: lower and compile for ARCH (sm_80, sm_90) without opening a device")
    parser.add_argument("--gpu", metavar="NAME",
                        help=f"with --device cuda: model a training step's time on NAME ({', '.join(GPUS)})")
    add_ranks_flag(parser, "add how a step splits over N data-parallel ranks (default: 1, or one per SEXPGPU_DEVICES id)")


def compile_unit(file: str, variant: str | None, sets: list[str], dump: str = "", out: TextIO | None = None) -> CompilationUnit:
    """The unit of `file` after the training pipeline, then the `dump` pass if one is named."""
    unit = CompilationUnit(path=file, variant=variant, sets=list(sets), out=out or sys.stdout)
    return run_pipeline(unit, f"{TRAINING_PIPELINE},{dump}" if dump else TRAINING_PIPELINE)


def listed_launches() -> bool:
    """Whether `SEXPGPU_EXPLAIN=kernels` asks for every launch of each row's first graph."""
    value = os.environ.get("SEXPGPU_EXPLAIN", "").strip()
    if value not in ("", "kernels"):
        raise UsageError(f"SEXPGPU_EXPLAIN must be kernels (or unset), not {value!r}")
    return value == "kernels"


def attention_unheld_wanted(lowering_pipeline: str | None) -> bool:
    """Whether the report names the attention tensors a fusing target would not hold (`step.attention_unheld`):
    not where the explained lowering fuses attention itself, whose lowering report and arena plan say what it
    holds (the recogniser costs seconds on GPT-2 small)."""
    from ..passes.match_patterns import fuses_attention

    return lowering_pipeline is None or not fuses_attention(lowering_pipeline)


def opened_device_document(args: argparse.Namespace) -> dict:
    """The report's document with the lowering the opened device made of a run's graphs under `device`."""
    from ..backends.training import DeviceSetup, TrainingPlan

    executor = open_device(args.device, "explain")
    unit = compile_unit(args.file, args.variant, args.set)
    document = build_document(unit.module, unit.facts, unit.path,
                              attention_unheld=attention_unheld_wanted(executor.lowering_pipeline))
    ranks = requested_ranks(args)
    if ranks > 1:
        with_ranks(document, unit, ranks, executor.planned_collectives(ranks))
    # The graphs a run derives for the driver, after the document (which shows the experiment's).
    run_pipeline(unit, run_graphs(executor.stacks_microbatches))
    DeviceSetup(TrainingPlan(unit.module, unit.path), executor)
    lowering = executor.lowering_facts()
    document["device"] = lowering.measured() if lowering is not None else None
    return document


def with_ranks(document: dict, unit: CompilationUnit, ranks: int, collectives: CollectivesPlan) -> dict:
    """The document with its `ranks` section (`--ranks N` or several `SEXPGPU_DEVICES`), its collectives
    through what the device plans for that many ranks."""
    from ..backends.ranks import local_microbatches

    run_op = next(op for op in unit.module.body.ops if op.name == "exp.run")
    local_microbatches(int(run_op.attributes["microbatches"]), ranks, run_op.loc)
    document["ranks"] = ranks_document(unit.module, document, ranks, collectives.transport, collectives.host_staging)
    return document


def requested_gpu(args: argparse.Namespace) -> Gpu | None:
    """The GPU `--gpu` names, None without it; a name not in the table is one line and exit 1."""
    if args.gpu is None:
        return None
    if args.device != "cuda":
        raise UsageError("--gpu needs --device cuda: it models the CUDA lowering's launches on that GPU")
    if args.gpu not in GPUS:
        raise SxError(unknown_gpu_message(args.gpu))
    return GPUS[args.gpu]


def with_estimate(document: dict, gpu: Gpu | None, launches: bool) -> dict:
    """The document with the step estimate on `gpu` under `device` (when one is named), then without each
    launch's costs unless `SEXPGPU_EXPLAIN=kernels` asked for them."""
    device = document["device"]
    if device is None:
        return document
    if gpu is not None:
        tokens = next((c["per_step"] for c in document["step"]["counters"] if c["name"] == "tokens" and c["static"]),
                      None)
        device["estimate"] = estimate(device, gpu, tokens)
    if not launches:
        without_launches(device)
    return document


def gpu_stacking(device: dict, gpu: Gpu) -> int | None:
    """The stacking degree a run on `gpu` would choose for the lowering document `device`
    (`roofline.stacking_on`), None for one microbatch a call. A microbatch's activations are its share of
    the `train stacked` row's arena (of `train`'s without one), as lowered."""
    rows = {row["kind"]: row for row in device["rows"]}
    stacked = rows.get("train_stacked")
    per_microbatch = (stacked["arena_bytes"] // device["stacking"]["planned"] if stacked is not None
                      else rows["train"]["arena_bytes"] if "train" in rows else 0)
    k = stacking_on(gpu, device["stacking"]["degrees"], device["memory"]["persistent_bytes"], per_microbatch)
    return k if k > 1 else None


def target_document(file: str, variant: str | None, sets: list[str], arch: str, gpu: Gpu | None,
                    ranks: int = 1) -> dict:
    """The report's document of `file` with its lowering for `arch` under `device`, every launch's list and
    costs kept, no device opened (`--target`). `train stacked` is lowered at the smallest degree above 1, or
    with `gpu` at the degree a run on that GPU would choose."""
    from ..backends.cuda.lowering import lowering_report, stack_for_report
    from ..backends.cuda.nccl import planned_collectives

    unit = compile_unit(file, variant, sets)
    document = build_document(unit.module, unit.facts, unit.path, attention_unheld=attention_unheld_wanted(CUDA_LOWERING))
    if ranks > 1:
        with_ranks(document, unit, ranks, planned_collectives("cuda", ranks))
    document["device"] = lowering_report(unit, arch, stack=stack_for_report(unit.module), launches=True)
    stack = gpu_stacking(document["device"], gpu) if gpu is not None else None
    if stack is not None and stack != document["device"]["stacking"]["planned"]:
        # The lowering above rewrote the unit: the degree the GPU takes is lowered from a fresh one.
        document["device"] = lowering_report(compile_unit(file, variant, sets), arch, stack=stack, launches=True)
    return document


def run(args: argparse.Namespace) -> int:
    if args.target is not None and args.device != "cuda":
        raise UsageError("--target needs --device cuda: it names the architecture the CUDA lowering compiles for")
    gpu = requested_gpu(args)
    ranks = requested_ranks(args)
    if args.device == "cpu" and ranks > 1:
        collectives = open_device(args.device, "explain").planned_collectives(ranks)
        unit = compile_unit(args.file, args.variant, args.set)
        document = with_ranks(build_document(unit.module, unit.facts, unit.path), unit, ranks, collectives)
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n" if args.json else render_text(document))
        return 0
    if args.device == "cpu":
        require_available(args.device, "explain")
        compile_unit(args.file, args.variant, args.set, "explain{json=true}" if args.json else "explain")
        return 0
    launches = listed_launches()
    if args.target is None:
        document = opened_device_document(args)
    else:
        from ..backends.cuda.lowering import check_target
        from ..backends.cuda.nvrtc import nvrtc_toolchain

        nvrtc_toolchain()  # without the cuda extra: one line naming the install command, before any work
        document = target_document(args.file, args.variant, args.set, check_target(args.target), gpu, ranks)
    with_estimate(document, gpu, launches)
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(render_text(document))
    return 0
