"""Data-parallel CPU ranks: tokens/s of 2 ranks against 1, the collectives' share of a step, and the
bytes a rank sends a step with and without ZeRO-1 (docs/distributed.md).

    python benchmarks/ranks_cpu.py [--example examples/gpt.sx] [--variant smoke] [--steps 8]
                                   [--ranks 2] [--set KNOB=VALUE ...]

Trains the spec GPT's smoke variant (4 microbatches a step, 1040 tokens) for
a few steps on 1 rank, then on N ranks with ZeRO-1 and without, each rank one
BLAS thread (the N-rank runs under the mpich wheel's `mpiexec`, as
`sexpgpu run --ranks N` starts them). Each configuration runs in processes of
its own: this script starts itself as the ranks (`--worker`). A step's time
is the median over the timed steps after one warm-up step, on rank 0 (the
ranks meet every step, so they keep pace). The collectives are timed by
wrapping the communicator: every call of the step (the gradient
reduce-scatter and all-gather, ZeRO-1's parameter all-gather, the metric
sums), wall time including waiting for the slower rank. Bytes are what a rank
sends in ring collectives, (N − 1)/N of each buffer, counted from the buffers
the step passes.

On a machine with as many idle cores as ranks, N ranks approach N times the
tokens/s; on a shared 2-core machine the figure moves with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt.sx"


class TimedCommunicator:
    """A communicator that counts the seconds its collectives take and the bytes a rank sends."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.seconds = 0.0
        self.bytes_sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.world, name)

    def _timed(self, method: str, nbytes: int, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = getattr(self.world, method)(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        self.bytes_sent += nbytes * (self.world.size - 1) // self.world.size
        return result

    def sum_into(self, buffer: Any) -> None:
        self._timed("sum_into", 2 * buffer.nbytes, buffer)

    def reduce_scatter(self, buffer: Any, shard: Any) -> None:
        self._timed("reduce_scatter", buffer.nbytes, buffer, shard)

    def all_gather(self, shard: Any, buffer: Any) -> None:
        self._timed("all_gather", buffer.nbytes, shard, buffer)

    def share(self, buffer: Any, root: int) -> None:
        self._timed("share", buffer.nbytes, buffer, root)

    def sum_values(self, values: Any) -> list[float]:
        return self._timed("sum_values", 8 * len(values), values)

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self._timed("broadcast", 0, value, root)


def worker(args: argparse.Namespace) -> None:
    """One rank: train `steps` + 1 steps and leave rank 0's figures in `args.result`."""
    from sexpgpu.backends.distributed import open_communicator
    from sexpgpu.backends.training import Trainer, TrainingPlan

    world = TimedCommunicator(open_communicator())
    plan = TrainingPlan.compile(str(args.example), args.variant, args.set)
    if args.zero_stage is not None:
        plan.run_op.attributes["zero_stage"] = args.zero_stage
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(plan, Path(out), None, executor=None, world=world)
        walls, collective = [], []
        for step in range(1, args.steps + 2):
            world.seconds, world.bytes_sent = 0.0, 0
            started = time.perf_counter()
            trainer.train_step(step)
            walls.append(time.perf_counter() - started)
            collective.append(world.seconds)
        sent = world.bytes_sent
    if world.is_root:
        step = statistics.median(walls[1:])
        Path(args.result).write_text(json.dumps({
            "ranks": world.size, "zero_stage": 1 if trainer.sharded is not None else 0,
            "tokens_per_step": trainer.tokens_per_step(), "step_seconds": step,
            "collective_seconds": statistics.median(collective[1:]), "bytes_sent": sent,
            "state_bytes": sum(trainer.executor.download(a).nbytes for a in trainer.states.values())
            + (trainer.sharded.state_bytes() if trainer.sharded is not None else 0),
        }))


def measure(args: argparse.Namespace, ranks: int, zero_stage: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [sys.executable, __file__, "--worker", "--result", str(result), "--example", str(args.example),
                   "--steps", str(args.steps)]
        command += ["--variant", args.variant] if args.variant else []
        command += [word for knob in args.set for word in ("--set", knob)]
        command += ["--zero-stage", str(zero_stage)] if zero_stage is not None else []
        if ranks > 1:
            command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument("--variant", default="smoke")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--zero-stage", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs = [("1 rank", measure(args, 1, None)), (f"{args.ranks} ranks, ZeRO-1", measure(args, args.ranks, 1)),
            (f"{args.ranks} ranks, no ZeRO", measure(args, args.ranks, 0))]
    base = runs[0][1]["tokens_per_step"] / runs[0][1]["step_seconds"]
    print(f"{args.example.name} --variant {args.variant}: {runs[0][1]['tokens_per_step']} tokens a step, "
          f"median of {args.steps} steps, one BLAS thread a rank")
    for name, run in runs:
        rate = run["tokens_per_step"] / run["step_seconds"]
        share = run["collective_seconds"] / run["step_seconds"]
        print(f"  {name:<20} {rate:8,.0f} tokens/s ({rate / base:.2f}x)  step {run['step_seconds'] * 1e3:7.1f} ms, "
              f"collectives {run['collective_seconds'] * 1e3:6.1f} ms ({share:.1%})  "
              f"sent {run['bytes_sent'] / 2**20:.2f} MiB a step a rank  optimizer states {run['state_bytes'] / 2**20:.2f} MiB a rank")


if __name__ == "__main__":
    main()
