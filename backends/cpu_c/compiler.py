"""The host C compiler: generated C to a shared object, cached on disk, loaded with ctypes.

- `host_compiler()`: `$CC`, else the first of `cc`, `gcc`, `clang` on the PATH that builds OpenMP code;
  `missing_compiler()` says in one line what to install when there is none (the `cpu-c` probe).
- `compile_shared(units)`: the shared object of a module's translation units, from the cache when it holds
  it (`$SEXPGPU_CACHE/cpu-c/<key>.so`, key = hash of the units, the compiler's identity, the flags and the
  host CPU, which `-march=native` compiles for), else each unit compiled to an object, as many compilers
  at once as there are cores (a cold compile of a large model is bound by the biggest unit, not the sum),
  linked, and stored whole (written beside, renamed into place), as the NVRTC cache stores CUBINs
  (`backends/cuda/nvrtc.py`). A unit the compiler rejects is a `CCompileError` with its log.

Flags: `-O3 -march=native -fopenmp` (what tinygrad's clang and Inductor's C++ use on a CPU), position
independent, `-fno-math-errno` (a `sqrtf` is the instruction), `-fno-trapping-math` (no floating-point
exception is ever looked at, so a select of two computed floats is a vector blend: without it a loop holding a
NaN test does not vectorize; no value changes), and `-ffp-contract=off`: no fused
multiply-adds the interpreter does not make, so the C computes what numpy computes, rounding for rounding.
No `-ffast-math`: NaNs, infinities and the order of sums stay as written. On x86-64, `-mprefer-vector-width=512`
too: GCC tunes Intel's AVX-512 cores for 256-bit loops, where a core with two 512-bit FMA pipes (Sapphire
Rapids) runs the GELU's and the loss's loops 20-35% faster at 512 bits; hosts without AVX-512 ignore it, and
an element's value does not depend on the vector width (no sum is split across lanes by the vectorizer).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

from ..cuda.nvrtc import cache_root

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))
LINK_FLAGS = ("-shared", "-fopenmp")
CANDIDATES = ("cc", "gcc", "clang")
#: How many times an idle OpenMP thread polls before it sleeps (libgomp's default is 300000: 8 ms where a
#: pause takes 26 ns, as measured on a Zen 4; 10000 is a quarter of a millisecond there): a graph's next
#: parallel loop comes within microseconds, while on a machine with more work than cores a thread that
#: polls for milliseconds takes the core its team's other threads wait for.
SPIN_COUNT = 10000
#: What `--device cpu-c` says to install when no compiler is found.
INSTALL_HINT = "install a C compiler with OpenMP (Debian/Ubuntu: apt-get install gcc; macOS: brew install gcc) or set CC"
#: Bumped when the layout of a cached object changes.
_CACHE_FORMAT = 2


class CCompileError(Exception):
    """Generated C the host compiler rejected: a bug in sexpgpu's C renderer, so an internal error (exit 3).
    The executor names the kernel and its model path (`at`)."""

    def __init__(self, compiler: str, log: str, kernel: str | None = None, model_path: str | None = None) -> None:
        super().__init__(compiler, log, kernel, model_path)
        self.compiler = compiler
        self.log = log
        self.kernel = kernel
        self.model_path = model_path

    def at(self, kernel: str, model_path: str) -> CCompileError:
        self.kernel, self.model_path = kernel, model_path
        return self

    def __str__(self) -> str:
        what = f"the generated kernel {self.kernel}" if self.kernel else "the generated C"
        where = f" (model path {self.model_path})" if self.model_path else ""
        return f"{self.compiler} rejected {what}{where}:\n{self.log.rstrip()}"


@frozen
class Compiler:
    path: str
    #: The first line of `--version`: part of the cache key, and what the lowering report names.
    version: str


@functools.cache
def host_compiler() -> Compiler | None:
    """The C compiler `cpu-c` uses, or None when no candidate builds an OpenMP program."""
    configured = os.environ.get("CC")
    candidates = [configured] if configured else list(CANDIDATES)
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        if _builds_openmp(path):
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
            return Compiler(path, version[0].strip() if version else name)
    return None


def _builds_openmp(path: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="sexpgpu-cc-") as folder:
        source = Path(folder) / "probe.c"
        source.write_text("#include <omp.h>\nint sx_probe(void) { return omp_get_max_threads(); }\n")
        try:
            done = subprocess.run([path, *FLAGS, *LINK_FLAGS, "-o", str(Path(folder) / "probe.so"), str(source)],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


def missing_compiler() -> str | None:
    """None when a compiler is found; else the one line naming what to install."""
    if host_compiler() is not None:
        return None
    wanted = f"$CC ({os.environ['CC']})" if os.environ.get("CC") else "cc, gcc or clang"
    return f"no C compiler with OpenMP found ({wanted}); {INSTALL_HINT}"


@functools.cache
def host_cpu() -> str:
    """What `-march=native` compiles for: the machine and its CPU's model and feature flags."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = hashlib.sha256(value.strip().encode()).hexdigest()[:16]
    except OSError:
        pass
    return f"{platform.machine()} {model} {flags}".strip()


def cache_key(units: Sequence[str], compiler: Compiler) -> str:
    document = {"format": _CACHE_FORMAT, "units": list(units), "flags": list(FLAGS), "compiler": compiler.version,
                "compiler_path": compiler.path, "cpu": host_cpu()}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def load(path: Path) -> ctypes.CDLL:
    """The shared object at `path`, loaded with `GOMP_SPINCOUNT` at `SPIN_COUNT` unless the user set how
    OpenMP threads wait (libgomp reads it once, when it is first loaded: normally with the first object)."""
    configured = any(name in os.environ for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"))
    if not configured:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        return ctypes.CDLL(str(path))
    finally:
        if not configured:
            del os.environ["GOMP_SPINCOUNT"]


def compile_shared(units: Sequence[str], use_cache: bool = True) -> tuple[ctypes.CDLL, bool]:
    """The loaded shared object of the translation units `units` and whether it came from the cache (see
    the module docstring)."""
    compiler = host_compiler()
    if compiler is None:
        raise RuntimeError(missing_compiler())
    key = cache_key(units, compiler)
    path = cache_root() / "cpu-c" / key[:2] / f"{key}.so"
    if use_cache and path.is_file():
        try:
            return load(path), True
        except OSError:
            pass  # not whole (a crash mid-write cannot leave one: it is renamed in) or foreign: compile again
    with tempfile.TemporaryDirectory(prefix="sexpgpu-cpu-c-") as folder:
        built = _build(compiler, units, Path(folder))
        if not use_cache:
            return load(built), False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            os.close(fd)
            shutil.copyfile(built, temporary)
            os.replace(temporary, path)
        except OSError:
            return load(built), False  # an unwritable cache costs the next run a compile
        return load(path), False


def _build(compiler: Compiler, units: Sequence[str], folder: Path) -> Path:
    """Compile each unit to an object (as many compilers at once as there are cores) and link them."""
    objects = []
    for number, unit in enumerate(units):
        (folder / unit_file(number)).write_text(unit)
        objects.append(folder / f"unit{number}.o")
    jobs = [[compiler.path, *FLAGS, "-c", "-o", str(obj), str(folder / unit_file(number))]
            for number, obj in enumerate(objects)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        done = list(pool.map(lambda job: subprocess.run(job, capture_output=True, text=True), jobs))
    for outcome in done:
        if outcome.returncode != 0:
            raise CCompileError(Path(compiler.path).name, outcome.stderr or outcome.stdout)
    built = folder / "kernels.so"
    linked = subprocess.run([compiler.path, *LINK_FLAGS, "-o", str(built), *map(str, objects)], capture_output=True,
                            text=True)
    if linked.returncode != 0:
        raise CCompileError(Path(compiler.path).name, linked.stderr or linked.stdout)
    return built


def unit_file(number: int) -> str:
    """The file name translation unit `number` is compiled from (what the compiler's messages name)."""
    return f"unit{number}.c"
