"""Start-up: the commands a user or an editor runs, each in a fresh process, as they run them.

    python benchmarks/startup.py [--repeat 5]

Prints the median wall time of `sexpgpu --version`, `sexpgpu check examples/gpt2-small.sx`
(what an editor or an agent runs on every save), `sexpgpu explain examples/gpt.sx` and
`sexpgpu-opt --list-passes`, each run through its console script, and the CPU time each
process took (user + system: what a shared, loaded machine does not inflate as it does the
wall time); the commands take turns (one run of each, then again), so a load that comes and
goes weighs on all alike. Each command runs once first, unmeasured, with Python's bytecode
cache written (PYTHONDONTWRITEBYTECODE unset for it), as an installed package has it: with
that variable set and the cache stale, every run would compile the sources again. For the
record it prints how long importing numpy, ml_dtypes and lark takes in a fresh interpreter,
none of which `check` imports (ml_dtypes 0.7's extension takes about a second; the pass
registry is lazy and the reader's terminals are generated, docs/passes.md). Goals:
`--version` under 0.2 s, `check` of GPT-2 small under 1.0 s.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def seconds(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """The wall time and the CPU time (user + system) of `argv` run once from the repository's root;
    a failure ends the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


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
    caching = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    for argv in runs.values():
        seconds(argv, caching)
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    for _ in range(args.repeat):
        for label, argv in runs.items():
            times[label].append(seconds(argv))
    width = max(map(len, runs))
    for label, taken in times.items():
        wall, cpu = [w for w, _ in taken], [c for _, c in taken]
        note = "  (the interpreter's start included)" if label in IMPORTS else ""
        print(f"  {label:<{width}}  {statistics.median(wall):6.3f} s  (min {min(wall):.3f}), "
              f"CPU {statistics.median(cpu):.3f} s  (min {min(cpu):.3f}){note}")


if __name__ == "__main__":
    main()
