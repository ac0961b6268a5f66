"""Frontend speed: reading a generated 1 MB .sx file, and a fold calling a user function; the peak
memory of reading a file holding one 1 MB string literal (in a fresh process).

Run: python benchmarks/frontend.py
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def string_literal_peak_mib(size: int = 1 << 20) -> float:
    """Peak memory reading one `size`-character string literal takes, above an interpreter that read nothing."""
    script = (
        "import resource, sys\n"
        "from sexpgpu.frontend.reader import read_text\n"
        "read_text('(warm)')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"read_text('(def s \"' + 'x' * {size} + '\")')\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    return float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    text = generated_source()
    print(f"read   {len(text) / 1e6:.2f} MB: {reading_mb_per_s(text):.2f} MB/s")
    print(f"fold   100000 calls of a user fn: {fold_calls_per_s():,.0f} calls/s")
    print(f"string a 1 MB literal: {string_literal_peak_mib():.0f} MiB peak above the interpreter")


if __name__ == "__main__":
    main()
