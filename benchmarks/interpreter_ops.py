"""Per-op cost of the numpy interpreter: one-op graphs on activation-sized tensors.

    python benchmarks/interpreter_ops.py [--rows 1024] [--width 512] [--repeats 20]

Each line is one op compiled alone (`compile_graph`) and called `--repeats`
times on a [rows, width] f32 operand (matmul: [rows, width] x [width, width]);
it prints the median microseconds per call and the effective GB/s of operand
and result traffic, so a regression in a kernel or in the call overhead
shows up next to the op it hit. `--dtype bf16` times the rounding path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "unit"))

from _graph_helpers import GraphBuilder, make_func, random_inputs  # noqa: E402
from sexpgpu.backends.interpreter import compile_graph  # noqa: E402

Case = Callable[[GraphBuilder], object]


def cases(rows: int, width: int) -> dict[str, Case]:
    last = [1]
    return {
        "exp": lambda g: g.exp(g.inputs["a"]),
        "erf": lambda g: g.erf(g.inputs["a"]),
        "tanh": lambda g: g.tanh(g.inputs["a"]),
        "add": lambda g: g.add(g.inputs["a"], g.inputs["b"]),
        "mul": lambda g: g.mul(g.inputs["a"], g.inputs["b"]),
        "maximum": lambda g: g.maximum(g.inputs["a"], g.inputs["b"]),
        "where": lambda g: g.where(g.gt(g.inputs["a"], g.inputs["b"]), g.inputs["a"], g.inputs["b"]),
        "sum(last)": lambda g: g.sum(g.inputs["a"], axes=last, keep=True),
        "max(last)": lambda g: g.max(g.inputs["a"], axes=last, keep=True),
        "transpose": lambda g: g.transpose(g.inputs["a"], perm=[1, 0]),
        "broadcast": lambda g: g.broadcast(g.sum(g.inputs["a"], axes=last, keep=True), shape=[rows, width]),
        "slice+pad": lambda g: g.pad(g.slice(g.inputs["a"], axis=1, start=1, end=width - 1), axis=1, before=1, after=1),
        "matmul": lambda g: g.matmul(g.inputs["a"], g.inputs["w"]),
        "take(rows)": lambda g: g.take(g.inputs["w"], g.inputs["idx"], axis=0),
        "scatter_add": lambda g: g.scatter_add(g.inputs["idx"], g.inputs["a"], axis=0, dim=width),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = parser.parse_args()
    rows, width, dtype = args.rows, args.width, args.dtype
    inputs = {"a": ((rows, width), dtype), "b": ((rows, width), dtype), "w": ((width, width), dtype),
              "idx": ((rows,), "i32")}
    rng = np.random.default_rng(0)
    print(f"{'op':14s} {'us/call':>10s} {'GB/s':>8s}   [{rows}x{width} {dtype}]")
    for name, case in cases(rows, width).items():
        func = make_func(inputs, lambda g, case=case: {"out": case(g)})
        graph = compile_graph(func)
        feed = {k: v.astype(spec.storage) for spec in graph.inputs for k, v in random_inputs(func, rng, width).items()
                if k == spec.name}
        graph(feed)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = graph(feed).outputs["out"]
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        used = {op.attributes["name"] for op in func.body.ops if op.name == "graph.input" and op.result.has_uses}
        traffic = sum(feed[k].nbytes for k in used) + out.nbytes
        print(f"{name:14s} {median * 1e6:10.1f} {traffic / median / 1e9:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
