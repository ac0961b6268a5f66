"""CPU training throughput: sexpgpu's interpreter against PyTorch eager on the same model and batch.

    python benchmarks/cpu_train.py [--steps 10] [--threads 2] [--set KNOB=VALUE ...]

Trains `examples/tiny-gpt.sx` (the spec GPT: prelude modules, AdamW, clip)
for a few steps with sexpgpu's training driver, then the same model from the
same parameters on the same batches in PyTorch eager, both in this process
with the same number of threads. Prints tokens/s of each and their ratio, the
per-op time profile of one interpreter train step (which ops dominate, by op
name and by the model code that made them, with the prelude line it went
through) and the peak RSS of the sexpgpu steps (measured before torch loads). Each step's time
is the median over the timed steps (after one warm-up step), so one
scheduling hiccup on a shared machine does not move the figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-gpt.sx"


def set_threads(threads: int) -> None:
    """Fix BLAS and OpenMP thread counts before numpy or torch load their libraries."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)


def sexpgpu_step_times(trainer, steps: int) -> list[float]:
    times = []
    for step in range(1, steps + 2):
        started = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - started)
    return times[1:]


def op_profile(trainer, repeats: int = 3) -> tuple[dict[str, float], dict[str, float], float]:
    """Seconds per op name and per source line for one call of the train graph, op by op.

    Runs the graph's ops one at a time with the interpreter's own kernels
    (without its buffer reuse), timing each: the shares, not the total, are
    what this is for.
    """
    import numpy as np
    from sexpgpu.backends.interpreter.dtypes import DtypePolicy
    from sexpgpu.backends.interpreter.kernels import constant_value, kernel_for

    func = trainer.exp.graph("train")
    policy = DtypePolicy("native")
    batch = trainer.train_loader.batch_at(0)
    inputs = trainer._inputs(trainer.train, batch)
    by_op: dict[str, float] = defaultdict(float)
    by_line: dict[str, float] = defaultdict(float)
    kernels = {}
    for op in func.body.ops:
        if op.name not in ("graph.input", "graph.const", "graph.iota", "graph.return", "graph.metric",
                           "graph.counter", "graph.observe"):
            kernels[op] = kernel_for(op, policy)
    for _ in range(repeats):
        values = {}
        for op in func.body.ops:
            if op.name == "graph.input":
                spec_dtype = policy.storage(op.result.type.dtype)
                values[op.result] = np.asarray(inputs[op.attributes["name"]]).astype(spec_dtype, copy=False)
            elif op.name in ("graph.const", "graph.iota"):
                values[op.result] = constant_value(op, policy)
            elif op in kernels:
                args = [values[v] for v in op.operands]
                started = time.perf_counter()
                values[op.result] = kernels[op].fn(*args)
                elapsed = time.perf_counter() - started
                by_op[op.name.removeprefix("graph.")] += elapsed / repeats
                where = "unknown"
                if op.loc is not None:
                    via = f" via {Path(op.loc.via.file).name}:{op.loc.via.line}" if op.loc.via else ""
                    where = op.loc.short() + via
                by_line[where] += elapsed / repeats
    total = sum(by_op.values())
    return dict(by_op), dict(by_line), total


def torch_step_times(exp, trainer_params, loader, steps: int, threads: int) -> list[float]:
    import torch

    sys.path.insert(0, str(ROOT / "test" / "e2e"))
    from gpt_reference import TorchGPT

    torch.set_num_threads(threads)
    model = TorchGPT.from_experiment(exp, trainer_params)
    times = []
    for step in range(1, steps + 2):
        batch = loader.next_batch()["tokens"]
        started = time.perf_counter()
        model.train_step(batch, step)
        times.append(time.perf_counter() - started)
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE")
    args = parser.parse_args()
    set_threads(args.threads)

    from sexpgpu.backends.loaders import Loader
    from sexpgpu.backends.training import Experiment, Trainer

    exp = Experiment(str(EXAMPLE), None, args.sets)
    trainer = Trainer(exp, Path("/nonexistent-benchmark-record"), None)
    initial = {path: value.copy() for path, value in trainer.params.items()}
    tokens = trainer.tokens_per_step()
    ours = statistics.median(sexpgpu_step_times(trainer, args.steps))
    # The peak so far is the training driver's alone: torch and the op-by-op profile come later.
    training_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"model: examples/tiny-gpt.sx {' '.join(args.sets)}  ({exp.parameter_count:,} parameters, "
          f"{tokens} tokens per step, {args.threads} threads)")
    print(f"sexpgpu interpreter  {tokens / ours:12,.0f} tokens/s  ({ours * 1000:.1f} ms per step)")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("pytorch eager        (torch is not installed: pip install torch)")
    else:
        theirs = statistics.median(torch_step_times(exp, initial, Loader.from_op(exp.loader_ops[exp.train_loader_name]),
                                                    args.steps, args.threads))
        print(f"pytorch eager        {tokens / theirs:12,.0f} tokens/s  ({theirs * 1000:.1f} ms per step)")
        print(f"ratio sexpgpu/torch  {theirs / ours:.3f}")

    by_op, by_line, total = op_profile(trainer)
    print(f"\ninterpreter profile of one train graph call, op by op ({total * 1000:.1f} ms):")
    for name, seconds in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name:16} {seconds * 1000:8.2f} ms  {100 * seconds / total:5.1f}%")
    print("by the source line that made the ops:")
    for where, seconds in sorted(by_line.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {where:48} {seconds * 1000:8.2f} ms  {100 * seconds / total:5.1f}%")
    print(f"\npeak RSS of the sexpgpu training steps {training_peak_kib / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
