"""Frontend speed: reading a generated 1 MB .sx file, a fold calling a user function, nested
`let`s (10,000 and 20,000 deep: the time should double, not quadruple), and a 1 MB string
literal (its reading's peak memory should be megabytes).

Run: python benchmarks/frontend.py

Each figure is wall time with the process's CPU time beside it (steadier on a busy machine).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import tracemalloc

from sexpgpu.dialects.core import tune_gc_for_large_ir
from sexpgpu.frontend.evaluator import Evaluator
from sexpgpu.frontend.reader import read_file, read_text

_UNIT = """;; block {i}
(defn layer-{i} (x &key (scale 0.02) (name "layer-{i}"))
  (let* ((h (* x scale 1.5e3))
         (shape [4 {i} (+ {i} 1)]))
    {{:out (+ h -7) :shape shape :tag 'train/loss}}))
"""


def generated_source(size: int = 1_000_000) -> str:
    parts, total, i = [], 0, 0
    while total < size:
        part = _UNIT.format(i=i)
        parts.append(part)
        total += len(part)
        i += 1
    return "".join(parts)


def reading_mb_per_s(text: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.sx")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        read_file(path)  # warm: the scanner is built on first use
        start = time.perf_counter()
        read_file(path)
        return len(text.encode()) / (time.perf_counter() - start) / 1e6


def fold_calls_per_s(n: int = 100_000) -> float:
    session = Evaluator()
    session.eval_text(f"(def xs (range {n}))")
    start = time.perf_counter()
    session.eval_text("(fold (fn (acc x) (+ acc x)) 0 xs)")
    return n / (time.perf_counter() - start)


def nested_lets(depth: int) -> str:
    """`depth` lets, each inside the one before, one per line."""
    return "".join(f"(let ((a{i} {i}))\n" for i in range(depth)) + "(+ a0 1)" + ")" * depth


def evaluation_seconds(text: str) -> tuple[float, float]:
    """Wall and CPU seconds to read and evaluate `text` in a fresh session.

    The cyclic collector is tuned as the command-line tools tune it: with Python's default
    thresholds, collections over the deep stack of live nodes make the time grow faster
    than the depth, which is not what `sexpgpu` does.
    """
    thresholds = gc.get_threshold()
    tune_gc_for_large_ir()
    try:
        session = Evaluator()
        wall, cpu = time.perf_counter(), time.process_time()
        session.eval_text(text, "nested.sx")
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.set_threshold(*thresholds)


def string_literal_read() -> tuple[float, float]:
    """Seconds and peak traced megabytes to read a 1 MB string literal."""
    text = '(def s "' + "x" * 1_000_000 + '")'
    start = time.perf_counter()
    read_text(text, "string.sx")
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        read_text(text, "string.sx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak / 1e6


def main() -> None:
    text = generated_source()
    print(f"read   {len(text) / 1e6:.2f} MB: {reading_mb_per_s(text):.2f} MB/s")
    print(f"fold   100000 calls of a user fn: {fold_calls_per_s():,.0f} calls/s")
    for depth in (10_000, 20_000):
        wall, cpu = evaluation_seconds(nested_lets(depth))
        print(f"let    {depth} nested lets: {wall:.2f} s (cpu {cpu:.2f} s)")
    seconds, peak = string_literal_read()
    print(f"string 1 MB literal: read in {seconds:.3f} s, peak {peak:.1f} MB")


if __name__ == "__main__":
    main()
