"""The template call behind a `row`, `cross_entropy` or `attention` `kern.kernel` (the CUDA target's answer to
match-patterns).

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

An `attention` kernel (`attention.attention_forward`, `attention_backward`)
records its head dimension, `causal`, `scale`, the `placements` of its
operands (each `[offset, batch, head, token]`, element expressions: where
`match-patterns` found Q, K, V and dO, so a packed projection is read where
it is) and its `sizes` (`batch`, `heads`, `seq`) instead of `rows`:

    kern.kernel @attention_forward_bf16_64 {kind = "attention", direction = "forward", head_dim = 64,
        causal = true, scale = 0.125, placements = {q = [...], ...}, sizes = {batch = 4, heads = 12, seq = 1024},
        operands = ["q", "k", "v", "o", "lse"], ...}
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from ....dialects.core import Operation
from ....passes.targets import PatternKernel
from . import attention, templates
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
ATTENTION_TEMPLATES: dict[str, tuple[Callable[..., KernelProgram], tuple[str, ...]]] = {
    "forward": (attention.attention_forward, ("causal", "scale", "placements")),
    "backward": (attention.attention_backward, ("causal", "scale", "placements")),
}
#: Head dimensions the attention kernels take.
ATTENTION_HEAD_DIMS = tuple(range(attention.HEAD_DIM_MULTIPLE, attention.MAX_HEAD_DIM + 1,
                                  attention.HEAD_DIM_MULTIPLE))
#: The operands an attention layout places.
ATTENTION_OPERANDS = ("q", "k", "v", "o", "do", "dq", "dk", "dv")
#: Operand dtypes the templates store (integers only for targets).
FLOAT_STORAGE = ("f32", "bf16")
INDEX_STORAGE = ("i32", "i64")


def template(kernel: PatternKernel) -> tuple[Callable[..., KernelProgram], tuple[str, ...]]:
    """The template function behind `kernel`, and the template options it takes."""
    table = {"row": ROW_TEMPLATES, "cross_entropy": CROSS_ENTROPY_TEMPLATES, "attention": ATTENTION_TEMPLATES}
    return table[kernel.kind][kernel.family]


def pattern_program(kernel: PatternKernel, dtypes: Mapping[str, str] | None = None) -> KernelProgram:
    """The template's program for `kernel`; `dtypes` gives every operand's dtype by name (the defaults when
    None)."""
    function, names = template(kernel)
    if kernel.kind == "attention":
        dtype = (dtypes or {}).get("q", "f32")
        placements = kernel.options["placements"]
        frozen = tuple((name, tuple(placements[name])) for name in ATTENTION_OPERANDS if name in placements)
        return _attention_program(function, kernel.cols, bool(kernel.options["causal"]),
                                  float(kernel.options["scale"]), dtype, frozen)
    options = tuple((name, kernel.options[name]) for name in names if name in kernel.options)
    return _program(function, kernel.cols, tuple(sorted((dtypes or {}).items())), options)


@functools.lru_cache(maxsize=256)
def _attention_program(function: Callable[..., KernelProgram], head_dim: int, causal: bool, scale: float, dtype: str,
                       placements: tuple[tuple[str, tuple[str, ...]], ...]) -> KernelProgram:
    """An attention program for these placements (operands not placed are contiguous [B, H, T, d]); the layout's
    name tells apart the functions of different placements in one translation unit."""
    given = dict(placements)
    layout = attention.AttentionLayout(
        _layout_name(given), **{name: attention.Placement(*given[name]) if name in given
                                else attention.HEADS.placement(name) for name in ATTENTION_OPERANDS})
    return function(head_dim, causal=causal, scale=scale, dtype=dtype, layout=layout)


def _layout_name(placements: Mapping[str, tuple[str, ...]]) -> str:
    """`packed` or `heads` when the placements are that layout's, else a name made from them."""
    for name, layout in attention.LAYOUTS.items():
        if all(attention.Placement(*p) == layout.placement(op) for op, p in placements.items()):
            return name
    digest = hashlib.sha1(repr(sorted(placements.items())).encode()).hexdigest()[:8]
    return f"placed{digest}"


@functools.lru_cache(maxsize=1024)
def _program(function: Callable[..., KernelProgram], cols: int, dtypes: tuple[tuple[str, str], ...],
             options: tuple[tuple[str, Any], ...]) -> KernelProgram:
    """A template's program, made once per specialisation (a model's layers ask for the same one many times)."""
    return function(cols, dtypes=dict(dtypes) or None, **dict(options))


def pattern_kernel(kernel: Operation) -> PatternKernel:
    """The pattern kernel a `row`, `cross_entropy` or `attention` `kern.kernel` symbol describes."""
    attrs = kernel.attributes
    kind = attrs["kind"]
    if kind == "row":
        family, cols, names = attrs["family"], attrs["cols"], ROW_TEMPLATES[attrs["family"]][1]
    elif kind == "cross_entropy":
        family, cols, names = attrs["direction"], attrs["vocab"], CROSS_ENTROPY_TEMPLATES[attrs["direction"]][1]
    elif kind == "attention":
        family, cols, names = attrs["direction"], attrs["head_dim"], ATTENTION_TEMPLATES[attrs["direction"]][1]
    else:
        raise ValueError(f"@{attrs.get('sym_name')} is a {kind} kernel, not a pattern kernel")
    return PatternKernel(kind, family, cols, {name: attrs[name] for name in names if name in attrs})


def kernel_program(kernel: Operation) -> KernelProgram:
    """The program a pattern `kern.kernel` is one step of, with its operands' dtypes."""
    return pattern_program(pattern_kernel(kernel), kernel.attributes["dtypes"])


def step_binding(kernel: Operation) -> tuple[KernelSource, list[Any]]:
    """The CUDA function a pattern kernel symbol launches (its program's step `step`) and what each of its
    parameters takes: `"in<k>"`/`"out<k>"` (the launch's k-th operand or result) or a size by value."""
    program = kernel_program(kernel)
    step = program.steps[kernel.attributes.get("step", 0)]
    sizes = program.all_sizes(kernel_sizes(kernel))
    inputs = (f"in{k}" for k in range(len(kernel.attributes["inputs"])))
    outputs = (f"out{k}" for k in range(len(kernel.attributes["outputs"])))
    bound: list[Any] = []
    for param, name in zip(step.kernel.params, step.arguments):
        if not param.is_pointer:
            bound.append(sizes[name])
        else:
            bound.append(next(inputs if param.role == "input" else outputs))
    return step.kernel, bound


def kernel_sizes(kernel: Operation) -> dict[str, int]:
    """The sizes a pattern kernel symbol's program runs with: `rows`, or an attention's batch, heads and seq."""
    attrs = kernel.attributes
    return dict(attrs["sizes"]) if attrs["kind"] == "attention" else {"rows": attrs["rows"]}
