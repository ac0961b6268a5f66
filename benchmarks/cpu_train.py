"""CPU training throughput: sexpgpu's interpreter (`cpu`) and compiled C (`cpu-c`) against PyTorch eager.

    python benchmarks/cpu_train.py [--example examples/gpt.sx] [--variant smoke] [--steps 10]
                                   [--threads N] [--set KNOB=VALUE ...] [--no-profile] [--cpu-c-profile]

By default trains the spec GPT, `examples/gpt.sx --variant smoke` (batch 4,
4 microbatches, 1040 tokens per step; `--example examples/tiny-gpt.sx
--variant none` measures tiny-gpt: batch 16, one microbatch), for a few steps
with sexpgpu's training driver on the interpreter and on `cpu-c` (the kern plan
compiled as C with OpenMP; its compile is done before timing), and the same
model from the same parameters on the same batches (the same microbatches per
step) in PyTorch eager, all in this process with the same number of threads
(default: the machine's cores), their steps alternating (interpreter, cpu-c,
torch, interpreter, ...) so a change in the machine's load hits all three alike.
Prints tokens/s of each and the ratios, the per-op time profile of the train
graph calls of one step (which ops dominate, by op name and by the model code
that made them, with the prelude line it went through) and the peak RSS of the
sexpgpu steps (measured before torch loads). Each step's time
is the median over the timed steps (after one warm-up step), so one
scheduling hiccup on a shared machine does not move the figure; the process
CPU time of each step is shown too (with one thread it barely depends on
what else the machine runs, so the CPU-time ratio is the steadier one there).
`--cpu-c-profile` adds the process CPU time of each step of the C (GEMMs,
kernels by kind, and the launch sequence's time outside them: Python and
ctypes), from a separately compiled, profiled copy of the graphs.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt.sx"


def set_threads(threads: int) -> None:
    """Fix BLAS and OpenMP thread counts before numpy or torch load their libraries.

    OpenBLAS's idle threads otherwise poll for about 2^28 cycles (a tenth of a second) after each call: the
    interpreter's matmuls would leave a thread spinning through most of the next side's step, taking a core
    from it (measured: a 2-thread cpu-c step 118 ms right after an interpreter step, 50 ms otherwise).
    `OPENBLAS_THREAD_TIMEOUT=4` (2^4 cycles, OpenBLAS's minimum) puts them to sleep at once, so the sides'
    steps do not run into each other. Set it yourself to override.

    OpenMP's idle threads do the same: PyTorch's libgomp polls 300,000 times after each parallel loop (about
    8 ms where a pause takes 26 ns, as on the 2-core Zen 4 this was measured on), so after a torch step its
    worker took the second core through most of the next cpu-c step (the MLP of cpu_train_mlp.py at 2
    threads: cpu-c 107 ms a step between torch steps, 59 ms alone). `GOMP_SPINCOUNT` at cpu-c's own
    `SPIN_COUNT` gives every libgomp in the process (torch's and cpu-c's) the same short poll."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    from sexpgpu.backends.cpu_c.compiler import SPIN_COUNT

    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


def op_profile(trainer, repeats: int = 5) -> tuple[dict[str, float], dict[str, float], float]:
    """CPU seconds per op name and per source line for the train graph calls of one step, op by op.

    Runs the compiled train graph (and, with microbatches, `train_accumulating`
    once per further microbatch) step by step (`CompiledGraph.profile`: the
    same kernels and reused buffers as a real call, over the graph `lower-cpu`
    made), timing each step in process CPU time, the median over `repeats`
    calls per op; ops are named without their dialect, a
    `cpu.broadcasting_binary` by its kind (a `mul` whose operand was a
    broadcast or a splat counts as a `mul`).
    """
    by_op: dict[str, float] = defaultdict(float)
    by_line: dict[str, float] = defaultdict(float)
    batch = trainer.train_loader.batch_at(0)
    calls = [(trainer.train, 1)]
    if trainer.train_accumulating is not None:
        calls.append((trainer.train_accumulating, trainer.plan.microbatches - 1))
    grads = {name: value.copy() for name, value in trainer.train(trainer._inputs(trainer.train, batch)).outputs.items()
             if name.startswith("grad/")}
    for graph, times in calls:
        inputs = trainer._inputs(graph, batch, grads)
        runs = [graph.profile(inputs, time.process_time) for _ in range(repeats)]
        for index, (op, _) in enumerate(runs[0]):
            elapsed = times * statistics.median(run[index][1] for run in runs)
            name = op.attributes["kind"] if op.name == "cpu.broadcasting_binary" else op.name.partition(".")[2]
            by_op[name] += elapsed
            where = "unknown"
            if op.loc is not None:
                via = f" via {Path(op.loc.via.file).name}:{op.loc.via.line}" if op.loc.via else ""
                where = op.loc.short() + via
            by_line[where] += elapsed
    total = sum(by_op.values())
    return dict(by_op), dict(by_line), total


def finite(train_step):
    """A `Trainer`'s `train_step` that stops the benchmark if a step's loss is not finite: a side training on
    NaN would be timed on other arithmetic than PyTorch's (the warm-up once ran step 0, which made every
    parameter NaN; `train_step` now refuses it)."""

    def step_fn(step: int):
        result = train_step(step)
        if not math.isfinite(result[0]):
            raise SystemExit(f"the loss of step {step} is {result[0]}: the timings would not be comparable")
        return result

    return step_fn


def torch_stepper(exp, trainer_params, loader, threads: int):
    import torch

    sys.path.insert(0, str(ROOT / "test" / "e2e"))
    from gpt_reference import TorchGPT

    torch.set_num_threads(threads)
    model = TorchGPT.from_experiment(exp, trainer_params)
    return lambda step: model.train_step([loader.next_batch()["tokens"] for _ in range(exp.microbatches)], step)


def torch_blas() -> str:
    """The BLAS PyTorch's matrix products use (MKL in its x86 wheels), from its build configuration."""
    import torch

    settings = torch.__config__.show()
    return next((part.split("=", 1)[1] for part in settings.replace(",", " ").split() if part.startswith("BLAS_INFO=")),
                "unknown")


def alternating(steppers: dict[str, object], steps: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of a step of each side, their steps taken in turn (one warm-up step each)."""
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    for step in range(1, steps + 2):
        for name, step_fn in steppers.items():
            started, cpu = time.perf_counter(), time.process_time()
            step_fn(step)
            if step > 1:
                walls[name].append(time.perf_counter() - started)
                cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in steppers}


def print_cpu_c_profile(exp, threads: int, steps: int) -> None:
    """Process CPU seconds of each step of the C per training step, summed by kind, the largest alone."""
    from sexpgpu.backends.devices import open_device
    from sexpgpu.backends.training import Trainer

    executor = open_device("cpu-c", "benchmark", threads=threads, profiled=True)
    trainer = Trainer(exp, Path("/nonexistent-benchmark-record"), None, executor=executor)
    trainer.train_step(1)
    before = executor.profile()
    started = time.process_time()
    for step in range(2, steps + 2):
        trainer.train_step(step)
    per_step = (time.process_time() - started) / steps
    steps_seconds = {label: (seconds - before.get(label, 0.0)) / steps for label, seconds in executor.profile().items()}
    by_kind: dict[str, float] = defaultdict(float)
    for label, seconds in steps_seconds.items():
        by_kind[label.split()[0]] += seconds
    by_kind["outside the C (Python, ctypes)"] = per_step - sum(steps_seconds.values())
    print(f"\ncpu-c profile of a training step ({per_step * 1000:.1f} ms CPU):")
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:32} {seconds * 1000:8.2f} ms  {100 * seconds / per_step:5.1f}%")
    print("the largest steps:")
    for label, seconds in sorted(steps_seconds.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {label[:64]:64} {seconds * 1000:8.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    parser.add_argument("--example", default=str(EXAMPLE), help="the experiment (default: examples/gpt.sx)")
    parser.add_argument("--variant", default="smoke", help="its variant (default: smoke; 'none' for none)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)),
                        help="BLAS, OpenMP and torch threads of every side (default: the machine's cores)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the interpreter's op profile")
    parser.add_argument("--cpu-c-profile", action="store_true", help="time each step of the C (compiles a profiled copy)")
    args = parser.parse_args()
    set_threads(args.threads)

    from sexpgpu.backends.cpu_c.blas import blas_config
    from sexpgpu.backends.cpu_c.compiler import host_cpu
    from sexpgpu.backends.devices import open_device
    from sexpgpu.backends.loaders import Loader
    from sexpgpu.backends.training import Trainer, TrainingPlan

    variant = None if args.variant == "none" else args.variant
    # With the stacking variants, as `sexpgpu run` compiles for cpu-c: it may run the microbatches in one call
    # (the interpreter runs one a call).
    exp = TrainingPlan.compile(args.example, variant, args.sets, stacking=True)
    trainer = Trainer(exp, Path("/nonexistent-benchmark-record"), None)
    compile_started = time.perf_counter()
    compiled = Trainer(exp, Path("/nonexistent-benchmark-record"), None,
                       executor=open_device("cpu-c", "benchmark", threads=args.threads))
    compile_seconds = time.perf_counter() - compile_started
    initial = {path: value.copy() for path, value in trainer.params.items()}
    tokens = trainer.tokens_per_step()
    steppers = {"interpreter": finite(trainer.train_step), "cpu-c": finite(compiled.train_step)}
    for step_fn in steppers.values():
        step_fn(1)
    # The peak so far is the training drivers' alone: torch and the op-by-op profile come later.
    training_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        import torch  # noqa: F401
    except ImportError:
        torch_available = False
    else:
        torch_available = True
        steppers["pytorch eager"] = torch_stepper(exp, initial, Loader.from_op(exp.loader_ops[exp.train_loader_name]),
                                                  args.threads)
    results = alternating(steppers, args.steps)
    name = os.path.relpath(args.example, ROOT) + (f" --variant {variant}" if variant else "")
    print(f"model: {name} {' '.join(args.sets)}  ({exp.parameter_count:,} parameters, "
          f"{tokens} tokens per step, batch {trainer.train_loader.batch} x {exp.microbatches} microbatches, "
          f"{args.threads} threads)")
    print(f"host: {host_cpu().rsplit(' ', 1)[0]}, {os.cpu_count()} cores; cpu-c GEMMs: {blas_config()}"
          + (f"; torch's BLAS: {torch_blas()}" if torch_available else ""))
    cache = "warm" if compiled.executor.experiment.from_cache else "cold"
    print(f"cpu-c lowering and compile of every graph: {compile_seconds:.1f} s (C cache {cache}); "
          f"{compiled.stack} microbatch{'es' if compiled.stack > 1 else ''} a call")
    for side, (wall, cpu) in results.items():
        print(f"{side:20} {tokens / wall:12,.0f} tokens/s  ({wall * 1000:.1f} ms per step, {cpu * 1000:.1f} ms CPU)")
    if not torch_available:
        print("pytorch eager        (torch is not installed: pip install torch)")
    ours, ours_cpu = results["interpreter"]
    fast, fast_cpu = results["cpu-c"]
    if torch_available:
        theirs, theirs_cpu = results["pytorch eager"]
        print(f"ratio interpreter/torch  {theirs / ours:.3f}  (by CPU time {theirs_cpu / ours_cpu:.3f})")
        print(f"ratio cpu-c/torch        {theirs / fast:.3f}  (by CPU time {theirs_cpu / fast_cpu:.3f})")
    print(f"ratio cpu-c/interpreter  {ours / fast:.3f}  (by CPU time {ours_cpu / fast_cpu:.3f})")
    if args.cpu_c_profile:
        print_cpu_c_profile(exp, args.threads, args.steps)
    if not args.profile:
        return 0

    by_op, by_line, total = op_profile(trainer)
    calls = f"train + {exp.microbatches - 1} x train_accumulating" if exp.microbatches > 1 else "train"
    print(f"\ninterpreter profile of one step's graph calls ({calls}), op by op ({total * 1000:.1f} ms CPU):")
    for name, seconds in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name:16} {seconds * 1000:8.2f} ms  {100 * seconds / total:5.1f}%")
    print("by the source line that made the ops:")
    for where, seconds in sorted(by_line.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {where:48} {seconds * 1000:8.2f} ms  {100 * seconds / total:5.1f}%")
    print(f"\npeak RSS of the sexpgpu training steps (interpreter and cpu-c) {training_peak_kib / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
