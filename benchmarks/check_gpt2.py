"""`sexpgpu check` on GPT-2 small: how long the editor's on-save check takes, and how it scales.

    python benchmarks/check_gpt2.py [--repeat 3]

Checks examples/gpt.sx set to GPT-2 small (12 layers, width 768, 12 heads,
sequence 1024, vocabulary 50304) and to 24 layers, as `sexpgpu check` does in
a fresh process (so imports count), and prints the wall time of each, the
evaluate pass alone (reading, evaluating and tracing) in process, and the
24/12 ratios. Goals: under 1.5 s for 12 layers, a ratio of at most 2.2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt.sx"


def gpt2_sets(layers: int) -> list[str]:
    # The spec's model takes its vocabulary as a literal 256; GPT-2's is set through a copy.
    return [f"layers={layers}", "width=768", "heads=12", "seq=1024"]


def gpt2_file(tmp: Path) -> Path:
    """examples/gpt.sx with GPT-2's padded vocabulary (50304) instead of bytes."""
    (tmp / "lib").mkdir(exist_ok=True)
    (tmp / "lib" / "model.sx").write_text((EXAMPLE.parent / "lib" / "model.sx").read_text())
    text = EXAMPLE.read_text().replace("(gpt :vocab 256", "(gpt :vocab 50304")
    path = tmp / "gpt2.sx"
    path.write_text(text)
    return path


def check_seconds(path: Path, layers: int, repeat: int) -> float:
    """The best wall time of `sexpgpu check` in a fresh process."""
    best = float("inf")
    for _ in range(repeat):
        args = [sys.executable, "-m", "sexpgpu.tools.main", "check", str(path)]
        for item in gpt2_sets(layers):
            args += ["--set", item]
        start = time.perf_counter()
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def evaluate_seconds(path: Path, layers: int, repeat: int) -> float:
    """The best in-process time of the `evaluate` pass alone."""
    from sexpgpu.passes.manager import CompilationUnit, run_pipeline

    run_pipeline(CompilationUnit(path=str(path), sets=gpt2_sets(layers)), "evaluate")  # warm: imports, prelude
    best = float("inf")
    for _ in range(repeat):
        unit = CompilationUnit(path=str(path), sets=gpt2_sets(layers))
        start = time.perf_counter()
        run_pipeline(unit, "evaluate")
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = gpt2_file(Path(tmp))
        results = {}
        for layers in (12, 24):
            results[layers] = (check_seconds(path, layers, args.repeat), evaluate_seconds(path, layers, args.repeat))
            print(f"{layers} layers: check {results[layers][0]:.3f} s, evaluate {results[layers][1]:.3f} s")
        print(
            f"24/12: check {results[24][0] / results[12][0]:.2f}x, evaluate {results[24][1] / results[12][1]:.2f}x"
            f"  (goals: check < 1.5 s at 12 layers, ratio <= 2.2)"
        )


if __name__ == "__main__":
    main()
