"""The template call behind a `row` or `cross_entropy` `kern.kernel` (the CUDA target's answer to match-patterns).

`match-patterns` describes a pattern kernel by its family, its row length,
its template options and its operands by name; this module turns that into
the `KernelProgram` of `templates` (which `emit-cuda` writes and a device
launches) and back into what the kernel symbol records:

    kern.kernel @layernorm_f32_768 {kind = "row", family = "layernorm", cols = 768, rows = 8192,
        eps = 1e-05, weight = true, bias = true, stats = true,
        operands = ["x", "weight", "bias", "y", "mean", "rstd"],
        inputs = [...], outputs = [...], grid = [...], block = [...], shared = 0, form = "...", path = "..."}

`operands` names the kernel's inputs then outputs in launch order, the
template's parameter names, so a launch's operands and results bind to the
program's parameters by position and each one's dtype is its type's. The
launch shape recorded on the symbol is the program's first kernel's for the
symbol's `rows` (a column-summing backward launches a second, `column_sum`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ....dialects.core import Operation
from ....passes.targets import PatternKernel
from . import templates
from .kernel_source import KernelProgram, KernelSource

#: The row-program template of each family, and the template options it takes.
ROW_TEMPLATES: dict[str, tuple[Callable[..., KernelProgram], tuple[str, ...]]] = {
    "softmax": (templates.softmax, ()),
    "log_softmax": (templates.log_softmax, ()),
    "layernorm": (templates.layernorm, ("eps", "weight", "bias", "stats")),
    "rmsnorm": (templates.rmsnorm, ("eps", "weight", "stats")),
    "softmax_backward": (templates.softmax_backward, ()),
    "log_softmax_backward": (templates.log_softmax_backward, ()),
    "layernorm_backward": (templates.layernorm_backward, ("weight", "bias")),
    "rmsnorm_backward": (templates.rmsnorm_backward, ("weight",)),
}
CROSS_ENTROPY_TEMPLATES: dict[str, tuple[Callable[..., KernelProgram], tuple[str, ...]]] = {
    "forward": (templates.cross_entropy_forward, ("reduction",)),
    "backward": (templates.cross_entropy_backward, ("grad", "scale", "mean")),
}
#: Operand dtypes the templates store (integers only for targets).
FLOAT_STORAGE = ("f32", "bf16")
INDEX_STORAGE = ("i32", "i64")


def template(kernel: PatternKernel) -> tuple[Callable[..., KernelProgram], tuple[str, ...]]:
    """The template function behind `kernel`, and the template options it takes."""
    table = ROW_TEMPLATES if kernel.kind == "row" else CROSS_ENTROPY_TEMPLATES
    return table[kernel.family]


def pattern_program(kernel: PatternKernel, dtypes: Mapping[str, str] | None = None) -> KernelProgram:
    """The template's program for `kernel`; `dtypes` gives every operand's dtype by name (the defaults when
    None)."""
    function, names = template(kernel)
    options = tuple((name, kernel.options[name]) for name in names if name in kernel.options)
    return _program(function, kernel.cols, tuple(sorted((dtypes or {}).items())), options)


@functools.lru_cache(maxsize=1024)
def _program(function: Callable[..., KernelProgram], cols: int, dtypes: tuple[tuple[str, str], ...],
             options: tuple[tuple[str, Any], ...]) -> KernelProgram:
    """A template's program, made once per specialisation (a model's layers ask for the same one many times)."""
    return function(cols, dtypes=dict(dtypes) or None, **dict(options))


def pattern_kernel(kernel: Operation) -> PatternKernel:
    """The pattern kernel a `row` or `cross_entropy` `kern.kernel` symbol describes."""
    attrs = kernel.attributes
    kind = attrs["kind"]
    if kind == "row":
        family, cols, names = attrs["family"], attrs["cols"], ROW_TEMPLATES[attrs["family"]][1]
    elif kind == "cross_entropy":
        family, cols, names = attrs["direction"], attrs["vocab"], CROSS_ENTROPY_TEMPLATES[attrs["direction"]][1]
    else:
        raise ValueError(f"@{attrs.get('sym_name')} is a {kind} kernel, not a pattern kernel")
    return PatternKernel(kind, family, cols, {name: attrs[name] for name in names if name in attrs})


def kernel_program(kernel: Operation) -> KernelProgram:
    """The program a `row` or `cross_entropy` `kern.kernel` is one step of, with its operands' dtypes."""
    return pattern_program(pattern_kernel(kernel), kernel.attributes["dtypes"])


def step_binding(kernel: Operation) -> tuple[KernelSource, list[Any]]:
    """The CUDA function a pattern kernel symbol launches (its program's step `step`) and what each of its
    parameters takes: `"in<k>"`/`"out<k>"` (the launch's k-th operand or result) or a size by value."""
    program = kernel_program(kernel)
    step = program.steps[kernel.attributes.get("step", 0)]
    sizes = program.all_sizes({"rows": kernel.attributes["rows"]})
    inputs = (f"in{k}" for k in range(len(kernel.attributes["inputs"])))
    outputs = (f"out{k}" for k in range(len(kernel.attributes["outputs"])))
    bound: list[Any] = []
    for param, name in zip(step.kernel.params, step.arguments):
        if not param.is_pointer:
            bound.append(sizes[name])
        else:
            bound.append(next(inputs if param.role == "input" else outputs))
    return step.kernel, bound
