"""`sexpgpu explain --device cuda --target ARCH` end to end: wall time cold and warm.

    python benchmarks/explain_cuda.py [--example examples/gpt2-small.sx] [--arch sm_90] [--repeat 3]

Runs the command as a user does (a fresh process each time) with `SEXPGPU_CACHE`
pointing at an empty directory (cold: the lowering, NVRTC and the report), then
again with the same directory (warm: the lowering document is read from the
lowering cache, so nothing is lowered or compiled). Prints each run's wall
seconds and, for reference, a plain `explain` (no device) of the same file: the
warm figure cannot be below it. The goals on GPT-2 small (12 layers, width 768,
sequence 1024, vocabulary 50304): under 10 s cold, under 2 s warm; torch.compile
spends about 27 s compiling this model's training step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(ROOT / "examples" / "gpt2-small.sx"))
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--repeat", type=int, default=3, help="cold and warm runs each (the best is reported too)")
    args = parser.parse_args()
    explain = [str(Path(sys.executable).with_name("sexpgpu")), "explain", args.example]
    cuda = [*explain, "--device", "cuda", "--target", args.arch]
    cold, warm = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="sexpgpu-explain-bench-") as cache:
            env = {**os.environ, "SEXPGPU_CACHE": cache}
            cold.append(timed(cuda, env))
            warm.append(timed(cuda, env))
    plain = [timed(explain, dict(os.environ)) for _ in range(args.repeat)]
    name = Path(args.example).name
    for label, times in ((f"cold  explain --device cuda --target {args.arch}", cold),
                         (f"warm  explain --device cuda --target {args.arch}", warm),
                         ("plain explain (no device)", plain)):
        runs = " ".join(f"{t:.2f}" for t in times)
        print(f"{name}  {label:<42} best {min(times):6.2f} s   runs {runs}")


if __name__ == "__main__":
    main()
