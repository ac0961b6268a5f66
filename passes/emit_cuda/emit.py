"""`emit-cuda`: the CUDA C of every kernel of a lowered module, as one translation unit.

One NVRTC program per module is much cheaper than one per kernel (each
program costs ~100 ms before its kernels' own work: docs/cuda.md, "Compile
time"), so the module's kernels go into one source: the prelude, the
generated kernels' helpers, then each distinct kernel once.

Each `kern.kernel` gets `function` (the `extern "C"` name in the source) and
`arguments`: what its parameters are bound to, in order — `"in<k>"` (the
launch's k-th operand), `"out<k>"` (its k-th result; a template's scratch
buffers are its last results, which nothing reads) or an int (a size passed
by value) — and `alignment`, the bytes every pointer argument must be
aligned to. A pattern kernel (`row`, `cross_entropy`) is a template
program that may launch several kernels in turn through scratch buffers (a
column sum's partial rows): all of them go into the unit, its `functions`
lists them in launch order (`function` is the first), and its `arguments`
bind the program's parameters — `"in<k>"`, `"out<k>"`, `"scratch<j>"` (a
workspace the launcher provides, `scratch_bytes` of each) or a size;
`passes/emit_cuda/pattern_kernels.kernel_program` gives the launches. The source is recorded in the module as `kern.source {text}`; the
executor and `explain --device cuda` compile it with NVRTC
(`backends/cuda/nvrtc.compile_cubin`). When `emit-cuda` ends a `sexpgpu-opt`
pipeline, the tool prints the source instead of the IR (as mlir-translate
prints its target language).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from attrs import define

from ...dialects.core import Operation, VerifyError
from ...dialects.kern import BODY_KINDS
from ..manager import CompilationUnit, Pass, register_pass
from .fused import FUSED_HELPERS, FusedKernel
from .kernel_source import KernelSource
from .launches import template_program, template_sizes
from .pattern_kernels import kernel_program
from .prelude import PRELUDE, translation_unit

#: Writers of the kinds other modules own (row programs, the cross-entropy tail), by kind.
KERNEL_WRITERS: dict[str, Callable[[Operation], KernelSource]] = {}


def _template_source(kernel: Operation) -> KernelSource:
    program = template_program(kernel.attributes["kind"], kernel.attributes)
    (step,) = program.steps
    return step.kernel


for _kind in ("fill", "copy", "scatter_add"):
    KERNEL_WRITERS[_kind] = _template_source


def kernel_source(kernel: Operation) -> KernelSource:
    """The CUDA function of one `kern.kernel`."""
    kind = kernel.attributes["kind"]
    if kind in BODY_KINDS:
        return FusedKernel(kernel).source()
    writer = KERNEL_WRITERS.get(kind)
    if writer is None:
        raise VerifyError(f"emit-cuda has no CUDA for a kernel of kind '{kind}'", kernel)
    return writer(kernel)


#: Kinds whose kernel is a template program of possibly several launches (emitted whole).
PROGRAM_KINDS = ("row", "cross_entropy")


def program_record(kernel: Operation) -> tuple[list[KernelSource], dict[str, Any]]:
    """The kernels of a pattern kernel's program, and what `emit-cuda` records on its symbol."""
    program = kernel_program(kernel)
    sizes = {"rows": kernel.attributes["rows"]}
    inputs = iter(f"in{k}" for k in range(len(kernel.attributes["inputs"])))
    outputs = iter(f"out{k}" for k in range(len(kernel.attributes["outputs"])))
    scratch = program.scratch_bytes(sizes)
    bound: list[Any] = []
    for param in program.params:
        if param.role == "scalar":
            bound.append(program.all_sizes(sizes)[param.name])
        elif param.role == "scratch":
            bound.append(f"scratch{list(scratch).index(param.name)}")
        else:
            bound.append(next(inputs if param.role == "input" else outputs))
    kernels = list(program.kernels)
    record = {"function": kernels[0].name, "functions": [k.name for k in kernels], "arguments": bound,
              "alignment": max(k.alignment for k in kernels), "scratch_bytes": list(scratch.values())}
    return kernels, record


def bind_arguments(kernel: Operation, source: KernelSource) -> list[Any]:
    """What each parameter of `source` takes for `kernel` (see the module docstring)."""
    sizes = template_sizes(kernel.attributes["kind"], kernel.attributes)
    inputs = (f"in{k}" for k in range(len(kernel.attributes["inputs"])))
    outputs = (f"out{k}" for k in range(len(kernel.attributes["outputs"])))
    bound: list[Any] = []
    for param in source.params:
        if param.role == "scalar":
            bound.append(sizes[param.name])
        else:
            bound.append(next(inputs if param.role == "input" else outputs))
    return bound


def unit_source(sources: list[KernelSource]) -> str:
    """The prelude, the generated kernels' helpers and each kernel once: one translation unit."""
    body = translation_unit(sources)[len(PRELUDE):]
    return PRELUDE + FUSED_HELPERS + body


def emit_module(module: Operation) -> str:
    """Write every kernel's CUDA, bind its arguments, record the unit in `kern.source`; returns the text."""
    sources = []
    for op in list(module.body.ops):
        if op.name == "kern.source":
            op.erase()
        elif op.name == "kern.kernel" and op.attributes["kind"] in PROGRAM_KINDS:
            kernels, record = program_record(op)
            op.attributes.update(record)
            sources.extend(kernels)
        elif op.name == "kern.kernel":
            source = kernel_source(op)
            op.attributes.update(function=source.name, arguments=bind_arguments(op, source),
                                 alignment=source.alignment)
            sources.append(source)
    text = unit_source(sources)
    record = Operation.create("kern.source", attributes={"text": text, "kernels": len(sources)})
    first = module.body.first_op
    if first is None:
        module.body.append(record)
    else:
        module.body.insert_before(record, first)
    return text


@register_pass
@define
class EmitCuda(Pass):
    """Writes the CUDA C of every `kern.kernel` of the module into one translation unit.

    Guarantees: every kernel has `function`, `arguments` and `alignment` (a
    pattern kernel also `functions` and `scratch_bytes`); the module holds one
    `kern.source` whose text defines each function once,
    after the prelude; nothing else changes. A kernel kind without a writer
    is an error at the kernel.
    """

    name: ClassVar[str] = "emit-cuda"
    summary: ClassVar[str] = "write every kernel's CUDA C into one translation unit (kern.source)"

    def run(self, unit: CompilationUnit) -> None:
        emit_module(unit.require_module(self.name))

    def final_output(self, unit: CompilationUnit) -> str | None:
        """Ending a pipeline, the CUDA source is the result (as mlir-translate prints its target)."""
        for op in unit.require_module(self.name).body.ops:
            if op.name == "kern.source":
                return op.attributes["text"]
        return None
