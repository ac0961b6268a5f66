"""Frontend speed: reading a generated 1 MB .sx file, and a fold calling a user function.

Run: python benchmarks/frontend.py
"""

from __future__ import annotations

import os
import tempfile
import time

from sexpgpu.frontend.evaluator import Evaluator
from sexpgpu.frontend.reader import read_file

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


def main() -> None:
    text = generated_source()
    print(f"read   {len(text) / 1e6:.2f} MB: {reading_mb_per_s(text):.2f} MB/s")
    print(f"fold   100000 calls of a user fn: {fold_calls_per_s():,.0f} calls/s")


if __name__ == "__main__":
    main()
