"""How the IR core scales: build, print, parse, and cse+dce on graphs of 25,000 and 50,000 ops.

    python benchmarks/ir_core.py [--sizes 25000 50000]

Prints seconds per phase for each size and the ratio between consecutive
sizes; linear scaling shows as a ratio near 2 for a doubling. The generated
graph mixes what the passes see in practice: matmuls, elementwise chains,
reductions with attributes, duplicate subexpressions (for cse) and dead
branches (for dce), all located.
"""

from __future__ import annotations

import argparse
import time

from sexpgpu.dialects.core import (
    Block,
    Builder,
    Operation,
    Region,
    TensorType,
    gc_paused,
    tune_gc_for_large_ir,
)
from sexpgpu.dialects.parser import parse_module
from sexpgpu.dialects.printer import print_module
from sexpgpu.passes.cse import eliminate_common_subexpressions
from sexpgpu.passes.dce import eliminate_dead_ops

from sexpgpu.diagnostics import Location

#: Ops one `_layer` call creates.
OPS_PER_LAYER = 10


def _layer(b: Builder, x, w, i: int):
    """One located layer of ten ops: a matmul, a bias, activations, a duplicate and dead branches."""
    b.loc = Location("bench.sx", i + 1, 3)
    h = b.value("graph.matmul", x, w)
    bias = b.create("graph.const", attributes={"value": 0.01 * (i % 7)}, result_types=[h.type]).result
    pre = b.value("graph.add", h, bias)
    h = b.value("graph.tanh", pre)
    again = b.value("graph.neg", b.value("graph.tanh", pre))  # the second tanh is cse fodder
    h = b.value("graph.mul", h, again)
    b.value("graph.sum", h, axes=[0, 1], keep=False)  # dead: dce fodder
    b.value("graph.exp", h)  # dead
    return b.value("graph.reshape", h, shape=[16, 16])


def build_graph(num_ops: int) -> Operation:
    with gc_paused():
        return _build_graph(num_ops)


def _build_graph(num_ops: int) -> Operation:
    module = Operation.create("builtin.module", regions=[Region.with_block()])
    func = Operation.create("graph.func", attributes={"sym_name": "train", "kind": "train"}, regions=[Region.with_block()])
    module.body.append(func)
    body: Block = func.body
    b = Builder(body)
    t = TensorType((16, 16), "f32")
    x = b.create("graph.input", attributes={"name": "x", "role": "batch"}, result_types=[t]).result
    w = b.create("graph.input", attributes={"name": "w", "role": "param"}, result_types=[t]).result
    for i in range(max(1, num_ops // OPS_PER_LAYER)):
        x = _layer(b, x, w, i)
    loss = b.value("graph.sum", x, axes=[0, 1], keep=False)
    b.create("graph.return", [loss], {"names": ["loss"]})
    return module


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _cse_dce(module: Operation) -> None:
    for func in module.body.ops:
        eliminate_common_subexpressions(func.body)
        eliminate_dead_ops(func.body)


def measure(num_ops: int) -> dict[str, float]:
    module, t_build = _timed(build_graph, num_ops)
    text, t_print = _timed(print_module, module)
    parsed, t_parse = _timed(parse_module, text, "bench.sxir")
    _, t_passes = _timed(_cse_dce, parsed)
    count = sum(1 for _ in module.walk()) - 1
    return {"ops": count, "build": t_build, "print": t_print, "parse+verify": t_parse, "cse+dce": t_passes}


def best_of(repeat: int, num_ops: int) -> dict[str, float]:
    """Each phase's fastest time over `repeat` runs (the least disturbed by other processes)."""
    runs = [measure(num_ops) for _ in range(repeat)]
    return {k: min(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    tune_gc_for_large_ir()  # as the command-line tools do
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 50_000])
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest counts")
    args = parser.parse_args()
    rows = [best_of(args.repeat, n) for n in args.sizes]
    phases = [k for k in rows[0] if k != "ops"]
    print(f"{'ops':>8}  " + "  ".join(f"{p:>12}" for p in phases))
    for row in rows:
        print(f"{row['ops']:>8}  " + "  ".join(f"{row[p]:>11.3f}s" for p in phases))
    for small, big in zip(rows, rows[1:]):
        ratios = "  ".join(f"{big[p] / small[p]:>11.2f}x" for p in phases)
        print(f"{'ratio':>8}  {ratios}   ({big['ops']} / {small['ops']} ops)")


if __name__ == "__main__":
    main()
