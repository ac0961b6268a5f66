"""Compile a CUDA source for the simulated device, cache it, load it.

The source is compiled unchanged by the host C++ compiler with `cuda_sim.h`
force-included. A small export section after it (a second file that
includes the source, so diagnostics keep the source's own file and line)
names each kernel to the runtime, which asks the compiler for the kinds and
sizes of its parameters, and points every `extern __shared__` array at the
launch's dynamic shared memory.

Shared objects are cached on disk under `$SEXPGPU_CACHE/cuda-sim` (default
`~/.cache/sexpgpu`, or `$XDG_CACHE_HOME/sexpgpu`) by a hash of the source,
its file name, the header, the compiler's version and the flags; each is
written under a temporary name and renamed into place, so a concurrent
compile never sees half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from attrs import field, frozen

from ..source import KernelDecl, extern_shared_names, find_kernels
from .errors import CompileError, SimError

HEADER_PATH = Path(__file__).with_name("cuda_sim.h")
#: Headers a CUDA source may include that the emulation header already stands for.
STUB_INCLUDE_DIR = Path(__file__).with_name("include")
#: Must equal the header's kAbiVersion.
ABI_VERSION = 1
FLAGS = (
    "-std=c++17", "-O2", "-fPIC", "-shared", "-DSEXPGPU_SIM",
    # CUDA code type-puns freely (float4 loads of bf16 rows); nvcc allows it.
    "-fno-strict-aliasing",
    # No contraction into FMA: the same results on every host architecture.
    "-ffp-contract=off",
    # Kernel modules keep their runtime to themselves.
    "-fvisibility=hidden",
    # Large stack frames probe page by page, so a fiber's overflow hits its guard page.
    "-fstack-clash-protection",
    "-fno-threadsafe-statics", "-fno-exceptions",
    # aarch64 probes every 64 KiB by default, which would step over a 4 KiB guard page.
    *(("--param=stack-clash-protection-guard-size=12",) if platform.machine() in ("aarch64", "arm64") else ()),
)

PARAM_KINDS = {1: "pointer", 2: "signed", 3: "unsigned", 4: "float", 5: "bfloat16", 6: "bytes"}


class _ParamInfo(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("size", ctypes.c_int), ("align", ctypes.c_int)]


class _KernelInfo(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_int),
        ("name", ctypes.c_char_p),
        ("thunk", ctypes.c_void_p),
        ("nparams", ctypes.c_int),
        ("params", ctypes.POINTER(_ParamInfo)),
        ("max_threads", ctypes.c_uint),
    ]


@frozen
class KernelParam:
    """A kernel parameter: its declared name and type, and the kind and size the compiler gave it."""

    name: str
    type: str
    kind: str
    size: int
    align: int


@frozen
class SimKernel:
    """A kernel of a loaded module, ready to launch on a `SimDevice`."""

    name: str
    params: tuple[KernelParam, ...]
    #: `__launch_bounds__`'s maximum threads per block, 0 without one.
    max_threads: int
    module: SimModule = field(repr=False, eq=False)
    info: int = field(repr=False)  # the address of the runtime's KernelInfo

    def signature(self) -> str:
        return f"{self.name}({', '.join(f'{p.type} {p.name}' for p in self.params)})"


class SimModule:
    """A compiled and loaded CUDA source: its kernels by name."""

    def __init__(self, path: Path, filename: str, decls: list[KernelDecl]) -> None:
        self.path = path
        self.filename = filename
        self._library = ctypes.CDLL(str(path))
        if self._library.sexpgpu_sim_abi_version() != ABI_VERSION:
            raise SimError(f"{path} was built by another version of cuda_sim.h")
        self.launch_entry = self._library.sexpgpu_sim_launch
        self.launch_entry.restype = ctypes.c_int
        self.launch_entry.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
        self.kernels = {decl.name: self._kernel(decl) for decl in decls}

    def _kernel(self, decl: KernelDecl) -> SimKernel:
        describe = getattr(self._library, f"sexpgpu_sim_kernel_{decl.name}")
        describe.restype = ctypes.POINTER(_KernelInfo)
        info = describe().contents
        if info.nparams != len(decl.params):
            raise SimError(f"kernel {decl.name}: the compiler sees {info.nparams} parameters, "
                           f"the source parser {len(decl.params)}")
        params = tuple(
            KernelParam(p.name, p.type, PARAM_KINDS[info.params[i].kind], info.params[i].size, info.params[i].align)
            for i, p in enumerate(decl.params)
        )
        return SimKernel(decl.name, params, info.max_threads, self, ctypes.addressof(info))

    def kernel(self, name: str) -> SimKernel:
        try:
            return self.kernels[name]
        except KeyError:
            known = ", ".join(self.kernels) or "none"
            raise SimError(f"{self.filename} has no kernel named {name} (its kernels: {known})") from None

    def __repr__(self) -> str:
        return f"SimModule({self.filename}, kernels={list(self.kernels)})"


def default_cache_dir() -> Path:
    """`$SEXPGPU_CACHE`, else `$XDG_CACHE_HOME/sexpgpu`, else `~/.cache/sexpgpu`."""
    if root := os.environ.get("SEXPGPU_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sexpgpu"


def host_compiler() -> str:
    """The C++ compiler: `$SEXPGPU_SIM_CXX`, default `g++`."""
    return os.environ.get("SEXPGPU_SIM_CXX") or "g++"


@functools.cache
def compiler_identity(cxx: str) -> str:
    """The compiler's version banner and target, part of every cache key."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        target = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SimError(f"cuda-sim compiles kernels with a C++ compiler, and `{cxx}` does not run ({err}); "
                       "install g++ or set SEXPGPU_SIM_CXX") from None
    return version.splitlines()[0] + " " + target.strip()


_LOADED: dict[Path, SimModule] = {}
_LOAD_LOCK = threading.Lock()


def compile_module(source: str, filename: str = "kernels.cu", cache_dir: Path | None = None) -> SimModule:
    """Compile (or find in the cache) and load `source`; `filename` is what diagnostics and kernel errors call it."""
    filename = re.sub(r"[^\w.+-]", "_", filename) or "kernels.cu"
    decls = find_kernels(source)
    exports = export_section(filename, decls, extern_shared_names(source))
    cxx = host_compiler()
    key = hashlib.sha256(
        "\0".join([source, filename, exports, HEADER_PATH.read_text(), compiler_identity(cxx), " ".join(FLAGS)]).encode()
    ).hexdigest()
    root = (cache_dir or default_cache_dir()) / "cuda-sim"
    path = root / f"{key[:32]}.so"
    with _LOAD_LOCK:
        if path in _LOADED:
            return _LOADED[path]
        if not path.exists():
            _build(cxx, source, filename, exports, root, path)
        module = _LOADED[path] = SimModule(path, filename, decls)
        return module


def export_section(filename: str, decls: list[KernelDecl], shared: list[str]) -> str:
    """The file compiled in the source's place: the source, then what the runtime needs to know of it."""
    lines = [f'#include "{filename}"']
    for decl in decls:
        bounds = f", {decl.launch_bounds}" if decl.launch_bounds else ""
        lines.append(f"SEXPGPU_SIM_EXPORT_KERNEL({decl.name}{bounds})")
    lines += [f"SEXPGPU_SIM_EXTERN_SHARED({name})" for name in shared]
    return "\n".join(lines) + "\n"


def compile_command(cxx: str, exports_file: str, output: str) -> list[str]:
    return [cxx, *FLAGS, "-I", str(STUB_INCLUDE_DIR), "-include", str(HEADER_PATH), "-x", "c++", exports_file,
            "-o", output, "-lm"]


def _build(cxx: str, source: str, filename: str, exports: str, root: Path, path: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        (work / filename).write_text(source)
        exports_file = f"{filename}.exports.cpp"
        (work / exports_file).write_text(exports)
        done = subprocess.run(compile_command(cxx, exports_file, "module.so"), cwd=work, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise CompileError(_compile_failure(filename, source, done.stderr), done.stderr)
        os.replace(work / "module.so", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_DIAGNOSTIC = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): (?:fatal )?error: (?P<message>.*)$", re.M)


def _compile_failure(filename: str, source: str, log: str) -> str:
    """The first error at its file:line (quoting the kernel source's line), then the whole log."""
    first = _DIAGNOSTIC.search(log)
    where = "the simulated CUDA source"
    if first:
        where = f"{first['file']}:{first['line']}:{first['col']}: {first['message']}"
        lines = source.splitlines()
        if first["file"] == filename and 1 <= int(first["line"]) <= len(lines):
            where += f"\n  {lines[int(first['line']) - 1]}"
    return (f"internal error: the host compiler rejected {filename} for cuda-sim "
            f"(the emulation header should take every kernel NVRTC takes):\n{where}\n--- compiler log ---\n{log}")
