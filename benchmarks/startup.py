"""Start-up: the commands a user or an editor runs, each in a fresh process, as they run them.

    python benchmarks/startup.py [--repeat 5]

Prints the median wall time of `sexpgpu --version`, `sexpgpu check examples/gpt2-small.sx`
(what an editor or an agent runs on every save), `sexpgpu explain examples/gpt.sx` and
`sexpgpu-opt --list-passes`, each run through its console script; the commands take turns
(one run of each, then again), so a load that comes and goes weighs on all alike. For the
record it prints how long importing numpy, ml_dtypes and lark takes in a fresh interpreter,
none of which `check` imports (ml_dtypes 0.7's extension takes about a second; the pass
registry is lazy and the reader's terminals are generated, docs/passes.md). Goals:
`--version` under 0.2 s, `check` of GPT-2 small under 1.0 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: label -> (console script, its arguments)
COMMANDS = {
    "sexpgpu --version": ("sexpgpu", ["--version"]),
    "sexpgpu check examples/gpt2-small.sx": ("sexpgpu", ["check", "examples/gpt2-small.sx"]),
    "sexpgpu explain examples/gpt.sx": ("sexpgpu", ["explain", "examples/gpt.sx"]),
    "sexpgpu-opt --list-passes": ("sexpgpu-opt", ["--list-passes"]),
}

IMPORTS = {
    "import numpy": "import numpy",
    "import ml_dtypes": "import ml_dtypes",
    "import lark": "import lark",
}


def seconds(argv: list[str]) -> float:
    """The wall time of `argv` run once from the repository's root; a failure ends the benchmark."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def script(name: str) -> str:
    """The console script `name` installed beside this interpreter (as a user runs it)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise SystemExit(f"{path} not found: run pip install -e . in this environment")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per command (the median counts)")
    args = parser.parse_args()
    try:
        import ml_dtypes

        version = ml_dtypes.__version__
    except ImportError:
        version = "not installed"
    print(f"python {sys.version.split()[0]}, ml_dtypes {version}; median of {args.repeat} fresh processes, "
          "the commands taking turns")
    runs = {label: [script(name), *words] for label, (name, words) in COMMANDS.items()}
    runs.update({label: [sys.executable, "-c", code] for label, code in IMPORTS.items()})
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(args.repeat):
        for label, argv in runs.items():
            times[label].append(seconds(argv))
    width = max(map(len, runs))
    for label, taken in times.items():
        note = "  (the interpreter's start included)" if label in IMPORTS else ""
        print(f"  {label:<{width}}  {statistics.median(taken):6.3f} s  (min {min(taken):.3f}){note}")


if __name__ == "__main__":
    main()
