"""An experiment lowered for a CUDA device: the lowering pipeline, its kernels compiled by NVRTC, the report's document.

- `lower(unit, stack, arch)`: `stack{k=...}` (when k > 1) and the CUDA lowering for `arch` (`cuda_lowering`)
  on a unit after the training pipeline.
- `NvrtcCompiler(arch)`: the GPU runtimes' `KernelCompiler`; `compile_module(compiler, module)` compiles a
  lowered module's translation unit with any compiler, naming the kernel NVRTC rejects.
- `compile_lowered(module, arch)`: the module's translation unit (`kern.source`: every distinct kernel of
  every graph once) compiled to CUBIN by NVRTC (`nvrtc.compile_cubin`, disk-cached by source). A kernel NVRTC
  rejects is a `KernelCompileError` (an internal error) naming the kernel whose function holds the first
  error and the model path of its region.
- `compile_facts(module, cubin, arch)`: the report's `compiled` figures: kernels and functions, the most
  registers, spills, and what a kernel cannot do on `arch` (a block needing more registers than an SM has,
  or more shared memory than a block may use).
- `lowering_report(unit, arch, ...)`: all three, returning the lowering document
  (`passes/lowering_report.py`). A module lowered before for the same target, by the same sexpgpu code and
  NVRTC, is not lowered again: its document is read from the lowering cache (`$SEXPGPU_CACHE/lowering`),
  so a warm `explain --device cuda` neither lowers nor runs NVRTC.

The CUDA executor lowers with `lower` and compiles with its runtime's compiler through `compile_module` (it
needs the lowered module, not only its report) and builds its report with
`passes.lowering_report.lowering_document`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...diagnostics import UsageError
from ...dialects.core import Operation
from ...dialects.printer import print_module
from ...passes.lowering_report import (
    lowering_document,
    stacking_degrees,
    without_launches,
)
from ...passes.manager import CompilationUnit, run_pipeline
from ...passes.pipelines import WORKING_COPIES, cuda_lowering
from ...version import __version__
from . import target  # noqa: F401  (registers the `cuda` target and emit-cuda, which CUDA_LOWERING runs)
from .compiler import KernelCompiler
from .errors import KernelCompileError
from .nvrtc import DEFAULT_OPTIONS, Cubin, cache_root, compile_cubin, nvrtc_toolchain, supported_archs
from .source import find_kernels

#: Registers of one streaming multiprocessor (every architecture from sm_80 to sm_90), allocated to a warp
#: in units of 256 (8 a thread): a block needs all of its threads' at once.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 8
#: The most shared memory, static and dynamic, one block may use (after opting in above 48 KiB), by architecture.
SHARED_PER_BLOCK = {"sm_80": 163 << 10, "sm_86": 99 << 10, "sm_87": 163 << 10, "sm_89": 99 << 10, "sm_90": 227 << 10}
#: Bumped when a cached lowering document's layout changes.
_CACHE_FORMAT = 1
#: Where NVRTC's log places an error: `kernels.cu(123): error: ...`.
_ERROR_LINE = re.compile(r"\((\d+)\): (?:catastrophic )?error")


def lower(unit: CompilationUnit, stack: int | None = None, arch: str = "") -> CompilationUnit:
    """`unit` (after the training pipeline) lowered for CUDA on `arch` (empty: any device), with
    `@train_stacked` for `stack` microbatches a call when `stack` is above 1."""
    lowering = cuda_lowering(arch)
    pipeline = f"stack{{k={stack}}},{lowering}" if stack is not None and stack > 1 else lowering
    return run_pipeline(unit, pipeline)


def stack_for_report(module: Operation) -> int | None:
    """The stacking degree `train stacked` is planned for without a device: the smallest above 1 a run may
    choose (the cheapest to plan; the report's stacking line lists them all); None when a step has one
    microbatch."""
    run = next(op.attributes for op in module.body.ops if op.name == "exp.run")
    return min((k for k in stacking_degrees(run["microbatches"]) if k > 1), default=None)


def module_source(module: Operation) -> str:
    """The CUDA translation unit `emit-cuda` recorded in a lowered module."""
    for op in module.body.ops:
        if op.name == "kern.source":
            return op.attributes["text"]
    raise ValueError("the module has no kern.source: run the CUDA lowering (emit-cuda) first")


class NvrtcCompiler(KernelCompiler):
    """NVRTC to CUBIN for `arch` (`nvrtc.compile_cubin`, disk-cached): the GPU drivers' compiler."""

    def __init__(self, arch: str, use_cache: bool = True) -> None:
        self.arch = arch
        self.use_cache = use_cache

    def compile(self, source: str, name: str) -> Cubin:
        return compile_cubin(source, self.arch, DEFAULT_OPTIONS, name=name, use_cache=self.use_cache)

    def compiled_facts(self, module: Operation, binary: Cubin) -> dict[str, Any]:
        return compile_facts(module, binary, self.arch)


def compile_module(compiler: KernelCompiler, module: Operation, name: str = "kernels") -> Any:
    """The lowered module's translation unit compiled by `compiler`; a kernel NVRTC rejects is named with
    its model path."""
    source = module_source(module)
    try:
        return compiler.compile(source, name)
    except KernelCompileError as err:
        located = _rejected_kernel(module, source, err.log)
        if located is None:
            raise
        function, symbol, path = located
        raise KernelCompileError(f"{function} (@{symbol})", err.target, err.log, path or None) from None


def compile_lowered(module: Operation, arch: str, use_cache: bool = True) -> Cubin:
    """The module's kernels compiled by NVRTC for `arch`; a rejection names its kernel and model path."""
    return compile_module(NvrtcCompiler(arch, use_cache), module)


def _rejected_kernel(module: Operation, source: str, log: str) -> tuple[str, str, str] | None:
    """(function, kernel symbol, model path) of the kernel holding the first error NVRTC logged; None when
    the error is outside every kernel (the prelude's helpers)."""
    match = _ERROR_LINE.search(log)
    if match is None:
        return None
    line = int(match.group(1))
    starts = sorted((decl.line, decl.name) for decl in find_kernels(source))
    function = next((name for start, name in reversed(starts) if start <= line), None)
    if function is None:
        return None
    for op in module.body.ops:
        if op.name == "kern.kernel" and op.attributes["function"] == function:
            return function, op.attributes["sym_name"], op.attributes.get("path", "")
    return None


def compile_facts(module: Operation, cubin: Cubin, arch: str) -> dict[str, Any]:
    """The report's `compiled` figures for `module`'s kernels in `cubin` (see the module docstring)."""
    kernels = [op for op in module.body.ops if op.name == "kern.kernel"]
    symbol_of = {op.attributes["function"]: op.attributes["sym_name"] for op in kernels}
    most = max(cubin.kernels.values(), key=lambda k: (k.registers, k.name))
    spilling = sorted({symbol_of.get(k.name, k.name) for k in cubin.spilling()})
    version = nvrtc_toolchain().version
    return {
        "compiler": f"NVRTC {version[0]}.{version[1]}",
        "kernels": len(kernels),
        "functions": len(cubin.kernels),
        "most_registers": {"kernel": symbol_of.get(most.name, most.name), "registers": most.registers},
        "spills": spilling,
        "limits": device_limits(kernels, cubin, arch),
    }


def device_limits(kernels: list[Operation], cubin: Cubin, arch: str) -> list[str]:
    """What the kernels cannot do on `arch`: a launch whose block needs more registers than an SM holds, or
    more shared memory than a block may use. Empty when every launch fits."""
    limits = []
    shared_limit = SHARED_PER_BLOCK.get(arch)
    for kernel in kernels:
        attrs = kernel.attributes
        symbol, function = attrs["sym_name"], attrs["function"]
        resources = cubin.kernels.get(function)
        if resources is None:
            continue
        threads = math.prod(attrs["block"])
        per_thread = -(-resources.registers // REGISTER_UNIT) * REGISTER_UNIT
        warps = -(-threads // 32)
        if per_thread * warps * 32 > REGISTERS_PER_SM:
            limits.append(f"{symbol} ({function}): {resources.registers} registers for each of {threads} "
                          f"threads a block, more than an SM's {REGISTERS_PER_SM}: it cannot launch on {arch}")
        shared = resources.shared + attrs["shared"]
        if shared_limit is not None and shared > shared_limit:
            limits.append(f"{symbol} ({function}): {shared} bytes of shared memory a block, more than "
                          f"{arch}'s {shared_limit}: it cannot launch")
    return list(dict.fromkeys(limits))


# -- the report, and its cache ------------------------------------------------------------------


def lowering_report(unit: CompilationUnit, arch: str, stack: int | None = None, launches: bool = False,
                    executor: str = "cuda", use_cache: bool = True) -> dict[str, Any]:
    """The lowering document of `unit` (after the training pipeline) lowered and compiled for `arch`, what
    no device told (`explain --target`; an opened device's is the executor's `lowering_document`).

    The unit is lowered in place unless the lowering cache holds the document (see the module docstring),
    after `working-copies` as a run's graphs are; `launches` keeps every launch of each row's first graph
    (`SEXPGPU_EXPLAIN=kernels`).
    """
    run_pipeline(unit, WORKING_COPIES)
    toolchain = nvrtc_toolchain()
    key = _report_key(unit.module, arch, stack, executor, toolchain.identity)
    path = cache_root() / "lowering" / key[:2] / f"{key}.json"
    document = _read_document(path) if use_cache else None
    if document is None:
        lower(unit, stack, arch)
        cubin = compile_lowered(unit.module, arch, use_cache=use_cache)
        document = lowering_document(unit.module, unit.facts, arch, executor,
                                     compiled=compile_facts(unit.module, cubin, arch), launches=True)
        if use_cache:
            _write_document(path, document)
    if not launches:
        without_launches(document)
    return document


def _report_key(module: Operation, arch: str, stack: int | None, executor: str, compiler: str) -> str:
    """What a lowering document depends on: the module, the target, the stacking, the code that lowers and
    reports it, and the compiler (its registers and spills)."""
    digest = hashlib.sha256()
    header = {"format": _CACHE_FORMAT, "version": __version__, "arch": arch, "stack": stack, "executor": executor, "compiler": compiler,
              "options": list(DEFAULT_OPTIONS), "code": code_identity()}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(print_module(module).encode())
    return digest.hexdigest()


@functools.cache
def code_identity() -> str:
    """A hash of the sources that lower a module and build its document: the dialects, the passes (with
    `lowering_report`), the CUDA target and its renderer (with the CUDA they emit) and this module. An edited
    checkout never reads a stale document."""
    from ... import dialects, passes
    from . import render

    files = [Path(__file__), Path(target.__file__)]
    for package in (dialects, passes, render):
        for root in package.__path__:
            files += [p for p in Path(root).rglob("*") if p.suffix in (".py", ".cuh") and p.is_file()]
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _read_document(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_document(path: Path, document: Mapping[str, Any]) -> None:
    """Stored whole or not at all (written to a temporary file, renamed into place); a cache that cannot be
    written only costs the next run the lowering."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(document, f)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass


# -- targets and devices ------------------------------------------------------------------------

#: The oldest architecture the kernels are written for (bf16 arithmetic, cp.async-era shared memory).
OLDEST_ARCH = 80


def check_target(arch: str) -> str:
    """`arch` when NVRTC compiles CUBIN for it and the kernels run there (sm_80 and later); else a usage
    error naming the ones that do."""
    usable = [a for a in supported_archs() if int(a.removeprefix("sm_")) >= OLDEST_ARCH]
    if arch not in usable:
        version = nvrtc_toolchain().version
        raise UsageError(f"--target must be an architecture NVRTC {version[0]}.{version[1]} compiles these kernels "
                         f"for ({', '.join(usable)}), not {arch}")
    return arch
