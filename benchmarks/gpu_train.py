"""GPT-2 small on one GPU: sexpgpu against the same model in PyTorch eager and under torch.compile.

    python benchmarks/gpu_train.py [--steps 20] [--warmup 11] [--only sexpgpu,eager,compile]
                                   [--device cuda] [--tiny] [--set KNOB=VALUE ...] [--json FILE] [--budget S]
    python benchmarks/gpu_train.py --dry-run      # no GPU needed (see below)

The model is `examples/gpt2-small.sx`: 12 layers, width 768, 12 heads, seq 1024,
vocab 50304, `precision bf16` (bf16 compute, f32 master weights), AdamW with
betas (0.9, 0.95), weight decay 0.1 (none on the embedding), warmup-cosine
learning rate; a step is 8 microbatches of 4 records, 32,768 tokens.

- **sexpgpu** trains it with its training driver (the `Trainer` that
  `sexpgpu run` runs) on `--device` (default `cuda`).
- **PyTorch eager** and **torch.compile** train the same model,
  `test/e2e/gpt_reference.py`'s `TorchGPT`, as llm.c's `train_gpt2.py` runs
  GPT-2: bf16 autocast over f32 master weights, causal attention by
  `scaled_dot_product_attention` (flash attention; the same function as the
  model's masked softmax), the fused AdamW kernel, f32 matmul precision
  "high"; `compile` adds `torch.compile` (default mode) of the loss and,
  through AOTAutograd, its backward. Both start from the parameters sexpgpu
  initializes for the run seed and see the same batches (a second copy of the
  run's loader), with the file's optimizer groups and schedule, so their first
  losses must agree with sexpgpu's (bf16: within 2e-2 relative).

Each side runs in a process of its own, one after the other on the same GPU
(a fault or an out-of-memory in one leaves the others' figures): `--warmup`
steps (compilation, cuBLASLt's heuristics, sexpgpu's graph capture after a
graph's tenth call), then `--steps` timed steps, the device synchronized at
both ends; tokens/s = timed steps x tokens per step / their wall time.

**Compile time.** sexpgpu: the training pipeline plus the executor's setup
(lowering, NVRTC, buffers) with an empty kernel cache (`SEXPGPU_CACHE` in a
fresh folder), plus what its warmup steps took beyond a timed step's median.
torch.compile: what its warmup steps took beyond a timed step's median (the
first calls compile the forward and the backward), with empty Inductor and
Triton caches.

**MFU.** Model FLOPs per token = 6·N + 6·L·d·T, llm.c's `gpt2_estimate_mfu`
(Kaplan et al. 2020, section 2.1: 2N a token forward for the weight
products, twice that backward, and 2·L·T·d forward for the attention scores
and their weighting, again three times over). N counts the parameters that
multiply: every trained parameter but the token-embedding table, a lookup.
llm.c's GPT-2 ties that table to the output projection and counts it once
as that; this model's output projection is a parameter of its own, so N is
the same 124,475,904 (of 163,109,376 trained) and the figures compare with
llm.c's. L layers, d width, T the sequence length; causal masking is not
discounted (llm.c does not either). MFU = FLOPs per token x tokens/s over the
chip's dense bf16 peak, from the step estimate's table of GPUs with its
datasheet sources (`passes/roofline.GPUS`; SXM boards, a PCIe or NVL board is
not measured): 989 TFLOP/s for an H100 or H200 SXM (NVIDIA's datasheet, the
figure llm.c divides by, so its ~38% on an H100 compares directly; an H200
has the H100's arithmetic with faster memory). The table
also gives the bf16 matmul rate measured on the same GPU (8192^3 products of
random data through PyTorch), which is what a training step can approach.

**Top kernels.** torch.profiler (CUPTI) over `--profile-steps` steps after
the timed ones, in each side's process: it sees every kernel the process
launches, sexpgpu's through the driver API (on the primary context PyTorch
shares) and cuBLASLt's among them; device time per step by kernel name.

**`--dry-run`** proves the script end to end without a GPU: the model at a
tiny size (`--tiny`: 1 layer, width 64, 2 heads, seq 32; the vocabulary and
the step's shape stay), sexpgpu's side built (the training pipeline and,
where this build has it, the CUDA lowering and NVRTC for sm_90) but not
trained, PyTorch eager one step on the CPU (one thread), torch.compile not
run; every figure only a GPU gives reads "not measured". `--device cuda-sim
--tiny` trains sexpgpu's side on the simulated device instead (slow: a test
device; the PyTorch sides then run on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt2-small.sx"
SIDES = ("sexpgpu", "eager", "compile")
LABELS = {"sexpgpu": "sexpgpu", "eager": "pytorch eager", "compile": "torch.compile"}
TINY = ["layers=1", "width=64", "heads=2", "seq=32"]
#: Each side's share of the time budget (what a side leaves unused goes to the later ones).
SHARES = {"sexpgpu": 0.3, "eager": 0.2, "compile": 0.5}
NOT_MEASURED = "not measured"
#: The bf16 tolerance of the device check: the first losses of two bf16 trainings of one model agree within it.
BF16_TOLERANCE = 2e-2
AGREEMENT_STEPS = 5


# --- the model's arithmetic ------------------------------------------------------------------------------

def model_figures(plan: Any) -> dict[str, Any]:
    """Sizes, N (parameters that multiply) and FLOPs per token of the experiment's GPT (see the docstring)."""
    knobs = {name: value[0] for name, value in plan.knobs().items()}
    shapes = {str(op.attributes["path"]): tuple(op.attributes["type"].shape) for op in plan.param_ops}
    total = plan.parameter_count
    lookups = sum(math.prod(shape) for path, shape in shapes.items() if path.endswith("embed.table"))
    layers, width, seq = int(knobs["layers"]), int(knobs["width"]), int(knobs["seq"])
    multiplying = total - lookups
    batch = int(plan.loader_ops[plan.train_loader_name].attributes["batch"])
    return {
        "layers": layers, "width": width, "heads": int(knobs["heads"]), "seq": seq,
        "vocab": shapes["model.embed.table"][0], "precision": plan.precision, "microbatches": plan.microbatches,
        "batch": batch, "tokens_per_step": plan.microbatches * batch * seq, "parameters": total, "n": multiplying,
        "flops_per_token": 6 * multiplying + 6 * layers * width * seq,
    }


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of the GPU named `device_name` in TFLOP/s, from the step estimate's table of GPUs
    and its datasheet sources (`passes/roofline.GPUS`); None for a GPU not in it."""
    from sexpgpu.passes.roofline import gpu_named

    gpu = gpu_named(device_name)
    return gpu.bf16_peak / 1e12 if gpu is not None else None


# --- one side, in its own process ------------------------------------------------------------------------

def timed_training(step: Callable[[int], float], sync: Callable[[], None], warmup: int, steps: int) -> dict[str, Any]:
    """Warmup steps one by one, then the timed steps as one stretch synchronized at both ends."""
    losses, warm_times, step_times = [], [], []
    for index in range(1, warmup + 1):
        started = time.perf_counter()
        losses.append(step(index))
        sync()
        warm_times.append(time.perf_counter() - started)
    sync()
    begun = time.perf_counter()
    for index in range(warmup + 1, warmup + steps + 1):
        started = time.perf_counter()
        losses.append(step(index))
        step_times.append(time.perf_counter() - started)
    sync()
    wall = time.perf_counter() - begun
    median = statistics.median(step_times) if step_times else None
    excess = sum(max(0.0, t - median) for t in warm_times) if median is not None else None
    return {"losses": losses, "warmup_seconds": warm_times, "step_seconds": step_times, "timed_wall": wall,
            "median_step": median, "warmup_excess": excess}


def kernel_profile(step: Callable[[int], float], sync: Callable[[], None], first: int, count: int,
                   top: int = 12) -> list[dict[str, Any]] | str:
    """Device time per step by kernel name over `count` steps, from torch.profiler's trace (CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return f"{NOT_MEASURED}: no GPU"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for index in range(first, first + count):
            step(index)
        sync()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    microseconds: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            microseconds[event["name"]] += float(event.get("dur", 0.0))
            launches[event["name"]] += 1
    total = sum(microseconds.values())
    ranked = sorted(microseconds, key=microseconds.get, reverse=True)[:top]
    return [{"kernel": name, "ms_per_step": microseconds[name] / 1000 / count,
             "launches_per_step": launches[name] / count,
             "share": microseconds[name] / total if total else 0.0} for name in ranked]


def optional(measure: Callable[[], Any]) -> Any:
    """A figure that must not cost the side its others: its value, or why it is not measured."""
    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - any failure of the profiler or of torch is reported, not raised
        traceback.print_exc()
        return f"{NOT_MEASURED}: {type(err).__name__}: {err}".splitlines()[0][:300]


def device_state() -> dict[str, Any]:
    """The GPU's name and the memory held on it (by every library in the process), where torch sees one."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"device": torch.cuda.get_device_name(), "memory_held": total - free}


def side_sexpgpu(args: argparse.Namespace, sets: list[str]) -> dict[str, Any]:
    from sexpgpu.backends.training import Trainer, TrainingPlan

    started = time.perf_counter()
    # The CUDA executors stack microbatches: the run pipeline makes the stacking variants for them (a dry
    # run lowers every graph of the module, so it leaves them out).
    plan = TrainingPlan.compile(str(EXAMPLE), None, sets, stacking=args.device != "cpu" and not args.dry_run)
    result: dict[str, Any] = {"model": model_figures(plan), "pipeline_seconds": time.perf_counter() - started}
    if args.dry_run:
        result.update(build_lowering(plan))
        result["status"] = "built"
        return result
    from sexpgpu.backends.devices import open_device

    started = time.perf_counter()
    executor = open_device(args.device, "run")
    with tempfile.TemporaryDirectory() as record:
        trainer = Trainer(plan, Path(record), None, executor=executor)
        result["setup_seconds"] = time.perf_counter() - started
        smallest = min(plan.param_ops, key=lambda op: op.attributes["type"].numel).attributes["path"]

        def sync() -> None:
            executor.download(trainer.params[str(smallest)])  # waits for the device

        result.update(timed_training(lambda step: trainer.train_step(step)[0], sync, args.warmup, args.steps))
        result["compile_seconds"] = result["pipeline_seconds"] + result["setup_seconds"] + result["warmup_excess"]
        state = optional(device_state)
        result.update(state if isinstance(state, dict) else {"device_state": state})
        if args.profile_steps and args.device == "cuda":
            result["top_kernels"] = optional(lambda: kernel_profile(
                lambda step: trainer.train_step(step)[0], sync, args.warmup + args.steps + 1, args.profile_steps))
    result["device_kind"] = args.device
    result["status"] = "done"
    return result


def build_lowering(plan: Any) -> dict[str, Any]:
    """Without a device: the CUDA lowering of every graph and NVRTC's compile of its code for sm_90,
    where this build has the lowering (what the executor's setup does before it opens buffers)."""
    from sexpgpu.passes import pipelines

    # For sm_90, as the executor lowers for its device's architecture (a build before `cuda_lowering` has one).
    lowering = pipelines.cuda_lowering("sm_90") if hasattr(pipelines, "cuda_lowering") else getattr(
        pipelines, "CUDA_LOWERING", None)
    if lowering is None:
        return {"lowering": f"{NOT_MEASURED}: this build has no CUDA lowering pipeline"}
    from sexpgpu.backends.cuda.nvrtc import compile_cubin
    from sexpgpu.passes.manager import CompilationUnit, run_pipeline

    from sexpgpu.targets import register_targets

    register_targets()
    started = time.perf_counter()
    module = run_pipeline(CompilationUnit(module=plan.module), lowering).module
    lowered = time.perf_counter()
    sources = [op.attributes["text"] for op in module.body.ops if op.name == "kern.source"]
    kernels = 0
    for index, source in enumerate(sources):
        kernels += len(compile_cubin(source, "sm_90", name=f"gpt2-small-{index}").kernels)
    return {"lowering_seconds": lowered - started, "nvrtc_seconds": time.perf_counter() - lowered,
            "kernels": kernels}


def side_torch(args: argparse.Namespace, sets: list[str], compiled: bool) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT / "test" / "e2e"))
    from gpt_reference import TorchGPT
    from sexpgpu.backends.loaders import Loader
    from sexpgpu.backends.training import TrainingPlan
    from sexpgpu.dialects.inits import initial_params

    torch.set_float32_matmul_precision("high")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dry_run:
        torch.set_num_threads(1)  # a dry run proves the code, on a machine that may be busy with other work
    started = time.perf_counter()
    plan = TrainingPlan.compile(str(EXAMPLE), None, sets)
    model = TorchGPT.from_experiment(plan, initial_params(plan.param_ops, plan.seed), device=device,
                                     attention="sdpa", fused=True, autocast=torch.bfloat16)
    if compiled:
        model.compile()
    loader = Loader.from_op(plan.loader_ops[plan.train_loader_name])
    result: dict[str, Any] = {"model": model_figures(plan), "setup_seconds": time.perf_counter() - started,
                              "device_kind": device, "torch": torch.__version__}

    def step(index: int) -> float:
        return model.train_step([loader.next_batch()["tokens"] for _ in range(plan.microbatches)], index)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    result.update(timed_training(step, sync, args.warmup, args.steps))
    if compiled:
        result["compile_seconds"] = result["warmup_excess"]
    result.update(device_state())
    if device == "cuda":
        if args.profile_steps:
            result["top_kernels"] = optional(
                lambda: kernel_profile(step, sync, args.warmup + args.steps + 1, args.profile_steps))
        if not compiled:
            result["matmul_tflops"] = optional(lambda: matmul_ceiling(torch))
    result["status"] = "done"
    return result


def matmul_ceiling(torch: Any, n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of an n^3 bf16 product of random data (the median of `repeats` after three warm-ups)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * n**3 / statistics.median(times) / 1e12


def run_side(args: argparse.Namespace) -> int:
    """The `--side` child: one side's figures to `--result` (a failure too, with its message)."""
    sets = (TINY if args.tiny else []) + args.sets
    try:
        if args.side == "sexpgpu":
            result = side_sexpgpu(args, sets)
        else:
            result = side_torch(args, sets, compiled=args.side == "compile")
    except BaseException as err:  # noqa: BLE001 - whatever stopped the side is its result
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}".splitlines()[0][:500]}
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0 if result["status"] in ("done", "built") else 1


# --- the parent: the sides one by one, the table ---------------------------------------------------------

def spawn_side(side: str, args: argparse.Namespace, timeout: float, folder: Path) -> dict[str, Any]:
    result_path = folder / f"{side}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--result", str(result_path),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
               "--device", args.device] + (["--tiny"] if args.tiny else []) + (["--dry-run"] if args.dry_run else [])
    for knob in args.sets:
        command += ["--set", knob]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not args.dry_run:  # cold compilers: their caches in fresh folders
        env["SEXPGPU_CACHE"] = str(folder / f"{side}-sexpgpu-cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / f"{side}-inductor-cache")
        env["TRITON_CACHE_DIR"] = str(folder / f"{side}-triton-cache")
    print(f"--- {LABELS[side]} (at most {timeout:.0f} s)", flush=True)
    started = time.perf_counter()
    # A process group of its own: torch.compile's worker processes go with the side when it runs out of time.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {"status": "failed", "error": f"the process ended with exit status {status} and no result"}
    result["wall_seconds"] = time.perf_counter() - started
    return result


def summarize(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s, ratios, MFU and loss agreement from the sides' raw figures."""
    model = next((s["model"] for s in sides.values() if "model" in s), None)
    device = next((s["device"] for s in sides.values() if s.get("device")), None)
    peak = peak_tflops(device)
    ceiling = sides.get("eager", {}).get("matmul_tflops")
    ceiling = ceiling if isinstance(ceiling, float) else None
    summary: dict[str, Any] = {"model": model, "device": device, "peak_tflops": peak, "matmul_tflops": ceiling,
                               "rows": {}}
    if model is None:
        return summary
    tokens = model["tokens_per_step"]
    for side, result in sides.items():
        row: dict[str, Any] = {"status": result.get("status"), "device": result.get("device_kind")}
        if result.get("timed_wall") and result.get("step_seconds"):
            rate = tokens * len(result["step_seconds"]) / result["timed_wall"]
            row["tokens_per_s"] = rate
            row["ms_per_step"] = 1000 * result["timed_wall"] / len(result["step_seconds"])
            on_gpu = result.get("device_kind") == "cuda"
            achieved = model["flops_per_token"] * rate / 1e12
            row["tflops"] = achieved
            if on_gpu and peak:
                row["mfu"] = achieved / peak
            if on_gpu and ceiling:
                row["of_matmul_ceiling"] = achieved / ceiling
        row["compile_seconds"] = result.get("compile_seconds")
        summary["rows"][side] = row
    rates = {side: row.get("tokens_per_s") for side, row in summary["rows"].items()}
    if rates.get("sexpgpu"):
        summary["ratios"] = {f"sexpgpu/{side}": rates["sexpgpu"] / rates[side]
                             for side in ("eager", "compile") if rates.get(side)}
    reference = sides.get("eager", {}).get("losses")
    if reference:
        summary["agreement"] = {
            side: max(abs(a - b) / abs(b) for a, b in zip(result["losses"][:AGREEMENT_STEPS], reference))
            for side, result in sides.items() if side != "eager" and result.get("losses")}
    return summary


def format_table(summary: dict[str, Any], sides: dict[str, dict[str, Any]], dry_run: bool) -> str:
    model = summary["model"]
    lines = []
    if model:
        lines.append(f"{EXAMPLE.relative_to(ROOT)}: {model['layers']} layers, width {model['width']}, "
                     f"{model['heads']} heads, seq {model['seq']}, vocab {model['vocab']}, {model['precision']}, "
                     f"{model['microbatches']} microbatches of {model['batch']}, {model['tokens_per_step']:,} tokens a step")
        lines.append(f"{model['parameters']:,} parameters; N = {model['n']:,} (without the token-embedding table); "
                     f"6N + 6LdT = {model['flops_per_token'] / 1e6:,.1f} MFLOP a token")
    peak = summary["peak_tflops"]
    device = summary["device"] or ("no GPU (dry run)" if dry_run else "no GPU")
    lines.append(f"device {device}; bf16 dense peak "
                 + (f"{peak:g} TFLOP/s (datasheet)" if peak else NOT_MEASURED + " (unknown device)")
                 + "; bf16 matmul measured "
                 + (f"{summary['matmul_tflops']:.0f} TFLOP/s" if summary["matmul_tflops"] else NOT_MEASURED))
    lines.append("")
    header = f"{'':15} {'device':7} {'tokens/s':>11} {'ms/step':>9} {'TFLOP/s':>8} {'MFU':>7} {'compile s':>10}"
    lines.append(header)
    for side, result in sides.items():
        row = summary["rows"].get(side, {})
        if result.get("status") not in ("done",):
            why = result.get("error") or (NOT_MEASURED + (": dry run builds only" if result.get("status") == "built"
                                                          else ""))
            lines.append(f"{LABELS[side]:15} {why}")
            continue
        compile_s = row.get("compile_seconds")
        lines.append(f"{LABELS[side]:15} {row.get('device') or '':7} {row['tokens_per_s']:11,.0f} "
                     f"{row['ms_per_step']:9.1f} {row['tflops']:8.1f} "
                     f"{(format(row['mfu'], '7.1%') if 'mfu' in row else NOT_MEASURED):>7} "
                     f"{(f'{compile_s:10.1f}' if compile_s is not None else '-'):>10}")
    for name, value in summary.get("ratios", {}).items():
        lines.append(f"ratio {name}: {value:.3f}")
    for side, error in summary.get("agreement", {}).items():
        verdict = "within" if error <= BF16_TOLERANCE else "OUTSIDE"
        lines.append(f"first {AGREEMENT_STEPS} losses, {LABELS[side]} against pytorch eager: largest relative "
                     f"difference {error:.2e} ({verdict} {BF16_TOLERANCE})")
    sexpgpu = sides.get("sexpgpu", {})
    if sexpgpu.get("status") == "built":
        if "lowering_seconds" in sexpgpu:
            lines.append(f"sexpgpu build: training pipeline {sexpgpu['pipeline_seconds']:.1f} s, lowering "
                         f"{sexpgpu['lowering_seconds']:.1f} s, NVRTC {sexpgpu['nvrtc_seconds']:.1f} s "
                         f"({sexpgpu['kernels']} kernels, sm_90)")
        else:
            lines.append(f"sexpgpu build: training pipeline {sexpgpu['pipeline_seconds']:.1f} s; lowering "
                         f"{sexpgpu.get('lowering')}")
    for side, result in sides.items():
        kernels = result.get("top_kernels")
        if isinstance(kernels, list) and kernels:
            lines.append(f"\ntop kernels of {LABELS[side]} (device time a step):")
            for k in kernels:
                lines.append(f"  {k['ms_per_step']:8.2f} ms {k['share']:6.1%} {k['launches_per_step']:6.1f}x  "
                             f"{k['kernel'][:100]}")
        elif side in sides and result.get("status") == "done":
            lines.append(f"top kernels of {LABELS[side]}: {kernels or NOT_MEASURED}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=11,
                        help="steps before the timed ones (default 11: sexpgpu captures a graph after its tenth call)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timed ones (0: none)")
    parser.add_argument("--only", default=",".join(SIDES), help="the sides to run, of sexpgpu,eager,compile")
    parser.add_argument("--device", default="cuda", help="sexpgpu's device (default cuda)")
    parser.add_argument("--tiny", action="store_true", help=f"the model at a tiny size ({' '.join(TINY)})")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: --tiny, one step, sexpgpu built but not trained, PyTorch eager on the CPU "
                             "(one thread), no torch.compile")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sides together (default 420)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tiny, args.steps, args.warmup, args.profile_steps = True, 1, 0, 0
    if args.side:
        return run_side(args)
    chosen = [side for side in args.only.split(",") if side]
    unknown = sorted(set(chosen) - set(SIDES))
    if unknown:
        parser.error(f"--only names {', '.join(unknown)}; the sides are {', '.join(SIDES)}")
    if args.dry_run:
        chosen = [side for side in chosen if side != "compile"]
    deadline = time.monotonic() + args.budget
    sides: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-train-") as folder:
        for index, side in enumerate(chosen):
            shares = sum(SHARES[s] for s in chosen[index:])
            timeout = max(30.0, (deadline - time.monotonic()) * SHARES[side] / shares)
            sides[side] = spawn_side(side, args, timeout, Path(folder))
    if args.dry_run:
        sides["compile"] = {"status": "not run", "error": f"{NOT_MEASURED}: dry run (torch.compile needs minutes)"}
    summary = summarize(sides)
    table = format_table(summary, sides, args.dry_run)
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "table": table.splitlines(), "sides": sides,
                                               "dry_run": args.dry_run,
                                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                              indent=1))
    failed = [side for side in chosen if sides[side].get("status") not in ("done", "built")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
