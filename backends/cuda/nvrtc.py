"""CUDA C to CUBIN with NVRTC: headers from the wheels, ptxas's figures per kernel, an on-disk cache.

Everything comes from the `cuda` extra (cuda-bindings, cuda-pathfinder, and NVIDIA's wheels of NVRTC
and of the runtime headers); nothing here needs a GPU, a driver or a CUDA toolkit, so CI compiles
every generated kernel. `compile_cubin` returns machine code for one architecture, never PTX: PTX
from an NVRTC newer than the driver does not load, and CUBIN skips the driver's JIT at load time.

Compiled modules are cached under `$SEXPGPU_CACHE` (default `~/.cache/sexpgpu`) by a hash of the
source, the architecture, the options and the compiler's identity; entries are written to a
temporary file and renamed into place, so concurrent processes never read a partial one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

from ...diagnostics import warn
from .errors import CudaToolchainMissing, KernelCompileError

#: Options every generated kernel is compiled with unless the caller gives its own. No fast math:
#: the lowering's precision contract (f32 within 1e-5 of the interpreter) rules out `--use_fast_math`.
DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17",)

#: Bumped when the layout of a cache entry changes, so old entries are never misread.
_CACHE_FORMAT = 1

_ARCH = re.compile(r"sm_(\d+)[af]?")


@frozen
class KernelResources:
    """What ptxas reported for one kernel; sizes in bytes."""

    name: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    shared: int  # static shared memory; dynamic shared memory is the launch's
    barriers: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@frozen
class Cubin:
    """A compiled module: the CUBIN image for `arch`, NVRTC's log and each kernel's resources."""

    image: bytes
    arch: str
    log: str
    kernels: dict[str, KernelResources]
    key: str  # the cache key it was compiled or found under
    from_cache: bool

    def spilling(self) -> list[KernelResources]:
        """The kernels that spill registers to local memory (a generated kernel must not)."""
        return [k for k in self.kernels.values() if k.spills]


@frozen
class Nvrtc:
    """The NVRTC library this process compiles with, and the headers it compiles against."""

    version: tuple[int, int]
    library: str
    library_found_via: str  # cuda-pathfinder's account: "site-packages", "conda", "CUDA_PATH", ...
    include_dirs: tuple[str, ...]
    include_found_via: tuple[str, ...]
    identity: str  # changes whenever the library or its headers do: part of every cache key

    def describe(self) -> str:
        headers = ", ".join(f"{d} ({via})" for d, via in zip(self.include_dirs, self.include_found_via))
        return (f"NVRTC {self.version[0]}.{self.version[1]} at {self.library} ({self.library_found_via}); "
                f"headers from {headers}")


@functools.cache
def nvrtc_toolchain() -> Nvrtc:
    """NVRTC and its headers, located once per process; `CudaToolchainMissing` if the extra is not installed."""
    return _locate_nvrtc()


def _locate_nvrtc() -> Nvrtc:
    needed_for = "compiling CUDA kernels"
    try:
        from cuda import pathfinder
        from cuda.bindings import nvrtc
    except ImportError as err:
        raise CudaToolchainMissing(f"cuda-python is not installed ({err})", needed_for) from None
    try:
        library = pathfinder.load_nvidia_dynamic_lib("nvrtc")
    except pathfinder.DynamicLibNotFoundError:
        raise CudaToolchainMissing("the NVRTC library (libnvrtc, wheel nvidia-cuda-nvrtc) is not installed",
                                   needed_for) from None
    # cuda_runtime.h marks the runtime's include folder, which holds cuda_bf16.h, cuda_fp16.h and
    # vector_types.h; what those include beyond it (<nv/target>) is built into NVRTC.
    headers = pathfinder.locate_nvidia_header_directory("cudart")
    if headers is None or not os.path.isfile(os.path.join(headers.abs_path, "cuda_bf16.h")):
        raise CudaToolchainMissing("the CUDA runtime headers (cuda_bf16.h, wheel nvidia-cuda-runtime) are not installed",
                                   needed_for)
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    crt = _crt_include_dir(headers.abs_path)
    include_dirs = (headers.abs_path,) if crt is None else (headers.abs_path, crt)
    identity = hashlib.sha256(json.dumps([
        major, minor, _file_identity(library.abs_path),
        [headers.abs_path, _file_identity(os.path.join(headers.abs_path, "cuda_bf16.h")),
         _file_identity(os.path.join(headers.abs_path, "cuda_fp16.h"))],
        None if crt is None else [crt, _file_identity(os.path.join(crt, "crt", "mma.h"))],
    ]).encode()).hexdigest()
    found_via = (headers.found_via,) if crt is None else (headers.found_via, "nvidia-cuda-crt")
    return Nvrtc((major, minor), library.abs_path, library.found_via, include_dirs, found_via, identity)


def _crt_include_dir(runtime_include: str) -> str | None:
    """Where `crt/mma.h` is (wheel nvidia-cuda-crt: the wmma API the runtime's mma.h includes) when it is not
    in the runtime's include folder: the wheel installed under another site (the device check carries it
    into its own), whose `nvidia` namespace package holds the other part of the same include tree."""
    if os.path.isfile(os.path.join(runtime_include, "crt", "mma.h")):
        return None
    try:
        import nvidia
    except ImportError:
        return None
    bases = list(nvidia.__path__)
    home = next((base for base in bases if runtime_include.startswith(base + os.sep)), None)
    if home is None:
        return None
    tail = os.path.relpath(runtime_include, home)
    for base in bases:
        candidate = os.path.join(base, tail)
        if os.path.isfile(os.path.join(candidate, "crt", "mma.h")):
            return candidate
    return None


def supported_archs() -> list[str]:
    """The real architectures this NVRTC compiles CUBIN for (`sm_75`, `sm_80`, ...)."""
    from cuda.bindings import nvrtc

    nvrtc_toolchain()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def _file_identity(path: str) -> list:
    stat = os.stat(path)
    return [os.path.realpath(path), stat.st_size, stat.st_mtime_ns]


def compile_cubin(
    source: str,
    arch: str = "sm_90",
    options: Sequence[str] = DEFAULT_OPTIONS,
    name: str = "kernels",
    model_path: str | None = None,
    use_cache: bool = True,
) -> Cubin:
    """CUDA C `source` compiled to a CUBIN for `arch` (`sm_80`, `sm_90`, ...), from the cache when it holds it.

    `name` names the program in NVRTC's log (`name.cu(12): error: ...`) and in errors; `model_path`
    is the region the kernels were generated from. A source NVRTC rejects is a `KernelCompileError`
    carrying its log. Kernels should be `extern "C"` so their names in `kernels` are unmangled.
    """
    if not _ARCH.fullmatch(arch):
        raise ValueError(f"NVRTC compiles CUBIN for a real architecture such as sm_90, not {arch!r}")
    toolchain = nvrtc_toolchain()
    key = cache_key(source, arch, options, toolchain)
    if use_cache:
        entry = _read_entry(_entry_path(key))
        if entry is not None:
            log, image = entry
            return Cubin(image, arch, log, parse_ptxas_log(log), key, from_cache=True)
    image, log = _nvrtc_compile(source, arch, options, name, model_path, toolchain)
    if use_cache:
        _write_entry(_entry_path(key), log, image)
    return Cubin(image, arch, log, parse_ptxas_log(log), key, from_cache=False)


def cache_key(source: str, arch: str, options: Sequence[str], toolchain: Nvrtc) -> str:
    """The hash a compiled module is cached under: source, architecture, options, compiler and headers."""
    document = {"format": _CACHE_FORMAT, "source": source, "arch": arch, "options": list(options),
                "nvrtc": toolchain.identity}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def _nvrtc_compile(source: str, arch: str, options: Sequence[str], name: str, model_path: str | None,
                   toolchain: Nvrtc) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    err, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        arguments = [f"--gpu-architecture={arch}", "--ptxas-options=-v",
                     *(f"--include-path={d}" for d in toolchain.include_dirs), *options]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(arguments), [a.encode() for a in arguments])
        err_log, size = nvrtc.nvrtcGetProgramLogSize(program)
        _check(err_log, "nvrtcGetProgramLogSize")
        log_buffer = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(program, log_buffer)[0], "nvrtcGetProgramLog")
        log = log_buffer.rstrip(b"\0").decode("utf-8", "replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(name, arch, log or err.name, model_path)
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(err, "nvrtcGetCUBINSize")
        image = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, image)[0], "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return image, log


def _check(err, call: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {err.name}")


# --- ptxas's report -------------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SHARED = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Each kernel's registers, spills, stack frame, static shared memory and barriers from `-v` output.

    ptxas reports an entry function as three lines (`Compiling entry function`, `Function properties
    for` with the frame and spills, `Used N registers, ...`); device functions it did not inline get a
    properties line of their own, which is not a kernel.
    """
    entries: list[str] = []
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, tuple[int, int, int]] = {}
    entry = properties_of = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            entries.append(entry)
        elif m := _PROPERTIES.search(line):
            properties_of = m.group(1)
        elif (m := _FRAME.search(line)) and properties_of is not None:
            frames[properties_of] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            barriers, shared = _BARRIERS.search(line), _SHARED.search(line)
            used[entry] = (int(m.group(1)), int(barriers.group(1)) if barriers else 0, int(shared.group(1)) if shared else 0)
    kernels = {}
    for name in entries:
        if name not in frames or name not in used:
            raise ValueError(f"ptxas reported no {'frame' if name not in frames else 'registers'} for kernel {name}:\n{log}")
        (frame, stores, loads), (registers, barriers, shared) = frames[name], used[name]
        kernels[name] = KernelResources(name, registers, frame, stores, loads, shared, barriers)
    return kernels


# --- the CUBIN itself ---------------------------------------------------------------------------------

_EM_CUDA = 190
_ELFOSABI_CUDA = 0x41


def cubin_arch(image: bytes) -> str:
    """The architecture a CUBIN (a CUDA ELF image) was compiled for, as `sm_NN`.

    The SM number sits in `e_flags`: its low byte before ELF ABI version 8 (CUDA 12.8), the byte above
    it since.
    """
    if image[:4] != b"\x7fELF" or image[7] != _ELFOSABI_CUDA or struct.unpack_from("<H", image, 18)[0] != _EM_CUDA:
        raise ValueError("not a CUDA ELF image")
    flags_offset = 48 if image[4] == 2 else 36  # ELFCLASS64 or ELFCLASS32
    flags = struct.unpack_from("<I", image, flags_offset)[0]
    sm = (flags >> 8) & 0xFF if image[8] >= 8 else flags & 0xFF
    return f"sm_{sm}"


# --- the cache ---------------------------------------------------------------------------------------

def cache_root() -> Path:
    """`$SEXPGPU_CACHE`, else `sexpgpu` in the user's cache folder (`$XDG_CACHE_HOME` or `~/.cache`)."""
    configured = os.environ.get("SEXPGPU_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sexpgpu"


def _entry_path(key: str) -> Path:
    return cache_root() / "nvrtc" / key[:2] / f"{key}.cubin"


def _read_entry(path: Path) -> tuple[str, bytes] | None:
    """The log and image stored at `path`, or None when absent or not whole (then it is compiled again)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    header, newline, image = data.partition(b"\n")
    try:
        meta = json.loads(header)
    except ValueError:
        return None
    if not newline or meta.get("size") != len(image) or meta.get("sha256") != hashlib.sha256(image).hexdigest():
        return None
    return meta["log"], image


def _write_entry(path: Path, log: str, image: bytes) -> None:
    """Store one entry: a JSON line (log, size, checksum) and the image, renamed into place whole."""
    header = json.dumps({"log": log, "size": len(image), "sha256": hashlib.sha256(image).hexdigest()}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header + b"\n" + image)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as err:
        root = cache_root()
        if root not in _UNWRITABLE_ROOTS_WARNED:  # once per cache, not once per kernel
            _UNWRITABLE_ROOTS_WARNED.add(root)
            warn(f"cannot write the kernel cache in {root} ({err.strerror or err}); kernels are compiled again "
                 "next time (set SEXPGPU_CACHE to a writable folder)")


_UNWRITABLE_ROOTS_WARNED: set[Path] = set()
