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
aligned to. The source is recorded in the module as `kern.source {text}`; the
executor and `explain --device cuda` compile it with NVRTC
(`backends/cuda/nvrtc.compile_cubin`). When `emit-cuda` ends a `sexpgpu-opt`
pipeline, the tool prints the source instead of the IR (as mlir-translate
prints its target language).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from attrs import define

from ....dialects.core import Operation, VerifyError
from ....dialects.kern import BODY_KINDS
from ....passes.manager import CompilationUnit, Pass, register_pass
from .fused import FUSED_HELPERS, FusedKernel
from .kernel_source import KernelSource
from .launches import template_program, template_sizes
from .pattern_kernels import step_binding
from .prelude import PRELUDE, translation_unit


def _bind(kernel: Operation, source: KernelSource, sizes: dict[str, int]) -> list[Any]:
    inputs = (f"in{k}" for k in range(len(kernel.attributes["inputs"])))
    outputs = (f"out{k}" for k in range(len(kernel.attributes["outputs"])))
    return [next(inputs if param.role == "input" else outputs) if param.is_pointer else sizes[param.name]
            for param in source.params]


def _template_binding(kernel: Operation) -> tuple[KernelSource, list[Any]]:
    """A one-launch template kernel (`fill`, `copy`, `scatter_add`) and its arguments."""
    program = template_program(kernel.attributes["kind"], kernel.attributes)
    (step,) = program.steps
    return step.kernel, _bind(kernel, step.kernel, template_sizes(kernel.attributes["kind"], kernel.attributes))


def _fused_binding(kernel: Operation) -> tuple[KernelSource, list[Any]]:
    """A generated kernel: its operands and results, every size compiled in."""
    source = FusedKernel(kernel).source()
    return source, _bind(kernel, source, {})


#: Each kernel kind's CUDA function and the arguments a launch passes it (module docstring): the generated
#: kinds from their body, the templates' from their program (a pattern kernel is one step of its family's).
BINDINGS: dict[str, Callable[[Operation], tuple[KernelSource, list[Any]]]] = {
    **{kind: _fused_binding for kind in BODY_KINDS},
    **{kind: _template_binding for kind in ("fill", "copy", "scatter_add")},
    "row": step_binding,
    "cross_entropy": step_binding,
    "attention": step_binding,
}


def kernel_binding(kernel: Operation) -> tuple[KernelSource, list[Any]]:
    """The CUDA function of one `kern.kernel` and what each of its parameters takes."""
    kind = kernel.attributes["kind"]
    binding = BINDINGS.get(kind)
    if binding is None:
        raise VerifyError(f"emit-cuda has no CUDA for a kernel of kind '{kind}'", kernel)
    return binding(kernel)


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
        elif op.name == "kern.kernel":
            source, arguments = kernel_binding(op)
            op.attributes.update(function=source.name, arguments=arguments,
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

    Guarantees: every kernel has `function`, `arguments` and `alignment`; the
    module holds one `kern.source` whose text defines each `function` once,
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
