"""Start-up: the commands a user or an editor runs, each in a fresh process, as they run them.

    python benchmarks/startup.py [--repeat 5]

Prints the best wall time of `sexpgpu --version`, `sexpgpu check examples/gpt2-small.sx`
(what an editor or an agent runs on every save) and `sexpgpu explain examples/gpt.sx
--variant smoke`, and, for the record, how long importing numpy and ml_dtypes takes in a
fresh interpreter (ml_dtypes 0.7's extension takes about a second; bf16 support is
imported only where a bf16 value is made). Goals: `--version` under 0.2 s, `check` of
GPT-2 small under 1.0 s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "sexpgpu --version": ["--version"],
    "sexpgpu check examples/gpt2-small.sx": ["check", "examples/gpt2-small.sx"],
    "sexpgpu explain examples/gpt.sx --variant smoke": ["explain", "examples/gpt.sx", "--variant", "smoke"],
}

IMPORTS = {
    "import numpy": "import numpy",
    "import ml_dtypes": "import ml_dtypes",
}


def best_seconds(argv: list[str], repeat: int) -> float:
    """The best wall time of `argv` (run from the repository's root) over `repeat` fresh processes."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
        best = min(best, seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per command (the best counts)")
    args = parser.parse_args()
    try:
        import ml_dtypes

        version = ml_dtypes.__version__
    except ImportError:
        version = "not installed"
    print(f"python {sys.version.split()[0]}, ml_dtypes {version}; best of {args.repeat} fresh processes")
    width = max(map(len, [*COMMANDS, *IMPORTS]))
    for label, words in COMMANDS.items():
        seconds = best_seconds([sys.executable, "-m", "sexpgpu.tools.main", *words], args.repeat)
        print(f"  {label:<{width}}  {seconds:6.3f} s")
    for label, code in IMPORTS.items():
        seconds = best_seconds([sys.executable, "-c", code], args.repeat)
        print(f"  {label:<{width}}  {seconds:6.3f} s  (the interpreter's start included)")


if __name__ == "__main__":
    main()
